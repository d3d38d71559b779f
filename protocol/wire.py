"""Protobuf wire format for the hot messages, by hand.

A decode step crosses every seam once per token, so its frame must encode and
decode in microseconds; the generated betterproto2 classes take about 100 µs for
one. This module writes and reads exactly the same bytes for ``Header``, ``Span``,
``Tensor``, ``Activations`` and ``Tokens`` (tests check byte-identity against the
generated code, and that any valid encoding of those messages is read: fields in
any order, unknown fields skipped, repeated scalars packed or not).

Readers raise :class:`~protocol.errors.RemoteProtocolError` on anything malformed
and never allocate more than the input's size.
"""

from __future__ import annotations

from collections.abc import Iterator

from protocol.errors import RemoteProtocolError, StatusCode

VARINT, I64, LEN, I32 = 0, 1, 2, 5
_UINT32_MAX = 0xFFFFFFFF
_UINT64_MAX = 0xFFFFFFFFFFFFFFFF
_SMALL = [bytes([i]) for i in range(128)]
_LOW_BYTES = bytes(range(128))


def varint(value: int) -> bytes:
    """Encode a non-negative integer as a protobuf varint."""
    if value < 128:
        return _SMALL[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(field: int, wire_type: int) -> bytes:
    """A field key."""
    return varint((field << 3) | wire_type)


def len_field(field: int, data: bytes) -> bytes:
    """A length-delimited field (always written, even when empty)."""
    return tag(field, LEN) + varint(len(data)) + data


def uint_field(field: int, value: int) -> bytes:
    """A varint field, omitted at its default (0) as proto3 does."""
    return tag(field, VARINT) + varint(value) if value else b""


def bytes_field(field: int, data: bytes) -> bytes:
    """A bytes/string field, omitted when empty as proto3 does."""
    return len_field(field, data) if data else b""


def read_varint(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    """(value, next position); at most ten bytes, never past ``end``."""
    if pos >= end:
        raise RemoteProtocolError("malformed protobuf: truncated varint")
    byte = buf[pos]
    if byte < 0x80:
        return byte, pos + 1
    result = byte & 0x7F
    shift = 7
    pos += 1
    while True:
        if pos >= end:
            raise RemoteProtocolError("malformed protobuf: truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            if result > _UINT64_MAX:
                raise RemoteProtocolError("malformed protobuf: varint larger than 64 bits")
            return result, pos
        shift += 7
        if shift >= 70:
            raise RemoteProtocolError("malformed protobuf: varint longer than ten bytes")


def fields(buf: bytes | memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Every field in ``buf[pos:end]``, one at a time, as (number, wire type, value or start, end).

    For varints the third item is the value and the fourth is unused; for
    length-delimited and fixed-width fields they are the slice bounds. Lazy, so that a
    reader may stop at a limit before the fields of a large input are all listed.
    """
    while pos < end:
        key, pos = read_varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise RemoteProtocolError("malformed protobuf: field number 0")
        if wire_type == VARINT:
            value, pos = read_varint(buf, pos, end)
            yield number, VARINT, value, 0
            continue
        if wire_type == LEN:
            length, start = read_varint(buf, pos, end)
        elif wire_type in (I64, I32):
            length, start = (8 if wire_type == I64 else 4), pos
        else:
            raise RemoteProtocolError(f"malformed protobuf: wire type {wire_type} is not supported")
        pos = start + length
        if pos > end:
            raise RemoteProtocolError(
                f"malformed protobuf: field {number} declares {length} bytes, {end - start} remain"
            )
        yield number, wire_type, start, pos


def count_varints(buf: bytes | memoryview, start: int, end: int) -> int:
    """How many varints a packed field holds (each ends in the one byte below 0x80)."""
    return end - start - len(bytes(buf[start:end]).translate(None, _LOW_BYTES))


def expect(wire_type: int, want: int, number: int, message: str) -> None:
    """Refuse a known field sent with the wrong wire type."""
    if wire_type != want:
        raise RemoteProtocolError(f"{message}.{number} has wire type {wire_type}, expected {want}")


def as_uint32(value: int, what: str) -> int:
    """Refuse a varint that does not fit uint32."""
    if value > _UINT32_MAX:
        raise RemoteProtocolError(f"{what} = {value} does not fit in 32 bits")
    return value


def packed_uint32(buf: bytes | memoryview, start: int, end: int, out: list[int], limit: int, what: str) -> None:
    """Append the varints of a packed repeated uint32 field to ``out`` (at most ``limit``)."""
    pos = start
    while pos < end:
        value, pos = read_varint(buf, pos, end)
        out.append(as_uint32(value, what))
        if len(out) > limit:
            raise RemoteProtocolError(f"more than {limit} {what}", StatusCode.RESOURCE_EXHAUSTED)


def repeated_uint32(
    buf: bytes | memoryview, wire_type: int, value: int, end: int, out: list[int], limit: int, what: str
) -> None:
    """One occurrence of a repeated uint32 field, packed (LEN) or not (VARINT)."""
    if wire_type == LEN:
        packed_uint32(buf, value, end, out, limit, what)
    elif wire_type == VARINT:
        out.append(as_uint32(value, what))
        if len(out) > limit:
            raise RemoteProtocolError(f"more than {limit} {what}", StatusCode.RESOURCE_EXHAUSTED)
    else:
        raise RemoteProtocolError(f"{what} has wire type {wire_type}")


def encode_packed_uint32(field: int, values: list[int] | tuple[int, ...]) -> bytes:
    """A packed repeated uint32 field; omitted when empty."""
    if not values:
        return b""
    body = b"".join(varint(v) for v in values)
    return len_field(field, body)


def text(buf: bytes | memoryview, start: int, end: int, what: str) -> str:
    """A UTF-8 string field."""
    try:
        return bytes(buf[start:end]).decode("utf-8")
    except UnicodeDecodeError:
        raise RemoteProtocolError(f"{what} is not valid UTF-8") from None
