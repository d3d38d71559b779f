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
import struct
from collections import OrderedDict
from typing import Any

import attrs
import crc32c

from protocol import encodings, wire
from protocol._generated.noderuntime.seam import v1 as pb
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError, StatusCode
from protocol.events import (
    MAX_TOP_LOGPROBS,
    Activations,
    Cancel,
    Credit,
    Encoding,
    Error,
    Event,
    Header,
    Hop,
    Identity,
    NamedTensor,
    OpenRoute,
    Phase,
    Release,
    Sampling,
    Span,
    TokenLogprob,
    Tokens,
    Usage,
    UsageRecord,
)

_FLOAT = struct.Struct("<f")
# Frame.body field numbers
_OPEN_ROUTE, _ACTIVATIONS, _TOKENS, _RELEASE, _CANCEL, _ERROR, _CREDIT, _USAGE = range(2, 10)
_PAYLOAD_FIELD = 15
# Bytes a chunk frame spends on everything but its payload, generously.
_CHUNK_OVERHEAD = 1024


@attrs.frozen
class Limits:
    """Bounds on what a peer may make us hold. Defaults suit hidden states of 8k-wide models."""

    max_frame_bytes: int = 4 << 20
    max_tensor_bytes: int = 64 << 20  # decoded float32 bytes of one tensor
    max_chunks: int = 1024
    max_tensors: int = 8
    max_tensor_dims: int = 4
    max_tokens: int = 1 << 17  # prompt length, or tokens in one frame
    max_hops: int = 64
    max_records: int = 64
    max_string_bytes: int = 4096
    max_grammar_bytes: int = 256 << 10  # a JSON schema's grammar runs to tens of KiB

    def __attrs_post_init__(self) -> None:
        if self.max_frame_bytes <= _CHUNK_OVERHEAD * 2:
            raise ValueError(f"max_frame_bytes must exceed {_CHUNK_OVERHEAD * 2}")


def _span_bytes(span: Span) -> bytes:
    return wire.uint_field(1, span.start) + wire.uint_field(2, span.end)


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
            + wire.len_field(8, _span_bytes(identity.shard))
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
            + wire.len_field(10, _span_bytes(header.positions))
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
                body += _logprob_fields(event)  # rare (sessions that ask): the generated code writes them
            return [self._frame(event.header, _TOKENS, [body])]
        field, message = _cold_body(event)
        return [self._frame(event.header, field, [bytes(message)])]

    def _activations(self, event: Activations) -> list[bytes]:
        if not 0 < len(event.tensors) <= self.limits.max_tensors:
            raise LocalProtocolError(f"an Activations step carries 1 to {self.limits.max_tensors} tensors")
        encoded = []
        for tensor in event.tensors:
            if not 0 < tensor.array.ndim <= self.limits.max_tensor_dims:
                raise LocalProtocolError(f"tensor {tensor.name!r} has {tensor.array.ndim} dimensions")
            encoded.append((tensor, encodings.encode(tensor.array, tensor.encoding)))
        count = wire.uint_field(2, len(event.tensors))
        whole = sum(len(payload) + _CHUNK_OVERHEAD for _, payload in encoded)
        if whole <= self.limits.max_frame_bytes:
            parts: list[bytes | memoryview] = []
            for tensor, payload in encoded:
                parts += _tensor_parts(tensor, payload, 0, len(payload), 0, 1)
            return [self._frame(event.header, _ACTIVATIONS, [*parts, count])]
        frames = []
        room = self.limits.max_frame_bytes - _CHUNK_OVERHEAD
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
                frames.append(self._frame(event.header, _ACTIVATIONS, [*parts, count]))
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
    payload_key = wire.tag(_PAYLOAD_FIELD, wire.LEN) + wire.varint(len(payload))
    inner = len(meta) + len(payload_key) + len(payload)
    return [wire.tag(1, wire.LEN) + wire.varint(inner) + meta + payload_key, payload]


