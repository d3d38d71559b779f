"""The sans-IO frame codec: events to bytes and bytes to events.

:class:`FrameEncoder` turns an event into one or more frames (an ``Activations``
step larger than the frame limit is split into chunks); :class:`FrameDecoder` turns
frames back into events, reassembling chunks, verifying the payload checksum and
every declared size against :class:`Limits` before allocating. Anything malformed
becomes a :class:`~protocol.errors.RemoteProtocolError` with a status code; no other
exception escapes ``receive``.

Neither class does I/O or knows about sessions; :mod:`protocol.seam` checks the order
and identity of events.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import attrs
import crc32c

from protocol import encodings, wire
from protocol.cold import cold_body, read_cold
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError, StatusCode
from protocol.events import (
    Activations,
    Encoding,
    Event,
    Header,
    Identity,
    NamedTensor,
    Tokens,
)
from protocol.hot import (
    ACTIVATIONS,
    OPEN_ROUTE,
    PAYLOAD_FIELD,
    PREFIX,
    TOKENS,
    logprob_fields,
    read_header,
    read_tokens,
    span_bytes,
)
from protocol.limits import CHUNK_OVERHEAD, Limits


class FrameEncoder:
    """Events to frame bytes."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        # identity fields of the header, encoded once per session
        self._identity_cache: OrderedDict[Identity, bytes] = OrderedDict()

    def _identity(self, identity: Identity) -> bytes:
        cached = self._identity_cache.get(identity)
        if cached is not None:
            self._identity_cache.move_to_end(identity)
            return cached
        encoded = (
            wire.bytes_field(3, identity.request_id.encode())
            + wire.bytes_field(4, identity.session_id)
            + wire.uint_field(5, identity.epoch)
            + wire.bytes_field(6, identity.artifact_fingerprint)
            + wire.bytes_field(7, identity.recipe_fingerprint)
            + wire.len_field(8, span_bytes(identity.shard))
        )
        self._identity_cache[identity] = encoded
        if len(self._identity_cache) > 1024:
            self._identity_cache.popitem(last=False)
        return encoded

    def header_bytes(self, header: Header, crc: int) -> bytes:
        """The encoded ``Header`` message of a frame whose body checksum is ``crc``."""
        return (
            wire.uint_field(1, header.schema_major)
            + wire.uint_field(2, header.schema_minor)
            + self._identity(header.identity)
            + wire.uint_field(9, int(header.phase))
            + wire.len_field(10, span_bytes(header.positions))
            + wire.uint_field(11, header.step_id)
            + wire.uint_field(12, header.cache_expectation)
            + wire.uint_field(13, crc)
        )

    def _frame(self, header: Header, body_field: int, body_parts: list[bytes | memoryview]) -> bytes:
        body_len = sum(len(p) for p in body_parts)
        crc = 0
        for part in body_parts:
            crc = crc32c.crc32c(part, crc)
        head = wire.len_field(1, self.header_bytes(header, crc))
        frame = b"".join([head, wire.tag(body_field, wire.LEN), wire.varint(body_len), *body_parts])
        if len(frame) > self.limits.max_frame_bytes:
            raise LocalProtocolError(
                f"frame of {len(frame)} bytes exceeds the {self.limits.max_frame_bytes}-byte limit",
                StatusCode.RESOURCE_EXHAUSTED,
            )
        return frame

    def encode(self, event: Event) -> list[bytes]:
        """One frame, or several for an Activations step larger than the frame limit."""
        if isinstance(event, Activations):
            return self._activations(event)
        if isinstance(event, Tokens):
            body = (
                wire.encode_packed_uint32(1, event.token_ids)
                + wire.uint_field(2, int(event.finished))
                + wire.bytes_field(3, event.finish_reason.encode())
            )
            if event.logprobs or event.prompt_logprobs:
                body += logprob_fields(event)  # rare (sessions that ask): the generated code writes them
            if event.window or event.drafted or event.ahead:
                body += wire.uint_field(6, event.window) + wire.uint_field(7, event.drafted)
                body += wire.uint_field(8, event.accepted) + wire.uint_field(9, event.ahead)
            return [self._frame(event.header, TOKENS, [body])]
        field, message = cold_body(event)
        return [self._frame(event.header, field, [bytes(message)])]

    def _activations(self, event: Activations) -> list[bytes]:
        if not 0 < len(event.tensors) <= self.limits.max_tensors:
            raise LocalProtocolError(f"an Activations step carries 1 to {self.limits.max_tensors} tensors")
        encoded = []
        for tensor in event.tensors:
            if not 0 < tensor.array.ndim <= self.limits.max_tensor_dims:
                raise LocalProtocolError(f"tensor {tensor.name!r} has {tensor.array.ndim} dimensions")
            encoded.append((tensor, encodings.encode(tensor.array, tensor.encoding)))
        if len(event.draft) > self.limits.max_window:
            raise LocalProtocolError(f"a window carries at most {self.limits.max_window} drafts")
        # every frame of a chunked step carries the drafts: each is checked on its own
        count = wire.uint_field(2, len(event.tensors)) + wire.encode_packed_uint32(3, event.draft)
        count += wire.uint_field(4, int(event.follows))
        whole = sum(len(payload) + CHUNK_OVERHEAD for _, payload in encoded)
        if whole <= self.limits.max_frame_bytes:
            parts: list[bytes | memoryview] = []
            for tensor, payload in encoded:
                parts += _tensor_parts(tensor, payload, 0, len(payload), 0, 1)
            return [self._frame(event.header, ACTIVATIONS, [*parts, count])]
        frames = []
        room = self.limits.max_frame_bytes - CHUNK_OVERHEAD
        for tensor, payload in encoded:
            n_chunks = max(1, math.ceil(len(payload) / room))
            if n_chunks > self.limits.max_chunks:
                raise LocalProtocolError(
                    f"tensor {tensor.name!r} needs {n_chunks} chunks", StatusCode.RESOURCE_EXHAUSTED
                )
            view = memoryview(payload)
            for index in range(n_chunks):
                start = index * room
                chunk = view[start : start + room]
                parts = _tensor_parts(tensor, chunk, start, len(payload), index, n_chunks)
                frames.append(self._frame(event.header, ACTIVATIONS, [*parts, count]))
        return frames


