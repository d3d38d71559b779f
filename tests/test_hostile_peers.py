"""A route member that breaks the protocol fails its own session only; the node serves on.

Real shard nodes on real llama.cpp engines, in one process: the peers here are the test,
speaking encoded frames over in-memory streams as a hostile node would over the network.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio

from noderuntime.engine.llama import Recipe
from noderuntime.seams.client import USAGE_TIMEOUT, GenerationRequest, RouteError, open_route_generation, over_stream
from noderuntime.seams.connection import SeamConnection
from noderuntime.services.localroute import LocalRoute, open_local_route
from noderuntime.transport import FrameStream, StreamBroken, TransportError, memory_stream_pair
from protocol import (
    Activations,
    Credit,
    Direction,
    Error,
    Event,
    FrameEncoder,
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
    Usage,
)
from tests.conftest import engine_threads

THREADS = engine_threads()

pytestmark = pytest.mark.slow

RECIPE = Recipe(n_threads=THREADS, n_ctx_per_seq=512, n_seq_max=4, n_batch=256, n_ubatch=256)
PROMPT = (1, 504, 3937, 260, 2)
FAKE_TAIL = b"\xee" * 32


@pytest.fixture
async def route(smollm2: Path) -> AsyncIterator[LocalRoute]:
    async with open_local_route(smollm2, [0, 15, 30], RECIPE) as running:
        yield running


async def _idle(route: LocalRoute) -> None:
    with trio.fail_after(10):
        while any(await route.kv_cells_used()) or any(n.sessions for n in route.nodes):
            await trio.sleep(0.05)


async def _as_head_toward_the_tail(
    route: LocalRoute, max_tokens: int, speculate: int = 0
) -> tuple[SeamConnection, SeamEndpoint]:
    """A seam to the tail, opened as the head of ``route`` would open it."""
    head, tail = route.hops
    identity = Identity("hostile", os.urandom(16), 0, route.artifact, route.recipe, head.layers)
    endpoint = SeamEndpoint(identity, Direction.DOWNSTREAM, peer_shard=tail.layers)
    conn = SeamConnection(await route.network.connect(tail), endpoint)
    opening = OpenRoute(endpoint.header(Phase.PREFILL), route.hops, Sampling(), PROMPT, max_tokens, (), 0, b"")
    await conn.send(attrs.evolve(opening, speculate=speculate))
    return conn, endpoint


async def _answer(conn: SeamConnection) -> Event:
    """The next event from the tail that is not one of its heartbeats (Credit frames)."""
    with trio.fail_after(10):
        while isinstance(event := await conn.receive(), Credit):
            pass
    return event


async def test_a_step_larger_than_a_batch_is_refused_with_its_status(route: LocalRoute) -> None:
    """Once a session is open its seam takes no tensor larger than a batch of hidden states."""
    conn, endpoint = await _as_head_toward_the_tail(route, max_tokens=400)  # reserves 405 positions
    rows = RECIPE.n_batch + 44  # within the reservation, beyond what one batch takes
    hidden = np.zeros((rows, route.nodes[1].engine_n_embd), np.float32)
    await conn.send(Activations(endpoint.header(Phase.PREFILL, Span(0, rows)), (NamedTensor("hidden_states", hidden),)))
    refusal = await _answer(conn)
    assert isinstance(refusal, Error) and refusal.code == StatusCode.RESOURCE_EXHAUSTED, refusal
    assert "exceeds" in refusal.message
    await conn.aclose()
    await _idle(route)
    assert len((await route.generate(GenerationRequest(PROMPT, 4))).tokens) == 4


async def test_a_decode_step_of_several_rows_is_refused(route: LocalRoute) -> None:
    """The scheduler counts decode steps as one row each: a longer one could overfill a batch."""
    conn, endpoint = await _as_head_toward_the_tail(route, max_tokens=16)
    hidden = np.zeros((3, route.nodes[1].engine_n_embd), np.float32)
    await conn.send(Activations(endpoint.header(Phase.DECODE, Span(0, 3)), (NamedTensor("hidden_states", hidden),)))
    refusal = await _answer(conn)
    assert isinstance(refusal, Error) and refusal.code == StatusCode.INVALID_ARGUMENT, refusal
    await conn.aclose()
    await _idle(route)


@pytest.mark.parametrize("speculate", [0, 8], ids=["no-windows", "stale-then-a-gap"])
async def test_windows_that_follow_beyond_what_a_session_takes_are_refused(route: LocalRoute, speculate: int) -> None:
    """A window that follows another where the session takes none is refused; where it takes
    them, a stale one (its guess is not the token drawn last) is passed over unanswered, and a
    step at its end, which would leave a gap in the tail's KV, is refused."""
    conn, endpoint = await _as_head_toward_the_tail(route, max_tokens=16, speculate=speculate)
    width, n = route.nodes[1].engine_n_embd, len(PROMPT)

    def hidden(rows: int) -> tuple[NamedTensor, ...]:
        return (NamedTensor("hidden_states", np.zeros((rows, width), np.float32)),)

    await conn.send(Activations(endpoint.header(Phase.PREFILL, Span(0, n)), hidden(n)))
    first = await _answer(conn)
    assert isinstance(first, Tokens) and first.header.positions == Span(n, n + 1), first
    guess = (first.token_ids[0] + 1) % 1000  # not the token drawn last
    await conn.send(Activations(endpoint.header(Phase.DECODE, Span(n, n + 2)), hidden(2), (guess, 7), True))
    if speculate:
        await conn.send(Activations(endpoint.header(Phase.DECODE, Span(n + 2, n + 3)), hidden(1)))
    refusal = await _answer(conn)  # nothing answered the stale window
    expected = StatusCode.FAILED_PRECONDITION if speculate else StatusCode.OUT_OF_RANGE
    assert isinstance(refusal, Error) and refusal.code == expected, refusal
    await conn.aclose()
    await _idle(route)
    assert len((await route.generate(GenerationRequest(PROMPT, 4))).tokens) == 4


