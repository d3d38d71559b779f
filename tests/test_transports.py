"""One conformance suite for every seam transport: memory, gRPC and the relay."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import socket
import ssl
import struct
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

from noderuntime.access.identity import Identity, channel_keys, self_signed, verify
from noderuntime.access.tickets import TicketVerifier, issue
from noderuntime.services.running import server_tls
from noderuntime.testing.linkproxy import LinkProxy, link_proxy
from noderuntime.testing.seams import KINDS, grpc_peer, seam
from noderuntime.transport import FrameStream, StreamBroken, StreamClosed, TransportError, sealed
from noderuntime.transport import relay_messages as messages
from noderuntime.transport.grpc import AsyncioThread, GrpcConnector, GrpcServer
from noderuntime.transport.relay_client import RelayDialer, RelayListener
from protocol import Hop, Limits, Span, StatusCode
from protocol.channel import MAGIC, Binding, ChannelClosed, ChannelKeys, DialerHandshake
from relay.server import Relay, RelayLimits, serve
from tests.protocol_helpers import open_route

UPGRADE = (
    "GET {} HTTP/1.1\r\nHost: relay\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


@pytest.mark.parametrize("kind", KINDS)
async def test_frames_pass_byte_identical_both_ways_in_order(kind: str) -> None:
    largest = Limits().max_frame_bytes  # the encoder's frames are never larger, and must all pass
    frames = [os.urandom(n) for n in (1, 100, 2442, 70_000, 1 << 20, largest, 3)]
    async with seam(kind) as (client, server):
        async with trio.open_nursery() as nursery:

            async def send_all(end: FrameStream) -> None:
                for frame in frames:
                    await end.send(frame)

            nursery.start_soon(send_all, client)
            nursery.start_soon(send_all, server)
            got_server = [await server.receive() for _ in frames]
            got_client = [await client.receive() for _ in frames]
        assert got_server == frames and got_client == frames
        # the accepting end knows the dialer's address where the seam is direct (a node counts
        # the streams one address has opening by it); a relayed seam comes from the relay
        assert server.source == ("127.0.0.1" if "grpc" in kind else "") and client.source == ""
        await client.aclose()
        await server.aclose()


@pytest.mark.parametrize("kind", KINDS)
async def test_many_frames_both_ways_with_readers_that_stall_and_run_lose_nothing(kind: str) -> None:
    """Buffers fill and drain over and over: every wait for room or for a frame is woken."""
    count = 1500
    async with seam(kind) as (client, server):

        async def send_all(end: FrameStream, tag: bytes) -> None:
            for i in range(count):
                await end.send(tag + i.to_bytes(4, "big") + bytes(i % 3000))

        async def receive_all(end: FrameStream, tag: bytes, got: list[int]) -> None:
            for i in range(count):
                if i % 200 == 0:
                    await trio.sleep(0.02)  # stall: the sender's buffers fill and it waits for room
                frame = await end.receive()
                assert frame[:1] == tag and len(frame) == 5 + int.from_bytes(frame[1:5], "big") % 3000
                got.append(int.from_bytes(frame[1:5], "big"))

        at_server: list[int] = []
        at_client: list[int] = []
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all, client, b"c")
                nursery.start_soon(send_all, server, b"s")
                nursery.start_soon(receive_all, server, b"c", at_server)
                nursery.start_soon(receive_all, client, b"s", at_client)
        assert at_server == list(range(count)) and at_client == list(range(count))
        await client.aclose()
        await server.aclose()


async def test_frames_that_cross_together_on_many_grpc_seams_each_reach_their_reader() -> None:
    """Sixteen seams on one connection, a frame on every one at once, both ways, over and over:
    the wake-ups that cross between the asyncio and trio threads together (one crossing for
    all that are ready) miss none of the readers, nor a sender waiting for room."""
    async with grpc_peer() as (connector, port, accepted):
        clients, servers = [], []
        for _ in range(16):
            clients.append(await connector.open(f"127.0.0.1:{port}"))
            servers.append(await accepted.receive())

        async def echo(end: FrameStream) -> None:
            with contextlib.suppress(TransportError):
                while True:
                    await end.send(await end.receive())

        async def round_trip(end: FrameStream, frame: bytes, frames: int) -> None:
            for _ in range(frames):  # more than a pipe holds: senders wait for room too
                await end.send(frame)
            for _ in range(frames):
                assert await end.receive() == frame

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for end in servers:
                    nursery.start_soon(echo, end)
                for i in range(40):
                    async with trio.open_nursery() as burst:
                        for j, end in enumerate(clients):
                            burst.start_soon(round_trip, end, bytes([i, j]) * 600, 1 + (i * j) % 12)
                nursery.cancel_scope.cancel()
        for end in clients + servers:
            await end.aclose()


async def test_a_peer_resetting_half_its_seams_mid_burst_stalls_none_of_the_others() -> None:
    """Sixteen seams; in every burst the dialer resets eight of them with frames in flight, as a
    hostile or dying peer would. The other eight get every frame back, and the serving ends of
    the reset ones end: a wake-up crossing with the others is never lost to an end."""
    from noderuntime.transport.grpc.stream import GrpcFrameStream

    async with grpc_peer() as (connector, port, accepted):
        ended = 0

        async def echo(end: FrameStream) -> None:
            nonlocal ended
            with contextlib.suppress(TransportError):
                while True:
                    await end.send(await end.receive())
            ended += 1

        async def round_trip(end: FrameStream, frame: bytes) -> None:
            for _ in range(6):
                await end.send(frame)
            for _ in range(6):
                assert await end.receive() == frame

        async def cut(end: FrameStream, frame: bytes) -> None:
            for _ in range(6):
                await end.send(frame)
            await trio.lowlevel.checkpoint()
            cast(GrpcFrameStream, end).reset()

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(10):
                    clients = []
                    for _ in range(16):
                        clients.append(await connector.open(f"127.0.0.1:{port}"))
                        nursery.start_soon(echo, await accepted.receive())
                    async with trio.open_nursery() as burst:
                        for j, end in enumerate(clients):
                            burst.start_soon(cut if j % 2 else round_trip, end, bytes([i, j]) * 600)
                    for end in clients:
                        await end.aclose()
                while ended < 160:  # every serving end, the reset ones' and the closed ones'
                    await trio.sleep(0.05)


@pytest.mark.parametrize("kind", KINDS)
async def test_two_tasks_sending_on_one_end_at_once_lose_nothing(kind: str) -> None:
    """A session's token forwarding and its closing notice may send at the same moment.

    The reader stalls so that both senders wait for room together, over and over.
    """
    count = 400
    async with seam(kind) as (client, server):

        async def send_all(tag: bytes) -> None:
            for i in range(count):
                await client.send(tag + i.to_bytes(4, "big") + bytes(4096))

        got: dict[bytes, list[int]] = {b"a": [], b"b": []}
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all, b"a")
                nursery.start_soon(send_all, b"b")
                for i in range(2 * count):
                    if i % 50 == 0:
                        await trio.sleep(0.01)
                    frame = await server.receive()
                    assert len(frame) == 5 + 4096
                    got[frame[:1]].append(int.from_bytes(frame[1:5], "big"))
        assert got == {b"a": list(range(count)), b"b": list(range(count))}
        await client.aclose()
        await server.aclose()


@pytest.mark.parametrize("kind", KINDS)
async def test_closing_one_end_ends_the_other(kind: str) -> None:
    async with seam(kind) as (client, server):
        await client.send(b"last words")
        await client.aclose()
        with trio.fail_after(10):
            assert await server.receive() == b"last words"
            with pytest.raises(TransportError):
                await server.receive()
            with pytest.raises(TransportError):
                for _ in range(50):  # a dead seam refuses sends (at once or after its buffer)
                    await server.send(b"x" * 1000)
                    await trio.sleep(0.01)
        await server.aclose()
        await server.aclose()  # idempotent


@pytest.mark.parametrize("kind", KINDS)
async def test_aborting_the_serving_end_tells_the_peer_its_status_at_once(kind: str) -> None:
    async with seam(kind) as (client, server):
        await client.send(b"not a frame")
        assert await server.receive() == b"not a frame"
        await server.abort(StatusCode.INVALID_ARGUMENT, "the first frame is not a seam frame")
        await server.abort(StatusCode.INVALID_ARGUMENT, "again")  # idempotent
        with trio.fail_after(1), pytest.raises(StreamBroken) as caught:
            await client.receive()
        assert caught.value.code == StatusCode.INVALID_ARGUMENT
        assert "the first frame is not a seam frame" in str(caught.value)
        with trio.fail_after(1), pytest.raises(TransportError):
            await client.send(b"more")  # and the seam takes nothing more
        await client.aclose()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_reader_that_stops_holds_back_the_sender(kind: str) -> None:
    frame = os.urandom(256 << 10)
    async with seam(kind) as (client, server):
        sent = 0
        with trio.move_on_after(1):
            while True:
                await client.send(frame)
                sent += 1
        # bounded buffers: far less than 1 s of loopback bandwidth (hundreds of MB) got through
        assert 0 < sent < 200, sent
        received = 0
        with trio.move_on_after(5):
            while received < sent:
                await server.receive()
                received += 1
        assert received == sent
        await client.aclose()
        await server.aclose()


@pytest.mark.parametrize("kind", KINDS)
async def test_cancelling_a_waiting_reader_then_closing_frees_the_peer(kind: str) -> None:
    async with seam(kind) as (client, server):
        with trio.move_on_after(0.2):
            await client.receive()
        await client.aclose()
        with trio.fail_after(10), pytest.raises(TransportError):
            await server.receive()


async def test_grpc_refuses_an_oversized_frame_before_buffering_it() -> None:
    async with grpc_peer(64 << 10) as (connector, port, streams):
        client = await connector.open(f"127.0.0.1:{port}")
        remote = await streams.receive()
        await client.send(b"x" * (1 << 20))
        with trio.fail_after(10), pytest.raises(StreamBroken) as info:
            await remote.receive()
        assert info.value.code == StatusCode.RESOURCE_EXHAUSTED
        with trio.fail_after(10), pytest.raises(TransportError):
            await client.receive()


async def test_a_hop_that_takes_the_stream_and_never_answers_costs_the_answer_timeout() -> None:
    """A next hop that accepted the seam's stream and stopped (a node under SIGSTOP: its kernel
    still accepts, its peer's gRPC stack still sends) fails the dial once the dialer's answer
    timeout (a node's hang timeout) has passed, not the acceptor's 10 s bound on the whole
    handshake: the route goes elsewhere that much sooner."""
    from noderuntime.seams.network import NetworkConnector

    async with grpc_peer() as (connector, port, streams):
        network = NetworkConnector(connector, None, channel_keys(Identity.generate()), answer_timeout=0.5)
        network.local_swarm = True  # the hop is on loopback
        hop = Hop(Identity.generate().node_id, Span(0, 15), f"127.0.0.1:{port}")
        started = trio.current_time()
        with trio.fail_after(5), pytest.raises(StreamBroken) as broken:
            await network.connect(hop, open_route())
        waited = trio.current_time() - started
        assert broken.value.code == StatusCode.UNAVAILABLE and "in 0.5 s" in str(broken.value), broken.value
        assert 0.5 <= waited < 3.0, waited
        held = await streams.receive()  # the stream reached the peer, which never read it
        await held.aclose()


async def test_grpc_one_address_holds_at_most_its_cap_of_connections() -> None:
    """Past the cap a node's seam server closes a new connection from the same address before a
    byte of HTTP/2; one that ends makes room. A stranger's idle connections otherwise held
    a descriptor each for as long as they answered keepalive pings."""
    runtime = AsyncioThread()
    server = GrpcServer(runtime, lambda stream: None, max_frame_bytes=1 << 20, per_host=2)
    try:
        port = await server.start("127.0.0.1", 0)

        async def settings_or_end(stream: trio.SocketStream) -> bytes:
            # an admitted connection hears the server's SETTINGS at once; a refused one, its end
            with trio.fail_after(5):
                try:
                    return bytes(await stream.receive_some())
                except trio.BrokenResourceError:
                    return b""  # reset

        held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
        for stream in held:
            assert await settings_or_end(stream) != b""
        extra = await trio.open_tcp_stream("127.0.0.1", port)
        assert await settings_or_end(extra) == b""
        await extra.aclose()
        assert server.connections.refused == 1
        await held.pop().aclose()
        await _until(lambda: server.connections.open["127.0.0.1"] == 1)
        again = await trio.open_tcp_stream("127.0.0.1", port)
        assert await settings_or_end(again) != b""
        for stream in [*held, again]:
            await stream.aclose()
    finally:
        await server.close()
        runtime.close()


async def _until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    with trio.fail_after(seconds):
        while not condition():
            await trio.sleep(0.01)


async def test_grpc_keepalive_finds_a_link_cut_long_after_the_connection_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from noderuntime.transport.grpc import wire

    monkeypatch.setattr(wire, "KEEPALIVE_SECONDS", 0.2)
    monkeypatch.setattr(wire, "KEEPALIVE_TIMEOUT", 0.5)
    async with grpc_peer() as (connector, port, streams), link_proxy(port) as proxy:
        client = await connector.open(f"127.0.0.1:{proxy.port}")
        await client.send(b"hello")
        server = await streams.receive()
        assert await server.receive() == b"hello"
        await trio.sleep(1.5)  # several pings answered on an idle seam
        proxy.mode = "stall"  # the link goes dark: no reset, no end, nothing
        with trio.fail_after(3), pytest.raises(TransportError):
            await client.receive()


async def test_grpc_tls_pins_the_certificate_the_route_names(tmp_path: Path) -> None:
    files = self_signed(tmp_path / "a")
    other = self_signed(tmp_path / "b")
    tls = server_tls(files.cert, files.key)
    async with grpc_peer(tls=tls) as (connector, port, streams), link_proxy(port) as proxy:
        address = f"127.0.0.1:{proxy.port}"
        client = await connector.open(address, tls_cert_sha256=files.cert_sha256)
        await client.send(b"over tls")
        assert await (await streams.receive()).receive() == b"over tls"
        # the certificate was fetched once (one connection), the seam has one and a spare waits
        await _until(lambda: proxy.connections == 3 and connector.spares == 1)
        again = await connector.open(address, tls_cert_sha256=files.cert_sha256)
        await again.send(b"pinned before")
        assert await (await streams.receive()).receive() == b"pinned before"
        # no second fetch: the seam took the spare, and only the next spare connected
        await _until(lambda: proxy.connections == 4)
        await trio.sleep(0.3)
        assert proxy.connections == 4
        with pytest.raises(StreamBroken) as info:
            await connector.open(address, tls_cert_sha256=other.cert_sha256)
        assert info.value.code == StatusCode.UNAUTHENTICATED
        await client.aclose()
        await again.aclose()


async def test_grpc_a_second_seam_to_a_peer_starts_on_a_connection_made_in_advance() -> None:
    async with grpc_peer() as (connector, port, streams), link_proxy(port) as proxy:
        address = f"127.0.0.1:{proxy.port}"
        first = await connector.open(address)
        # the seam's connection, then a spare (the connector holds it once it has connected)
        await _until(lambda: proxy.connections == 2 and connector.spares == 1)
        second = await connector.open(address)
        await second.send(b"s" * 70_000)
        remote = [await streams.receive(), await streams.receive()]
        assert await remote[1].receive() == b"s" * 70_000
        assert proxy.bytes_up[1] > 70_000 > proxy.bytes_up[0]  # it went over the spare
        # the peer drops every connection: the seams end, the spare is not handed out again
        await trio.to_thread.run_sync(proxy.drop)
        for stream in (first, second):
            with trio.fail_after(5), pytest.raises(TransportError):
                await stream.receive()
        await trio.sleep(0.2)
        third = await connector.open(address)
        await third.send(b"after the drop")
        assert await (await streams.receive()).receive() == b"after the drop"
        for stream in (first, second, third):
            await stream.aclose()


async def test_grpc_a_spare_on_a_link_gone_dark_is_not_handed_out() -> None:
    async with grpc_peer() as (connector, port, streams), link_proxy(port) as proxy:
        address = f"127.0.0.1:{proxy.port}"
        first = await connector.open(address)
        first_remote = await streams.receive()
        # the seam's connection, then a spare (the connector holds it once it has connected)
        await _until(lambda: proxy.connections == 2 and connector.spares == 1)
        proxy.mode = "stall"  # the links go dark: no reset, no end, nothing
        with trio.fail_after(3):
            second = await connector.open(address)
        # the spare did not answer its PING: the seam went over a connection of its own
        assert connector.spares_dropped == 1
        await _until(lambda: proxy.connections >= 3)
        proxy.mode = "pass"
        await second.send(b"s" * 70_000)
        with trio.fail_after(5):
            remote = await streams.receive()
            assert await remote.receive() == b"s" * 70_000
        assert proxy.bytes_up[2] > 70_000 > proxy.bytes_up[1]
        for stream in (first, first_remote, second, remote):
            await stream.aclose()


async def test_grpc_spare_connections_are_closed_with_the_connector() -> None:
    async with grpc_peer() as (connector, port, _), link_proxy(port) as proxy:
        seam_ = await connector.open(f"127.0.0.1:{proxy.port}")
        await _until(lambda: proxy.connections == 2)
        await seam_.aclose()
        await connector.close()
        await connector.close()  # idempotent
        await _until(lambda: not proxy.open_links)


async def test_grpc_a_seam_whose_peer_stops_reading_holds_up_no_other_seam() -> None:
    async with grpc_peer() as (connector, port, streams):
        stuck = await connector.open(f"127.0.0.1:{port}")
        stuck_remote = await streams.receive()
        # the peer never reads this seam: send until the sender is held back (every window
        # and buffer on the way is full) and a little longer
        sent = 0
        with trio.move_on_after(1):
            while True:
                await stuck.send(b"x" * (256 << 10))
                sent += 256 << 10
        assert 4 << 20 <= sent < 64 << 20  # held back past HTTP/2's windows, not buffered without bound
        # a new seam to the same peer still carries frames both ways at once
        with trio.fail_after(5):
            fresh = await connector.open(f"127.0.0.1:{port}")
            remote = await streams.receive()
            await fresh.send(b"a" * 70_000)
            assert await remote.receive() == b"a" * 70_000
            await remote.send(b"ok")
            assert await fresh.receive() == b"ok"
        # resetting the stuck seam ends it at the peer too (its connection is aborted)
        stuck.reset()
        with trio.fail_after(5), pytest.raises(TransportError):
            while True:
                await stuck_remote.receive()


async def test_grpc_a_seam_reset_while_held_back_is_freed_without_the_cyclic_collector() -> None:
    """An ended seam goes with its last reference: no cycle keeps it, and its unsent frames, for later.

    A reset ends the asyncio task that owns the HTTP/2 stream with an error whose traceback
    holds the pump and, through it, the seam; a seam that kept its task made a cycle, and a
    head whose next hop stopped reading held every prompt's activations until a full
    collection (25-31 MiB over eight waves of four prompts in the stalled-link fault test).
    """
    async with grpc_peer() as (connector, port, streams):
        stuck = await connector.open(f"127.0.0.1:{port}")
        remote = await streams.receive()
        with trio.move_on_after(0.5):
            while True:
                await stuck.send(b"x" * (256 << 10))
        ends = [weakref.ref(stuck), weakref.ref(remote)]
        gc.collect()
        gc.disable()  # what frees the seams now is their reference counts alone
        try:
            stuck.reset()
            with trio.fail_after(5), pytest.raises(TransportError):
                while True:
                    await remote.receive()
            await remote.aclose()
            del stuck, remote
            with trio.move_on_after(5):
                while any(end() is not None for end in ends):
                    await trio.sleep(0.05)
            assert [end() is None for end in ends] == [True, True]
        finally:
            gc.enable()


async def test_grpc_connect_failure_is_a_clear_unavailable() -> None:
    runtime = AsyncioThread()
    connector = GrpcConnector(runtime, max_frame_bytes=1 << 20)
    try:
        with pytest.raises(StreamBroken, match="cannot open a seam") as info:
            await connector.open("127.0.0.1:1")
        assert info.value.code == StatusCode.UNAVAILABLE
    finally:
        await connector.close()
        runtime.close()


async def test_relay_ends_a_seam_that_sends_a_message_over_the_largest_frame_and_serves_on() -> None:
    issuer, node = Identity.generate(), Identity.generate()
    relay = Relay(TicketVerifier([issuer.node_id]))
    accepted, streams = trio.open_memory_channel[FrameStream](4)
    largest = Limits().max_frame_bytes
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, relay, "127.0.0.1", 0)
        url = f"ws://127.0.0.1:{server.port}"
        await nursery.start(RelayListener(url, node, accepted.send_nowait).run)
        dialer = RelayDialer(nursery, channel_keys(Identity.generate()))

        async def dial() -> tuple[FrameStream, FrameStream]:
            session = os.urandom(16)
            hops = [Hop(node.node_id, Span(0, 1))]
            ticket = issue(issuer, session_id=session, epoch=0, artifact=b"a" * 32, hops=hops)
            stream = await dialer.dial(url, node.node_id, session_id=session, epoch=0, ticket=ticket)
            return stream, await streams.receive()

        with trio.fail_after(10):
            client, remote = await dial()
            await client.send(os.urandom(largest + 1))
            # the relay closes the sender's connection (1009) rather than assemble and forward
            # the message: the node's end only hears that its peer left (4410)
            with pytest.raises(StreamBroken, match="1009"):
                await client.receive()
            with pytest.raises(StreamBroken, match="4410"):
                await remote.receive()
            client, remote = await dial()
            frame = os.urandom(largest)
            await client.send(frame)
            assert await remote.receive() == frame
            await client.aclose()
        nursery.cancel_scope.cancel()


def _ticket(issuer: Identity, node: bytes, session: bytes, client: bytes) -> bytes:
    """A ticket for a one-hop route to ``node`` that lets ``client`` dial it."""
    return issue(issuer, session_id=session, epoch=0, artifact=b"a" * 32, hops=[Hop(node, Span(0, 1))], client=client)


@asynccontextmanager
async def _raw_relayed_seam(
    url: str, issuer: Identity, node: bytes, keys: ChannelKeys
) -> AsyncIterator[tuple[WebSocketConnection, DialerHandshake]]:
    """A websocket the relay paired with ``node``, before any handshake message: it and a dialer's handshake."""
    session = os.urandom(16)
    async with open_websocket_url(url + "/dial") as ws:
        await ws.send_message(messages.Dial(node, session, 0, _ticket(issuer, node, session, keys.node_id)).encode())
        messages.decode(await ws.get_message(), messages.Paired)
        yield ws, DialerHandshake(keys, Binding(session, 0, keys.node_id, node), verify)


def _status_of_close(exc: ConnectionClosed) -> str:
    """The status a relayed seam's websocket close names (it must name one)."""
    assert exc.reason is not None and messages.is_status_close(exc.reason.code), exc.reason
    return StatusCode.coerce(exc.reason.code - messages.CLOSE_STATUS_BASE).name


@pytest.mark.parametrize("broken", ["first-garbage", "first-small-order-key", "third", "record"])
async def test_relay_a_seam_sent_a_broken_message_at_any_stage_is_closed_at_once_with_a_status(broken: str) -> None:
    """A dialer's broken handshake message or sealed record: the acceptor's typed close comes back at once.

    At every stage it can tell, well within the handshake's timeout, and the node's listener
    serves on (a first message whose key no DH may use, which the acceptor meets only in its
    answer, once raised an untyped error that ended the listener, and with it the node).
    """
    issuer, node = Identity.generate(), Identity.generate()
    relay = Relay(TicketVerifier([issuer.node_id]))
    accepted, streams = trio.open_memory_channel[FrameStream](4)
    keys = channel_keys(Identity.generate())
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, relay, "127.0.0.1", 0)
        url = f"ws://127.0.0.1:{server.port}"
        listener = RelayListener(url, node, accepted.send_nowait)
        await nursery.start(listener.run)
        ended: str
        with trio.fail_after(sealed.HANDSHAKE_TIMEOUT / 2):
            async with _raw_relayed_seam(url, issuer, node.node_id, keys) as (ws, handshake):
                first = handshake.first()
                try:
                    if broken == "first-garbage":
                        await ws.send_message(MAGIC + os.urandom(40))
                    elif broken == "first-small-order-key":
                        await ws.send_message(first[: len(MAGIC)] + bytes(32) + first[len(MAGIC) + 32 :])
                    else:
                        await ws.send_message(first)
                        third = handshake.read_second(cast(bytes, await ws.get_message()))
                        if broken == "third":
                            await ws.send_message(third[:-1] + bytes([third[-1] ^ 1]))
                        else:
                            await ws.send_message(third)
                            channel = handshake.channel()
                            record = channel.seal(b"an opening")
                            await ws.send_message(record[:-1] + bytes([record[-1] ^ 1]))
                            remote = await streams.receive()
                            with pytest.raises(StreamBroken) as refused:
                                await remote.receive()  # the node's end refuses it, and says so sealed
                            assert refused.value.code == StatusCode.DATA_LOSS
                            with pytest.raises(ChannelClosed) as sealed_end:
                                channel.open(cast(bytes, await ws.get_message()))
                            ended = sealed_end.value.code.name
                    while broken != "record":  # the handshake's refusal is the websocket's close
                        await ws.get_message()
                except ConnectionClosed as exc:
                    ended = _status_of_close(exc)
        expected = {
            "first-garbage": "INVALID_ARGUMENT",
            "first-small-order-key": "INVALID_ARGUMENT",
            "third": "UNAUTHENTICATED",
            "record": "DATA_LOSS",
        }
        assert ended == expected[broken]
        # and the listener serves on: an honest dialer's seam opens
        with trio.fail_after(10):
            dialer = RelayDialer(nursery, keys)
            session = os.urandom(16)
            ticket = _ticket(issuer, node.node_id, session, keys.node_id)
            client = await dialer.dial(url, node.node_id, session_id=session, epoch=0, ticket=ticket)
            remote = await streams.receive()
            await client.send(b"frame")
            assert await remote.receive() == b"frame"
            await client.aclose()
        listener.stop()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("silent", ["from-the-start", "after-the-answer"])
