"""Signed manifests of Model Artifacts: what a node needs to fetch only its layers, and to check them.

A byte range of a model file cannot be checked against a sha256 of the whole file. A
manifest lists, for every tensor of an artifact, its line of the tensor index that the
artifact's fingerprint covers (name, type, shape, size and the sha256 of its bytes alone:
where the tensor lies does not change it), and where the tensor lies in the file, or in which of the
gguf-split parts (``NAME-00001-of-00003.gguf``, ...) the model is stored as; for each file
it gives the size and the sha256 of its header. The publisher signs all of it with an
Ed25519 key (:mod:`noderuntime.access.identity`, domain :data:`SIGNATURE_DOMAIN`).

A node that fetched a range checks each tensor against its sha256, and the header it
read against the header's; from that header's metadata and the manifest's tensor index it
recomputes the artifact's fingerprint, which must be the manifest's. The same
:class:`Manifest` type reads and writes the JSON, here, at the tracker that serves it and
at the node that fetches with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from noderuntime.access.identity import Identity, IdentityError, load_or_create_key, verify
from noderuntime.models import artifacts
from noderuntime.models import gguf as ggufio
from noderuntime.models.artifacts import ArtifactError, TensorEntry

# 2: the tensor index carries each tensor's whole sha256 (1 carried a digest of 4 KiB samples)
FORMAT: Literal["noderuntime-manifest-2"] = "noderuntime-manifest-2"
SIGNATURE_DOMAIN = b"noderuntime-manifest-v2"
HEX32 = r"^[0-9a-f]{64}$"
MAX_MANIFEST_BYTES = 64 << 20  # a few hundred bytes a tensor: room for tens of thousands
MAX_PARTS = 9999
# how llama.cpp names the parts gguf-split writes, and finds them: by this pattern beside the first
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_NO_KEY = "split.no"
SPLIT_COUNT_KEY = "split.count"
SPLIT_TENSORS_KEY = "split.tensors.count"


class ManifestError(ArtifactError):
    """A manifest is malformed, its signature does not verify, or it does not describe a file."""


class ManifestPart(BaseModel):
    """One file of the model: the whole model, or one of its gguf-split parts, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,254}$")  # as published
    size: int = Field(gt=0)
    data_offset: int = Field(gt=0)  # where its tensor data starts: its header is the bytes before
    header_sha256: str = Field(pattern=HEX32)


