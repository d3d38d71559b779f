"""A small, strict GGUF reader and raw writer.

The ``gguf`` package's reader builds a numpy view per metadata element, which takes
seconds on a 49k-token vocabulary. This reader walks the header once with ``struct``,
keeps each metadata field as its raw bytes (what fingerprints hash and what sliced
files copy verbatim) and decodes values only on demand. Every declared length is
checked against the file size before it is used.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import attrs

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR = {
    UINT8: "<B",
    INT8: "<b",
    UINT16: "<H",
    INT16: "<h",
    UINT32: "<I",
    INT32: "<i",
    FLOAT32: "<f",
    BOOL: "<?",
    UINT64: "<Q",
    INT64: "<q",
    FLOAT64: "<d",
}
_SIZES = {t: struct.calcsize(f) for t, f in _SCALAR.items()}
_MAX_DIMS = 8


class GGUFError(ValueError):
    """The file is not a well-formed GGUF file."""


@attrs.frozen
class Field:
    """One metadata key/value, with the raw bytes it occupies in the file."""

    key: str
    type: int
    raw: bytes  # from the key's length prefix to the end of the value
    value_offset: int  # offset of the value inside ``raw``
    array_type: int = -1
    count: int = 1

    def value(self) -> Any:
        """The decoded value (lists for arrays, ``str`` for strings)."""
        return _decode_value(self.raw, self.value_offset, self.type, self.array_type, self.count)


@attrs.frozen
class TensorInfo:
    """One entry of the tensor index."""

    name: str
    shape: tuple[int, ...]  # ggml order, ne0 first
    ggml_type: int
    offset: int  # absolute offset of the data in the file
    n_bytes: int


@attrs.frozen
class GGUFFile:
    """The parsed header of a GGUF file."""

    path: Path
    version: int
    fields: dict[str, Field]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default``."""
        field = self.fields.get(key)
        return default if field is None else field.value()


def _type_sizes() -> dict[int, tuple[int, int]]:
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()}


_GGML_SIZES = _type_sizes()


def tensor_nbytes(shape: Sequence[int], ggml_type: int) -> int:
    """Bytes of a tensor of ``shape`` (ggml order) stored as ``ggml_type``."""
    try:
        block, type_size = _GGML_SIZES[ggml_type]
    except KeyError:
        raise GGUFError(f"unknown ggml type {ggml_type}") from None
    if not shape or shape[0] % block:
        raise GGUFError(f"row length {shape[0] if shape else 0} is not a multiple of the block size {block}")
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size


class HeaderIncomplete(GGUFError):
    """The header goes on past the bytes given: parse again with at least ``needed`` of them."""

    def __init__(self, needed: int) -> None:
        super().__init__(f"the header goes on past the bytes given: at least {needed} are needed")
        self.needed = needed


