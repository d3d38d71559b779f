"""The per-session state machine of one end of a seam.

A seam joins two consecutive hops of a route. Frames travel *downstream* (toward
the tail: OpenRoute, Activations, Release, Cancel) and *upstream* (toward the head:
Tokens, Credit, Usage, Error, Cancel). Each end of a seam keeps one
:class:`SeamEndpoint` per session: it stamps outgoing headers (step ids, cache
expectation) and checks incoming events against one transition table, the session's
identity, step order and the KV length it holds. Violations by the peer raise
:class:`~protocol.errors.RemoteProtocolError`; attempts of our own raise
:class:`~protocol.errors.LocalProtocolError`. Both carry a status code for the
``Error`` frame or gRPC status the peer is given.
"""

from __future__ import annotations

import enum

import attrs

from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError, StatusCode
from protocol.events import (
    SCHEMA_MAJOR,
    Activations,
    Cancel,
    Credit,
    Error,
    Event,
    Header,
    Identity,
    OpenRoute,
    Phase,
    Prefix,
    Release,
    Span,
    Tokens,
    Usage,
)


class Direction(enum.Enum):
    """Which way a frame travels along the route."""

    DOWNSTREAM = "downstream"  # toward the tail
    UPSTREAM = "upstream"  # toward the head and the client


class State(enum.Enum):
    """State of one direction of a seam for one session."""

    IDLE = "idle"
    OPEN = "open"
    CLOSED = "closed"


_D, _U = Direction.DOWNSTREAM, Direction.UPSTREAM
_IDLE, _OPEN, _CLOSED = State.IDLE, State.OPEN, State.CLOSED

# The whole protocol of a seam, per direction: (state, event type) -> next state.
# Anything not listed is a protocol error.
TRANSITIONS: dict[Direction, dict[tuple[State, type], State]] = {
    _D: {
        (_IDLE, OpenRoute): _OPEN,
        (_OPEN, Activations): _OPEN,
        (_OPEN, Release): _CLOSED,
        (_IDLE, Cancel): _CLOSED,
        (_OPEN, Cancel): _CLOSED,
        (_IDLE, Error): _CLOSED,
        (_OPEN, Error): _CLOSED,
    },
    _U: {
        (_IDLE, Prefix): _OPEN,  # only first: the session's Activations start where it says
        (_IDLE, Credit): _OPEN,
        (_OPEN, Credit): _OPEN,
        (_IDLE, Tokens): _OPEN,
        (_OPEN, Tokens): _OPEN,
        (_IDLE, Usage): _CLOSED,
        (_OPEN, Usage): _CLOSED,
        (_IDLE, Error): _CLOSED,
        (_OPEN, Error): _CLOSED,
        (_IDLE, Cancel): _CLOSED,
        (_OPEN, Cancel): _CLOSED,
    },
}


def _next_state(direction: Direction, state: State, event: Event, error: type[ProtocolError]) -> State:
    try:
        return TRANSITIONS[direction][(state, type(event))]
    except KeyError:
        raise error(
            f"{type(event).__name__} is not allowed {direction.value} in state {state.value}",
            StatusCode.FAILED_PRECONDITION,
        ) from None


@attrs.define
class _Track:
    """One direction's progress."""

    direction: Direction
    state: State = State.IDLE
    last_step: int = -1
    kv_length: int = 0  # positions covered by accepted Activations (downstream only)
    # positions whose inputs are known, which no step may compute again: a step's rows, but of
    # a window only its first (none where it follows another), and where Tokens end (downstream only)
    final: int = 0