async def test_relay_a_dialer_that_goes_silent_mid_handshake_is_closed_when_the_handshake_times_out(
    silent: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dialer that stops (as one whose first message changed where the acceptor cannot tell may):
    the acceptor's handshake timeout runs out, and it closes with DEADLINE_EXCEEDED."""
    monkeypatch.setattr(sealed, "HANDSHAKE_TIMEOUT", 0.5)
    issuer, node = Identity.generate(), Identity.generate()
    relay = Relay(TicketVerifier([issuer.node_id]))
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, relay, "127.0.0.1", 0)
        url = f"ws://127.0.0.1:{server.port}"
        listener = RelayListener(url, node, lambda _: None)
        await nursery.start(listener.run)
        with trio.fail_after(5):
            async with _raw_relayed_seam(url, issuer, node.node_id, channel_keys(Identity.generate())) as (ws, dial):
                if silent == "after-the-answer":
                    await ws.send_message(dial.first())
                    await ws.get_message()
                with pytest.raises(ConnectionClosed) as closed:
                    await ws.get_message()
        assert _status_of_close(closed.value) == "DEADLINE_EXCEEDED"
        assert listener.refused == 1
        listener.stop()
        nursery.cancel_scope.cancel()


async def test_relay_authenticates_controls_and_pairs_only_ticket_holders() -> None:
    issuer, node, impostor = Identity.generate(), Identity.generate(), Identity.generate()
    relay = Relay(TicketVerifier([issuer.node_id]), accept_timeout=2)
    accepted: list[FrameStream] = []
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, relay, "127.0.0.1", 0)
        url = f"ws://127.0.0.1:{server.port}"
        await nursery.start(RelayListener(url, node, accepted.append).run)
        dialer = RelayDialer(nursery, channel_keys(Identity.generate()))
        session = os.urandom(16)
        hops = [Hop(node.node_id, Span(0, 1))]

        async def dial(ticket: bytes, target: bytes = node.node_id, epoch: int = 0) -> StatusCode:
            try:
                stream = await dialer.dial(url, target, session_id=session, epoch=epoch, ticket=ticket)
            except StreamBroken as exc:
                return exc.code
            await stream.aclose()
            return StatusCode.OK

        good = issue(issuer, session_id=session, epoch=0, artifact=b"a" * 32, hops=hops)
        assert await dial(good) == StatusCode.OK
        assert await dial(good) == StatusCode.PERMISSION_DENIED  # replayed
        forged = issue(impostor, session_id=session, epoch=1, artifact=b"a" * 32, hops=hops)
        assert await dial(forged, epoch=1) == StatusCode.PERMISSION_DENIED
        expired = issue(issuer, session_id=session, epoch=2, artifact=b"a" * 32, hops=hops, ttl_seconds=-1)
        assert await dial(expired, epoch=2) == StatusCode.PERMISSION_DENIED
        elsewhere = issue(
            issuer, session_id=session, epoch=3, artifact=b"a" * 32, hops=[Hop(impostor.node_id, Span(0, 1))]
        )
        assert await dial(elsewhere, epoch=3) == StatusCode.PERMISSION_DENIED  # misdirected
        unknown = issue(
            issuer, session_id=session, epoch=4, artifact=b"a" * 32, hops=[Hop(impostor.node_id, Span(0, 1))]
        )
        assert await dial(unknown, target=impostor.node_id, epoch=4) == StatusCode.UNAVAILABLE  # not connected
        assert relay.statistics().refused.get("ticket", 0) == 4
        # a control connection must prove its key
        assert await _hello_with_wrong_signature(url, node.node_id) == 4401
        nursery.cancel_scope.cancel()
    assert len(accepted) == 1