def _cold_body(event: Event) -> tuple[int, Any]:
    """Frame field and betterproto message of the bodies off the hot path."""
    if isinstance(event, OpenRoute):
        s = event.sampling
        return _OPEN_ROUTE, pb.OpenRoute(
            hops=[
                pb.Hop(
                    node_id=h.node_id,
                    address=h.address,
                    relay=h.relay,
                    layers=pb.Span(h.layers.start, h.layers.end),
                    tls_cert_sha256=h.tls_cert_sha256,
                )
                for h in event.hops
            ],
            sampling=pb.Sampling(
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                min_p=s.min_p,
                seed=s.seed,
                repeat_penalty=s.repeat_penalty,
                frequency_penalty=s.frequency_penalty,
                presence_penalty=s.presence_penalty,
                penalty_last_n=s.penalty_last_n,
                grammar=s.grammar,
                logit_bias=[pb.LogitBias(token=t, bias=b) for t, b in s.logit_bias],
                logprobs=s.logprobs,
                top_logprobs=s.top_logprobs,
                prompt_logprobs=s.prompt_logprobs,
            ),
            prompt_tokens=list(event.prompt_tokens),
            max_tokens=event.max_tokens,
            stop_token_ids=list(event.stop_token_ids),
            deadline_unix_ms=event.deadline_unix_ms,
            ticket=event.ticket,
        )
    if isinstance(event, Release):
        return _RELEASE, pb.Release(reason=event.reason)
    if isinstance(event, Cancel):
        return _CANCEL, pb.Cancel(reason=event.reason)
    if isinstance(event, Error):
        return _ERROR, pb.Error(code=int(event.code), message=event.message, node_id=event.node_id)
    if isinstance(event, Credit):
        return _CREDIT, pb.Credit(frames=event.frames)
    if isinstance(event, Usage):
        return _USAGE, pb.Usage(
            records=[pb.UsageRecord(body=r.body, node_id=r.node_id, signature=r.signature) for r in event.records]
        )
    raise LocalProtocolError(f"not a protocol event: {type(event).__name__}")


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
            elif _OPEN_ROUTE <= number <= _USAGE:
                wire.expect(wire_type, wire.LEN, number, "Frame")
                if body is not None and body[0] != number:
                    raise RemoteProtocolError("frame carries more than one body")
                body = (number, a, b)
        if header_range is None:
            raise RemoteProtocolError("frame has no header")
        if body is None:
            raise RemoteProtocolError("frame has no body", StatusCode.UNIMPLEMENTED)
        header, crc = _read_header(buf, *header_range, self.limits)
        field, start, end = body
        if crc32c.crc32c(buf[start:end]) != crc:
            raise RemoteProtocolError("payload checksum mismatch", StatusCode.DATA_LOSS)
        if field == _ACTIVATIONS:
            return self._activations(header, buf, start, end)
        if self._pending is not None:
            raise RemoteProtocolError(f"step {self._pending.header.step_id} left incomplete by another frame")
        if field == _TOKENS:
            return _read_tokens(header, buf, start, end, self.limits)
        return _read_cold(field, header, bytes(buf[start:end]), self.limits)

    def _activations(self, header: Header, buf: bytes | memoryview, start: int, end: int) -> Activations | None:
        tensors: list[tuple[int, int]] = []
        tensor_count = 0
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
        if step is not None and (step.header != header or step.tensor_count != tensor_count):
            raise RemoteProtocolError(f"chunks of step {header.step_id} disagree on their header")
        if step is None:
            step = _PendingStep(header, tensor_count)
        for a, b in tensors:
            self._chunk(step, buf, a, b)
        if len(step.done) == step.tensor_count:
            self._pending = None
            return Activations(header, tuple(step.done[name] for name in step.order))
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


def _read_span(buf: bytes | memoryview, start: int, end: int, what: str) -> Span:
    values = [0, 0]
    for number, wire_type, a, _ in wire.fields(buf, start, end):
        if number in (1, 2):
            wire.expect(wire_type, wire.VARINT, number, what)
            values[number - 1] = wire.as_uint32(a, what)
    return Span(values[0], values[1])


