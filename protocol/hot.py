"""The hot messages read and written by hand: Header, Span, Tokens (with logprobs).

Byte-identical to the generated code (tests check it), in microseconds, with a typed
error for every malformed field.
"""

from __future__ import annotations

import math
import struct

from protocol import wire
from protocol._generated.noderuntime.seam import v1 as pb
from protocol.errors import RemoteProtocolError
from protocol.events import (
    MAX_TOP_LOGPROBS,
    Header,
    Identity,
    Phase,
    Span,
    TokenLogprob,
    Tokens,
)
from protocol.limits import Limits

FLOAT = struct.Struct("<f")

# Frame.body field numbers
OPEN_ROUTE, ACTIVATIONS, TOKENS, RELEASE, CANCEL, ERROR, CREDIT, USAGE, PREFIX = range(2, 11)
PAYLOAD_FIELD = 15


def span_bytes(span: Span) -> bytes:
    return wire.uint_field(1, span.start) + wire.uint_field(2, span.end)


def read_span(buf: bytes | memoryview, start: int, end: int, what: str) -> Span:
    values = [0, 0]
    for number, wire_type, a, _ in wire.fields(buf, start, end):
        if number in (1, 2):
            wire.expect(wire_type, wire.VARINT, number, what)
            values[number - 1] = wire.as_uint32(a, what)
    return Span(values[0], values[1])


def read_header(buf: bytes | memoryview, start: int, end: int, limits: Limits) -> tuple[Header, int]:
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
                shard = read_span(buf, a, b, "Header.shard")
            else:
                positions = read_span(buf, a, b, "Header.positions")
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


def logprob_fields(event: Tokens) -> bytes:
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
        out.append(FLOAT.unpack_from(buf, a)[0])
    elif wire_type == wire.LEN and (b - a) % 4 == 0:
        out += (v for (v,) in FLOAT.iter_unpack(buf[a:b]))
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
            logprob = FLOAT.unpack_from(buf, a)[0]
        elif number == 3:
            wire.repeated_uint32(buf, wire_type, a, b, top_tokens, MAX_TOP_LOGPROBS, "top tokens")
        elif number == 4:
            _floats(buf, wire_type, a, b, top_logprobs)
    if len(top_tokens) != len(top_logprobs):
        raise RemoteProtocolError("a token's top logprobs must pair each token with its logprob")
    if not all(-1e9 <= lp <= 0.0 for lp in (logprob, *top_logprobs)):  # NaN fails too
        raise RemoteProtocolError("a logprob must be a finite number <= 0")
    return TokenLogprob(token, logprob, tuple(zip(top_tokens, top_logprobs, strict=True)))


def read_tokens(header: Header, buf: bytes | memoryview, start: int, end: int, limits: Limits) -> Tokens:
    tokens: list[int] = []
    finished = False
    reason = ""
    logprobs: list[TokenLogprob] = []
    prompt_logprobs: list[TokenLogprob] = []
    counts = [0, 0, 0, 0]  # window, drafted, accepted, ahead
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
        elif 6 <= number <= 9:
            wire.expect(wire_type, wire.VARINT, number, "Tokens")
            counts[number - 6] = wire.as_uint32(a, ("window", "drafted", "accepted", "ahead")[number - 6])
    if logprobs and len(logprobs) != len(tokens):
        raise RemoteProtocolError(f"{len(logprobs)} logprobs for {len(tokens)} tokens: one each, or none")
    window, drafted, accepted, ahead = counts
    if window > limits.max_window or drafted > limits.max_window:
        raise RemoteProtocolError(f"a window carries at most {limits.max_window} drafts")
    if ahead > limits.max_ahead:
        raise RemoteProtocolError(f"at most {limits.max_ahead} windows may follow one in flight, not {ahead}")
    # a window keeps the drafts that agree with the tail's draws, then adds the tail's next token
    if accepted > drafted or (drafted and len(tokens) > accepted + 1):
        raise RemoteProtocolError(f"{len(tokens)} tokens from a window that kept {accepted} of {drafted} drafts")
    return Tokens(
        header,
        tuple(tokens),
        finished,
        reason,
        tuple(logprobs),
        tuple(prompt_logprobs),
        window,
        drafted,
        accepted,
        ahead,
    )


def finite(value: float, what: str, low: float = -math.inf, high: float = math.inf) -> float:
    if not math.isfinite(value) or not low <= value <= high:
        raise RemoteProtocolError(f"{what} = {value} is out of range [{low}, {high}]")
    return value
