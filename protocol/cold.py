"""The cold messages: built and parsed by the generated code, after their shape is checked
on the wire (wire types, nesting, counts) so that the parser never sees a malformed one.
"""

from __future__ import annotations

from typing import Any

from protocol import wire
from protocol._generated.noderuntime.seam import v1 as pb
from protocol.errors import LocalProtocolError, RemoteProtocolError, StatusCode
from protocol.events import (
    MAX_TOP_LOGPROBS,
    Cancel,
    Credit,
    Error,
    Event,
    Header,
    Hop,
    OpenRoute,
    Prefix,
    Release,
    Sampling,
    Span,
    Usage,
    UsageRecord,
    route_recipe,
)
from protocol.hot import CANCEL, CREDIT, ERROR, OPEN_ROUTE, PREFIX, RELEASE, USAGE, finite
from protocol.limits import Limits

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
    6: (_L, None, ""),
}
_SAMPLING_SHAPE: _Shape = {n: (_F if n in (1, 3, 4, 6, 7, 8) else _V, None, "") for n in range(1, 10)}
_LOGIT_BIAS_SHAPE: _Shape = {1: (_V, None, ""), 2: (_F, None, "")}
_SAMPLING_SHAPE[10] = (_L, None, "")
_SAMPLING_SHAPE[11] = (_L, _LOGIT_BIAS_SHAPE, "max_tokens")
_RECORD_SHAPE: _Shape = {1: (_L, None, ""), 2: (_L, None, ""), 3: (_L, None, "")}
_COLD_SHAPES: dict[int, _Shape] = {
    OPEN_ROUTE: {
        1: (_L, _HOP_SHAPE, "max_hops"),
        2: (_L, _SAMPLING_SHAPE, ""),
        3: (_PACKABLE, None, "max_tokens"),
        4: (_V, None, ""),
        5: (_PACKABLE, None, "max_tokens"),
        6: (_V, None, ""),
        7: (_L, None, ""),
        8: (_V, None, ""),
        9: (_V, None, ""),
        10: (_V, None, ""),
        11: (_V, None, ""),
    },
    RELEASE: {1: (_L, None, "")},
    CANCEL: {1: (_L, None, "")},
    ERROR: {1: (_V, None, ""), 2: (_L, None, ""), 3: (_L, None, "")},
    CREDIT: {1: (_V, None, "")},
    PREFIX: {1: (_V, None, "")},
    USAGE: {1: (_L, _RECORD_SHAPE, "max_records")},
}
_MAX_OTHER_FIELDS = 64  # occurrences of singular and unknown fields in one message