async def test_relay_caps_its_nodes_and_the_handshakes_one_address_leaves_open() -> None:
    from trio_websocket import ConnectionRejected, open_websocket_url

    from noderuntime.transport import relay_messages as messages

    issuer, first, second = Identity.generate(), Identity.generate(), Identity.generate()
    limits = RelayLimits(max_nodes=1, max_handshakes_per_host=2)
    relay = Relay(TicketVerifier([issuer.node_id]), limits=limits, handshake_timeout=30)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, relay, "127.0.0.1", 0)
        url = f"ws://127.0.0.1:{server.port}"
        await nursery.start(RelayListener(url, first, lambda _: None).run)
        assert await _control_answer(url, second) == messages.CLOSE_BUSY  # the relay holds its one node
        async with open_websocket_url(url + "/control"), open_websocket_url(url + "/dial"):
            # two connections that never finish their handshake hold this address's share
            with pytest.raises(ConnectionRejected) as rejected:
                async with open_websocket_url(url + "/control"):
                    pass
            assert rejected.value.status_code == 429
        with trio.fail_after(5):  # closed, they free it; a proven node's connection never held it
            while relay.statistics().refused.get("host_handshakes") != 1 or relay.statistics().handshakes_open:
                await trio.sleep(0.01)
        assert await _control_answer(url, second) == messages.CLOSE_BUSY
        assert relay.statistics().nodes_connected == 1 and relay.statistics().refused["nodes"] == 2
        nursery.cancel_scope.cancel()
    with pytest.raises(ValueError, match="max_nodes"):
        RelayLimits(max_nodes=0)