def _read_header(buf: bytes | memoryview, start: int, end: int, limits: Limits) -> tuple[Header, int]:
    major = minor = epoch = phase = step = cache = crc = 0
    request_id = ""
    session = artifact = recipe = b""
    shard = positions = Span()
    for number, wire_type, a, b in wire.fields(buf, start, end):
        if number in (3, 4, 6, 7, 8, 10):
            wire.expect(wire_type, wire.LEN, number, "Header")
            if b - a > limits.max_string_bytes:
                raise RemoteProtocolError(f"Header.{number} longer than {limits.max_string_bytes} bytes")
            if number == 3:
                request_id = wire.text(buf, a, b, "request_id")
            elif number == 4:
                session = bytes(buf[a:b])
            elif number == 6:
                artifact = bytes(buf[a:b])
            elif number == 7:
                recipe = bytes(buf[a:b])
            elif number == 8:
                shard = _read_span(buf, a, b, "Header.shard")
            else:
                positions = _read_span(buf, a, b, "Header.positions")
        elif 1 <= number <= 13:
            wire.expect(wire_type, wire.VARINT, number, "Header")
            if number == 1:
                major = wire.as_uint32(a, "schema_major")
            elif number == 2:
                minor = wire.as_uint32(a, "schema_minor")
            elif number == 5:
                epoch = wire.as_uint32(a, "epoch")
            elif number == 9:
                phase = a
            elif number == 11:
                step = a
            elif number == 12:
                cache = wire.as_uint32(a, "cache_expectation")
            elif number == 13:
                crc = wire.as_uint32(a, "payload_crc32c")
    try:
        phase_value = Phase(phase)
    except ValueError:
        raise RemoteProtocolError(f"unknown phase {phase}") from None
    identity = Identity(request_id, session, epoch, artifact, recipe, shard)
    return Header(identity, phase_value, step, positions, cache, major, minor), crc


def _logprob_fields(event: Tokens) -> bytes:
    parts = []
    for number, entries in ((4, event.logprobs), (5, event.prompt_logprobs)):
        for e in entries:
            message = pb.TokenLogprob(
                token=e.token,
                logprob=e.logprob,
                top_tokens=[t for t, _ in e.top],
                top_logprobs=[lp for _, lp in e.top],
            )
            parts.append(wire.len_field(number, bytes(message)))
    return b"".join(parts)


def _floats(buf: bytes | memoryview, wire_type: int, a: int, b: int, out: list[float]) -> None:
    """One occurrence of a repeated float field, packed (LEN) or not (I32)."""
    if wire_type == wire.I32:
        out.append(_FLOAT.unpack_from(buf, a)[0])
    elif wire_type == wire.LEN and (b - a) % 4 == 0:
        out += (v for (v,) in _FLOAT.iter_unpack(buf[a:b]))
    else:
        raise RemoteProtocolError("TokenLogprob.top_logprobs is not a run of 4-byte floats")
    if len(out) > MAX_TOP_LOGPROBS:
        raise RemoteProtocolError(f"a token has at most {MAX_TOP_LOGPROBS} top logprobs")


def _read_logprob(buf: bytes | memoryview, start: int, end: int) -> TokenLogprob:
    token, logprob = 0, 0.0
    top_tokens: list[int] = []
    top_logprobs: list[float] = []
    for number, wire_type, a, b in wire.fields(buf, start, end):
        if number == 1:
            wire.expect(wire_type, wire.VARINT, number, "TokenLogprob")
            token = wire.as_uint32(a, "TokenLogprob.token")
        elif number == 2:
            wire.expect(wire_type, wire.I32, number, "TokenLogprob")
            logprob = _FLOAT.unpack_from(buf, a)[0]
        elif number == 3:
            wire.repeated_uint32(buf, wire_type, a, b, top_tokens, MAX_TOP_LOGPROBS, "top tokens")
        elif number == 4:
            _floats(buf, wire_type, a, b, top_logprobs)
    if len(top_tokens) != len(top_logprobs):
        raise RemoteProtocolError("a token's top logprobs must pair each token with its logprob")
    if not all(-1e9 <= lp <= 0.0 for lp in (logprob, *top_logprobs)):  # NaN fails too
        raise RemoteProtocolError("a logprob must be a finite number <= 0")
    return TokenLogprob(token, logprob, tuple(zip(top_tokens, top_logprobs, strict=True)))


def _read_tokens(header: Header, buf: bytes | memoryview, start: int, end: int, limits: Limits) -> Tokens:
    tokens: list[int] = []
    finished = False
    reason = ""
    logprobs: list[TokenLogprob] = []
    prompt_logprobs: list[TokenLogprob] = []
    for number, wire_type, a, b in wire.fields(buf, start, end):
        if number == 1:
            wire.repeated_uint32(buf, wire_type, a, b, tokens, limits.max_tokens, "token ids")
        elif number == 2:
            wire.expect(wire_type, wire.VARINT, number, "Tokens")
            finished = a != 0
        elif number == 3:
            wire.expect(wire_type, wire.LEN, number, "Tokens")
            if b - a > limits.max_string_bytes:
                raise RemoteProtocolError("finish_reason too long")
            reason = wire.text(buf, a, b, "finish_reason")
        elif number in (4, 5):
            wire.expect(wire_type, wire.LEN, number, "Tokens")
            entries = logprobs if number == 4 else prompt_logprobs
            if len(entries) >= limits.max_tokens:
                raise RemoteProtocolError(f"more than {limits.max_tokens} logprobs in one frame")
            entries.append(_read_logprob(buf, a, b))
    if logprobs and len(logprobs) != len(tokens):
        raise RemoteProtocolError(f"{len(logprobs)} logprobs for {len(tokens)} tokens: one each, or none")
    return Tokens(header, tuple(tokens), finished, reason, tuple(logprobs), tuple(prompt_logprobs))


