"""The client end of a route: opens a route session on the head and reads its tokens.

Used by the gateway, the tests and the benchmarks::

    async with open_route_generation(connector, hops, request, artifact=..., recipe=...) as gen:
        while (tokens := await gen.next()) is not None:
            ...

Leaving the block normally releases the session on every hop and collects the
usage records; leaving it by an exception or cancellation cancels the session.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

import attrs
import trio

from noderuntime.seams.connection import SeamConnection
from noderuntime.transport import FrameStream, TransportError
from protocol import (
    HEARTBEAT_MINOR,
    Cancel,
    Credit,
    Direction,
    Error,
    Event,
    Hop,
    Identity,
    Limits,
    OpenRoute,
    Phase,
    Prefix,
    ProtocolError,
    Release,
    RemoteProtocolError,
    Sampling,
    SeamEndpoint,
    Span,
    StatusCode,
    Tokens,
    Usage,
    UsageRecord,
)

USAGE_TIMEOUT = 5.0


@attrs.frozen
class GenerationRequest:
    """What to generate."""

    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = Sampling()
    stop_token_ids: tuple[int, ...] = ()
    deadline_unix_ms: int = 0
    request_id: str = ""
    # a session resumed on a repaired route: prompt_tokens[:prompt_length] is the prompt and
    # the rest was generated already (see protocol.OpenRoute); 0 for a new session
    prompt_length: int = 0
    # whether the route may take the prompt's first positions from its nodes' prefix caches
    reuse_prefix: bool = True
    # an audit (see protocol.OpenRoute): the route recomputes a served session, teacher-forced,
    # and its hops commit from this position on; None for an ordinary session
    audit_from: int | None = None
    # speculative decoding: the most drafted tokens a decode window may carry (0: none);
    # where a hop's engine cannot keep a window exact, the route takes none
    speculate: int = 0

    def resumed(self, generated: Sequence[int]) -> GenerationRequest:
        """This request carried on after ``generated`` tokens, for a new route to go on with."""
        prompt = self.prompt_tokens[: self.prompt_length] if self.prompt_length else self.prompt_tokens
        # its prompt's logprobs were sent with the first tokens: not again
        sampling = attrs.evolve(self.sampling, prompt_logprobs=False)
        return attrs.evolve(self, prompt_tokens=(*prompt, *generated), prompt_length=len(prompt), sampling=sampling)


class RouteError(Exception):
    """The route ended the session: ``code`` is a gRPC status, ``node_id`` who reported it."""

    def __init__(self, message: str, code: StatusCode, node_id: bytes = b"") -> None:
        super().__init__(message)
        self.code = code
        self.node_id = node_id


class Generation:
    """An open route session, from the client's side.

    A head that speaks heartbeats (schema 1.3) and sends nothing, not one, for
    ``hang_timeout`` seconds is hung: :meth:`next` raises UNAVAILABLE, and the route may be
    repaired. An older head is waited on as long as the caller waits.
    """

    def __init__(self, conn: SeamConnection, session_id: bytes, epoch: int, hang_timeout: float = 2.0) -> None:
        self.conn = conn
        self.hang_timeout = hang_timeout
        self._beats = False  # the head sends heartbeats
        self.cached_tokens = 0  # prompt positions the route took from its prefix caches
        self.session_id = session_id
        self.epoch = epoch
        self.tokens: list[int] = []
        self.drafted = self.accepted = 0  # speculative decoding's drafts, and those the tail kept
        self.finished = False
        self.finish_reason = ""
        self.usage: tuple[UsageRecord, ...] | None = None
        self.failed = False  # the route ended the session with an error: nothing to release

    @property
    def endpoint(self) -> SeamEndpoint:
        """This seam's state machine."""
        assert self.conn.endpoint is not None
        return self.conn.endpoint

    async def next(self) -> Tokens | None:
        """The next tokens from the route; ``None`` once the generation finished."""
        if self.finished:
            return None
        event = await self._receive()
        if isinstance(event, Tokens):
            self.tokens.extend(event.token_ids)
            self.drafted += event.drafted
            self.accepted += event.accepted
            if event.finished:
                self.finished = True
                self.finish_reason = event.finish_reason
            return event
        self.failed = True  # a broken head: do not wait on it for usage records
        raise RouteError(f"unexpected {type(event).__name__} from the head", StatusCode.INTERNAL)

    async def _receive(self, *, watch: bool = True) -> Event:
        """The next event that is not a heartbeat; with ``watch``, a heartbeating head silent too long fails."""
        while True:
            with trio.move_on_after(self.hang_timeout if self._beats and watch else math.inf):
                event = await self._receive_any()
                if isinstance(event, Prefix):
                    self.cached_tokens = event.positions
                    continue
                if not isinstance(event, Credit):
                    return event
                continue  # a heartbeat: the head is alive
            self.failed = True
            raise RouteError(
                f"the head sent nothing, not a heartbeat, for {self.hang_timeout:.1f} s", StatusCode.UNAVAILABLE
            )

    async def _receive_any(self) -> Event:
        try:
            event = await self.conn.receive()
        except RemoteProtocolError as exc:
            self.failed = True
            await self.conn.fail(exc)
            raise RouteError(f"the head broke the protocol: {exc.message}", exc.code) from None
        except TransportError as exc:
            self.failed = True
            raise RouteError(f"the route closed: {exc}", StatusCode.UNAVAILABLE) from None
        if isinstance(event, Error):
            self.failed = True
            raise RouteError(event.message, event.code, event.node_id)
        if isinstance(event, Cancel):
            self.failed = True
            raise RouteError(event.reason or "cancelled by the route", StatusCode.CANCELLED)
        self._beats = self._beats or event.header.schema_minor >= HEARTBEAT_MINOR
        return event

    async def release(self, reason: str = "done") -> tuple[UsageRecord, ...]:
        """End the session normally and collect every hop's usage record."""
        await self.conn.send(Release(self.endpoint.header(Phase.RELEASE), reason))
        with trio.fail_after(USAGE_TIMEOUT):  # bounds the wait itself: a silent head costs no more than this
            while True:
                event = await self._receive(watch=False)
                if isinstance(event, Usage):
                    self.usage = event.records
                    return event.records
                # tokens generated after our Release crossed the route are dropped


