"""A route session alone: a fake engine behind its SessionContext, its seam over memory
streams, time on trio's autojump clock. No node, no llama.cpp, no sockets: the tier
where a session's own rules (what it sends, when it ends, what it frees) are tested.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing

from noderuntime.node.batcher import StepOutput, StepRequest
from noderuntime.node.context import SessionContext
from noderuntime.node.ending import ENDINGS, Blame, EndReason, ending, idle_blame, stop_reason
from noderuntime.node.leases import LeaseManager
from noderuntime.node.prefix import PrefixCache
from noderuntime.node.sessions import RouteSession
from noderuntime.seams.connection import SeamConnection
from noderuntime.transport import TransportError, memory_stream_pair
from protocol import (
    Credit,
    Direction,
    Encoding,
    Error,
    Event,
    Hop,
    Identity,
    Limits,
    OpenRoute,
    Phase,
    Prefix,
    Release,
    Sampling,
    SeamEndpoint,
    Span,
    StatusCode,
    Tokens,
    Usage,
)

LAYERS = Span(0, 4)


@attrs.define
class FakeNode:
    """What the session may ask of its node, recorded."""

    steps: list[StepRequest] = attrs.Factory(list)
    retired: list[tuple[int, Any]] = attrs.Factory(list)
    last_steps: list[int] = attrs.Factory(list)
    # what the prefix cache's engine calls did: ("save", seq, positions) / ("restore", seq, keep)
    kv_calls: list[tuple[str, int, int]] = attrs.Factory(list)
    cache: PrefixCache = attrs.Factory(lambda: PrefixCache(1 << 20))
    next_hop: Any = None  # the stream a two-hop session's head dials

    async def save(self, seq: int, positions: int) -> bytes:
        self.kv_calls.append(("save", seq, positions))
        return b"kv" * positions

    async def restore(self, seq: int, state: bytes, keep: int) -> None:
        assert len(state) >= 2 * keep
        self.kv_calls.append(("restore", seq, keep))

    async def step(self, request: StepRequest) -> StepOutput:
        self.steps.append(request)
        await trio.sleep(0.01)  # an engine call takes time
        # the "model" answers each step with the token 100 + its first position
        return StepOutput(None, 100 + request.start, request.n_rows, 0.01)

    async def connect(self, hop: Hop, open_route: OpenRoute) -> Any:
        if self.next_hop is None:
            raise TransportError("one hop: nothing to connect to")
        return self.next_hop

    def context(self, idle_timeout: float = 5.0) -> SessionContext:
        return SessionContext(
            node_id=b"n" * 32,
            step=self.step,
            retire=lambda seq, sampler: self.retired.append((seq, sampler)),
            last_step=self.last_steps.append,
            connect=self.connect,
            sign=lambda body: b"s" * 64,
            count_frame=lambda transport, direction, size: None,
            seam_round_trip=lambda transport, seconds: None,
            limits=Limits(),
            encoding=Encoding.F32,
            prefill_chunk=4,
            idle_timeout=idle_timeout,
            n_embd=8,
            n_vocab=1000,
            prefix_cache=self.cache,
            save_state=self.save,
            restore_state=self.restore,
        )


async def _receive(client: SeamConnection) -> Event:
    """The client's next event that is not a heartbeat (a Credit the head sends while it serves)."""
    while isinstance(event := await client.receive(), Credit):
        pass
    return event


async def _open(
    node: FakeNode,
    prompt: tuple[int, ...],
    max_tokens: int,
    *,
    offer: int = 0,
    hops: tuple[Hop, ...] = (Hop(b"n" * 32, LAYERS),),
    **context: Any,
) -> tuple[SeamConnection, RouteSession]:
    """A client's seam and the session (the head, the tail too with one hop) it opened."""
    ours, theirs = memory_stream_pair()
    identity = Identity("req", b"s" * 16, 0, b"a" * 32, b"r" * 8, Span())
    client = SeamConnection(ours, SeamEndpoint(identity, Direction.DOWNSTREAM, peer_shard=LAYERS))
    assert client.endpoint is not None
    header = client.endpoint.header(Phase.PREFILL)
    await client.send(OpenRoute(header, hops, Sampling(), prompt, max_tokens, prefix_offer=offer))
    upstream = SeamConnection(theirs)
    opening = await upstream.receive()
    assert isinstance(opening, OpenRoute)
    endpoint = SeamEndpoint(attrs.evolve(identity, shard=LAYERS), Direction.UPSTREAM, peer_shard=Span())
    endpoint.receive(opening)
    upstream.endpoint = endpoint
    lease = LeaseManager(2, 64).acquire(len(prompt) + max_tokens)
    assert lease is not None
    sampler = object()
    cached = node.cache.lookup(prompt, limit=offer) if offer else (0, None)
    deadline = trio.current_time() + 600
    session = RouteSession(node.context(**context), opening, 0, upstream, lease, sampler, deadline, cached)
    return client, session


