"""Access control, one rule per test, against real node and relay processes.

A route of two nodes — the head on gRPC, the tail reachable only through the relay —
trusts one ticket issuer. Whoever does not hold a valid ticket for a session cannot
open it on a shard, cannot join a relay pair, and cannot read another session's frames.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from noderuntime.access.identity import Identity, channel_keys
from noderuntime.access.signing import sign
from noderuntime.access.tickets import MAGIC, issue
from noderuntime.seams.client import GenerationRequest, RouteError
from noderuntime.seams.dialer import open_dialer
from noderuntime.testing.clusters import Cluster, running_cluster
from noderuntime.transport import StreamBroken
from noderuntime.transport.relay_client import RelayDialer
from noderuntime.transport.sealed import seal_dialer
from protocol import Hop, Span, StatusCode
from protocol.channel import Binding

pytestmark = pytest.mark.slow
REQUEST = GenerationRequest((1, 504, 3937, 260, 2), 24)


@pytest.fixture(scope="module")
def cluster(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(smollm2, [0, 15, 30], tmp_path_factory.mktemp("access"), relay_only=[1]) as running:
        yield running


async def _attempt(
    cluster: Cluster, ticket: bytes, session: bytes, *, hops: tuple[Hop, ...] | None = None, artifact: bytes = b""
) -> StatusCode:
    async with open_dialer(identity=cluster.client) as dialer:
        dialer.local_swarm = True  # the tickets here are the test's: the nodes, not the dialler, judge them
        try:
            async with cluster.open(
                dialer, REQUEST, session_id=session, ticket=ticket, hops=hops, artifact=artifact or None
            ) as gen:
                while await gen.next() is not None:
                    pass
        except RouteError as exc:
            return exc.code
    return StatusCode.OK


async def test_a_session_without_a_ticket_is_refused(cluster: Cluster) -> None:
    assert await _attempt(cluster, b"", os.urandom(16)) == StatusCode.UNAUTHENTICATED
    await cluster.wait_idle()


async def test_a_ticket_signed_by_another_key_is_refused(cluster: Cluster) -> None:
    session = os.urandom(16)
    forged = cluster.ticket(session, issuer=Identity.generate())
    assert await _attempt(cluster, forged, session) == StatusCode.UNAUTHENTICATED


async def test_an_altered_ticket_is_refused(cluster: Cluster) -> None:
    session = os.urandom(16)
    altered = bytearray(cluster.ticket(session))
    altered[20] ^= 1
    assert await _attempt(cluster, bytes(altered), session) == StatusCode.UNAUTHENTICATED


async def test_an_expired_ticket_is_refused(cluster: Cluster) -> None:
    session = os.urandom(16)
    assert await _attempt(cluster, cluster.ticket(session, ttl=-5), session) == StatusCode.PERMISSION_DENIED


async def test_a_replayed_ticket_is_refused(cluster: Cluster) -> None:
    session = os.urandom(16)
    ticket = cluster.ticket(session)
    assert await _attempt(cluster, ticket, session) == StatusCode.OK
    assert await _attempt(cluster, ticket, session) == StatusCode.PERMISSION_DENIED
    await cluster.wait_idle()


async def test_a_ticket_for_another_session_is_refused(cluster: Cluster) -> None:
    ticket = cluster.ticket(os.urandom(16))
    assert await _attempt(cluster, ticket, os.urandom(16)) == StatusCode.PERMISSION_DENIED


async def test_a_ticket_for_another_route_is_refused(cluster: Cluster) -> None:
    session = os.urandom(16)
    elsewhere = (Hop(Identity.generate().node_id, Span(0, 15)), cluster.hops[1])
    ticket = cluster.ticket(session, hops=elsewhere)
    assert await _attempt(cluster, ticket, session) == StatusCode.PERMISSION_DENIED


async def test_a_ticket_for_another_model_is_refused(cluster: Cluster) -> None:
    session = os.urandom(16)
    ticket = issue(cluster.issuer, session_id=session, epoch=0, artifact=os.urandom(32), hops=cluster.hops, local=True)
    assert await _attempt(cluster, ticket, session) == StatusCode.PERMISSION_DENIED


async def test_a_relay_pair_needs_a_valid_ticket(cluster: Cluster) -> None:
    assert cluster.relay_info is not None
    tail = cluster.hops[1]
    session = os.urandom(16)
    async with trio.open_nursery() as nursery:
        dialer = RelayDialer(nursery, channel_keys(Identity.generate()))
        for ticket in (b"", os.urandom(200), cluster.ticket(session, issuer=Identity.generate())):
            with pytest.raises(StreamBroken) as refused:
                await dialer.dial(cluster.relay_info.url, tail.node_id, session_id=session, epoch=0, ticket=ticket)
            assert refused.value.code == StatusCode.PERMISSION_DENIED
        # a ticket for the session that names another node is not a ticket to this one
        wrong = issue(
            cluster.issuer, session_id=session, epoch=0, artifact=cluster.artifact, hops=cluster.hops[:1], local=True
        )
        with pytest.raises(StreamBroken) as refused:
            await dialer.dial(cluster.relay_info.url, tail.node_id, session_id=session, epoch=0, ticket=wrong)
        assert refused.value.code == StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("hop", [0, 1], ids=["grpc", "relay"])
async def test_a_seam_whose_first_frame_is_not_a_frame_gets_a_typed_status_at_once(cluster: Cluster, hop: int) -> None:
    """Bytes that never become a session leave no Error frame to send; the seam's sealed end carries the status."""
    from noderuntime.transport.grpc import AsyncioThread, GrpcConnector

    session = os.urandom(16)
    keys = channel_keys(cluster.client)
    async with trio.open_nursery() as nursery:
        runtime = connector = None
        if hop == 0:
            runtime = AsyncioThread()
            connector = GrpcConnector(runtime, max_frame_bytes=1 << 20)
            binding = Binding(session, 0, keys.node_id, cluster.hops[0].node_id)
            raw = await connector.open(cluster.infos[0].address)
            stream: Any = await seal_dialer(raw, keys, binding, "the head")
        else:
            assert cluster.relay_info is not None
            stream = await RelayDialer(nursery, keys).dial(
                cluster.relay_info.url,
                cluster.hops[1].node_id,
                session_id=session,
                epoch=0,
                ticket=cluster.ticket(session),
            )
        try:
            await stream.send(b"\x00not a seam frame")
            started = time.monotonic()
            with trio.fail_after(2), pytest.raises(StreamBroken) as refused:
                await stream.receive()
            assert time.monotonic() - started < 1.0
            assert refused.value.code == StatusCode.INVALID_ARGUMENT, refused.value
            assert "malformed protobuf" in str(refused.value)
        finally:
            await stream.aclose()
            if connector is not None and runtime is not None:
                await connector.close()
                runtime.close()
    await cluster.wait_idle()