async def test_relay_caps_the_nodes_one_address_holds() -> None:
    from noderuntime.transport import relay_messages as messages

    issuer, nodes = Identity.generate(), [Identity.generate() for _ in range(3)]
    relay = Relay(TicketVerifier([issuer.node_id]), limits=RelayLimits(max_nodes_per_host=2))
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, relay, "127.0.0.1", 0)
        url = f"ws://127.0.0.1:{server.port}"
        for node in nodes[:2]:
            await nursery.start(RelayListener(url, node, lambda _: None).run)
        assert await _control_answer(url, nodes[2]) == messages.CLOSE_BUSY
        assert await _control_answer(url, nodes[0]) == 0  # a node already there may replace its connection
        assert relay.statistics().refused == {"host_nodes": 1}
        nursery.cancel_scope.cancel()


async def test_a_connection_reset_before_its_upgrade_is_answered_ends_only_itself() -> None:
    issuer, node = Identity.generate(), Identity.generate()
    relay = Relay(TicketVerifier([issuer.node_id]))
    async with trio.open_nursery() as nursery:
        server = await nursery.start(functools.partial(serve, relay, "127.0.0.1", 0, connect_timeout=1.0))
        for path in ("/control", "/dial", "/accept/x", "/nowhere") * 5:
            with socket.socket() as raw:
                raw.connect(("127.0.0.1", server.port))
                raw.sendall(UPGRADE.format(path).encode())
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        await trio.sleep(0.5)
        assert await _control_answer(f"ws://127.0.0.1:{server.port}", node) == 0  # still serving
        # one reset before its request was read counts as unproven until the connect timeout
        await _until(lambda: relay.statistics().handshakes_open == 0, 5)
        nursery.cancel_scope.cancel()


