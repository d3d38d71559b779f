"""Promises the docstrings make, each checked where no other test checked it: trio tasks
over memory streams, fakes in place of the engine and the tracker, on the autojump clock."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from noderuntime.control.admission import AdmissionError
from noderuntime.engine.base import Rows, StepResult
from noderuntime.engine.thread import EngineThread
from noderuntime.node.batcher import Batcher, StepFailed, StepOutput, StepRequest
from noderuntime.node.context import SessionContext, deadline_from_unix_ms
from noderuntime.node.core import Node, NodeConfig
from noderuntime.node.ending import Blame, EndReason
from noderuntime.node.leases import LeaseManager
from noderuntime.node.sessions import RouteSession
from noderuntime.seams.connection import NOTICE_TIMEOUT, SeamConnection
from noderuntime.testing.seams import first_hop_seam
from noderuntime.transport import StreamBroken, TransportError, memory_stream_pair
from protocol import (
    Activations,
    Cancel,
    Credit,
    Direction,
    Encoding,
    Error,
    Event,
    Hop,
    Identity,
    Limits,
    NamedTensor,
    OpenRoute,
    Phase,
    Sampling,
    SeamEndpoint,
    Span,
    StatusCode,
    Tokens,
    route_recipe,
)

LAYERS = Span(0, 4)
NODE_ID = b"n" * 32
ARTIFACT, RECIPE = b"a" * 32, b"r" * 8
STEP_SECONDS = 0.01


def _identity(shard: Span = Span()) -> Identity:
    return Identity("req", b"s" * 16, 0, ARTIFACT, RECIPE, shard)


async def _read_until_closed(conn: SeamConnection, first: trio.Event) -> list[Event]:
    """Everything the peer sends until the seam closes; ``first`` is set at the first event."""
    events: list[Event] = []
    while True:
        try:
            events.append(await conn.receive())
        except TransportError:
            return events
        first.set()


# --- a route session, however it ends


@attrs.define
class FakeNode:
    """What a session may ask of its node, recorded; step ``fail_at`` fails as the engine or ``defect_at`` as a bug."""

    fail_at: int = 0
    defect_at: int = 0
    steps: int = 0
    retired: list[tuple[int, Any]] = attrs.Factory(list)

    async def step(self, request: StepRequest) -> StepOutput:
        self.steps += 1
        await trio.sleep(STEP_SECONDS)
        if self.steps == self.fail_at:
            raise StepFailed("decode failed")
        if self.steps == self.defect_at:
            raise RuntimeError("a defect")
        return StepOutput(None, 100 + request.start, request.n_rows, STEP_SECONDS)

    async def connect(self, hop: Hop, open_route: OpenRoute) -> Any:
        raise TransportError("one hop: nothing to connect to")

    def context(self) -> SessionContext:
        return SessionContext(
            node_id=NODE_ID,
            step=self.step,
            retire=lambda seq, sampler: self.retired.append((seq, sampler)),
            last_step=lambda seq: None,
            connect=self.connect,
            sign=lambda body: b"s" * 64,
            count_frame=lambda transport, direction, size: None,
            seam_round_trip=lambda transport, seconds: None,
            limits=Limits(),
            encoding=Encoding.F32,
            prefill_chunk=4,
            idle_timeout=30.0,
            n_embd=8,
            n_vocab=1000,
        )


async def _session(node: FakeNode, *, seconds: float = 600.0) -> tuple[SeamConnection, RouteSession]:
    """A client's seam and the one-hop session (head and tail) it opened: 3 prompt tokens, 40 to generate."""
    ours, theirs = memory_stream_pair()
    client = SeamConnection(ours, SeamEndpoint(_identity(), Direction.DOWNSTREAM, peer_shard=LAYERS))
    assert client.endpoint is not None
    hops = (Hop(NODE_ID, LAYERS),)
    await client.send(OpenRoute(client.endpoint.header(Phase.PREFILL), hops, Sampling(), (1, 2, 3), 40))
    upstream, opening = await first_hop_seam(theirs, LAYERS)
    lease = LeaseManager(2, 64).acquire(43)
    assert lease is not None
    deadline = trio.current_time() + seconds
    return client, RouteSession(node.context(), opening, 0, upstream, lease, object(), deadline)