def _tensor_parts(
    tensor: NamedTensor, payload: bytes | memoryview, offset: int, total: int, index: int, count: int
) -> list[bytes | memoryview]:
    meta = (
        wire.bytes_field(1, tensor.name.encode())
        + wire.encode_packed_uint32(2, tensor.array.shape)
        + wire.uint_field(3, int(tensor.encoding))
        + wire.uint_field(5, total)
        + wire.uint_field(6, offset)
        + wire.uint_field(7, index)
        + wire.uint_field(8, count)
    )
    payload_key = wire.tag(PAYLOAD_FIELD, wire.LEN) + wire.varint(len(payload))
    inner = len(meta) + len(payload_key) + len(payload)
    return [wire.tag(1, wire.LEN) + wire.varint(inner) + meta + payload_key, payload]


@attrs.define
class _PendingTensor:
    name: str
    shape: tuple[int, ...]
    encoding: Encoding
    big_endian: bool
    total: int
    count: int
    chunks: dict[int, tuple[int, bytes | memoryview]] = attrs.Factory(dict)
    received: int = 0


@attrs.define
class _PendingStep:
    header: Header
    tensor_count: int
    draft: tuple[int, ...] = ()
    follows: bool = False
    tensors: dict[str, _PendingTensor] = attrs.Factory(dict)
    done: dict[str, NamedTensor] = attrs.Factory(dict)
    order: list[str] = attrs.Factory(list)