async def test_a_session_prefills_in_chunks_generates_and_is_released(autojump_clock: trio.testing.MockClock) -> None:
    node = FakeNode()
    client, session = await _open(node, tuple(range(1, 11)), 3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        tokens = [await _receive(client) for _ in range(3)]
        assert all(isinstance(t, Tokens) for t in tokens)
        assert [t.token_ids for t in tokens] == [(108,), (110,), (111,)]  # type: ignore[union-attr]
        assert [t.finish_reason for t in tokens] == ["", "", "length"]  # type: ignore[union-attr]
        assert node.last_steps == [session.lease.seq_id]  # told before the Release: no tick waits for it
        assert client.endpoint is not None
        await client.send(Release(client.endpoint.header(Phase.RELEASE), "done"))
        usage = await _receive(client)
        assert isinstance(usage, Usage) and len(usage.records) == 1
    # chunks of 4, 4 and 2 prompt rows (the last one sampled), then one row per token
    assert [(s.start, s.n_rows, s.sampler is not None) for s in node.steps] == [
        (0, 4, False),
        (4, 4, False),
        (8, 2, True),
        (10, 1, True),
        (11, 1, True),
    ]
    assert session.end is not None and session.end.reason is EndReason.RELEASED
    assert node.retired == [(session.lease.seq_id, session.sampler)]  # freed once
    session.release()
    assert len(node.retired) == 1  # idempotent


async def test_a_client_that_never_releases_is_ended_by_the_idle_watchdog(
    autojump_clock: trio.testing.MockClock,
) -> None:
    node = FakeNode()
    client, session = await _open(node, (1, 2, 3), 1, idle_timeout=30.0)
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        finished = await _receive(client)
        assert isinstance(finished, Tokens) and finished.finished
        error = await _receive(client)  # nobody released: the watchdog ends it
    assert isinstance(error, Error) and error.code == StatusCode.DEADLINE_EXCEEDED
    assert session.end is not None and session.end.reason is EndReason.IDLE
    assert 30.0 <= trio.current_time() - started <= 30.0 * 1.5
    assert node.retired == [(session.lease.seq_id, session.sampler)]


# --- prefix reuse


async def test_a_session_restores_the_agreed_prefix_says_so_first_and_keeps_its_kv(
    autojump_clock: trio.testing.MockClock,
) -> None:
    node = FakeNode()
    prompt = tuple(range(1, 41))
    assert node.cache.store((*prompt[:32], 7, 7, 7), b"kv" * 35)  # an earlier session's 35 positions
    client, session = await _open(node, prompt, 2, offer=len(prompt) - 1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        prefix = await _receive(client)
        assert isinstance(prefix, Prefix) and prefix.positions == 32  # two whole blocks; the third differs
        tokens = [await _receive(client) for _ in range(2)]
        assert client.endpoint is not None
        await client.send(Release(client.endpoint.header(Phase.RELEASE), "done"))
        await _receive(client)
    seq = session.lease.seq_id
    # restored before any step, which start after it; saved (41 positions) before the KV was freed
    assert node.kv_calls == [("restore", seq, 32), ("save", seq, 41)]
    assert [(s.start, s.n_rows) for s in node.steps] == [(32, 4), (36, 4), (40, 1)]
    assert session.usage.cached_tokens == 32 and session.kv_length == 41
    assert node.retired == [(seq, session.sampler)]
    assert [t.token_ids for t in tokens] == [(136,), (140,)]  # type: ignore[union-attr]
    assert node.cache.statistics().stored == 2  # the earlier session's, and this one's


async def test_an_older_next_hop_that_sends_no_prefix_means_none(autojump_clock: trio.testing.MockClock) -> None:
    node = FakeNode()
    prompt = tuple(range(1, 41))
    node.cache.store(prompt, b"kv" * 40)
    ours, node.next_hop = memory_stream_pair()
    hops = (Hop(b"n" * 32, LAYERS), Hop(b"m" * 32, Span(4, 8)))
    client, session = await _open(node, prompt, 1, offer=39, hops=hops)
    next_hop = SeamConnection(ours)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        opening = await next_hop.receive()
        assert isinstance(opening, OpenRoute) and opening.prefix_offer == 39  # the head holds all the offer
        endpoint = SeamEndpoint(attrs.evolve(opening.header.identity, shard=Span(4, 8)), Direction.UPSTREAM)
        endpoint.receive(opening)
        next_hop.endpoint = endpoint
        # a hop of schema 1.3 heartbeats and knows nothing of prefixes
        await next_hop.send(Credit(attrs.evolve(endpoint.header(Phase.PREFILL), schema_minor=3), 0))
        prefix = await _receive(client)
        assert isinstance(prefix, Prefix) and prefix.positions == 0
        nursery.cancel_scope.cancel()
    assert not [call for call in node.kv_calls if call[0] == "restore"]
    assert node.steps and node.steps[0].start == 0  # the head prefills from the start


# --- the ending table and the rules it is decided by


def test_every_ending_has_its_row_and_an_open_code_must_be_given() -> None:
    assert set(ENDINGS) == set(EndReason)
    assert ending(EndReason.RELEASED).code is StatusCode.OK
    assert ending(EndReason.DOWNSTREAM_ERROR, "x", StatusCode.RESOURCE_EXHAUSTED).code is StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(ValueError, match="needs a status code"):
        ending(EndReason.IDLE)
    with pytest.raises(ValueError, match="whom it blames"):
        ending(EndReason.IDLE, code=StatusCode.UNAVAILABLE)
    with pytest.raises(ValueError, match="ends with"):
        ending(EndReason.RELEASED, code=StatusCode.INTERNAL)
    # who is told: a failure comes from one side and is told to the other
    assert (ending(EndReason.UPSTREAM_CLOSED).tell_upstream, ending(EndReason.UPSTREAM_CLOSED).tell_downstream) == (
        False,
        True,
    )
    closed = ending(EndReason.DOWNSTREAM_CLOSED)
    assert (closed.tell_upstream, closed.tell_downstream) == (True, False)


def test_the_watchdog_blames_the_side_that_stalled() -> None:
    assert idle_blame(30, sends_up=1, awaiting_downstream=True) == (
        StatusCode.DEADLINE_EXCEEDED,
        "the previous hop read nothing for 30 s",
        Blame.PREVIOUS,
    )
    assert idle_blame(30, sends_up=0, awaiting_downstream=True)[::2] == (StatusCode.UNAVAILABLE, Blame.NEXT)
    assert idle_blame(30, sends_up=0, awaiting_downstream=False)[0] is StatusCode.DEADLINE_EXCEEDED


def test_the_tail_stops_at_a_stop_token_max_tokens_or_its_reservation() -> None:
    rule = {"max_tokens": 4, "reserved": 20, "stop_tokens": {2}}
    assert stop_reason(2, generated=1, position=5, **rule) == "stop"  # type: ignore[arg-type]
    assert stop_reason(7, generated=4, position=5, **rule) == "length"  # type: ignore[arg-type]
    assert stop_reason(7, generated=1, position=19, **rule) == "length"  # type: ignore[arg-type]
    assert stop_reason(7, generated=1, position=18, **rule) == ""  # type: ignore[arg-type]


async def test_senders_waiting_their_turn_on_a_seam_each_take_the_next_step() -> None:
    """A session's tokens and its heartbeats go up one seam from two tasks: a header made before the
    sender's turn took a step id another waiting sender took too (a node failed the session on it)."""
    ours, theirs = memory_stream_pair(buffer=0)  # every send waits for the peer to read it
    identity = Identity("req", b"s" * 16, 0, b"a" * 32, b"r" * 8, Span())
    client = SeamConnection(ours, SeamEndpoint(identity, Direction.DOWNSTREAM, peer_shard=LAYERS))
    assert client.endpoint is not None
    hops = (Hop(b"n" * 32, LAYERS),)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send, OpenRoute(client.endpoint.header(Phase.PREFILL), hops, Sampling(), (1, 2), 4))
        upstream = SeamConnection(theirs)
        opening = await upstream.receive()
        endpoint = SeamEndpoint(attrs.evolve(identity, shard=LAYERS), Direction.UPSTREAM, peer_shard=Span())
        endpoint.receive(opening)
        upstream.endpoint = endpoint
        for _ in range(3):  # the first holds the turn until read; the other two wait for it together
            nursery.start_soon(upstream.send_next, lambda: Credit(endpoint.header(Phase.DECODE), 0))
        await trio.testing.wait_all_tasks_blocked()
        steps = [(await client.receive()).header.step_id for _ in range(3)]
    assert steps == [0, 1, 2]