def _prefix_offer(request: GenerationRequest) -> int:
    """The prompt positions a route may take from its prefix caches: all but the last (its logits
    are needed), none when the request scores its prompt (every row must be computed) or opts out."""
    if not request.reuse_prefix or request.sampling.prompt_logprobs:
        return 0
    if request.audit_from is not None:  # an audit's hops must compute every row they commit to
        return min(request.audit_from, len(request.prompt_tokens) - 1)
    return max(0, len(request.prompt_tokens) - 1)


class Connector(Protocol):
    """Opens the seam to a hop of a route."""

    async def connect(self, hop: Hop, open_route: OpenRoute) -> FrameStream:
        """A frame stream to ``hop`` (direct, or through a relay) for the session ``open_route`` opens."""
        ...


@attrs.frozen
class over_stream:
    """A connector whose seam to the head is open already: ``stream`` (a test's or a local route's)."""

    stream: FrameStream

    async def connect(self, hop: Hop, open_route: OpenRoute) -> FrameStream:
        """``stream``, whatever the hop."""
        return self.stream


@asynccontextmanager
async def open_route_generation(
    connector: Connector,
    hops: Sequence[Hop],
    request: GenerationRequest,
    *,
    artifact: bytes,
    recipe: bytes,
    ticket: bytes = b"",
    session_id: bytes | None = None,
    epoch: int = 0,
    limits: Limits = Limits(),
) -> AsyncIterator[Generation]:
    """Open a route session on ``hops``' head, dialled with ``connector`` (direct, through its
    relay, or :class:`over_stream`); see the module docstring."""
    session_id = session_id or os.urandom(16)
    identity = Identity(request.request_id, session_id, epoch, artifact, recipe, Span())
    endpoint = SeamEndpoint(identity, Direction.DOWNSTREAM, peer_shard=hops[0].layers)
    opening = OpenRoute(
        endpoint.header(Phase.PREFILL),
        tuple(hops),
        request.sampling,
        request.prompt_tokens,
        request.max_tokens,
        request.stop_token_ids,
        request.deadline_unix_ms,
        ticket,
        request.prompt_length,
        _prefix_offer(request),
        request.audit_from is not None,
        request.audit_from or 0,
        0 if request.audit_from is not None else request.speculate,
    )
    try:
        stream = await connector.connect(hops[0], opening)
    except TransportError as exc:
        raise RouteError(f"cannot reach the head: {exc}", exc.code) from None
    conn = SeamConnection(stream, endpoint, limits, label="client")
    generation = Generation(conn, session_id, epoch)
    try:
        await conn.send(opening)
        try:
            yield generation
        except BaseException:
            await conn.notify(Cancel(endpoint.header(Phase.CANCEL), "the client went away"))
            raise
        if not generation.failed:
            # the tokens were delivered; a lost usage record does not fail the request
            with contextlib.suppress(RouteError, ProtocolError, TransportError, trio.TooSlowError):
                await generation.release()
    except TransportError as exc:
        raise RouteError(f"the route closed: {exc}", StatusCode.UNAVAILABLE) from None
    finally:
        await conn.aclose()
