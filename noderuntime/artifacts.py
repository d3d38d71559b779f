"""Model Artifacts: GGUF inspection, fingerprints, and slicing into shard files.

An artifact is identified by its *fingerprint*: a sha256 over its metadata and its
tensor index (name, type, shape, size, and a digest of a small sample of each
tensor's bytes), not over the whole file, so that a multi-GB model is fingerprinted
in well under a second and a shard file can prove which artifact it was cut from.

A *shard file* holds the tensors of one layer range with absolute block numbers, the
range keys the patched llama.cpp reads (``shard.layer_start`` / ``shard.layer_end``),
the parent's fingerprint and the parent's whole tensor index. From those the parent
fingerprint is recomputed and every local tensor is checked against the parent index
at load, so a file edited or cut from another model is refused.

This module reads GGUF with the ``gguf`` package; it never imports ``llama_cpp``.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

SHARD_START_KEY = "shard.layer_start"
SHARD_END_KEY = "shard.layer_end"
PARENT_FINGERPRINT_KEY = "noderuntime.parent.fingerprint"
PARENT_INDEX_KEY = "noderuntime.parent.tensor_index"
# Keys that describe how a file was cut, not what model it holds.
_NON_IDENTITY_PREFIXES = ("shard.", "noderuntime.", "GGUF.")

SUPPORTED_ARCHITECTURES = frozenset({"llama", "qwen3"})
_FINGERPRINT_DOMAIN = b"noderuntime-artifact-v1\n"
_SAMPLE_BYTES = 4096
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


class ArtifactError(Exception):
    """A model file is missing, malformed, or not what it claims to be."""


@attrs.frozen
class LayerRange:
    """A contiguous half-open range of transformer blocks ``[start, end)``."""

    start: int
    end: int

    def __attrs_post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(f"invalid layer range {self.start}:{self.end}: need 0 <= start < end")

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """Parse ``"A:B"``."""
        parts = text.strip().split(":")
        if len(parts) != 2:
            raise ValueError(f"invalid layer range {text!r}: expected START:END, e.g. 0:15")
        try:
            start, end = int(parts[0]), int(parts[1])
        except ValueError:
            raise ValueError(f"invalid layer range {text!r}: START and END must be integers") from None
        return cls(start, end)

    @classmethod
    def parse_list(cls, text: str) -> list[LayerRange]:
        """Parse ``"0:10,10:20,20:30"``."""
        return [cls.parse(part) for part in text.split(",") if part.strip()]

    def check_within(self, n_layer: int) -> None:
        """Raise ``ValueError`` unless the range lies inside a model of ``n_layer`` blocks."""
        if self.end > n_layer:
            raise ValueError(f"layer range {self} is outside the model, which has {n_layer} layers (0:{n_layer})")

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


@attrs.frozen
class TensorEntry:
    """One line of a tensor index."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # ggml order: ne0 first
    n_bytes: int
    sample_digest: str

    def line(self) -> str:
        """The canonical text form stored in shard files and hashed into fingerprints."""
        shape = ",".join(str(d) for d in self.shape)
        return f"{self.name}\t{self.ggml_type}\t{shape}\t{self.n_bytes}\t{self.sample_digest}"

    @classmethod
    def from_line(cls, line: str) -> TensorEntry:
        """Parse :meth:`line` output; raises ``ArtifactError`` on malformed text."""
        try:
            name, ggml_type, shape, n_bytes, digest = line.split("\t")
            return cls(name, int(ggml_type), tuple(int(d) for d in shape.split(",")), int(n_bytes), digest)
        except ValueError:
            raise ArtifactError(f"malformed tensor index line {line!r}") from None


@attrs.frozen
class ArtifactInfo:
    """What a GGUF file holds, as far as routing and loading need to know."""

    path: Path
    fingerprint: str  # of the whole model: the parent's for a shard file
    file_fingerprint: str  # of this file's own metadata and tensors
    architecture: str
    name: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    context_length: int
    file_type: int
    quant: str
    n_tensors: int
    tensor_bytes: int
    file_bytes: int
    layer_range: LayerRange  # the whole model for an unsliced file
    has_chat_template: bool

    @property
    def is_shard_file(self) -> bool:
        """True when the file holds only a slice of the model."""
        return self.layer_range != LayerRange(0, self.n_layer)


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ArtifactError(f"model file not found: {path}")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises whatever numpy raises on bad bytes
        raise ArtifactError(f"{path} is not a readable GGUF file: {exc}") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size or tensor.data.nbytes != tensor.n_bytes:
            raise ArtifactError(f"{path} is truncated or corrupted: tensor {tensor.name} ends past the end of the file")
    return reader


def _field_bytes(field: Any) -> bytes:
    return b"".join(part.tobytes() for part in field.parts)


