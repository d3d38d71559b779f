"""Relayed seams are sealed end to end: what a relay operator sees, and what tampering gets it.

Real node processes on loopback — SmolLM2 split 0:15 / 15:30, the head reachable
directly and through the relay, the tail only through the relay — and a relay that is
the project's own with its forwarding patched (``tests/hostile_relay.py``), its attack
switched between tests. The test process plays the gateway.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import trio

from noderuntime.access.identity import Identity, channel_keys
from noderuntime.seams.client import GenerationRequest, RouteError
from noderuntime.seams.dialer import open_dialer
from noderuntime.services.cluster import ManagedProcess
from noderuntime.services.ready import RelayReady, expect
from noderuntime.testing.clusters import Cluster, running_cluster
from noderuntime.transport import FrameStream, StreamBroken
from noderuntime.transport.relay_client import RelayDialer, RelayListener
from protocol import (
    Direction,
    Error,
    Event,
    FrameDecoder,
    FrameEncoder,
    Hop,
    OpenRoute,
    Phase,
    ProtocolError,
    SeamEndpoint,
    Span,
    StatusCode,
)
from protocol import Identity as SessionIdentity
from tests.hostile_relay import read_tap

pytestmark = pytest.mark.slow
REQUEST = GenerationRequest((1, 504, 3937, 260, 2), 16)
IDLE_TIMEOUT = 3.0


@attrs.frozen
class Rig:
    cluster: Cluster
    mode: Path
    tap: Path
    url: str

    def attack(self, mode: str) -> None:
        self.mode.write_text(mode)


@pytest.fixture(scope="module")
def rig(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    root = tmp_path_factory.mktemp("e2e")
    issuer = Identity.generate()
    mode, tap = root / "mode", root / "tap"
    relay = ManagedProcess(
        "hostile-relay",
        ["--listen", "127.0.0.1:0", "--issuer-key", issuer.node_id.hex(), "--mode-file", str(mode), "--tap", str(tap)],
        module="tests.hostile_relay",
    )
    url = expect(relay.start(), RelayReady).url
    try:
        with running_cluster(
            smollm2,
            [0, 15, 30],
            root,
            relay_only=[1],
            with_relay=True,
            relay_url=url,
            issuer=issuer,
            # a relay that swallows a message leaves its session waiting: the watchdog ends it
            extra=["--idle-timeout", str(IDLE_TIMEOUT)],
        ) as cluster:
            yield Rig(cluster, mode, tap, url)
    finally:
        relay.stop()


async def _generate(rig: Rig, mode: str, request: GenerationRequest = REQUEST) -> tuple[list[int], StatusCode, str]:
    """The tokens a session got before it ended, and how it ended (status, message), with the relay in ``mode``."""
    rig.attack(mode)
    tokens: list[int] = []
    try:
        async with open_dialer() as dialer, rig.cluster.open(dialer, request) as gen:
            while (event := await gen.next()) is not None:
                tokens += event.token_ids
    except RouteError as exc:
        return tokens, exc.code, str(exc)
    finally:
        rig.attack("honest")
    return tokens, StatusCode.OK, ""


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return {}


async def _honest(rig: Rig, reference: dict[str, list[int]]) -> list[int]:
    if "tokens" not in reference:
        tokens, code, _ = await _generate(rig, "honest")
        assert code == StatusCode.OK and len(tokens) == REQUEST.max_tokens
        reference["tokens"] = tokens
    return reference["tokens"]


def _decoded(messages: list[bytes]) -> list[Event]:
    """Every event the project's own decoder gets out of ``messages``, as a relay operator would try."""
    events = []
    for message in messages:
        try:
            event = FrameDecoder().receive(message)
        except ProtocolError:
            continue
        if event is not None:
            events.append(event)
    return events


async def test_a_tap_on_the_relay_decodes_no_frame_and_no_token(rig: Rig, reference: dict[str, list[int]]) -> None:
    honest = await _honest(rig, reference)
    rig.tap.unlink(missing_ok=True)
    tokens, code, _ = await _generate(rig, "tap")
    assert (code, tokens) == (StatusCode.OK, honest)
    tapped = read_tap(rig.tap)
    assert len(tapped) > REQUEST.max_tokens  # the whole session passed the tap: a message a token and more
    # no frame, so no Tokens frame and none of the reply's token ids
    assert _decoded([message for _, message in tapped]) == []