class SeamEndpoint:
    """One end of one seam, for one route session.

    ``sends`` is the direction our frames travel: a hop's endpoint toward its next hop
    sends downstream, its endpoint toward its previous hop sends upstream.
    """

    def __init__(self, identity: Identity, sends: Direction, *, peer_shard: Span | None = None) -> None:
        """``identity`` is ours; ``peer_shard``, if known, is the range the peer's frames must name."""
        self.identity = identity
        self.peer_shard = peer_shard
        receives = Direction.UPSTREAM if sends is Direction.DOWNSTREAM else Direction.DOWNSTREAM
        self._out = _Track(sends)
        self._in = _Track(receives)
        # the schema minor version the peer must speak for what this session uses: a peer
        # below it would ignore the field (proto3 skips unknown fields), not refuse it
        self.required_minor = 0
        self._offer = 0  # the prefix the OpenRoute that crossed this seam offered

    @property
    def outbound_state(self) -> State:
        """State of the frames we send."""
        return self._out.state

    @property
    def inbound_state(self) -> State:
        """State of the frames we receive."""
        return self._in.state

    @property
    def closed(self) -> bool:
        """Both directions are closed: nothing more may pass for this session."""
        return self._out.state is State.CLOSED and self._in.state is State.CLOSED

    @property
    def kv_length(self) -> int:
        """KV positions the receiving end holds, by the Activations that crossed this seam."""
        return self._down.kv_length

    @property
    def final(self) -> int:
        """Of those, the positions no step may compute again (the next step starts between the two)."""
        return self._down.final

    @property
    def _down(self) -> _Track:
        return self._out if self._out.direction is Direction.DOWNSTREAM else self._in

    # --- sending

    def outbound_snapshot(self) -> tuple[State, int, int]:
        """Our sending progress, to restore if a checked event could not be sent at all."""
        return self._out.state, self._out.last_step, self._out.kv_length

    def restore_outbound(self, snapshot: tuple[State, int, int]) -> None:
        """Undo :meth:`send` for an event that never left (no frame of it was written)."""
        self._out.state, self._out.last_step, self._out.kv_length = snapshot

    def header(self, phase: Phase, positions: Span = Span()) -> Header:
        """The header of our next frame: the next step id, and the KV length the peer should hold
        for it (a step that starts before the KV's end, after a window, expects its start)."""
        held = self._out.kv_length
        return Header(
            identity=self.identity,
            phase=phase,
            step_id=self._out.last_step + 1,
            positions=positions,
            cache_expectation=min(held, positions.start) if len(positions) else held,
        )

    def send(self, event: Event) -> Event:
        """Check an event we are about to send and advance; returns it unchanged."""
        track = self._out
        state = _next_state(track.direction, track.state, event, LocalProtocolError)
        header = event.header
        if header.identity != self.identity:
            raise LocalProtocolError("event carries another session's identity")
        if header.step_id != track.last_step + 1:
            raise LocalProtocolError(f"step {header.step_id} sent after step {track.last_step}")
        if isinstance(event, Activations):
            _step(track, event, LocalProtocolError)
        if isinstance(event, OpenRoute):
            self.required_minor = max(self.required_minor, required_minor(event))
            self._offer = event.prefix_offer
        if isinstance(event, Prefix):
            self._take_prefix(self._in, event, LocalProtocolError)
        if isinstance(event, Tokens):
            _keep(self._in, event)
        track.last_step = header.step_id
        track.state = state
        return event

    def _take_prefix(self, track: _Track, event: Prefix, error: type[ProtocolError]) -> None:
        """The session's Activations start at ``event.positions``: nothing may have crossed before."""
        if track.kv_length or not self._offer or not 0 <= event.positions <= self._offer:
            raise error(
                f"a prefix of {event.positions} positions where {self._offer} were offered and "
                f"{track.kv_length} already crossed",
                StatusCode.FAILED_PRECONDITION,
            )
        track.kv_length = track.final = event.positions

    # --- receiving

    def receive(self, event: Event) -> Event | None:
        """Check an event from the peer; ``None`` for one that repeats the last accepted step id
        (a retry, ignored whatever it carries)."""
        track = self._in
        header = event.header
        if header.schema_major != SCHEMA_MAJOR:
            raise RemoteProtocolError(
                f"schema version {header.schema_major}.{header.schema_minor} is not supported (major {SCHEMA_MAJOR})",
                StatusCode.UNIMPLEMENTED,
            )
        if header.schema_minor < self.required_minor:
            raise RemoteProtocolError(
                f"the peer speaks schema {header.schema_major}.{header.schema_minor}; this session needs "
                f"{SCHEMA_MAJOR}.{self.required_minor} ({_NEEDS[self.required_minor]})",
                StatusCode.UNIMPLEMENTED,
            )
        if isinstance(event, OpenRoute):
            self.required_minor = max(self.required_minor, required_minor(event))
            self._offer = event.prefix_offer
        self._check_identity(header.identity)
        if header.step_id == track.last_step and track.last_step >= 0:
            return None  # the peer retried a step we already accepted
        if header.step_id < track.last_step:
            raise RemoteProtocolError(
                f"step {header.step_id} after step {track.last_step}: steps must increase", StatusCode.OUT_OF_RANGE
            )
        if header.step_id > track.last_step + 1:
            raise RemoteProtocolError(
                f"step {header.step_id} after step {track.last_step}: steps {track.last_step + 1}.. are missing",
                StatusCode.OUT_OF_RANGE,
            )
        state = _next_state(track.direction, track.state, event, RemoteProtocolError)
        if isinstance(event, Activations):
            _step(track, event, RemoteProtocolError)
        if isinstance(event, Prefix):
            self._take_prefix(self._out, event, RemoteProtocolError)
        if isinstance(event, Tokens):
            _keep(self._out, event)
        track.last_step = header.step_id
        track.state = state
        return event

    def _check_identity(self, theirs: Identity) -> None:
        ours = self.identity
        if theirs.session_id != ours.session_id:
            raise RemoteProtocolError("frame of another session on this seam", StatusCode.INVALID_ARGUMENT)
        if theirs.epoch != ours.epoch:
            raise RemoteProtocolError(
                f"frame of epoch {theirs.epoch}; this session is epoch {ours.epoch}", StatusCode.ABORTED
            )
        if theirs.artifact_fingerprint != ours.artifact_fingerprint:
            raise RemoteProtocolError("frame names another model artifact", StatusCode.FAILED_PRECONDITION)
        if theirs.recipe_fingerprint != ours.recipe_fingerprint:
            raise RemoteProtocolError("frame names another recipe", StatusCode.FAILED_PRECONDITION)
        if theirs.request_id != ours.request_id:
            raise RemoteProtocolError("frame names another request", StatusCode.INVALID_ARGUMENT)
        if self.peer_shard is not None and theirs.shard != self.peer_shard:
            raise RemoteProtocolError(
                f"frame from layers {theirs.shard.start}:{theirs.shard.end}; the peer of this seam runs "
                f"{self.peer_shard.start}:{self.peer_shard.end}",
                StatusCode.FAILED_PRECONDITION,
            )