class ManifestTensor(BaseModel):
    """One tensor: its index line (what the fingerprint covers), its sha256, and where it lies."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    ggml_type: int = Field(ge=0, lt=1 << 16)
    shape: tuple[Annotated[int, Field(gt=0)], ...] = Field(min_length=1, max_length=8)
    n_bytes: int = Field(gt=0)
    sha256: str = Field(pattern=HEX32)  # of the tensor's bytes, its padding excluded: the index's digest
    part: int = Field(ge=0)  # which of the manifest's parts holds it
    offset: int = Field(ge=0)  # absolute, in that part's file

    def entry(self) -> TensorEntry:
        """The tensor index line of this tensor."""
        return TensorEntry(self.name, self.ggml_type, self.shape, self.n_bytes, self.sha256)


class Manifest(BaseModel):
    """A signed description of one artifact's tensors and of the file(s) that hold them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["noderuntime-manifest-2"] = FORMAT
    artifact: str = Field(pattern=HEX32)  # the fingerprint (artifacts.inspect)
    name: str = Field(max_length=300)
    architecture: str = Field(max_length=100)
    n_layer: int = Field(gt=0, le=1 << 16)
    parts: tuple[ManifestPart, ...] = Field(min_length=1, max_length=MAX_PARTS)
    tensors: tuple[ManifestTensor, ...] = Field(min_length=1)  # in file order, part after part
    publisher: str = Field(pattern=HEX32)  # the Ed25519 public key that signed it
    signature: str = Field(default="", pattern=r"^([0-9a-f]{128})?$")

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        names = set()
        for tensor in self.tensors:
            if tensor.name in names:
                raise ValueError(f"tensor {tensor.name!r} is listed twice")
            names.add(tensor.name)
            if tensor.part >= len(self.parts):
                raise ValueError(f"tensor {tensor.name!r} is in part {tensor.part}; there are {len(self.parts)}")
            part = self.parts[tensor.part]
            if tensor.offset < part.data_offset or tensor.offset + tensor.n_bytes > part.size:
                raise ValueError(f"tensor {tensor.name!r} does not lie in the data of {part.file}")
        return self

    def body(self) -> bytes:
        """The bytes the signature covers: the canonical JSON of every field but the signature."""
        data = self.model_dump(mode="json", exclude={"signature"})
        return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    def signed(self, identity: Identity) -> Manifest:
        """This manifest published by ``identity``: its key named, its signature over :meth:`body`."""
        unsigned = self.model_copy(update={"publisher": identity.node_id.hex(), "signature": ""})
        return unsigned.model_copy(update={"signature": identity.sign(SIGNATURE_DOMAIN, unsigned.body()).hex()})

    def check(self, publisher: bytes | None = None) -> Manifest:
        """This manifest, once its signature verifies (and it is ``publisher``'s, when given)."""
        if publisher is not None and bytes.fromhex(self.publisher) != publisher:
            raise ManifestError(
                f"the manifest of {self.artifact[:16]}… is signed by {self.publisher[:16]}…, "
                f"not by the publisher key given ({publisher.hex()[:16]}…)"
            )
        if not self.signature or not verify(
            bytes.fromhex(self.publisher), SIGNATURE_DOMAIN, self.body(), bytes.fromhex(self.signature)
        ):
            raise ManifestError(
                f"the manifest of {self.artifact[:16]}… does not carry a valid signature of its publisher "
                f"{self.publisher[:16]}…: it was changed after it was signed, or never signed"
            )
        return self

    def index(self) -> list[TensorEntry]:
        """The artifact's tensor index, in file order (what a shard file carries as its parent's)."""
        return [tensor.entry() for tensor in self.tensors]

    def summary(self) -> dict[str, Any]:
        """What a tracker lists of it: enough to find the manifest of a file from its first header."""
        return {
            "artifact": self.artifact,
            "name": self.name,
            "parts": [{"file": p.file, "size": p.size, "header_sha256": p.header_sha256} for p in self.parts],
        }

    def dumps(self) -> str:
        """The JSON document."""
        return self.model_dump_json(indent=1) + "\n"

    @classmethod
    def loads(cls, text: str | bytes, where: str = "manifest") -> Manifest:
        """Parse (not check: see :meth:`check`) a manifest; :class:`ManifestError` when malformed."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where} is over {MAX_MANIFEST_BYTES >> 20} MiB: not a manifest")
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            errors = exc.errors()
            at = ".".join(str(x) for x in errors[0]["loc"]) if errors else ""
            message = errors[0]["msg"] if errors else str(exc)
            where_in = f"{at}: " if at else ""
            raise ManifestError(f"{where} is not a manifest: {where_in}{message}") from None


def load(path: str | os.PathLike[str], publisher: bytes | None = None) -> Manifest:
    """Read a manifest file and check its signature (and its publisher, when given)."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"cannot read the manifest {path}: {exc}") from None
    return Manifest.loads(text, str(path)).check(publisher)