async def test_an_unencrypted_dialer_is_refused_and_what_a_tap_would_have_read(rig: Rig) -> None:
    """An old peer's plaintext is readable by the relay, so a node refuses it (fail closed)."""
    cluster = rig.cluster
    session = os.urandom(16)
    rig.tap.unlink(missing_ok=True)
    rig.attack("tap")
    try:
        async with trio.open_nursery() as nursery:
            old = RelayDialer(nursery, channel_keys(Identity.generate()), plaintext=True)
            stream = await old.dial(
                rig.url, cluster.hops[1].node_id, session_id=session, epoch=0, ticket=cluster.ticket(session)
            )
            await stream.send(_open_route_frame(rig, session))
            with trio.fail_after(5), pytest.raises(StreamBroken) as refused:
                await stream.receive()
            await stream.aclose()
    finally:
        rig.attack("honest")
    assert refused.value.code == StatusCode.FAILED_PRECONDITION
    assert "only sealed" in str(refused.value)
    # the control: the same tap decodes a plaintext frame, so its silence above is the channel's doing
    assert [type(e) for e in _decoded([m for _, m in read_tap(rig.tap)])] == [OpenRoute]
    await cluster.wait_idle()


def _open_route_frame(rig: Rig, session: bytes) -> bytes:
    """The bytes of an OpenRoute for ``session``, as the head would send it to the tail."""
    cluster = rig.cluster
    identity = SessionIdentity("req-old", session, 0, cluster.artifact, cluster.recipe, Span(0, 15))
    event = OpenRoute(
        SeamEndpoint(identity, Direction.DOWNSTREAM).header(Phase.PREFILL),
        cluster.hops,
        REQUEST.sampling,
        REQUEST.prompt_tokens,
        REQUEST.max_tokens,
        (),
        0,
        cluster.ticket(session),
    )
    return FrameEncoder().encode(event)[0]


async def test_a_new_dialer_refuses_an_acceptor_that_does_not_speak_the_channel(rig: Rig) -> None:
    """An old node behind the relay (no handshake) is not served in plaintext: the dialer fails closed."""
    old_node = Identity.generate()
    streams: list[FrameStream] = []
    session = os.urandom(16)
    async with trio.open_nursery() as nursery:
        listener = RelayListener(rig.url, old_node, streams.append, plaintext=True)
        await nursery.start(listener.run)
        ticket = rig.cluster.ticket(session, hops=(rig.cluster.hops[0], Hop(old_node.node_id, Span(15, 30))))

        async def old_node_answers() -> None:
            # what an old node does with bytes that are no frame: refuse them with a status
            while not streams:
                await trio.sleep(0.01)
            try:
                FrameDecoder().receive(await streams[0].receive())
            except ProtocolError as exc:
                await streams[0].abort(exc.code, exc.message)

        nursery.start_soon(old_node_answers)
        dialer = RelayDialer(nursery, channel_keys(Identity.generate()))
        with trio.fail_after(10), pytest.raises(StreamBroken) as refused:
            await dialer.dial(rig.url, old_node.node_id, session_id=session, epoch=0, ticket=ticket)
        listener.stop()
        nursery.cancel_scope.cancel()
    # the old node's refusal came as a websocket close, which the relay could have written: the path's word
    assert refused.value.code == StatusCode.UNAVAILABLE
    assert "did not answer the seam handshake" in str(refused.value), refused.value


@pytest.mark.parametrize("attack", ["close-a:0", "close-a:1"], ids=["in-handshake", "before-first-frame"])
async def test_a_relay_close_before_the_peer_sealed_a_word_is_the_relays_not_the_peers(
    rig: Rig, reference: dict[str, list[int]], attack: str
) -> None:
    """A relay that closes with a status code claiming the node refused is reported as the path, UNAVAILABLE."""
    await _honest(rig, reference)
    tokens, code, message = await _generate(rig, attack)
    assert (tokens, code) == ([], StatusCode.UNAVAILABLE), message
    assert "PERMISSION_DENIED" in message and ("the path says" in message or "did not answer" in message), message
    await rig.cluster.wait_idle()


@pytest.mark.parametrize(
    "attack",
    [
        "flip-d:2",  # the OpenRoute, on its way to the tail
        "flip-a:1",  # the tail's first tokens, on their way back
        "inject-d:2",
        "drop-d:2",
        "reorder-d:2",
        "replay-a:1",
    ],
)
async def test_a_relay_that_tampers_with_a_session_ends_it_with_data_loss(
    rig: Rig, reference: dict[str, list[int]], attack: str
) -> None:
    honest = await _honest(rig, reference)
    tokens, code, message = await _generate(rig, attack)
    assert code == StatusCode.DATA_LOSS, (attack, code, message)
    assert "integrity" in message and "altered, dropped, reordered, replayed or injected" in message
    assert tokens == honest[: len(tokens)]  # nothing altered was accepted
    assert len(tokens) <= 1  # at most the token ahead of the replayed copy
    await rig.cluster.wait_idle()