@pytest.mark.defects_expected
async def test_a_defect_met_in_one_session_fails_it_and_the_node_serves_on(
    route: LocalRoute, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception no check foresaw ends its session with INTERNAL, told to both peers; not the node."""
    node = route.nodes[1]
    real_step = node.batcher.step
    calls = 0

    async def step_with_a_defect(request: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a defect")
        return await real_step(request)

    # sessions reach the batcher through the context their node made for them
    monkeypatch.setattr(node, "_session_context", attrs.evolve(node._session_context, step=step_with_a_defect))
    with trio.fail_after(20), pytest.raises(RouteError) as failed:
        await route.generate(GenerationRequest(PROMPT, 4))
    assert failed.value.code == StatusCode.INTERNAL and "failed this session" in str(failed.value)
    await _idle(route)
    assert len((await route.generate(GenerationRequest(PROMPT, 4))).tokens) == 4


async def test_a_chunked_step_before_any_session_is_refused(route: LocalRoute) -> None:
    """Before admission a stream may not make the node hold the chunks of a large step."""
    identity = Identity("hostile", os.urandom(16), 0, route.artifact, route.recipe, Span(0, 15))
    hidden = np.zeros((64, route.nodes[1].engine_n_embd), np.float32)
    step = Activations(
        SeamEndpoint(identity, Direction.DOWNSTREAM).header(Phase.PREFILL, Span(0, 64)),
        (NamedTensor("hidden_states", hidden),),
    )
    frames = FrameEncoder(Limits(max_frame_bytes=16 << 10)).encode(step)
    assert len(frames) > 1
    stream = await route.network.connect(route.hops[1])
    await stream.send(frames[0])
    with trio.fail_after(5), pytest.raises(StreamBroken) as refused:
        await stream.receive()
    assert refused.value.code == StatusCode.INVALID_ARGUMENT
    assert "chunk" in str(refused.value)


async def test_streams_that_never_open_a_session_are_bounded(route: LocalRoute) -> None:
    head = route.nodes[0]
    idle = [await route.network.connect(route.hops[0]) for _ in range(head.config.max_opening)]
    one_more = await route.network.connect(route.hops[0])
    with trio.fail_after(5), pytest.raises(StreamBroken) as refused:
        await one_more.receive()
    assert refused.value.code == StatusCode.UNAVAILABLE
    for stream in idle:
        await stream.aclose()
    with trio.fail_after(5):
        while head._opening:
            await trio.sleep(0.02)
    assert len((await route.generate(GenerationRequest(PROMPT, 4))).tokens) == 4


async def test_one_address_holds_at_most_its_share_of_the_opening_streams(route: LocalRoute) -> None:
    """Once half the places for opening streams are taken, an address that holds its share
    gets no more: one address no longer holds them all, and sessions from elsewhere open."""
    head, config = route.nodes[0], route.nodes[0].config
    half, share = config.max_opening // 2, config.max_opening_per_source

    async def fill(address: str) -> list[FrameStream]:
        """Empty streams from ``address`` until the node refuses one, naming the address."""
        held = []
        while True:
            opening = head._opening
            stream = await route.network.connect(route.hops[0], source=address)
            if head._opening > opening:  # the node takes a stream or refuses it as it is accepted
                held.append(stream)
                continue
            with trio.fail_after(5), pytest.raises(StreamBroken) as refused:
                await stream.receive()
            assert refused.value.code == StatusCode.UNAVAILABLE and f"from {address}" in str(refused.value)
            return held

    first = await fill("198.51.100.7")  # alone, it goes past its share until half are taken
    assert len(first) == half
    second = await fill("203.0.113.9")  # past half, a newcomer gets its share
    assert len(second) == share and head._opening == half + share < config.max_opening
    with trio.fail_after(30):
        assert len((await route.generate(GenerationRequest(PROMPT, 4))).tokens) == 4  # from neither
    for stream in first + second:
        await stream.aclose()
    with trio.fail_after(5):
        while head._opening:
            await trio.sleep(0.02)
    assert not head._opening_from


class _HostileTail:
    """Takes the head's session and answers its prefill with one bad Tokens frame."""

    def __init__(self, nursery: trio.Nursery, answer: tuple[int, int, bool]) -> None:
        self.node_id = FAKE_TAIL
        self._nursery: trio.Nursery | None = nursery  # what the in-process network checks
        self.answer = answer  # (token id, position, finished)
        self.told: list[Event] = []

    def accept(self, stream: FrameStream) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._serve, stream)

    async def _serve(self, stream: FrameStream) -> None:
        conn = SeamConnection(stream)
        opening = await conn.receive()
        assert isinstance(opening, OpenRoute)
        ident = opening.header.identity
        endpoint = SeamEndpoint(attrs.evolve(ident, shard=Span(15, 30)), Direction.UPSTREAM, peer_shard=ident.shard)
        endpoint.receive(opening)
        conn.endpoint = endpoint
        while True:
            step = await conn.receive()
            if isinstance(step, Activations) and step.header.positions.end == len(opening.prompt_tokens):
                break
        token, position, finished = self.answer
        await conn.send(Tokens(endpoint.header(Phase.DECODE, Span(position, position + 1)), (token,), finished))
        with trio.move_on_after(5), contextlib.suppress(TransportError):
            while True:
                self.told.append(await conn.receive())  # until the head ends the seam