async def _answer_from(address: str, port: int, request: bytes) -> bytes:
    """Send ``request`` from the local ``address`` to the relay; what it answers before closing."""
    sock = trio.socket.socket()
    await sock.bind((address, 0))
    await sock.connect(("127.0.0.1", port))
    async with trio.SocketStream(sock) as stream:
        await stream.send_all(request)
        answer = b""
        with trio.move_on_after(2):
            while b"\r\n\r\n" not in answer and (data := await stream.receive_some(4096)):
                answer += data
    return answer


async def test_a_relay_over_tls_serves_and_answers_connections_over_its_caps(tmp_path: Path) -> None:
    from trio_websocket import ConnectionRejected, open_websocket_url

    files = self_signed(tmp_path / "relay")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(files.cert, files.key)
    trusting = ssl.create_default_context(cafile=str(files.cert))
    trusting.check_hostname = False
    relay = Relay(TicketVerifier([Identity.generate().node_id]), limits=RelayLimits(max_handshakes_per_host=1))
    async with trio.open_nursery() as nursery:
        server = await nursery.start(functools.partial(serve, relay, "127.0.0.1", 0, tls=tls))
        url = f"wss://127.0.0.1:{server.port}"
        with pytest.raises(ConnectionRejected) as rejected:
            async with open_websocket_url(url + "/nowhere", trusting):
                pass
        assert rejected.value.status_code == 404  # the handler answered over TLS
        await _until(lambda: relay.statistics().handshakes_open == 0)
        silent = await trio.open_tcp_stream("127.0.0.1", server.port)
        await _until(lambda: relay.statistics().upgrades_awaited == 1)
        # over its address's share: a clear status over TLS too, before the request is read
        with trio.fail_after(5), pytest.raises(ConnectionRejected) as rejected:
            async with open_websocket_url(url + "/nowhere", trusting):
                pass
        assert rejected.value.status_code == 429
        assert relay.statistics().refused == {"host_handshakes": 1}
        await silent.aclose()
        nursery.cancel_scope.cancel()