async def _client_cancels(client: SeamConnection, session: RouteSession) -> None:
    assert client.endpoint is not None
    await client.send(Cancel(client.endpoint.header(Phase.CANCEL), "the user left"))


async def _client_hangs_up(client: SeamConnection, session: RouteSession) -> None:
    await client.aclose()


async def _client_breaks_the_protocol(client: SeamConnection, session: RouteSession) -> None:
    assert client.endpoint is not None
    rows = (NamedTensor("hidden_states", np.zeros((1, 8), np.float32)),)
    await client.send(Activations(client.endpoint.header(Phase.PREFILL, Span(0, 1)), rows))


async def _node_stops(client: SeamConnection, session: RouteSession) -> None:
    session.cancel()


async def _nothing(client: SeamConnection, session: RouteSession) -> None:
    pass


ENDINGS: list[tuple[str, Callable[..., Any], dict[str, Any], EndReason, StatusCode | None]] = [
    ("cancelled by the client", _client_cancels, {}, EndReason.CANCELLED, None),
    ("the client hung up", _client_hangs_up, {}, EndReason.UPSTREAM_CLOSED, None),
    ("the client broke the protocol", _client_breaks_the_protocol, {}, EndReason.UPSTREAM_PROTOCOL_ERROR,
     StatusCode.INVALID_ARGUMENT),
    ("the deadline passed", _nothing, {"seconds": 0.1}, EndReason.DEADLINE, StatusCode.DEADLINE_EXCEEDED),
    ("the node stops", _node_stops, {}, EndReason.NODE_STOPPED, StatusCode.UNAVAILABLE),
    ("the engine failed", _nothing, {"fail_at": 6}, EndReason.ENGINE_ERROR, StatusCode.INTERNAL),
    ("a defect of ours", _nothing, {"defect_at": 6}, EndReason.DEFECT, StatusCode.INTERNAL),
]  # fmt: skip


@pytest.mark.parametrize(("name", "action", "options", "reason", "heard"), ENDINGS, ids=[e[0] for e in ENDINGS])
async def test_whatever_ends_a_session_releases_its_lease_once_tells_who_listens_and_closes_its_seam(
    autojump_clock: trio.testing.MockClock,
    name: str,
    action: Callable[..., Any],
    options: dict[str, Any],
    reason: EndReason,
    heard: StatusCode | None,
) -> None:
    """sessions.py: "Whatever ends it ... it releases the lease exactly once, tells the neighbours
    that still listen, and closes its seams"."""
    options = dict(options)
    seconds = options.pop("seconds", 600.0)
    node = FakeNode(**options)
    client, session = await _session(node, seconds=seconds)
    raised: list[BaseException] = []

    async def run() -> None:
        try:
            await session.run()
        except Exception as exc:  # noqa: BLE001 - a defect is raised on (in a group), for the node to log
            raised.append(exc)

    first = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            reading = trio.Event()
            events: list[Event] = []

            async def read() -> None:
                events.extend(await _read_until_closed(client, first))  # returns only once the seam closed
                reading.set()

            nursery.start_soon(read)
            await first.wait()
            await action(client, session)
            await reading.wait()
    assert session.end is not None and session.end.reason is reason
    assert [e.code for e in events if isinstance(e, Error)] == ([heard] if heard is not None else [])
    assert sum(isinstance(e, Tokens) for e in events) < 40  # ended mid-generation, not by finishing
    assert node.retired == [(session.lease.seq_id, session.sampler)]
    session.release()
    assert len(node.retired) == 1
    assert bool(raised) is (reason is EndReason.DEFECT)