class _Cursor:
    def __init__(self, buf: Any, limit: int, size: int) -> None:
        self.buf = buf
        self.pos = 0
        self.limit = limit  # bytes at hand: a prefix of the file when read over the network
        self.size = size  # of the whole file

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise GGUFError(f"truncated header: needs {n} bytes at offset {start}, file has {self.size}")
        if start + n > self.limit:
            raise HeaderIncomplete(start + n)
        self.pos = start + n
        return start

    def unpack(self, fmt: str) -> Any:
        start = self.take(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.take(n)
        try:
            return bytes(self.buf[start : start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"string at offset {start} is not UTF-8") from None

    def skip_value(self, vtype: int, depth: int = 0) -> tuple[int, int]:
        """Skip a value; returns (array element type, count) for arrays."""
        if vtype in _SIZES:
            self.take(_SIZES[vtype])
            return -1, 1
        if vtype == STRING:
            self.take(self.unpack("<Q"))
            return -1, 1
        if vtype == ARRAY:
            if depth > 0:
                raise GGUFError("nested arrays are not supported")
            element, count = self.unpack("<I"), self.unpack("<Q")
            if element in _SIZES:
                self.take(_SIZES[element] * count)
            elif element == STRING:
                if count > self.size:
                    raise GGUFError(f"array of {count} strings cannot fit in the file")
                for _ in range(count):
                    self.take(self.unpack("<Q"))
            else:
                raise GGUFError(f"array of unsupported element type {element}")
            return element, count
        raise GGUFError(f"unknown metadata value type {vtype}")


def _decode_value(raw: bytes, offset: int, vtype: int, element: int, count: int) -> Any:
    if vtype in _SCALAR:
        return struct.unpack_from(_SCALAR[vtype], raw, offset)[0]
    if vtype == STRING:
        (n,) = struct.unpack_from("<Q", raw, offset)
        return raw[offset + 8 : offset + 8 + n].decode("utf-8", errors="replace")
    pos = offset + 12  # element type + count
    if element in _SCALAR:
        return list(struct.unpack_from(f"<{count}{_SCALAR[element][1]}", raw, pos))
    values = []
    for _ in range(count):
        (n,) = struct.unpack_from("<Q", raw, pos)
        values.append(raw[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
        pos += 8 + n
    return values


def read(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse the header of a GGUF file; raises :class:`GGUFError` on anything malformed."""
    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{size} bytes is too small for a GGUF file")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return parse(mm, size, path)


def parse(head: Any, file_size: int, path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF header from ``head``, the first bytes of a file of ``file_size`` bytes.

    ``head`` may be all of the file or a prefix read over the network: when the header goes
    on past it, :class:`HeaderIncomplete` says how many bytes at least to read. ``path``
    only names the file in the result and in messages.
    """
    path = Path(path)
    size = file_size
    if size < 24:
        raise GGUFError(f"{size} bytes is too small for a GGUF file")
    cur = _Cursor(head, min(len(head), size), size)
    cur.take(4)
    if bytes(head[0:4]) != GGUF_MAGIC:
        raise GGUFError("bad magic: not a GGUF file")
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    if n_tensors > size // 24 or n_kv > size // 12:
        raise GGUFError(f"header declares {n_kv} keys and {n_tensors} tensors, more than the file can hold")
    fields: dict[str, Field] = {}
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string()
        vtype = cur.unpack("<I")
        value_start = cur.pos
        element, count = cur.skip_value(vtype)
        if key in fields:
            raise GGUFError(f"duplicate key {key!r}")
        fields[key] = Field(key, vtype, bytes(head[start : cur.pos]), value_start - start, element, count)
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        alignment = fields["general.alignment"].value()
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"alignment {alignment!r:.40} is not a power of two")
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if not 0 < n_dims <= _MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {n_dims} dimensions")
        shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
        ggml_type, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((name, shape, ggml_type, offset))
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = []
    seen = set()
    for name, shape, ggml_type, offset in infos:
        if name in seen:
            raise GGUFError(f"duplicate tensor {name!r}")
        seen.add(name)
        if any(d == 0 for d in shape):
            raise GGUFError(f"tensor {name!r} has an empty dimension")
        n_bytes = tensor_nbytes(shape, ggml_type)
        absolute = data_offset + offset
        if absolute + n_bytes > size:
            raise GGUFError(f"tensor {name!r} ends past the end of the file: truncated or corrupted")
        tensors.append(TensorInfo(name, shape, ggml_type, absolute, n_bytes))
    return GGUFFile(path, version, fields, tensors, alignment, data_offset, size)


def _pack_string(text: str | bytes) -> bytes:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def string_field(key: str, value: str) -> bytes:
    """Raw bytes of a string metadata field."""
    return _pack_string(key) + struct.pack("<I", STRING) + _pack_string(value)


def uint32_field(key: str, value: int) -> bytes:
    """Raw bytes of a uint32 metadata field."""
    return scalar_field(key, UINT32, value)


def scalar_field(key: str, vtype: int, value: Any) -> bytes:
    """Raw bytes of a metadata field of scalar type ``vtype`` (``UINT16``, ``INT32``, ...)."""
    try:
        packed = struct.pack(_SCALAR[vtype], value)
    except KeyError:
        raise GGUFError(f"{vtype} is not a scalar metadata type") from None
    return _pack_string(key) + struct.pack("<I", vtype) + packed


def string_array_field(key: str, values: Iterable[str]) -> bytes:
    """Raw bytes of an array-of-strings metadata field."""
    items = [_pack_string(v) for v in values]
    return _pack_string(key) + struct.pack("<IIQ", ARRAY, STRING, len(items)) + b"".join(items)


@attrs.frozen
class Layout:
    """Where everything goes in a file :func:`write` makes: its header, each tensor, its size.

    A file laid out here and filled in place (a tensor at a time, in any order, the rest
    left zero) is byte for byte the file :func:`write` makes from the same arguments.
    """

    header: bytes  # magic, counts, metadata, tensor index and the padding up to the data
    offsets: tuple[int, ...]  # absolute offset of each tensor's data, in the order given
    size: int  # of the whole file, the last tensor's padding included


def layout(raw_fields: Sequence[bytes], tensors: Sequence[TensorInfo], *, alignment: int = DEFAULT_ALIGNMENT) -> Layout:
    """The layout of a GGUF v3 file holding ``raw_fields`` and ``tensors`` (their order kept)."""
    index = bytearray()
    relative = []
    offset = 0
    for info in tensors:
        index += _pack_string(info.name) + struct.pack("<I", len(info.shape))
        index += struct.pack(f"<{len(info.shape)}Q", *info.shape) + struct.pack("<IQ", info.ggml_type, offset)
        relative.append(offset)
        offset += -(-info.n_bytes // alignment) * alignment
    header = bytearray(GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(raw_fields)))
    for raw in raw_fields:
        header += raw
    header += index
    header += b"\0" * (-len(header) % alignment)
    return Layout(bytes(header), tuple(len(header) + r for r in relative), len(header) + offset)


def write(
    path: str | os.PathLike[str],
    raw_fields: Sequence[bytes],
    tensors: Sequence[tuple[TensorInfo, BinaryIO]],
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    progress: Any = None,
) -> None:
    """Write a GGUF v3 file from raw metadata fields and tensors copied from open files.

    ``progress``, if given, is called with the bytes written after each tensor.
    """
    planned = layout(raw_fields, [info for info, _ in tensors], alignment=alignment)
    with open(path, "wb") as out:
        out.write(planned.header)
        for info, source in tensors:
            source.seek(info.offset)
            left = info.n_bytes
            while left:
                chunk = source.read(min(left, 16 << 20))
                if not chunk:
                    raise GGUFError(f"source of tensor {info.name!r} ended early")
                out.write(chunk)
                left -= len(chunk)
            out.write(b"\0" * (-info.n_bytes % alignment))
            if progress is not None:
                progress(info.n_bytes)