def _scalar(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None or not field.types:
        return default
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    if field.types[0] == GGUFValueType.ARRAY:
        return default
    return field.parts[field.data[0]][0].item()


def _array_len(reader: GGUFReader, key: str) -> int:
    field = reader.fields.get(key)
    return len(field.data) if field is not None and field.types and field.types[0] == GGUFValueType.ARRAY else 0


def _identity_fields(reader: GGUFReader) -> list[tuple[str, bytes]]:
    return sorted(
        (name, _field_bytes(field))
        for name, field in reader.fields.items()
        if not name.startswith(_NON_IDENTITY_PREFIXES)
    )


def _tensor_index(reader: GGUFReader) -> list[TensorEntry]:
    raw = reader.data
    entries = []
    for tensor in reader.tensors:
        begin, end = tensor.data_offset, tensor.data_offset + tensor.n_bytes
        head = raw[begin : min(end, begin + _SAMPLE_BYTES)].tobytes()
        tail = raw[max(begin, end - _SAMPLE_BYTES) : end].tobytes()
        digest = hashlib.sha256(head + tail).hexdigest()[:16]
        shape = tuple(int(d) for d in tensor.shape)
        entries.append(TensorEntry(tensor.name, int(tensor.tensor_type), shape, int(tensor.n_bytes), digest))
    return entries


def _fingerprint(fields: Iterable[tuple[str, bytes]], index: Iterable[TensorEntry]) -> str:
    digest = hashlib.sha256(_FINGERPRINT_DOMAIN)
    for name, blob in fields:
        digest.update(hashlib.sha256(name.encode() + b"\0" + blob).digest())
    digest.update(b"tensors\n")
    for line in sorted(entry.line() for entry in index):
        digest.update(line.encode() + b"\n")
    return digest.hexdigest()


def tensor_belongs(name: str, layers: LayerRange, n_layer: int, tied_output: bool) -> bool:
    """Whether a shard of ``layers`` needs tensor ``name`` (the rule the llama.cpp patch applies)."""
    match = _BLOCK_RE.match(name)
    if match:
        return int(match.group(1)) in layers
    if name.startswith("token_embd."):
        return layers.start == 0 or (tied_output and layers.end == n_layer)
    if name.startswith(("output_norm.", "output.")):
        return layers.end == n_layer
    return True  # global tensors every block may use (rope factors)


def inspect(path: str | os.PathLike[str], *, verify: bool = True) -> ArtifactInfo:
    """Read a GGUF file's identity; for a shard file, ``verify`` checks it against its parent."""
    path = Path(path)
    reader = _open(path)
    arch = _scalar(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ArtifactError(f"{path} has no general.architecture")
    n_layer = _scalar(reader, f"{arch}.block_count")
    n_embd = _scalar(reader, f"{arch}.embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int) or n_layer <= 0 or n_embd <= 0:
        raise ArtifactError(f"{path} lacks {arch}.block_count or {arch}.embedding_length")
    fields = _identity_fields(reader)
    index = _tensor_index(reader)
    file_fingerprint = _fingerprint(fields, index)
    start = _scalar(reader, SHARD_START_KEY)
    end = _scalar(reader, SHARD_END_KEY)
    if start is None and end is None:
        layer_range, fingerprint = LayerRange(0, n_layer), file_fingerprint
    else:
        try:
            layer_range = LayerRange(int(start if start is not None else 0), int(end if end is not None else n_layer))
            layer_range.check_within(n_layer)
        except ValueError as exc:
            raise ArtifactError(f"{path}: {exc}") from None
        fingerprint = _scalar(reader, PARENT_FINGERPRINT_KEY, "")
        if verify:
            _verify_slice(path, reader, fields, index, layer_range, n_layer)
    file_type = _scalar(reader, "general.file_type", -1)
    types = {entry.ggml_type for entry in index if _BLOCK_RE.match(entry.name) and len(entry.shape) >= 2}
    quant = "+".join(sorted(GGMLQuantizationType(t).name for t in types)) if types else "unknown"
    n_head = _scalar(reader, f"{arch}.attention.head_count", 0)
    return ArtifactInfo(
        path=path,
        fingerprint=str(fingerprint),
        file_fingerprint=file_fingerprint,
        architecture=arch,
        name=str(_scalar(reader, "general.name", path.stem)),
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=_array_len(reader, "tokenizer.ggml.tokens") or int(_scalar(reader, f"{arch}.vocab_size", 0)),
        n_head=int(n_head) if isinstance(n_head, int) else 0,
        n_head_kv=int(_scalar(reader, f"{arch}.attention.head_count_kv", n_head) or 0),
        context_length=int(_scalar(reader, f"{arch}.context_length", 0)),
        file_type=int(file_type),
        quant=quant,
        n_tensors=len(index),
        tensor_bytes=sum(entry.n_bytes for entry in index),
        file_bytes=path.stat().st_size,
        layer_range=layer_range,
        has_chat_template="tokenizer.chat_template" in reader.fields,
    )


def _parent_index(path: Path, reader: GGUFReader) -> list[TensorEntry]:
    field = reader.fields.get(PARENT_INDEX_KEY)
    if field is None or not field.types or field.types[-1] != GGUFValueType.STRING:
        raise ArtifactError(f"{path} is a shard file without its parent's tensor index ({PARENT_INDEX_KEY})")
    return [TensorEntry.from_line(bytes(field.parts[i]).decode()) for i in field.data]


def _verify_slice(
    path: Path,
    reader: GGUFReader,
    fields: list[tuple[str, bytes]],
    index: list[TensorEntry],
    layers: LayerRange,
    n_layer: int,
) -> None:
    claimed = _scalar(reader, PARENT_FINGERPRINT_KEY)
    if not isinstance(claimed, str) or not claimed:
        raise ArtifactError(f"{path} is a shard file without a parent fingerprint ({PARENT_FINGERPRINT_KEY})")
    parent = _parent_index(path, reader)
    if _fingerprint(fields, parent) != claimed:
        raise ArtifactError(
            f"{path}: metadata or parent index does not match the parent fingerprint {claimed[:16]}…; "
            "the file was modified after it was cut"
        )
    parent_lines = {entry.name: entry for entry in parent}
    for entry in index:
        if parent_lines.get(entry.name) != entry:
            raise ArtifactError(f"{path}: tensor {entry.name} differs from the parent model {claimed[:16]}…")
    tied = "output.weight" not in parent_lines
    wanted = {name for name in parent_lines if tensor_belongs(name, layers, n_layer, tied)}
    have = {entry.name for entry in index}
    if have != wanted:
        missing, extra = sorted(wanted - have), sorted(have - wanted)
        raise ArtifactError(f"{path}: tensors do not match range {layers}: missing {missing[:5]}, extra {extra[:5]}")


def verify_parent(info: ArtifactInfo, expected_fingerprint: str) -> None:
    """Refuse a file that is not (a slice of) the artifact ``expected_fingerprint``."""
    if info.fingerprint != expected_fingerprint:
        raise ArtifactError(
            f"{info.path} belongs to artifact {info.fingerprint[:16]}…, not the expected {expected_fingerprint[:16]}…"
        )


def _copy_field(writer: GGUFWriter, name: str, field: Any) -> None:
    main = field.types[0]
    if main == GGUFValueType.STRING:
        writer.add_key_value(name, bytes(field.parts[field.data[0]]), main)
    elif main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if len(field.types) > 2:
            raise ArtifactError(f"nested array metadata ({name}) is not supported")
        if sub == GGUFValueType.STRING:
            values: Sequence[Any] = [bytes(field.parts[i]) for i in field.data]
        else:
            values = [field.parts[i][0].item() for i in field.data]
        if values:
            writer.add_key_value(name, values, main, sub)
    else:
        writer.add_key_value(name, field.parts[field.data[0]][0].item(), main)


def split(
    model: str | os.PathLike[str],
    ranges: Sequence[LayerRange],
    out_dir: str | os.PathLike[str],
    *,
    progress: bool = False,
) -> list[Path]:
    """Write one shard file per range (with a progress bar if asked); returns their paths."""
    model = Path(model)
    info = inspect(model)
    if info.is_shard_file:
        raise ArtifactError(f"{model} is already a shard file ({info.layer_range}); split the whole model")
    if info.architecture not in SUPPORTED_ARCHITECTURES:
        raise ArtifactError(f"architecture {info.architecture!r} is not supported for layer ranges")
    if not ranges:
        raise ArtifactError("no ranges given")
    for layers in ranges:
        try:
            layers.check_within(info.n_layer)
        except ValueError as exc:
            raise ArtifactError(str(exc)) from None
    reader = _open(model)
    parent = _tensor_index(reader)
    tied = not any(entry.name == "output.weight" for entry in parent)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for layers in ranges:
        target = out / f"{model.stem}.layers-{layers.start}-{layers.end}.gguf"
        tmp = target.with_suffix(".gguf.partial")
        writer = GGUFWriter(tmp, arch=info.architecture, use_temp_file=False)
        for name, field in reader.fields.items():
            if name.startswith(_NON_IDENTITY_PREFIXES) or name == "general.architecture":
                continue
            if name == "general.alignment":
                writer.add_custom_alignment(int(field.parts[field.data[0]][0]))
            _copy_field(writer, name, field)
        writer.add_uint32(SHARD_START_KEY, layers.start)
        writer.add_uint32(SHARD_END_KEY, layers.end)
        writer.add_string(PARENT_FINGERPRINT_KEY, info.fingerprint)
        writer.add_array(PARENT_INDEX_KEY, [entry.line() for entry in parent])
        for tensor in reader.tensors:
            if not tensor_belongs(tensor.name, layers, info.n_layer, tied):
                continue
            raw = np.asarray(reader.data[tensor.data_offset : tensor.data_offset + tensor.n_bytes])
            ggml_type = GGMLQuantizationType(int(tensor.tensor_type))
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            shape = [int(d) for d in tensor.shape]  # ggml order
            row_bytes = shape[0] // block * type_size
            byte_shape = [*reversed(shape[1:]), row_bytes]
            writer.add_tensor(tensor.name, raw.reshape(byte_shape), raw_dtype=ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=progress)
        writer.close()
        os.replace(tmp, target)
        written.append(target)
    for path in written:
        inspect(path)  # verifies every slice against the parent fingerprint
    return written