def _step(track: _Track, event: Activations, error: type[ProtocolError]) -> None:
    """A step's rows: where they may start, and what they leave the receiving end holding.

    A step continues the KV (``start == kv_length``) or, after a window, goes back to where the
    tokens say the kept rows end, dropping the rest; never before ``final``. Both ends see the
    same Activations, so ``kv_length`` and what a step makes final agree whatever order the
    Tokens crossing them in flight took; a step's ``cache_expectation`` is its start.
    """
    header = event.header
    start, end = header.positions.start, header.positions.end
    if header.cache_expectation != min(track.kv_length, start):
        raise error(
            f"cache expectation {header.cache_expectation}, but the receiver holds {track.kv_length} positions",
            StatusCode.FAILED_PRECONDITION,
        )
    if not track.final <= start <= track.kv_length or end <= start:
        raise error(
            f"positions {start}:{end} do not continue from {track.kv_length} "
            f"(nor go back to {track.final} or later, after a window)",
            StatusCode.FAILED_PRECONDITION,
        )
    track.kv_length = end
    if not event.follows:
        # a window's first row ran the token the tail drew last; a plain step's rows all known ones
        track.final = max(track.final, start + 1 if event.draft else end)


def _keep(track: _Track, event: Tokens) -> None:
    """Tokens end where the next step starts: the rows before it are kept, and final.

    A window of rows ``start..end`` whose tail kept ``j`` of its drafts sends back tokens for
    positions ``start + 1 .. start + j + 1``; the next step runs the last of them, at
    ``start + j + 1``, and may not start before. A single row's tokens end where its KV does, so
    this changes nothing without speculation; and tokens beyond the KV make nothing final.
    """
    if event.token_ids:
        track.final = max(track.final, min(event.header.positions.end - 1, track.kv_length))


# From this schema minor on, a hop sends heartbeats (Credit frames toward the client) while
# a session is open, and watches its next hop's: one that sends nothing, not even a
# heartbeat, for a while is hung, however long its steps take.
HEARTBEAT_MINOR = 3

# what a session uses that needs each schema minor version
_NEEDS = {1: "a grammar or a logit bias", 2: "logprobs", 3: "resuming a session on a repaired route"}


def required_minor(open_route: OpenRoute) -> int:
    """The schema minor version every hop of this session must speak."""
    sampling = open_route.sampling
    if open_route.audit:
        return 5  # an older hop would serve it as a plain resumed session, committing to nothing
    if open_route.prompt_length:
        return 3
    if sampling.logprobs or sampling.prompt_logprobs:
        return 2
    return 1 if sampling.grammar or sampling.logit_bias else 0


def error_event(endpoint: SeamEndpoint, error: ProtocolError, node_id: bytes = b"") -> Error:
    """The Error frame that tells the peer about ``error`` (Error is allowed in any state but closed)."""
    return Error(endpoint.header(Phase.CANCEL), error.code, error.message, node_id)
