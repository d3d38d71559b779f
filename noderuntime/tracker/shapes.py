"""An artifact's shape from the artifact itself: a proof its fingerprint binds, checked and kept.

An artifact's fingerprint (:mod:`noderuntime.models.artifacts`) is a hash over the digest of
each identity field (the layer count among them) and over its tensor index. A node sends,
with its registration, those digests, the architecture and block count fields whole, and the
index (:func:`prove`); the tracker recomputes the fingerprint from them (:func:`proven_layers`).
Where it matches, the layer count is the artifact's own: finding other fields that hash to
the same fingerprint is finding a sha256 collision. So a registrant's claim cannot change
the shape, nor can a majority of them (a vote is what an open swarm must not go by). Anyone
can prove the shape of an artifact they make up, which harms nobody: no honest node serves it.

Proven shapes are kept by artifact (:class:`ProvenShapes`): for as long as a node of the
artifact is registered, and for a while after its last one leaves, a bounded number of them.
Plain synchronous code, no I/O.
"""

from __future__ import annotations

import base64
import binascii
import struct
import zlib
from collections.abc import Sequence

from noderuntime.models import gguf as ggufio
from noderuntime.models.artifacts import TensorEntry, field_digest, fingerprint_of_digests
from noderuntime.tracker.messages import MAX_SHAPE_FIELDS, MAX_SHAPE_INDEX_CHARS, ShapeProof

ARCHITECTURE_KEY = "general.architecture"
# the tensor index unpacked: at most this many bytes (2,048 tensors of 128), lines
MAX_INDEX_BYTES = 256 << 10
MAX_INDEX_TENSORS = 2048
# the GGUF types a block count may be stored as (llama.cpp writes uint32)
_INTEGER_TYPES = frozenset(
    {ggufio.UINT8, ggufio.INT8, ggufio.UINT16, ggufio.INT16, ggufio.UINT32, ggufio.INT32, ggufio.UINT64, ggufio.INT64}
)
# proven shapes kept of artifacts no registered node serves: how many, and how long
SHAPES_KEPT = 1024
SHAPE_KEPT_SECONDS = 3600.0


class ShapeError(ValueError):
    """A shape proof that does not hold, or cannot be made of a model's identity."""


def prove(fields: Sequence[tuple[str, bytes]], index: Sequence[TensorEntry]) -> ShapeProof:
    """The proof of the shape of the model whose identity fields (key, raw bytes, in key order) and
    tensor index are these (``models.artifacts.identity``); :class:`ShapeError` when it has no
    architecture or block count, or is larger than a proof may be."""
    found = dict(fields)
    try:
        kind, architecture = _value(ARCHITECTURE_KEY, found[ARCHITECTURE_KEY])
        count_type, n_layer = _value(f"{architecture}.block_count", found[f"{architecture}.block_count"])
    except (KeyError, struct.error, ggufio.GGUFError):
        raise ShapeError("the model has no architecture or no block count") from None
    if not isinstance(architecture, str) or kind != ggufio.STRING or not isinstance(n_layer, int):
        raise ShapeError(f"the model's architecture or block count is of GGUF type {kind} or {count_type}")
    text = "\n".join(sorted(entry.line() for entry in index)).encode()
    packed = base64.b64encode(zlib.compress(text, 9)).decode()
    if len(fields) > MAX_SHAPE_FIELDS or len(packed) > MAX_SHAPE_INDEX_CHARS or len(index) > MAX_INDEX_TENSORS:
        raise ShapeError(f"{len(fields)} fields and {len(index)} tensors ({len(packed)} characters) exceed a proof")
    try:
        return ShapeProof(
            architecture=architecture,
            n_layer=n_layer,
            n_layer_type=count_type,
            fields=[field_digest(key, raw).hex() for key, raw in fields],
            index=packed,
        )
    except ValueError as exc:  # pydantic's ValidationError: an architecture name or a count out of bounds
        raise ShapeError(f"the model's shape cannot be proven: {exc}") from None


def _value(key: str, raw: bytes) -> tuple[int, object]:
    """The GGUF type and the value of the scalar field ``key`` whose raw bytes are ``raw``."""
    at = 8 + len(key.encode())  # past the key's length and the key
    (vtype,) = struct.unpack_from("<I", raw, at)
    if vtype not in (ggufio.STRING, *_INTEGER_TYPES):
        return vtype, None
    return vtype, ggufio.Field(key, vtype, raw, at + 4).value()