async def test_connections_that_never_send_their_upgrade_hold_only_their_address_share() -> None:
    from trio_websocket import ConnectionRejected, open_websocket_url

    issuer, node = Identity.generate(), Identity.generate()
    relay = Relay(TicketVerifier([issuer.node_id]), limits=RelayLimits(max_handshakes_per_host=3))
    async with trio.open_nursery() as nursery:
        server = await nursery.start(functools.partial(serve, relay, "127.0.0.1", 0, connect_timeout=1.0))
        url = f"ws://127.0.0.1:{server.port}"
        silent = [await trio.open_tcp_stream("127.0.0.1", server.port) for _ in range(3)]
        await _until(lambda: relay.statistics().upgrades_awaited == 3)
        # they hold this address's share: the next connection gets a clear status before it says anything
        with pytest.raises(ConnectionRejected) as rejected:
            async with open_websocket_url(url + "/control"):
                pass
        assert rejected.value.status_code == 429
        assert relay.statistics().refused == {"host_handshakes": 1}
        # another address is served meanwhile
        assert (await _answer_from("127.0.0.2", server.port, UPGRADE.format("/nowhere").encode())).startswith(
            b"HTTP/1.1 404"
        )
        # the relay closes them at its connect timeout, and their share returns
        for stream in silent:
            with trio.fail_after(5):
                assert await stream.receive_some(1) == b""
            await stream.aclose()
        await _until(lambda: relay.statistics().handshakes_open == 0, 5)
        assert relay.statistics().upgrades_awaited == 0
        assert await _control_answer(url, node) == 0
        nursery.cancel_scope.cancel()