def model_parts(first: str | os.PathLike[str]) -> list[Path]:
    """The files a model is stored in: ``first`` alone, or all its gguf-split parts in order.

    Parts are found as llama.cpp finds them: by name, beside the first; each must say it
    is that part of that many.
    """
    first = Path(first)
    match = SPLIT_NAME.match(first.name)
    gguf = _read(first)
    count_field = gguf.get(SPLIT_COUNT_KEY, 0)
    if match is None or count_field in (0, 1):
        if isinstance(count_field, int) and count_field > 1:
            raise ManifestError(f"{first} is part of a {count_field}-part model but not named NAME-00001-of-NNNNN.gguf")
        return [first]
    if int(match["no"]) != 1:
        raise ManifestError(f"{first} is part {int(match['no'])} of a split model: give the first part")
    count = int(match["count"])
    paths = [first.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for number, path in enumerate(paths):
        part = gguf if number == 0 else _read(path)
        if (part.get(SPLIT_NO_KEY), part.get(SPLIT_COUNT_KEY)) != (number, count):
            raise ManifestError(f"{path} does not say it is part {number + 1} of {count} ({SPLIT_NO_KEY})")
    return paths


def _read(path: Path) -> ggufio.GGUFFile:
    try:
        return ggufio.read(path)
    except ggufio.GGUFError as exc:
        raise ManifestError(f"{path} is not a valid GGUF file: {exc}") from None
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc}") from None


def make(
    model: str | os.PathLike[str],
    identity: Identity,
    *,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """The signed manifest of the model in ``model`` (a GGUF file, or the first of its gguf-split parts).

    It reads every tensor once, for its sha256 (or takes the digests
    :func:`artifacts.tensor_index` kept of this very file); ``progress`` is called with the bytes read.
    """
    paths = model_parts(model)
    ggufs = [_read(path) for path in paths]
    head = ggufs[0]
    if artifacts.SHARD_START_KEY in head.fields or artifacts.SHARD_END_KEY in head.fields:
        raise ManifestError(f"{paths[0]} is a shard file; a manifest describes a whole model")
    arch = head.get("general.architecture")
    n_layer = head.get(f"{arch}.block_count") if isinstance(arch, str) else None
    if not isinstance(arch, str) or type(n_layer) is not int or n_layer <= 0:
        raise ManifestError(f"{paths[0]} has no general.architecture and block count")
    parts, tensors, index = [], [], []
    for number, (path, gguf) in enumerate(zip(paths, ggufs, strict=True)):
        try:
            with path.open("rb") as f:
                header = f.read(gguf.data_offset)
        except OSError as exc:
            raise ManifestError(f"cannot read {path}: {exc}") from None
        part_index = artifacts.tensor_index(gguf, progress=progress)
        for info, entry in zip(gguf.tensors, part_index, strict=True):
            tensors.append(
                ManifestTensor(
                    name=info.name,
                    ggml_type=info.ggml_type,
                    shape=info.shape,
                    n_bytes=info.n_bytes,
                    sha256=entry.sha256,
                    part=number,
                    offset=info.offset,
                )
            )
        index += part_index
        parts.append(
            ManifestPart(
                file=path.name,
                size=gguf.file_size,
                data_offset=gguf.data_offset,
                header_sha256=hashlib.sha256(header).hexdigest(),
            )
        )
    if len(paths) > 1 and head.get(SPLIT_TENSORS_KEY) not in (None, len(tensors)):
        raise ManifestError(f"the parts of {paths[0]} hold {len(tensors)} tensors, not {head.get(SPLIT_TENSORS_KEY)}")
    unsigned = Manifest(
        artifact=artifacts.fingerprint_of(head, index),
        name=str(head.get("general.name", paths[0].stem)),
        architecture=arch,
        n_layer=n_layer,
        parts=tuple(parts),
        tensors=tuple(tensors),
        publisher=identity.node_id.hex(),
    )
    return unsigned.signed(identity)


def load_key(path: str | os.PathLike[str]) -> Identity:
    """The publisher's Ed25519 key in the PEM file ``path``, made there (mode 0600) when missing."""
    try:
        return load_or_create_key(path)
    except IdentityError as exc:
        raise ManifestError(str(exc)) from None


__all__ = [
    "FORMAT",
    "SIGNATURE_DOMAIN",
    "Manifest",
    "ManifestError",
    "ManifestPart",
    "ManifestTensor",
    "load",
    "load_key",
    "make",
    "model_parts",
]