@pytest.mark.parametrize(
    "answer",
    [(10**6, len(PROMPT), False), (-1 & 0x7FFFFFFF, len(PROMPT), False), (42, len(PROMPT) + 2, False)],
    ids=["beyond-the-vocabulary", "huge-id", "past-the-reservation"],
)
async def test_bad_tokens_from_the_next_hop_fail_that_session_only(
    route: LocalRoute, answer: tuple[int, int, bool]
) -> None:
    hops = (route.hops[0], Hop(FAKE_TAIL, Span(15, 30)))
    innocent = GenerationRequest(PROMPT, 24)
    expected = (await route.generate(innocent)).tokens
    async with trio.open_nursery() as nursery:
        hostile = _HostileTail(nursery, answer)
        route.network.nodes[FAKE_TAIL] = hostile  # type: ignore[assignment]
        results: list[tuple[int, ...]] = []

        async def run_innocent() -> None:
            results.append((await route.generate(innocent)).tokens)

        nursery.start_soon(run_innocent)
        stream, theirs = memory_stream_pair()
        route.nodes[0].accept(theirs)
        request = GenerationRequest(PROMPT, 2)  # reserves len(PROMPT) + 2 positions
        with trio.fail_after(20), pytest.raises(RouteError) as failed:
            async with open_route_generation(
                over_stream(stream), hops, request, artifact=route.artifact, recipe=route.recipe
            ) as gen:
                while await gen.next() is not None:
                    pass
        assert failed.value.code == StatusCode.UNAVAILABLE
        assert "broke the protocol" in str(failed.value)
    # the head told the hostile tail why it ended the session, and the innocent session
    # batched beside it on the head ran to its end
    assert [type(e) for e in hostile.told] == [Error] and hostile.told[0].code == StatusCode.OUT_OF_RANGE
    assert results == [expected]
    await _idle(route)