def _finite(value: float, what: str, low: float = -math.inf, high: float = math.inf) -> float:
    if not math.isfinite(value) or not low <= value <= high:
        raise RemoteProtocolError(f"{what} = {value} is out of range [{low}, {high}]")
    return value


# The shapes of the cold messages, checked on the wire before the generated parser sees
# them: that parser takes a field of the wrong wire type as whatever it reads (an int
# where a message belongs), and builds every repeated element before a limit could apply.
# field number -> (wire types allowed, nested shape, the Limits attribute that caps its count)
_Shape = dict[int, tuple[frozenset[int], "_Shape | None", str]]
_V, _L, _F = frozenset({wire.VARINT}), frozenset({wire.LEN}), frozenset({wire.I32})
_PACKABLE = frozenset({wire.VARINT, wire.LEN})  # a repeated scalar, packed or not
_SPAN_SHAPE: _Shape = {1: (_V, None, ""), 2: (_V, None, "")}
_HOP_SHAPE: _Shape = {
    1: (_L, None, ""),
    2: (_L, None, ""),
    3: (_L, None, ""),
    4: (_L, _SPAN_SHAPE, ""),
    5: (_L, None, ""),
}
_SAMPLING_SHAPE: _Shape = {n: (_F if n in (1, 3, 4, 6, 7, 8) else _V, None, "") for n in range(1, 10)}
_LOGIT_BIAS_SHAPE: _Shape = {1: (_V, None, ""), 2: (_F, None, "")}
_SAMPLING_SHAPE[10] = (_L, None, "")
_SAMPLING_SHAPE[11] = (_L, _LOGIT_BIAS_SHAPE, "max_tokens")
_RECORD_SHAPE: _Shape = {1: (_L, None, ""), 2: (_L, None, ""), 3: (_L, None, "")}
_COLD_SHAPES: dict[int, _Shape] = {
    _OPEN_ROUTE: {
        1: (_L, _HOP_SHAPE, "max_hops"),
        2: (_L, _SAMPLING_SHAPE, ""),
        3: (_PACKABLE, None, "max_tokens"),
        4: (_V, None, ""),
        5: (_PACKABLE, None, "max_tokens"),
        6: (_V, None, ""),
        7: (_L, None, ""),
    },
    _RELEASE: {1: (_L, None, "")},
    _CANCEL: {1: (_L, None, "")},
    _ERROR: {1: (_V, None, ""), 2: (_L, None, ""), 3: (_L, None, "")},
    _CREDIT: {1: (_V, None, "")},
    _USAGE: {1: (_L, _RECORD_SHAPE, "max_records")},
}
_MAX_OTHER_FIELDS = 64  # occurrences of singular and unknown fields in one message


def _check_shape(buf: bytes, start: int, end: int, shape: _Shape, limits: Limits, what: str) -> None:
    counts: dict[int, int] = {}
    others = 0
    for number, wire_type, a, b in wire.fields(buf, start, end):
        spec = shape.get(number)
        if spec is None or not spec[2]:
            others += 1
            if others > _MAX_OTHER_FIELDS:
                raise RemoteProtocolError(
                    f"{what} has more than {_MAX_OTHER_FIELDS} fields", StatusCode.RESOURCE_EXHAUSTED
                )
            if spec is None:
                continue  # unknown: skipped, as proto3 asks
        wire_types, nested, limit = spec
        if wire_type not in wire_types:
            raise RemoteProtocolError(f"{what}.{number} has wire type {wire_type}")
        if nested is not None:
            _check_shape(buf, a, b, nested, limits, f"{what}.{number}")
        if limit:
            counts[number] = counts.get(number, 0) + (
                wire.count_varints(buf, a, b) if wire_type == wire.LEN and nested is None else 1
            )
            if counts[number] > getattr(limits, limit):
                raise RemoteProtocolError(
                    f"{what}.{number} has more than {getattr(limits, limit)} elements", StatusCode.RESOURCE_EXHAUSTED
                )