async def test_a_sessions_deadline_is_the_clients_but_never_beyond_the_nodes_own_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """sessions.deadline_from_unix_ms: the client's deadline, capped at ``default_seconds`` from now."""
    now = trio.current_time()
    assert deadline_from_unix_ms(0, 60.0) == pytest.approx(now + 60.0)
    in_ms = int((time.time() + 5.0) * 1000)
    assert deadline_from_unix_ms(in_ms, 60.0) == pytest.approx(now + 5.0, abs=1.0)
    far = int((time.time() + 86400.0) * 1000)
    assert deadline_from_unix_ms(far, 60.0) == pytest.approx(now + 60.0)
    assert deadline_from_unix_ms(int((time.time() - 5.0) * 1000), 60.0) < now


# --- a node, stopped with a session running, and its probes


class FakeShard:
    """A one-shard model: samples ``100 + position``; records what the node removes."""

    is_head = is_tail = True
    n_embd = 8
    n_vocab = 1000

    def __init__(self) -> None:
        self.removed: list[int] = []
        self.samplers: list[FakeSampler] = []

    def run(self, rows: Rows, *, samplers: Any = None, want_logits: bool = False, scores: Any = None) -> StepResult:
        sampled = {row: 100 + int(rows.positions[row]) for row in (samplers or {})}
        return StepResult(None, None, sampled, STEP_SECONDS)

    def remove_sequence(self, seq_id: int) -> None:
        self.removed.append(seq_id)

    def new_sampler(self, params: Sampling, history: Any = (), generated: Any = ()) -> FakeSampler:
        self.samplers.append(FakeSampler())
        return self.samplers[-1]

    def kv_cells_used(self) -> int:
        return 0

    @property
    def live_samplers(self) -> int:
        return sum(not s.closed for s in self.samplers)


@attrs.define
class FakeSampler:
    closed: int = 0

    def close(self) -> None:
        self.closed += 1


class VirtualEngineThread(EngineThread):
    """Like the engine's thread, a call cannot be abandoned; it takes a step's virtual time."""

    async def run(self, fn: Callable[[], Any]) -> Any:
        with trio.CancelScope(shield=True):
            await trio.sleep(STEP_SECONDS)
        return fn()


def _node(shard: FakeShard, slots: int = 2) -> Node:
    config = NodeConfig(
        layers=LAYERS,
        n_layer=LAYERS.end,
        artifact_fingerprint=ARTIFACT,
        recipe_fingerprint=RECIPE,
        n_slots=slots,
        ctx_per_seq=64,
    )
    return Node(shard, config, NODE_ID, engine_thread=VirtualEngineThread())