async def test_a_node_that_stops_answering_pings_loses_its_place_at_the_relay() -> None:
    issuer, node = Identity.generate(), Identity.generate()
    relay = Relay(TicketVerifier([issuer.node_id]), keepalive=0.3)
    proxy = LinkProxy()
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, relay, "127.0.0.1", 0)
        proxy.target = server.port
        await trio.to_thread.run_sync(proxy.start)  # its own trio, in its own thread
        try:
            # the node reaches the relay through a link that will go dead (no close, no reset)
            await nursery.start(RelayListener(f"ws://127.0.0.1:{proxy.port}", node, lambda _: None).run)
            await trio.sleep(1.0)  # pings answered: still there
            assert relay.statistics().nodes_connected == 1
            proxy.mode = "stall"
            with trio.fail_after(5):
                while relay.statistics().nodes_connected:
                    await trio.sleep(0.05)
            assert relay.statistics().refused["keepalive"] == 1
        finally:
            await trio.to_thread.run_sync(proxy.close)
        nursery.cancel_scope.cancel()


async def test_a_node_whose_relay_stops_answering_pings_connects_again() -> None:
    issuer, node = Identity.generate(), Identity.generate()
    relay = Relay(TicketVerifier([issuer.node_id]), keepalive=60)  # the relay alone would not notice yet
    proxy = LinkProxy()
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, relay, "127.0.0.1", 0)
        proxy.target = server.port
        await trio.to_thread.run_sync(proxy.start)
        try:
            listener = RelayListener(f"ws://127.0.0.1:{proxy.port}", node, lambda _: None, keepalive=0.3)
            await nursery.start(listener.run)
            first = relay.nodes[node.node_id]
            proxy.mode = "stall"
            with trio.fail_after(5):
                while listener.connected:
                    await trio.sleep(0.05)
            proxy.mode = "pass"
            with trio.fail_after(20):
                while not listener.connected or relay.nodes.get(node.node_id) in (None, first):
                    await trio.sleep(0.05)
        finally:
            await trio.to_thread.run_sync(proxy.close)
        nursery.cancel_scope.cancel()