async def test_a_plaintext_seam_is_refused_with_the_reason(cluster: Cluster) -> None:
    """A dialer that skips the handshake (an old peer, or one started with --insecure-plaintext-seams) learns why."""
    from noderuntime.seams.network import NetworkConnector
    from noderuntime.transport.grpc import AsyncioThread, GrpcConnector

    runtime = AsyncioThread()
    connector = GrpcConnector(runtime, max_frame_bytes=1 << 20)
    try:
        plain = NetworkConnector(connector, None, channel_keys(cluster.client), plaintext=True)
        with pytest.raises(RouteError) as refused:
            await cluster.generate(plain, REQUEST)
        assert "accepts seams only sealed" in str(refused.value), refused.value
        assert "--insecure-plaintext-seams" in str(refused.value)
    finally:
        await connector.close()
        runtime.close()
    await cluster.wait_idle()


async def test_nobody_else_joins_or_reads_a_relayed_session(cluster: Cluster) -> None:
    assert cluster.relay_info is not None
    tail = cluster.hops[1]
    session = os.urandom(16)
    ticket = cluster.ticket(session)
    long = GenerationRequest(REQUEST.prompt_tokens, 200)
    async with open_dialer(identity=cluster.client) as dialer, trio.open_nursery() as nursery:
        tokens: list[int] = []

        async def legitimate() -> None:
            async with cluster.open(dialer, long, session_id=session, ticket=ticket) as gen:
                while (event := await gen.next()) is not None:
                    tokens.extend(event.token_ids)

        nursery.start_soon(legitimate)
        while len(tokens) < 3:
            await trio.sleep(0.02)
        relay = RelayDialer(nursery, channel_keys(Identity.generate()))
        # the same session's ticket, seen on the wire: it was used, so it opens nothing
        with pytest.raises(StreamBroken) as refused:
            await relay.dial(cluster.relay_info.url, tail.node_id, session_id=session, epoch=0, ticket=ticket)
        assert refused.value.code == StatusCode.PERMISSION_DENIED
        # a valid ticket of its own gets a seam of its own: none of the other session's frames
        other = os.urandom(16)
        stream = await relay.dial(
            cluster.relay_info.url, tail.node_id, session_id=other, epoch=0, ticket=cluster.ticket(other)
        )
        with trio.move_on_after(2.0) as silent:
            await stream.receive()
        assert silent.cancelled_caught
        await stream.aclose()
    assert len(tokens) == 200
    await cluster.wait_idle()


