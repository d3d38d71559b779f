"""Promises the docstrings of the seams, the client end of a route and a node's tracker link make,
each checked where no other test checked it: trio tasks over memory streams, fakes in place of
the node and the tracker, on the autojump clock (the node's own: tests/test_claims_memory.py)."""

from __future__ import annotations

import contextlib
from typing import Any

import httpx
import numpy as np
import pytest
import trio
import trio.testing

from noderuntime.access.identity import Identity as NodeKey
from noderuntime.seams.client import (
    USAGE_TIMEOUT,
    GenerationRequest,
    RouteError,
    open_route_generation,
    over_stream,
)
from noderuntime.seams.connection import NOTICE_TIMEOUT, SeamConnection
from noderuntime.testing.seams import first_hop_seam
from noderuntime.tracker.client import NodeLoad, TrackerLink
from noderuntime.tracker.messages import Registration
from noderuntime.transport import StreamBroken, StreamClosed, TransportError, memory_stream_pair
from protocol import (
    Activations,
    Cancel,
    Direction,
    Error,
    Event,
    Hop,
    Identity,
    Limits,
    NamedTensor,
    OpenRoute,
    Phase,
    Release,
    Sampling,
    SeamEndpoint,
    Span,
    StatusCode,
    Tokens,
    Usage,
    UsageRecord,
)

LAYERS = Span(0, 4)
NODE_ID = b"n" * 32
ARTIFACT, RECIPE = b"a" * 32, b"r" * 8


def _identity(shard: Span = Span()) -> Identity:
    return Identity("req", b"s" * 16, 0, ARTIFACT, RECIPE, shard)


# --- the seam connection


class ScriptedStream:
    """A frame stream whose ``send`` fails at the calls named (1 is the first)."""

    kind = "scripted"

    def __init__(self, *failing: int) -> None:
        self.failing = set(failing)
        self.calls = 0
        self.frames: list[bytes] = []

    async def send(self, frame: bytes) -> None:
        self.calls += 1
        if self.calls in self.failing:
            raise StreamBroken("reset")
        self.frames.append(frame)

    async def receive(self) -> bytes:
        await trio.sleep_forever()
        raise AssertionError

    async def aclose(self) -> None:
        pass

    async def abort(self, code: StatusCode, message: str) -> None:
        pass


def _client_seam(stream: Any, limits: Limits = Limits()) -> tuple[SeamConnection, SeamEndpoint]:
    endpoint = SeamEndpoint(_identity(), Direction.DOWNSTREAM, peer_shard=LAYERS)
    return SeamConnection(stream, endpoint, limits), endpoint


def _open_route(endpoint: SeamEndpoint) -> OpenRoute:
    return OpenRoute(endpoint.header(Phase.PREFILL), (Hop(NODE_ID, LAYERS),), Sampling(), (1, 2), 4)


async def test_an_event_that_never_left_did_not_happen_and_one_cut_off_breaks_the_seam() -> None:
    """connection.send: "nothing left: the event never happened; part of it left: the seam is unusable"."""
    stream = ScriptedStream(1)
    conn, endpoint = _client_seam(stream)
    opening = _open_route(endpoint)
    with pytest.raises(StreamBroken):
        await conn.send(opening)
    await conn.send(opening)  # the same step again: the state machine never counted the first
    assert len(stream.frames) == 1
    # a step of several frames cut off after its first: nothing more goes out on this seam
    stream = ScriptedStream(3)
    conn, endpoint = _client_seam(stream, Limits(max_frame_bytes=4096))
    await conn.send(_open_route(endpoint))
    rows = (NamedTensor("hidden_states", np.zeros((4, 1024), np.float32)),)
    with pytest.raises(StreamBroken, match="reset"):
        await conn.send(Activations(endpoint.header(Phase.PREFILL, Span(0, 4)), rows))
    with pytest.raises(StreamBroken, match="cut off"):
        await conn.send(Cancel(endpoint.header(Phase.CANCEL)))
    assert not await conn.notify(Cancel(endpoint.header(Phase.CANCEL)))  # a notice is best effort: no raise


async def test_a_notice_to_a_peer_that_does_not_read_gives_up_soon_and_close_is_idempotent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """connection.notify: "never waits long"; aclose: "idempotent, does not wait for the peer"."""
    ours, theirs = memory_stream_pair(buffer=1)
    conn, endpoint = _client_seam(ours)
    await conn.send(_open_route(endpoint))  # fills the peer's buffer: it reads nothing
    started = trio.current_time()
    with trio.fail_after(60):
        assert not await conn.notify(Cancel(endpoint.header(Phase.CANCEL), "bye"))
    assert trio.current_time() - started == pytest.approx(NOTICE_TIMEOUT) and NOTICE_TIMEOUT <= 1.0
    await conn.aclose()
    await conn.aclose()
    assert not await conn.notify(Cancel(endpoint.header(Phase.CANCEL), "bye"))
    assert trio.current_time() - started == pytest.approx(NOTICE_TIMEOUT)  # no wait after the close
    await theirs.receive()  # what was sent before the close is still read
    with pytest.raises(StreamClosed):
        await theirs.receive()


# --- the client end of a route


def _record() -> UsageRecord:
    return UsageRecord(b"{}", NODE_ID, b"s" * 64)