def cold_body(event: Event) -> tuple[int, Any]:
    """Frame field and betterproto message of the bodies off the hot path."""
    if isinstance(event, OpenRoute):
        s = event.sampling
        return OPEN_ROUTE, pb.OpenRoute(
            hops=[
                pb.Hop(
                    node_id=h.node_id,
                    address=h.address,
                    relay=h.relay,
                    layers=pb.Span(h.layers.start, h.layers.end),
                    tls_cert_sha256=h.tls_cert_sha256,
                    recipe_fingerprint=h.recipe_fingerprint,
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
            prompt_length=event.prompt_length,
            prefix_offer=event.prefix_offer,
            audit=event.audit,
            audit_from=event.audit_from,
            speculate=event.speculate,
        )
    if isinstance(event, Release):
        return RELEASE, pb.Release(reason=event.reason)
    if isinstance(event, Cancel):
        return CANCEL, pb.Cancel(reason=event.reason)
    if isinstance(event, Error):
        return ERROR, pb.Error(code=int(event.code), message=event.message, node_id=event.node_id)
    if isinstance(event, Credit):
        return CREDIT, pb.Credit(frames=event.frames)
    if isinstance(event, Prefix):
        return PREFIX, pb.Prefix(positions=event.positions)
    if isinstance(event, Usage):
        return USAGE, pb.Usage(
            records=[pb.UsageRecord(body=r.body, node_id=r.node_id, signature=r.signature) for r in event.records]
        )
    raise LocalProtocolError(f"not a protocol event: {type(event).__name__}")


def check_shape(buf: bytes, start: int, end: int, shape: _Shape, limits: Limits, what: str) -> None:
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
            check_shape(buf, a, b, nested, limits, f"{what}.{number}")
        if limit:
            counts[number] = counts.get(number, 0) + (
                wire.count_varints(buf, a, b) if wire_type == wire.LEN and nested is None else 1
            )
            if counts[number] > getattr(limits, limit):
                raise RemoteProtocolError(
                    f"{what}.{number} has more than {getattr(limits, limit)} elements", StatusCode.RESOURCE_EXHAUSTED
                )


def read_cold(field: int, header: Header, body: bytes, limits: Limits) -> Event:
    message_type: Any = {
        OPEN_ROUTE: pb.OpenRoute,
        RELEASE: pb.Release,
        CANCEL: pb.Cancel,
        ERROR: pb.Error,
        CREDIT: pb.Credit,
        USAGE: pb.Usage,
        PREFIX: pb.Prefix,
    }[field]
    check_shape(body, 0, len(body), _COLD_SHAPES[field], limits, message_type.__name__)
    try:
        message: Any = message_type.parse(body)
    except Exception as exc:  # noqa: BLE001 - a third-party parser on untrusted bytes: any failure is the peer's
        raise RemoteProtocolError(f"malformed {message_type.__name__}: {type(exc).__name__}") from None
    for value in vars(message).values():
        if isinstance(value, str | bytes) and len(value) > limits.max_string_bytes:
            raise RemoteProtocolError(f"{message_type.__name__} field longer than {limits.max_string_bytes} bytes")
    if field == OPEN_ROUTE:
        return open_route_event(header, message, limits)
    if field == RELEASE:
        return Release(header, message.reason)
    if field == CANCEL:
        return Cancel(header, message.reason)
    if field == ERROR:
        return Error(header, StatusCode.coerce(message.code), message.message, message.node_id)
    if field == CREDIT:
        return Credit(header, message.frames)
    if field == PREFIX:
        return Prefix(header, message.positions)
    return Usage(header, tuple(UsageRecord(r.body, r.node_id, r.signature) for r in message.records))


def _at_most(value: int, limit: int, what: str) -> int:
    # the sampler allocates a window this long: a bound keeps a peer from asking for gigabytes
    if value > limit:
        raise RemoteProtocolError(f"{what} {value} exceeds {limit}", StatusCode.OUT_OF_RANGE)
    return value


def _check_hop_recipes(header: Header, hops: list[Hop]) -> None:
    """A plan names the recipe of every hop or of none, and the session's recipe is theirs together."""
    named = [h.recipe_fingerprint for h in hops if h.recipe_fingerprint]
    if not named:
        return
    if len(named) != len(hops):
        raise RemoteProtocolError("the route plan names the recipes of some hops, not of all")
    if header.identity.recipe_fingerprint != route_recipe(named):
        raise RemoteProtocolError(
            "the session names another recipe than its route plan's hops run", StatusCode.FAILED_PRECONDITION
        )


def open_route_event(header: Header, m: Any, limits: Limits) -> OpenRoute:
    if not m.hops:  # the counts' upper bounds were checked on the wire (check_shape)
        raise RemoteProtocolError("route plan has no hops")
    hops = []
    for h in m.hops:
        layers = Span(h.layers.start, h.layers.end) if h.layers is not None else Span()
        if layers.end <= layers.start:
            raise RemoteProtocolError(f"hop with empty layer range {layers.start}:{layers.end}")
        for text in (h.address, h.relay):
            if len(text) > limits.max_string_bytes:
                raise RemoteProtocolError("hop address too long")
        # bounded as the session's own recipe in the header is
        if len(h.recipe_fingerprint) > limits.max_string_bytes:
            raise RemoteProtocolError("hop recipe fingerprint too long")
        hops.append(Hop(h.node_id, layers, h.address, h.relay, h.tls_cert_sha256, h.recipe_fingerprint))
    _check_hop_recipes(header, hops)
    s = m.sampling or pb.Sampling()
    if len(s.grammar.encode()) > limits.max_grammar_bytes:
        raise RemoteProtocolError(
            f"grammar longer than {limits.max_grammar_bytes} bytes", StatusCode.RESOURCE_EXHAUSTED
        )
    sampling = Sampling(
        temperature=finite(s.temperature, "temperature", 0.0, 100.0),
        top_k=s.top_k,
        top_p=finite(s.top_p, "top_p", 0.0, 1.0) if s.top_p else 1.0,
        min_p=finite(s.min_p, "min_p", 0.0, 1.0),
        seed=s.seed,
        repeat_penalty=finite(s.repeat_penalty, "repeat_penalty", 0.0, 100.0) if s.repeat_penalty else 1.0,
        frequency_penalty=finite(s.frequency_penalty, "frequency_penalty", -100.0, 100.0),
        presence_penalty=finite(s.presence_penalty, "presence_penalty", -100.0, 100.0),
        penalty_last_n=_at_most(s.penalty_last_n, limits.max_tokens, "penalty_last_n"),
        grammar=s.grammar,
        logit_bias=tuple((b.token, finite(b.bias, "logit_bias", -100.0, 100.0)) for b in s.logit_bias),
        logprobs=s.logprobs,
        top_logprobs=_at_most(s.top_logprobs, MAX_TOP_LOGPROBS, "top_logprobs"),
        prompt_logprobs=s.prompt_logprobs,
    )
    # a resumed session has generated tokens after its prompt; an audit of a one-token reply has none
    last = len(m.prompt_tokens) if m.audit else len(m.prompt_tokens) - 1
    if m.prompt_length and not 0 < m.prompt_length <= last:
        raise RemoteProtocolError(
            f"prompt_length {m.prompt_length} must lie inside the {len(m.prompt_tokens)} prompt tokens"
        )
    if m.prompt_length and len(m.prompt_tokens) - m.prompt_length >= m.max_tokens:
        raise RemoteProtocolError("a resumed session must have tokens left to generate")
    if m.prefix_offer >= len(m.prompt_tokens):
        raise RemoteProtocolError("a prefix offer must leave the last prompt token to compute")
    if m.audit and not (m.prompt_length and m.prefix_offer <= m.audit_from < len(m.prompt_tokens)):
        raise RemoteProtocolError(
            "an audit names the tokens its route sampled (prompt_length) and commits from a position "
            "it computes, at or past its prefix offer"
        )
    if m.audit_from and not m.audit:
        raise RemoteProtocolError("audit_from belongs to an audit")
    if m.speculate > limits.max_window:
        raise RemoteProtocolError(f"speculate = {m.speculate}: a window carries at most {limits.max_window} drafts")
    if m.speculate and m.audit:
        raise RemoteProtocolError("an audit recomputes what a route drew, teacher-forced: it drafts nothing")
    return OpenRoute(
        header,
        tuple(hops),
        sampling,
        tuple(m.prompt_tokens),
        m.max_tokens,
        tuple(m.stop_token_ids),
        m.deadline_unix_ms,
        m.ticket,
        m.prompt_length,
        m.prefix_offer,
        m.audit,
        m.audit_from,
        m.speculate,
    )
