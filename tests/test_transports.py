"""One conformance suite for every seam transport: memory, gRPC and the relay (the relay's own
handshakes, caps and pings: tests/test_relay_links.py)."""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import trio

from noderuntime.access.identity import Identity, channel_keys, self_signed
from noderuntime.services.running import server_tls
from noderuntime.testing.linkproxy import link_proxy
from noderuntime.testing.seams import KINDS, grpc_peer, seam
from noderuntime.transport import FrameStream, StreamBroken, StreamClosed, TransportError, sealed
from noderuntime.transport.grpc import AsyncioThread, GrpcConnector, GrpcServer
from protocol import Hop, Limits, Span, StatusCode
from protocol.channel import Binding, ChannelKeys
from tests.protocol_helpers import open_route


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