async def test_a_node_that_stops_ends_its_sessions_tells_their_clients_and_frees_their_kv(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """core.Node.run: "Serve until cancelled; sessions still running are ended and their KV released"."""
    shard = FakeShard()
    node = _node(shard)
    ours, theirs = memory_stream_pair()
    client = SeamConnection(ours, SeamEndpoint(_identity(), Direction.DOWNSTREAM, peer_shard=LAYERS))
    assert client.endpoint is not None
    opening = OpenRoute(client.endpoint.header(Phase.PREFILL), (Hop(NODE_ID, LAYERS),), Sampling(), (1, 2), 60)
    first, read = trio.Event(), trio.Event()
    events: list[Event] = []

    async def client_reads() -> None:  # outside the node's nursery: it reads on while the node stops
        events.extend(await _read_until_closed(client, first))
        read.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as outside:
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                node.accept(theirs)
                await client.send(opening)
                outside.start_soon(client_reads)
                await first.wait()
                assert node.statistics().active_sessions == 1
                nursery.cancel_scope.cancel()  # the node stops
            await read.wait()
    assert [e.code for e in events if isinstance(e, Error)] == [StatusCode.UNAVAILABLE]
    stats = node.statistics()
    assert stats.sessions_ended == {EndReason.NODE_STOPPED.value: 1} and stats.active_sessions == 0
    assert shard.removed == [0] and [s.closed for s in shard.samplers] == [1]
    assert stats.leases.slots_free == 2 and stats.leases.kv_reserved_tokens == 0


@pytest.mark.parametrize(
    ("named", "code", "says"),
    [
        (RECIPE, StatusCode.UNAVAILABLE, "cannot reach the next hop"),  # past the check: it dials its next hop
        (b"o" * 8, StatusCode.FAILED_PRECONDITION, "another recipe"),
    ],
)
async def test_a_node_on_a_route_across_devices_runs_the_recipe_its_hop_names(
    named: bytes, code: StatusCode, says: str, autojump_clock: trio.testing.MockClock
) -> None:
    """core.Node._check_route: a plan across devices names each hop's recipe; the session names them together."""
    config = NodeConfig(
        layers=LAYERS, n_layer=8, artifact_fingerprint=ARTIFACT, recipe_fingerprint=RECIPE, n_slots=2, ctx_per_seq=64
    )
    node = Node(FakeShard(), config, NODE_ID, engine_thread=VirtualEngineThread())
    gpu = b"g" * 8
    hops = (Hop(NODE_ID, LAYERS, recipe_fingerprint=named), Hop(b"m" * 32, Span(4, 8), "127.0.0.1:9", "", b"", gpu))
    ident = attrs.evolve(_identity(), recipe_fingerprint=route_recipe([named, gpu]))
    assert ident.recipe_fingerprint != RECIPE  # the session's recipe is the route's, not this node's
    ours, theirs = memory_stream_pair()
    client = SeamConnection(ours, SeamEndpoint(ident, Direction.DOWNSTREAM, peer_shard=LAYERS))
    assert client.endpoint is not None
    opening = OpenRoute(client.endpoint.header(Phase.PREFILL), hops, Sampling(), (1, 2), 6)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            node.accept(theirs)
            await client.send(opening)
            answer = await client.receive()
            nursery.cancel_scope.cancel()
    assert isinstance(answer, Error) and answer.code == code and says in answer.message, answer


async def test_a_stream_that_arrives_while_the_node_stops_is_refused_with_unavailable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """core.Node.accept: "A stream that arrives while the node stops ... is refused with UNAVAILABLE"."""
    node = _node(FakeShard())
    ours, theirs = memory_stream_pair()
    client = SeamConnection(ours, SeamEndpoint(_identity(), Direction.DOWNSTREAM, peer_shard=LAYERS))
    assert client.endpoint is not None
    opening = OpenRoute(client.endpoint.header(Phase.PREFILL), (Hop(NODE_ID, LAYERS),), Sampling(), (1, 2), 60)
    late, late_peer = memory_stream_pair()
    refusal: list[StreamBroken] = []

    async def arrives_late() -> None:
        # the session's last notice waits on a client that reads nothing: the node is stopping meanwhile
        await trio.sleep(NOTICE_TIMEOUT / 2)
        node.accept(late)
        with pytest.raises(StreamBroken) as refused:
            await late_peer.receive()
        refusal.append(refused.value)

    with trio.fail_after(60):
        async with trio.open_nursery() as outside, trio.open_nursery() as nursery:
            await nursery.start(node.run)
            node.accept(theirs)
            await client.send(opening)
            await trio.sleep(1.0)  # generating, until the client's buffer is full
            assert node.statistics().active_sessions == 1
            outside.start_soon(arrives_late)
            nursery.cancel_scope.cancel()
    assert refusal and refusal[0].code is StatusCode.UNAVAILABLE and "stopping" in str(refusal[0])


async def test_a_probe_waits_for_a_slot_a_bounded_time_and_a_failed_probe_frees_its_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """core.Node.probe: "waiting up to ``patience`` s for one ... AdmissionError if no slot came free
    or the seed is bad"."""
    shard = FakeShard()
    node = _node(shard, slots=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        held = node.leases.acquire(8)
        assert held is not None
        started = trio.current_time()
        with pytest.raises(AdmissionError, match="no sequence slot"):
            await node.probe(1, patience=3.0)
        assert 2.5 <= trio.current_time() - started <= 3.0 + 1e-9
        held.release()
        node.batcher.retire(held.seq_id)
        with pytest.raises(AdmissionError, match="63-bit"):
            await node.probe(-1)
        assert node.leases.statistics().slots_free == 1  # the failed probe gave its slot back
        assert shard.removed == [0, 0]
        nursery.cancel_scope.cancel()


# --- the batcher's work between batches


class CountingEngine:
    """Records what ran on it, in order: each batch, each call."""

    is_head = is_tail = True

    def __init__(self, ran: list[str]) -> None:
        self.ran = ran

    def run(self, rows: Rows, *, samplers: Any = None, want_logits: bool = False) -> StepResult:
        self.ran.append(f"batch of {len(rows)}")
        return StepResult(np.zeros((len(rows), 4), np.float32), None, {}, STEP_SECONDS)

    def remove_sequence(self, seq_id: int) -> None:
        self.ran.append(f"remove {seq_id}")


async def _virtual(call: Callable[[], Any]) -> Any:
    await trio.sleep(STEP_SECONDS)
    return call()


def _step(seq: int, n: int) -> StepRequest:
    return StepRequest(seq, 0, tokens=np.arange(n, dtype=np.int32))


async def test_calls_on_the_engine_wait_for_the_batch_under_way_and_run_before_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """batcher.py: a probe (``exclusive``) and a read (``between_runs``) are "queued and done by the
    loop between runs"; a call's error goes to its caller, and a cancelled call not yet started is withdrawn."""
    ran: list[str] = []
    engine: Any = CountingEngine(ran)
    batcher = Batcher(engine, LeaseManager(4, 100), max_batch_tokens=64, runner=_virtual)

    def probe() -> str:
        ran.append("probe")
        return "answer"

    def read() -> str:
        ran.append("read")
        return "cells"

    def fails() -> None:
        raise ValueError("bad seed")

    answers: list[Any] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        async with trio.open_nursery() as work:
            work.start_soon(batcher.step, _step(0, 8))
            await trio.sleep(STEP_SECONDS / 5)  # the first batch is on the engine now

            async def call(fn: Callable[[], Any], exclusive: bool) -> None:
                answers.append(await (batcher.exclusive(fn) if exclusive else batcher.between_runs(fn)))

            work.start_soon(call, probe, True)
            await trio.sleep(STEP_SECONDS / 10)
            work.start_soon(call, read, False)
            await trio.sleep(STEP_SECONDS / 10)
            work.start_soon(batcher.step, _step(1, 8))
            with trio.move_on_after(STEP_SECONDS / 5):  # given up while the batch still runs: never run
                await batcher.exclusive(lambda: ran.append("withdrawn"))
        with pytest.raises(ValueError, match="bad seed"):
            await batcher.exclusive(fails)
        assert await batcher.exclusive(lambda: 7) == 7  # the batcher serves on
        nursery.cancel_scope.cancel()
    assert ran == ["batch of 8", "probe", "read", "batch of 8"]
    assert sorted(answers) == ["answer", "cells"]


# --- a session's idle watchdog


async def _a_head_before(
    next_hop: Callable[[SeamConnection, SeamEndpoint], Awaitable[None]], *, client_reads: bool = False
) -> tuple[RouteSession, float]:
    """A head session of 4 tokens after the prompt (1, 2, 3) whose next hop, the tail, ``next_hop``
    plays once the seam is open; the client sends nothing after its OpenRoute and reads what
    comes up where ``client_reads``. The session as it ended, and how long it ran."""
    ours, theirs = memory_stream_pair()
    down_ours, down_theirs = memory_stream_pair()
    first, second = Span(0, 2), Span(2, 4)
    hops = (Hop(NODE_ID, first), Hop(b"m" * 32, second))

    @attrs.define
    class Head(FakeNode):
        async def step(self, request: StepRequest) -> StepOutput:
            await trio.sleep(STEP_SECONDS)
            return StepOutput(np.zeros((request.n_rows, 8), np.float32), None, request.n_rows, STEP_SECONDS)

        async def connect(self, hop: Hop, open_route: OpenRoute) -> Any:
            return down_ours

    async def tail() -> None:
        conn = SeamConnection(down_theirs)
        opening = await conn.receive()
        assert isinstance(opening, OpenRoute)
        endpoint = SeamEndpoint(opening.header.identity.at(second), Direction.UPSTREAM, peer_shard=first)
        endpoint.receive(opening)
        conn.endpoint = endpoint
        with contextlib.suppress(TransportError):
            await next_hop(conn, endpoint)

    async def read(conn: SeamConnection) -> None:
        with contextlib.suppress(TransportError):
            while True:
                await conn.receive()

    client = SeamConnection(ours, SeamEndpoint(_identity(), Direction.DOWNSTREAM, peer_shard=first))
    assert client.endpoint is not None
    await client.send(OpenRoute(client.endpoint.header(Phase.PREFILL), hops, Sampling(), (1, 2, 3), 4))
    upstream, opening = await first_hop_seam(theirs, first)
    lease = LeaseManager(2, 64).acquire(7)
    assert lease is not None
    session = RouteSession(Head().context(), opening, 0, upstream, lease, object(), trio.current_time() + 600)
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tail)
        if client_reads:
            nursery.start_soon(read, client)
        await session.run()
        nursery.cancel_scope.cancel()
    assert session.end is not None
    return session, trio.current_time() - started


async def test_a_next_hop_that_sends_only_credits_does_not_keep_a_session_alive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """sessions._downstream_loop: a Credit, which no hop sends, is passed over and is not progress."""

    async def credits_only(conn: SeamConnection, endpoint: SeamEndpoint) -> None:
        async with trio.open_nursery() as inner:

            async def drain() -> None:
                with contextlib.suppress(TransportError):
                    while True:
                        await conn.receive()

            inner.start_soon(drain)
            while True:  # "flow control" every second, and never a token
                await trio.sleep(1.0)
                await conn.send(Credit(endpoint.header(Phase.DECODE), 4))

    session, took = await _a_head_before(credits_only)
    assert session.end is not None and session.end.reason is EndReason.IDLE, session.end
    assert took <= 30.0 * 1.5  # the idle timeout, not the 600 s deadline


async def test_a_client_that_never_releases_blames_nobody_downstream_once_every_step_is_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """sessions._downstream_loop: a head whose next hop answered every step it sent, and whose
    client then neither releases nor asks more, ends idle blaming nobody. It used to read its
    steps in flight before the answer took its step off them, so it still took itself for
    waiting on the next hop, and its Error named that honest hop as the one to avoid."""

    async def answers_each_step(conn: SeamConnection, endpoint: SeamEndpoint) -> None:
        drawn = 0
        while drawn < 4:
            step = await conn.receive()
            if not isinstance(step, Activations):
                continue
            span = step.header.positions
            at = span.end if step.header.phase is Phase.PREFILL else span.start + 1
            if step.header.phase is Phase.PREFILL and span.end < 3:
                continue  # a prompt chunk before the last
            drawn += 1
            # tokens the prompt does not hold: nothing for prompt lookup to draft from
            await conn.send(Tokens(endpoint.header(Phase.DECODE, Span(at, at + 1)), (100 + drawn,), drawn == 4))
        while True:  # alive, as a tail waiting for the Release is: a heartbeat now and then
            await trio.sleep(0.5)
            await conn.send(Credit(endpoint.header(Phase.DECODE), 4))

    session, took = await _a_head_before(answers_each_step, client_reads=True)
    assert session.end is not None and session.end.reason is EndReason.IDLE, session.end
    assert session.end.code is StatusCode.DEADLINE_EXCEEDED and session.end.blame is Blame.NONE, session.end
    assert took <= 30.0 * 1.5