async def test_a_relay_control_connection_must_prove_the_key_it_claims(cluster: Cluster) -> None:
    from trio_websocket import ConnectionClosed, open_websocket_url

    from noderuntime.transport import relay_messages as messages

    assert cluster.relay_info is not None
    impostor = Identity.generate()
    async with open_websocket_url(cluster.relay_info.url + "/control") as ws:
        challenge = messages.decode(await ws.get_message(), messages.Challenge)
        # the tail's id, signed with another key: taking over its control connection fails
        signature = impostor.sign(messages.CONTROL_DOMAIN, challenge.nonce)
        await ws.send_message(messages.Hello(cluster.hops[1].node_id, signature).encode())
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
    assert closed.value.reason is not None and closed.value.reason.code == messages.CLOSE_UNAUTHENTICATED
    assert await _attempt(cluster, cluster.ticket(session := os.urandom(16)), session) == StatusCode.OK


async def test_bytes_that_break_json_parsers_end_one_connection_not_the_node_or_the_relay(cluster: Cluster) -> None:
    """Deep nesting raises RecursionError and 1e999 overflows int(): neither is a ValueError."""
    from trio_websocket import ConnectionClosed, open_websocket_url

    from noderuntime.transport import relay_messages as messages

    assert cluster.relay_info is not None
    url = cluster.relay_info.url
    nested = "[" * 3000  # a ticket must fit a 4096-byte OpenRoute field
    for path in ("/dial", "/control"):
        async with open_websocket_url(url + path) as ws:
            if path == "/control":
                messages.decode(await ws.get_message(), messages.Challenge)
            await ws.send_message(nested)
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
        assert closed.value.reason is not None and closed.value.reason.code == messages.CLOSE_POLICY
    overflowing = b'{"artifact":"00","epoch":1e999,"exp":1,"hops":[],"iss":"00","sid":"00"}'
    for body in (nested.encode(), overflowing):
        ticket = MAGIC + struct.pack(">H", len(body)) + body + bytes(64)
        assert await _attempt(cluster, ticket, os.urandom(16)) == StatusCode.UNAUTHENTICATED
        async with trio.open_nursery() as nursery:
            with pytest.raises(StreamBroken) as refused:
                await RelayDialer(nursery, channel_keys(Identity.generate())).dial(
                    url, cluster.hops[1].node_id, session_id=bytes(16), epoch=0, ticket=ticket
                )
        assert refused.value.code == StatusCode.PERMISSION_DENIED
    session = os.urandom(16)
    assert await _attempt(cluster, cluster.ticket(session), session) == StatusCode.OK
    await cluster.wait_idle()


async def test_a_route_plan_naming_undialable_addresses_fails_the_session_not_the_node(cluster: Cluster) -> None:
    """Tickets bind node ids and layers, not addresses: whatever a plan names, the head survives it."""
    head, tail = cluster.hops
    long_label = "a" * 64  # the resolver raises UnicodeError (a ValueError, not an OSError)
    for address, relay in [
        ("no-port", ""),
        ("", "http://relay:1"),
        ("host:99999", "ws://[::1"),
        (f"{long_label}:7000", ""),
        ("", f"ws://{long_label}:1"),
    ]:
        hops = (head, Hop(tail.node_id, tail.layers, address, relay))
        session = os.urandom(16)
        code = await _attempt(cluster, cluster.ticket(session, hops=hops), session, hops=hops)
        assert code == StatusCode.UNAVAILABLE, (address, relay, code)  # the route failed: another may serve
    session = os.urandom(16)
    assert await _attempt(cluster, cluster.ticket(session), session) == StatusCode.OK
    await cluster.wait_idle()