async def _control_answer(url: str, identity: Identity) -> int:
    """A control handshake with a good signature: 0 when welcomed, else the relay's close code."""
    from trio_websocket import ConnectionClosed, open_websocket_url

    from noderuntime.transport import relay_messages as messages

    async with open_websocket_url(url + "/control") as ws:
        challenge = messages.decode(await ws.get_message(), messages.Challenge)
        signature = identity.sign(messages.CONTROL_DOMAIN, challenge.nonce)
        await ws.send_message(messages.Hello(identity.node_id, signature).encode())
        try:
            messages.decode(await ws.get_message(), messages.Welcome)
        except ConnectionClosed as exc:
            assert exc.reason is not None
            return exc.reason.code
    return 0


async def _hello_with_wrong_signature(url: str, claimed: bytes) -> int:
    from trio_websocket import ConnectionClosed, open_websocket_url

    from noderuntime.transport import relay_messages as messages

    async with open_websocket_url(url + "/control") as ws:
        messages.decode(await ws.get_message(), messages.Challenge)
        await ws.send_message(messages.Hello(claimed, bytes(64)).encode())
        try:
            await ws.get_message()
        except ConnectionClosed as exc:
            assert exc.reason is not None
            return exc.reason.code
    return 0


@pytest.mark.parametrize("impostor", ["substituted-key", "another-node"])
async def test_a_direct_seam_to_anyone_but_the_named_node_fails_before_a_frame(impostor: str) -> None:
    """Whoever answers at a hop's address must prove the node id the route names, or gets no frame."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from noderuntime.access.identity import x25519_public_bytes
    from protocol.channel import STATIC_KEY_DOMAIN

    honest, other = Identity.generate(), Identity.generate()
    if impostor == "substituted-key":
        # a man in the middle claims the honest node id with a handshake key of its own,
        # vouched for by its own node key: the only signature it can make
        static = X25519PrivateKey.generate()
        keys = ChannelKeys(honest.node_id, static, other.sign(STATIC_KEY_DOMAIN, x25519_public_bytes(static)))
    else:
        keys = channel_keys(other)  # a real node, answering at an address given for another
    dialer = channel_keys(Identity.generate())
    async with grpc_peer(1 << 20) as (connector, port, streams), trio.open_nursery() as nursery:
        raw = await connector.open(f"127.0.0.1:{port}")
        far_end = sealed.seal_acceptor(await streams.receive(), keys, "the dialer")
        heard: list[bytes] = []

        async def impostor_reads() -> None:
            with contextlib.suppress(StreamBroken, StreamClosed):
                heard.append(await far_end.receive())

        nursery.start_soon(impostor_reads)
        binding = Binding(os.urandom(16), 0, dialer.node_id, honest.node_id)
        with trio.fail_after(10), pytest.raises(StreamBroken) as refused:
            await sealed.seal_dialer(raw, dialer, binding, "the node at the hop's address")
    assert heard == []
    if impostor == "substituted-key":
        assert refused.value.code == StatusCode.UNAUTHENTICATED, refused.value
        assert "did not sign" in str(refused.value)
    else:  # the other node refuses a seam bound to someone else; its refusal is the path's word to the dialer
        assert refused.value.code == StatusCode.UNAVAILABLE, refused.value
        assert "meant for another node" in str(refused.value)