@pytest.mark.parametrize("attack", ["flip-d:0", "flip-a:0", "flip-d:1"])
async def test_a_relay_that_tampers_with_the_handshake_gets_no_seam(
    rig: Rig, reference: dict[str, list[int]], attack: str
) -> None:
    """The route fails at its opening, as one whose hop cannot be reached: a gateway tries another."""
    await _honest(rig, reference)
    tokens, code, message = await _generate(rig, attack)
    assert (tokens, code) == ([], StatusCode.UNAVAILABLE), message
    # the head's dial fails (flip-d:0, flip-a:0), or its first frame meets the tail's refusal (flip-d:1):
    # at its send (the seam ended) or on the stream
    assert "cannot reach the next hop" in message or "went away" in message, message
    assert "did not verify" in message, message
    await rig.cluster.wait_idle()


async def _seam_corrupted(rig: Rig) -> float:
    """Sessions the nodes ended because a seam failed its integrity check, so far."""

    def fetch(url: str) -> float:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        line = 'noderuntime_sessions_ended_total{reason="seam_corrupted"} '
        return sum(float(row[len(line) :]) for row in text.splitlines() if row.startswith(line))

    return sum([await trio.to_thread.run_sync(fetch, info.http) for info in rig.cluster.infos])


async def test_a_relay_that_splices_two_sessions_ends_both(rig: Rig, reference: dict[str, list[int]]) -> None:
    honest = await _honest(rig, reference)
    long = attrs.evolve(REQUEST, max_tokens=64)
    results: list[tuple[list[int], StatusCode]] = []

    async def one() -> None:
        tokens: list[int] = []
        try:
            async with open_dialer() as dialer, rig.cluster.open(dialer, long) as gen:
                while (event := await gen.next()) is not None:
                    tokens += event.token_ids
        except RouteError as exc:
            results.append((tokens, exc.code))
            return
        results.append((tokens, StatusCode.OK))

    corrupted = await _seam_corrupted(rig)
    rig.attack("splice:12")
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
    finally:
        rig.attack("honest")
    # a spliced message opens on neither side: the hop it reached ends its session at once,
    # as corrupted; the one it was taken from when its next message fails too, when its pair
    # is cut with the other's, or when its watchdog sees it wait for a message that never
    # comes. The client hears DATA_LOSS when the hop's sealed close gets back to it, which the
    # relay forwards or not (and a loaded machine may give up on after its 0.5 s): UNAVAILABLE
    codes = [code for _, code in results]
    assert len(codes) == 2, results
    assert await _seam_corrupted(rig) > corrupted
    assert set(codes) <= {StatusCode.DATA_LOSS, StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED}, results
    for tokens, _ in results:
        assert tokens == honest[: len(tokens)] and len(tokens) < long.max_tokens
    await rig.cluster.wait_idle()


async def test_a_relay_that_pairs_the_wrong_node_gets_no_seam(rig: Rig) -> None:
    tokens, code, message = await _generate(rig, "wrong-node")
    assert (tokens, code) == ([], StatusCode.UNAVAILABLE), message
    assert "meant for another node" in message, message
    await rig.cluster.wait_idle()


async def test_the_acceptor_serves_only_the_dialer_its_ticket_names(rig: Rig) -> None:
    """The tail serves the head the ticket names; a stranger with the same ticket, nothing."""
    cluster = rig.cluster
    session = os.urandom(16)
    async with trio.open_nursery() as nursery:
        stranger = RelayDialer(nursery, channel_keys(Identity.generate()))
        stream = await stranger.dial(
            rig.url, cluster.hops[1].node_id, session_id=session, epoch=0, ticket=cluster.ticket(session)
        )
        await stream.send(_open_route_frame(rig, session))
        with trio.fail_after(5):
            answer = FrameDecoder().receive(await stream.receive())
        await stream.aclose()
    assert isinstance(answer, Error), answer
    assert answer.code == StatusCode.PERMISSION_DENIED and "puts before this node" in answer.message
    await cluster.wait_idle()


async def test_a_head_behind_a_relay_serves_only_the_client_its_ticket_names(rig: Rig) -> None:
    cluster = rig.cluster
    relayed = (attrs.evolve(cluster.hops[0], address="", relay=rig.url), cluster.hops[1])
    async with open_dialer() as dialer:
        # the ticket names this client: served through the relay, end to end
        tokens: list[int] = []
        async with cluster.open(dialer, REQUEST, hops=relayed) as gen:
            while (event := await gen.next()) is not None:
                tokens += event.token_ids
        assert len(tokens) == REQUEST.max_tokens
        for client in (b"", Identity.generate().node_id):  # none named, or another
            session = os.urandom(16)
            ticket = cluster.ticket(session, hops=relayed, client=client)
            with pytest.raises(RouteError) as refused:
                async with cluster.open(dialer, REQUEST, hops=relayed, session_id=session, ticket=ticket) as gen:
                    while await gen.next() is not None:
                        pass
            assert refused.value.code == StatusCode.PERMISSION_DENIED, refused.value
    await cluster.wait_idle()