class FrameDecoder:
    """Frame bytes to events; holds the chunks of at most one step at a time."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self._pending: _PendingStep | None = None

    @property
    def pending_bytes(self) -> int:
        """Payload bytes held for an incomplete step."""
        if self._pending is None:
            return 0
        return sum(t.received for t in self._pending.tensors.values())

    def receive(self, data: bytes | bytearray | memoryview) -> Event | None:
        """Decode one frame; ``None`` while a chunked step is incomplete."""
        try:
            return self._receive(data)
        except ProtocolError:
            self._pending = None
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the bytes make a check or a parser raise
            # a defect in our own checks must still reach the peer as a typed error, never the node
            self._pending = None
            raise RemoteProtocolError(f"malformed frame: {type(exc).__name__}: {exc}") from None

    def _receive(self, data: bytes | bytearray | memoryview) -> Event | None:
        if len(data) > self.limits.max_frame_bytes:
            raise RemoteProtocolError(
                f"frame of {len(data)} bytes exceeds the {self.limits.max_frame_bytes}-byte limit",
                StatusCode.RESOURCE_EXHAUSTED,
            )
        buf = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        header_range: tuple[int, int] | None = None
        body: tuple[int, int, int] | None = None
        for number, wire_type, a, b in wire.fields(buf, 0, len(buf)):
            if number == 1:
                wire.expect(wire_type, wire.LEN, number, "Frame")
                header_range = (a, b)
            elif OPEN_ROUTE <= number <= PREFIX:
                wire.expect(wire_type, wire.LEN, number, "Frame")
                if body is not None and body[0] != number:
                    raise RemoteProtocolError("frame carries more than one body")
                body = (number, a, b)
        if header_range is None:
            raise RemoteProtocolError("frame has no header")
        if body is None:
            raise RemoteProtocolError("frame has no body", StatusCode.UNIMPLEMENTED)
        header, crc = read_header(buf, *header_range, self.limits)
        field, start, end = body
        if crc32c.crc32c(buf[start:end]) != crc:
            raise RemoteProtocolError("payload checksum mismatch", StatusCode.DATA_LOSS)
        if field == ACTIVATIONS:
            return self._activations(header, buf, start, end)
        if self._pending is not None:
            raise RemoteProtocolError(f"step {self._pending.header.step_id} left incomplete by another frame")
        if field == TOKENS:
            return read_tokens(header, buf, start, end, self.limits)
        return read_cold(field, header, bytes(buf[start:end]), self.limits)

    def _activations(self, header: Header, buf: bytes | memoryview, start: int, end: int) -> Activations | None:
        tensors: list[tuple[int, int]] = []
        tensor_count = 0
        draft: list[int] = []
        follows = False
        for number, wire_type, a, b in wire.fields(buf, start, end):
            if number == 1:
                wire.expect(wire_type, wire.LEN, number, "Activations")
                tensors.append((a, b))
                if len(tensors) > self.limits.max_tensors:
                    raise RemoteProtocolError(
                        f"more than {self.limits.max_tensors} tensors", StatusCode.RESOURCE_EXHAUSTED
                    )
            elif number == 2:
                wire.expect(wire_type, wire.VARINT, number, "Activations")
                tensor_count = wire.as_uint32(a, "tensor_count")
            elif number == 3:
                wire.repeated_uint32(buf, wire_type, a, b, draft, self.limits.max_window, "drafted tokens")
            elif number == 4:
                wire.expect(wire_type, wire.VARINT, number, "Activations")
                follows = a != 0
        if not tensors:
            raise RemoteProtocolError("Activations without tensors")
        if tensor_count == 0:
            tensor_count = len(tensors)
        if tensor_count > self.limits.max_tensors:
            raise RemoteProtocolError(f"tensor_count {tensor_count} exceeds {self.limits.max_tensors}")
        step = self._pending
        if step is not None and step.header.step_id != header.step_id:
            raise RemoteProtocolError(
                f"chunks of step {header.step_id} interleaved with incomplete step {step.header.step_id}"
            )
        if step is not None and (step.header, step.tensor_count, step.draft, step.follows) != (
            header,
            tensor_count,
            tuple(draft),
            follows,
        ):
            raise RemoteProtocolError(f"chunks of step {header.step_id} disagree on their header")
        if step is None:
            step = _PendingStep(header, tensor_count, tuple(draft), follows)
        for a, b in tensors:
            self._chunk(step, buf, a, b)
        if len(step.done) == step.tensor_count:
            self._pending = None
            return Activations(header, tuple(step.done[name] for name in step.order), step.draft, step.follows)
        if len(step.tensors) + len(step.done) > step.tensor_count:
            raise RemoteProtocolError(f"step {header.step_id} has more tensors than its tensor_count")
        self._pending = step
        return None

    def _chunk(self, step: _PendingStep, buf: bytes | memoryview, start: int, end: int) -> None:
        limits = self.limits
        name = ""
        shape: list[int] = []
        encoding = 0
        big_endian = False
        total = offset = index = 0
        count = 1
        payload: bytes | memoryview = b""
        for number, wire_type, a, b in wire.fields(buf, start, end):
            if number == 1:
                wire.expect(wire_type, wire.LEN, number, "Tensor")
                if b - a > 256:
                    raise RemoteProtocolError("tensor name longer than 256 bytes")
                name = wire.text(buf, a, b, "tensor name")
            elif number == 2:
                wire.repeated_uint32(buf, wire_type, a, b, shape, limits.max_tensor_dims, "tensor dimensions")
            elif number == 15:
                wire.expect(wire_type, wire.LEN, number, "Tensor")
                payload = buf[a:b]
            elif 3 <= number <= 8:
                wire.expect(wire_type, wire.VARINT, number, "Tensor")
                if number == 3:
                    encoding = a
                elif number == 4:
                    big_endian = a == 1
                    if a > 1:
                        raise RemoteProtocolError(f"unknown byte order {a}")
                elif number == 5:
                    total = a
                elif number == 6:
                    offset = a
                elif number == 7:
                    index = a
                else:
                    count = a
        if not name:
            raise RemoteProtocolError("tensor without a name")
        if not shape or any(d == 0 for d in shape):
            raise RemoteProtocolError(f"tensor {name!r} has an empty shape {shape}")
        try:
            enc = Encoding(encoding)
        except ValueError:
            raise RemoteProtocolError(
                f"tensor {name!r} has unknown encoding {encoding}", StatusCode.UNIMPLEMENTED
            ) from None
        n_elements = math.prod(shape)
        if n_elements * 4 > limits.max_tensor_bytes:
            raise RemoteProtocolError(
                f"tensor {name!r} of shape {shape} exceeds {limits.max_tensor_bytes} bytes",
                StatusCode.RESOURCE_EXHAUSTED,
            )
        expected = encodings.encoded_size(n_elements, enc)
        if total != expected:
            raise RemoteProtocolError(
                f"tensor {name!r} declares {total} bytes; shape {shape} in {enc.name} is {expected}"
            )
        if not 1 <= count <= limits.max_chunks or index >= count:
            raise RemoteProtocolError(f"tensor {name!r} chunk {index} of {count}")
        if offset + len(payload) > total:
            raise RemoteProtocolError(f"tensor {name!r} chunk [{offset}, {offset + len(payload)}) ends past {total}")
        if name in step.done:
            raise RemoteProtocolError(f"tensor {name!r} of step {step.header.step_id} sent twice")
        if count == 1 and name not in step.tensors:
            if offset != 0 or len(payload) != total:
                raise RemoteProtocolError(f"single-chunk tensor {name!r} covers [{offset}, {offset + len(payload)})")
            array = encodings.decode(payload, n_elements, enc, big_endian=big_endian).reshape(shape)
            step.done[name] = NamedTensor(name, array, enc)
            step.order.append(name)
            return
        pending = step.tensors.get(name)
        if pending is None:
            pending = _PendingTensor(name, tuple(shape), enc, big_endian, total, count)
            step.tensors[name] = pending
            step.order.append(name)
        elif (pending.shape, pending.encoding, pending.big_endian, pending.total, pending.count) != (
            tuple(shape),
            enc,
            big_endian,
            total,
            count,
        ):
            raise RemoteProtocolError(
                f"chunk {index} of tensor {name!r} disagrees with the first chunk's shape or size"
            )
        if index in pending.chunks:
            raise RemoteProtocolError(f"chunk {index} of tensor {name!r} sent twice")
        for other_offset, other in pending.chunks.values():
            if offset < other_offset + len(other) and other_offset < offset + len(payload):
                raise RemoteProtocolError(f"chunk {index} of tensor {name!r} overlaps another chunk")
        pending.chunks[index] = (offset, payload)
        pending.received += len(payload)
        if len(pending.chunks) < pending.count:
            return
        if pending.received != pending.total:
            raise RemoteProtocolError(
                f"tensor {name!r} chunks leave a gap: {pending.received} of {pending.total} bytes"
            )
        ordered = b"".join(bytes(p) for _, p in sorted(pending.chunks.values(), key=lambda c: c[0]))
        array = encodings.decode(ordered, n_elements, enc, big_endian=big_endian).reshape(shape)
        step.done[name] = NamedTensor(name, array, enc)
        del step.tensors[name]


__all__ = ["FrameDecoder", "FrameEncoder", "Limits"]