def _read_cold(field: int, header: Header, body: bytes, limits: Limits) -> Event:
    message_type: Any = {
        _OPEN_ROUTE: pb.OpenRoute,
        _RELEASE: pb.Release,
        _CANCEL: pb.Cancel,
        _ERROR: pb.Error,
        _CREDIT: pb.Credit,
        _USAGE: pb.Usage,
    }[field]
    _check_shape(body, 0, len(body), _COLD_SHAPES[field], limits, message_type.__name__)
    try:
        message: Any = message_type.parse(body)
    except Exception as exc:  # noqa: BLE001 - a third-party parser on untrusted bytes: any failure is the peer's
        raise RemoteProtocolError(f"malformed {message_type.__name__}: {type(exc).__name__}") from None
    for value in vars(message).values():
        if isinstance(value, str | bytes) and len(value) > limits.max_string_bytes:
            raise RemoteProtocolError(f"{message_type.__name__} field longer than {limits.max_string_bytes} bytes")
    if field == _OPEN_ROUTE:
        return _open_route(header, message, limits)
    if field == _RELEASE:
        return Release(header, message.reason)
    if field == _CANCEL:
        return Cancel(header, message.reason)
    if field == _ERROR:
        return Error(header, StatusCode.coerce(message.code), message.message, message.node_id)
    if field == _CREDIT:
        return Credit(header, message.frames)
    return Usage(header, tuple(UsageRecord(r.body, r.node_id, r.signature) for r in message.records))


def _at_most(value: int, limit: int, what: str) -> int:
    # the sampler allocates a window this long: a bound keeps a peer from asking for gigabytes
    if value > limit:
        raise RemoteProtocolError(f"{what} {value} exceeds {limit}", StatusCode.OUT_OF_RANGE)
    return value


def _open_route(header: Header, m: Any, limits: Limits) -> OpenRoute:
    if not m.hops:  # the counts' upper bounds were checked on the wire (_check_shape)
        raise RemoteProtocolError("route plan has no hops")
    hops = []
    for h in m.hops:
        layers = Span(h.layers.start, h.layers.end) if h.layers is not None else Span()
        if layers.end <= layers.start:
            raise RemoteProtocolError(f"hop with empty layer range {layers.start}:{layers.end}")
        for text in (h.address, h.relay):
            if len(text) > limits.max_string_bytes:
                raise RemoteProtocolError("hop address too long")
        hops.append(Hop(h.node_id, layers, h.address, h.relay, h.tls_cert_sha256))
    s = m.sampling or pb.Sampling()
    if len(s.grammar.encode()) > limits.max_grammar_bytes:
        raise RemoteProtocolError(
            f"grammar longer than {limits.max_grammar_bytes} bytes", StatusCode.RESOURCE_EXHAUSTED
        )
    sampling = Sampling(
        temperature=_finite(s.temperature, "temperature", 0.0, 100.0),
        top_k=s.top_k,
        top_p=_finite(s.top_p, "top_p", 0.0, 1.0) if s.top_p else 1.0,
        min_p=_finite(s.min_p, "min_p", 0.0, 1.0),
        seed=s.seed,
        repeat_penalty=_finite(s.repeat_penalty, "repeat_penalty", 0.0, 100.0) if s.repeat_penalty else 1.0,
        frequency_penalty=_finite(s.frequency_penalty, "frequency_penalty", -100.0, 100.0),
        presence_penalty=_finite(s.presence_penalty, "presence_penalty", -100.0, 100.0),
        penalty_last_n=_at_most(s.penalty_last_n, limits.max_tokens, "penalty_last_n"),
        grammar=s.grammar,
        logit_bias=tuple((b.token, _finite(b.bias, "logit_bias", -100.0, 100.0)) for b in s.logit_bias),
        logprobs=s.logprobs,
        top_logprobs=_at_most(s.top_logprobs, MAX_TOP_LOGPROBS, "top_logprobs"),
        prompt_logprobs=s.prompt_logprobs,
    )
    return OpenRoute(
        header,
        tuple(hops),
        sampling,
        tuple(m.prompt_tokens),
        m.max_tokens,
        tuple(m.stop_token_ids),
        m.deadline_unix_ms,
        m.ticket,
    )


__all__ = ["FrameDecoder", "FrameEncoder", "Limits"]