async def test_a_node_cannot_speak_for_another_at_the_tracker() -> None:
    import httpx

    from noderuntime.operations.httpserve import serve_http
    from noderuntime.tracker.app import Tracker

    from .test_tracker import _registration

    tracker = Tracker(Identity.generate(), local_swarm=True)
    victim, impostor = Identity.generate(), Identity.generate()
    bodies = {
        "/v1/nodes/register": _registration(victim),
        "/v1/nodes/heartbeat": {
            "node_id": victim.node_id.hex(),
            "active_sessions": 0,
            "free_slots": 0,
            "queue_depth": 0,
            "step_ms": 1.0,
        },
        "/v1/nodes/probe": {"node_id": victim.node_id.hex(), "seed": 1, "digest": "00" * 32, "sketch": [0.0] * 256},
    }
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        for i, (path, body) in enumerate(bodies.items()):
            data = json.dumps(body).encode()
            # a valid signature, but the impostor's own: it may speak only for its own id
            headers = sign(impostor, "POST", path, data, int(time.time() * 1000) + i)
            response = await client.post(
                url + path, content=data, headers={**headers, "content-type": "application/json"}
            )
            assert response.status_code == 403, (path, response.text)
        nursery.cancel_scope.cancel()
    assert victim.node_id not in tracker.state.nodes


def _grpc_messages(data: bytes, *, client_side: bool) -> list[bytes]:
    """Every gRPC message a tap reads out of one direction of an HTTP/2 connection's bytes."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    # parse as the far end would: it reads what ``client_side`` sent
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=not client_side, header_encoding=None))
    conn.initiate_connection()
    # the ends agreed on larger frames and windows than h2's defaults: take them as given
    conn.local_settings.update({h2.settings.SettingCodes.MAX_FRAME_SIZE: (1 << 24) - 1})
    conn.local_settings.acknowledge()
    if not client_side:  # the reader plays the client, whose call is stream 1
        conn.send_headers(1, [(b":method", b"POST"), (b":path", b"/"), (b":scheme", b"http"), (b":authority", b"x")])
    bodies: dict[int, bytearray] = {}
    for at in range(0, len(data), 1024):
        for event in conn.receive_data(data[at : at + 1024]):
            if isinstance(event, h2.events.DataReceived):
                bodies.setdefault(event.stream_id, bytearray()).extend(event.data)
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
    messages = []
    for body in bodies.values():
        at = 0
        while at + 5 <= len(body):
            size = struct.unpack(">I", body[at + 1 : at + 5])[0]
            messages.append(bytes(body[at + 5 : at + 5 + size]))
            at += 5 + size
    return messages


def _packed(tokens: tuple[int, ...] | list[int]) -> bytes:
    """Token ids as protobuf packs them (varints, back to back)."""
    out = bytearray()
    for token in tokens:
        while True:
            byte, token = token & 0x7F, token >> 7
            out.append(byte | (0x80 if token else 0))
            if not token:
                break
    return bytes(out)


async def test_a_tap_on_a_direct_seam_decodes_no_frame_and_reads_no_token(cluster: Cluster) -> None:
    """What a recording proxy between a gateway and a head sees of a session: sealed messages only."""
    from noderuntime.testing.linkproxy import link_proxy
    from protocol import Direction, FrameEncoder, OpenRoute, Phase, SeamEndpoint
    from protocol import Identity as SessionIdentity

    from .test_relay_e2e import _decoded

    prompt = (1, 504, 3937, 260, 17023, 9876, 12345, 2)
    head = cluster.hops[0]
    async with link_proxy(int(head.address.rsplit(":", 1)[1])) as proxy:
        proxy.record = True
        hops = (attrs.evolve(head, address=f"127.0.0.1:{proxy.port}"), *cluster.hops[1:])
        async with open_dialer(identity=cluster.client) as dialer:
            reply = await cluster.generate(dialer, GenerationRequest(prompt, 24), hops=hops)
    assert len(reply) == 24
    up = bytes(proxy.recorded[(0, "up")])
    down = bytes(proxy.recorded[(0, "down")])
    sent, received = _grpc_messages(up, client_side=True), _grpc_messages(down, client_side=False)
    # the tap parsed the connection: the handshake, the OpenRoute and a message a token or more
    assert len(sent) >= 3 and len(received) >= len(reply) // 2, (len(sent), len(received))
    assert _decoded(sent) == [] and _decoded(received) == []
    assert _packed(prompt) not in up and _packed(reply[:4]) not in down
    # the control: the same decoder reads a plaintext frame of this very session
    session = os.urandom(16)
    identity = SessionIdentity("req-tap", session, 0, cluster.artifact, cluster.recipe, Span(0, 15))
    header = SeamEndpoint(identity, Direction.DOWNSTREAM).header(Phase.PREFILL)
    sampling = GenerationRequest(prompt, 24).sampling
    event = OpenRoute(header, cluster.hops, sampling, prompt, 24, (), 0, cluster.ticket(session))
    plain = FrameEncoder().encode(event)[0]
    assert _packed(prompt) in plain and len(_decoded([plain])) == 1