async def test_leaving_a_generation_releases_it_and_collects_usage_or_cancels_it_on_an_error() -> None:
    """client.py: "Leaving the block normally releases the session on every hop and collects the
    usage records; leaving it by an exception or cancellation cancels the session"."""
    for leave_by_error in (False, True):
        ours, theirs = memory_stream_pair()
        heard: list[Event] = []

        async def head(theirs: Any, heard: list[Event]) -> None:
            conn, _ = await first_hop_seam(theirs, LAYERS)
            assert conn.endpoint is not None
            await conn.send(Tokens(conn.endpoint.header(Phase.DECODE, Span(2, 3)), (7,), True, "length"))
            heard.append(await conn.receive())
            if isinstance(heard[-1], Release):
                await conn.send(Usage(conn.endpoint.header(Phase.RELEASE), (_record(),)))

        request = GenerationRequest((1, 2), 1, request_id="req")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(head, theirs, heard)
            with pytest.raises(ValueError) if leave_by_error else contextlib.nullcontext():
                async with open_route_generation(
                    over_stream(ours),
                    (Hop(NODE_ID, LAYERS),),
                    request,
                    artifact=ARTIFACT,
                    recipe=RECIPE,
                    session_id=b"s" * 16,
                ) as gen:
                    assert (await gen.next()) is not None and (await gen.next()) is None
                    if leave_by_error:
                        raise ValueError("the caller failed")
        if leave_by_error:
            assert isinstance(heard[0], Cancel) and gen.usage is None
        else:
            assert isinstance(heard[0], Release) and gen.usage == (_record(),)
            assert gen.tokens == [7] and gen.finish_reason == "length"


async def test_a_lost_usage_record_does_not_fail_a_generation_and_a_route_error_needs_no_release(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """client.py: usage "lost ... does not fail the request"; a route that ended the session with an
    Error is told nothing more (``failed``: nothing to release), and its error is typed."""
    request = GenerationRequest((1, 2), 1, request_id="req")
    hops = (Hop(NODE_ID, LAYERS),)
    for route_fails in (False, True):
        ours, theirs = memory_stream_pair()
        heard: list[Event | str] = []

        async def head(theirs: Any, heard: list[Event | str], route_fails: bool) -> None:
            conn, _ = await first_hop_seam(theirs, LAYERS)
            assert conn.endpoint is not None
            if route_fails:
                await conn.send(Error(conn.endpoint.header(Phase.CANCEL), StatusCode.RESOURCE_EXHAUSTED, "full", b"x"))
            else:
                await conn.send(Tokens(conn.endpoint.header(Phase.DECODE, Span(2, 3)), (7,), True, "stop"))
            try:
                heard.append(await conn.receive())
                await trio.sleep_forever()  # and never sends the usage
            except TransportError:
                heard.append("closed")

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(head, theirs, heard, route_fails)
            if route_fails:
                with pytest.raises(RouteError) as failed:
                    async with open_route_generation(
                        over_stream(ours), hops, request, artifact=ARTIFACT, recipe=RECIPE
                    ) as gen:
                        await gen.next()
                assert failed.value.code is StatusCode.RESOURCE_EXHAUSTED and failed.value.node_id == b"x"
            else:
                async with open_route_generation(
                    over_stream(ours), hops, request, artifact=ARTIFACT, recipe=RECIPE
                ) as gen:
                    await gen.next()
                assert gen.usage is None and gen.tokens == [7]
                assert trio.current_time() - started == pytest.approx(USAGE_TIMEOUT)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        assert heard and (isinstance(heard[0], Release) is not route_fails)


async def test_a_head_that_cannot_be_reached_is_a_route_error_with_the_transports_code() -> None:
    """client.open_route_generation: the connector's failure comes back typed, as a RouteError."""

    class Unreachable:
        async def connect(self, hop: Hop, open_route: OpenRoute) -> Any:
            raise TransportError("connection refused", StatusCode.UNAVAILABLE)

    request = GenerationRequest((1, 2), 1)
    with pytest.raises(RouteError, match="cannot reach the head") as failed:
        async with open_route_generation(
            Unreachable(), (Hop(NODE_ID, LAYERS),), request, artifact=ARTIFACT, recipe=RECIPE
        ):
            pytest.fail("no generation without a head")
    assert failed.value.code is StatusCode.UNAVAILABLE


# --- a node's tracker link


async def test_each_probe_the_tracker_sends_is_answered_once(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """client.TrackerLink: ``on_probe(seed)`` answers the tracker's known-answer probes."""
    me = NodeKey.generate()
    posted: list[str] = []

    def tracker(request: httpx.Request) -> httpx.Response:
        posted.append(request.url.path)
        if request.url.path == "/v1/nodes/register":
            return httpx.Response(200, json={"heartbeat_seconds": 60, "probe": {"seed": 5}})
        if request.url.path == "/v1/nodes/probe":
            refused = posted.count("/v1/nodes/probe") > 1  # the challenge was answered already
            return httpx.Response(409 if refused else 200, json={"passed": True, "detail": "exact"})
        return httpx.Response(200, json={"ok": True})

    real_client = httpx.AsyncClient
    # the link makes its own client: one whose transport is the fake tracker
    monkeypatch.setattr(httpx, "AsyncClient", lambda: real_client(transport=httpx.MockTransport(tracker)))
    registration = Registration(
        node_id=me.node_id.hex(),
        artifact="ab" * 32,
        n_layer=4,
        layers=(0, 4),
        recipe="0" * 16,
        address="127.0.0.1:1",
        slots=2,
        ctx_per_session=64,
        capability={"body": "{}", "signature": ""},
    )
    answered: list[int] = []

    async def on_probe(seed: int) -> dict[str, Any]:
        answered.append(seed)
        return {"seed": seed, "digest": "0" * 64, "sketch": [0.0]}

    link = TrackerLink("http://tracker", me, registration, lambda: NodeLoad(0, 2, 0, 1.0), on_probe=on_probe)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        await trio.sleep(1.0)  # well before the first heartbeat
        nursery.cancel_scope.cancel()
    assert posted[0] == "/v1/nodes/register"
    assert answered == [5] and link.probes_answered == 1