def proven_layers(artifact: str, proof: ShapeProof) -> int:
    """The layer count ``proof`` proves of ``artifact`` (its fingerprint, hex); :class:`ShapeError` when
    it proves nothing: the fields shown are not among those hashed, or all of it does not hash to
    ``artifact``. Bounded before anything is decoded (the message's bounds, then :data:`MAX_INDEX_BYTES`)."""
    if proof.n_layer_type not in _INTEGER_TYPES:
        raise ShapeError(f"a block count is an integer, not GGUF type {proof.n_layer_type}")
    key = f"{proof.architecture}.block_count"
    try:
        count_raw = ggufio.scalar_field(key, proof.n_layer_type, proof.n_layer)
    except struct.error:
        raise ShapeError(f"{proof.n_layer} does not fit GGUF type {proof.n_layer_type}") from None
    digests = [bytes.fromhex(d) for d in proof.fields]
    shown = (
        field_digest(ARCHITECTURE_KEY, ggufio.string_field(ARCHITECTURE_KEY, proof.architecture)),
        field_digest(key, count_raw),
    )
    if not all(one in digests for one in shown):
        raise ShapeError("the architecture and block count shown are not among the fields hashed")
    lines = _unpack(proof.index)
    if fingerprint_of_digests(digests, lines) != artifact:
        raise ShapeError(f"the fields and tensor index sent do not hash to the artifact {artifact[:16]}…")
    return proof.n_layer


def _unpack(packed: str) -> list[str]:
    """The index lines of a proof's packed index, never more than :data:`MAX_INDEX_BYTES` unpacked."""
    try:
        squeezed = base64.b64decode(packed, validate=True)
        inflater = zlib.decompressobj()
        text = inflater.decompress(squeezed, MAX_INDEX_BYTES + 1)
    except (binascii.Error, zlib.error) as exc:
        raise ShapeError(f"the tensor index is not zlib in base64: {exc}") from None
    if len(text) > MAX_INDEX_BYTES or inflater.unconsumed_tail:
        raise ShapeError(f"the tensor index unpacks to more than {MAX_INDEX_BYTES} bytes")
    if not inflater.eof or inflater.unused_data:
        raise ShapeError("the tensor index is not one whole zlib stream")
    if text.count(b"\n") >= MAX_INDEX_TENSORS:
        raise ShapeError(f"the tensor index lists more than {MAX_INDEX_TENSORS} tensors")
    try:
        return text.decode().split("\n")
    except UnicodeDecodeError:
        raise ShapeError("the tensor index is not UTF-8 text") from None


class ProvenShapes:
    """Layer counts proven by artifact: kept while a node of the artifact is registered, and for
    ``keep_seconds`` after its last one left, ``kept`` of those at most (the longest idle go first).

    Those of artifacts in use are bounded as the registered nodes are; the rest by ``kept``,
    so a flood of made-up artifacts, each with a proof, cannot grow it without bound, nor
    evict the shape of an artifact that honest nodes serve.
    """

    def __init__(self, *, kept: int = SHAPES_KEPT, keep_seconds: float = SHAPE_KEPT_SECONDS) -> None:
        """``kept`` and ``keep_seconds``: how many proven shapes of artifacts nobody serves are kept, how long."""
        self.kept = kept
        self.keep_seconds = keep_seconds
        self._shapes: dict[str, int] = {}
        self._idle: dict[str, float] = {}  # artifacts no node serves -> since when, longest idle first

    def __len__(self) -> int:
        return len(self._shapes)

    def get(self, artifact: str) -> int | None:
        """``artifact``'s proven layer count; None if none is proven (or it was forgotten)."""
        return self._shapes.get(artifact)

    def prove(self, artifact: str, n_layer: int, now: float) -> None:
        """Keep ``artifact``'s proven layer count; idle (no node serves it yet) until :meth:`in_use`."""
        self._shapes[artifact] = n_layer
        self.idle(artifact, now)

    def in_use(self, artifact: str) -> None:
        """A node of ``artifact`` is registered: its shape is kept until :meth:`idle`."""
        self._idle.pop(artifact, None)

    def idle(self, artifact: str, now: float) -> None:
        """The last node of ``artifact`` is gone: its shape is kept ``keep_seconds`` more, if room allows."""
        if artifact not in self._shapes:
            return
        self._idle.pop(artifact, None)
        self._idle[artifact] = now
        while len(self._idle) > self.kept:
            self._forget(next(iter(self._idle)))

    def expire(self, now: float) -> None:
        """Forget the shapes of artifacts nobody has served for ``keep_seconds``."""
        for artifact, since in list(self._idle.items()):
            if now - since <= self.keep_seconds:
                break  # oldest first: the rest are younger
            self._forget(artifact)

    def _forget(self, artifact: str) -> None:
        del self._idle[artifact]
        del self._shapes[artifact]