async def test_a_stream_that_arrives_when_the_node_is_not_running_is_dropped_not_raised(
    smollm2: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Transports hand streams over from callbacks that must not fail (one ends the trio run)."""
    caplog.set_level(logging.INFO, logger="noderuntime")
    async with open_local_route(smollm2, [0, 30], RECIPE) as running:
        node = running.nodes[0]
    caplog.clear()
    ours, theirs = memory_stream_pair()
    node.accept(theirs)
    # dropped: nothing started for it, nothing counted opening (that count bounds the streams a node
    # takes: one left in it would hold a place for ever); refused as a stopped node refuses, with no
    # nursery left to tell the peer why, and the node said so
    assert node._opening == 0 and not node.sessions
    said = [r.getMessage() for r in caplog.records]
    dropped = "dropped a seam that arrived while the node was not running"
    assert said == ["refused a seam: the node is stopping", dropped], said
    await ours.aclose()  # its transport closes it, not the node


async def test_a_client_that_stops_reading_times_out_without_blaming_the_next_hop(
    smollm2: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its tokens back up into the head, whose watchdog names the previous hop, not the next.

    (The client cannot be told: it reads nothing. The blame shows in the nodes' logs and
    metrics, where an operator looks for the hop at fault.)
    """
    caplog.set_level(logging.INFO, logger="noderuntime")
    async with open_local_route(smollm2, [0, 15, 30], RECIPE, idle_timeout=1.0) as running:
        stream = await running.network.connect(running.hops[0])
        request = GenerationRequest(PROMPT, 200)
        with trio.fail_after(20), pytest.raises(RouteError):
            async with open_route_generation(
                over_stream(stream), running.hops, request, artifact=running.artifact, recipe=running.recipe
            ) as gen:
                await trio.sleep(4)  # reads nothing while the route produces
                while await gen.next() is not None:
                    pass
        await _idle(running)
    # the head blames the client; the tail, waiting for a next step, saw no progress
    ended = [r.getMessage() for r in caplog.records if "ended: idle" in r.getMessage()]
    assert any("the previous hop read nothing" in line for line in ended), ended
    assert not any("next hop" in line for line in ended), ended


async def test_a_head_that_answers_out_of_turn_fails_the_client_at_once() -> None:
    """A head that sends usage records before any Release is broken: the client does not wait on it.

    The client would otherwise release the session and wait for records a broken head may
    never send, holding its caller (the gateway's request) for the usage timeout.
    """
    client_end, head_end = memory_stream_pair()
    session, artifact, recipe = os.urandom(16), b"a" * 32, b"r" * 8
    head_span = Span(0, 15)
    request = GenerationRequest(PROMPT, 8)
    endpoint = SeamEndpoint(Identity("", session, 0, artifact, recipe, head_span), Direction.UPSTREAM)
    head = SeamConnection(head_end, endpoint)

    async def broken_head() -> None:
        assert isinstance(await head.receive(), OpenRoute)
        await head.send(Usage(endpoint.header(Phase.RELEASE), ()))

    with trio.fail_after(USAGE_TIMEOUT / 2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(broken_head)
            hops = (Hop(b"\x01" * 32, head_span),)
            async with open_route_generation(
                over_stream(client_end), hops, request, artifact=artifact, recipe=recipe, session_id=session
            ) as gen:
                with pytest.raises(RouteError) as info:
                    while await gen.next() is not None:
                        pass
                # and leaves the session normally, as a caller that goes on to another route does
    assert info.value.code == StatusCode.INTERNAL and gen.failed
