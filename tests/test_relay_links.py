"""The relay as a seam transport: its handshakes and caps, broken and oversized messages at every
stage of a relayed seam, TLS, and the pings that find a silent node or relay (the conformance
suite every transport passes, the relay included, is tests/test_transports.py)."""

from __future__ import annotations

import functools
import os
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

from noderuntime.access.identity import Identity, channel_keys, self_signed, verify
from noderuntime.access.tickets import TicketVerifier, issue
from noderuntime.testing.linkproxy import LinkProxy
from noderuntime.transport import FrameStream, StreamBroken, sealed
from noderuntime.transport import relay_messages as messages
from noderuntime.transport.relay_client import RelayDialer, RelayListener
from protocol import Hop, Limits, Span, StatusCode
from protocol.channel import MAGIC, Binding, ChannelClosed, ChannelKeys, DialerHandshake
from relay.server import Relay, RelayLimits, serve, served_stream

UPGRADE = (
    "GET {} HTTP/1.1\r\nHost: relay\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


async def _until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    with trio.fail_after(seconds):
        while not condition():
            await trio.sleep(0.01)


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


def _tls_contexts(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A relay's TLS context on a self-signed certificate, and a client's that trusts it."""
    files = self_signed(tmp_path / "relay")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(files.cert, files.key)
    trusting = ssl.create_default_context(cafile=str(files.cert))
    trusting.check_hostname = False
    return tls, trusting


async def test_a_relay_over_tls_serves_and_answers_connections_over_its_caps(tmp_path: Path) -> None:
    from trio_websocket import ConnectionRejected, open_websocket_url

    tls, trusting = _tls_contexts(tmp_path)
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


async def test_a_tls_connection_closed_by_two_tasks_at_once_raises_in_neither(tmp_path: Path) -> None:
    """trio-websocket closes a server connection's stream from its reader task and from the
    wrapper around the handler when close handshakes cross: both closes must end quietly, or
    the loser's error ends the whole relay (it did, now and then, at a relay's SIGTERM)."""
    tls, trusting = _tls_contexts(tmp_path)
    # each round is a coin toss with TLS that sends close_notify on close (about one in two
    # rounds raised ClosedResourceError in one of the two closes): forty rounds
    for _ in range(40):
        ours, theirs = socket.socketpair()
        served = served_stream(trio.SocketStream(trio.socket.from_stdlib_socket(ours)), tls)
        peer_socket = trio.SocketStream(trio.socket.from_stdlib_socket(theirs))
        peer = trio.SSLStream(peer_socket, trusting, https_compatible=True)
        async with trio.open_nursery() as nursery:
            assert isinstance(served, trio.SSLStream)
            nursery.start_soon(served.do_handshake)
            nursery.start_soon(peer.do_handshake)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(served.aclose)
            nursery.start_soon(served.aclose)
            with trio.fail_after(5):
                assert await peer.receive_some(64) == b""  # a clean end, as trio-websocket's clients read it
        await peer.aclose()


async def test_strangers_whose_closes_cross_the_relays_refusals_leave_it_serving(tmp_path: Path) -> None:
    """The attack on the race above: strangers over TLS send a control handshake the relay
    refuses and close from their side at once, so that their close frames cross its own."""
    tls, trusting = _tls_contexts(tmp_path)
    relay = Relay(TicketVerifier([Identity.generate().node_id]), limits=RelayLimits(max_handshakes_per_host=64))
    async with trio.open_nursery() as nursery:
        server = await nursery.start(functools.partial(serve, relay, "127.0.0.1", 0, tls=tls))
        url = f"wss://127.0.0.1:{server.port}/control"

        async def stranger(k: int) -> None:
            async with open_websocket_url(url, trusting) as ws:
                await ws.get_message()
                await ws.send_message(b"not a hello")
                await trio.sleep(k % 7 * 0.0003)  # leaving the block closes from this side too

        for _ in range(3):
            async with trio.open_nursery() as strangers:
                for k in range(20):
                    strangers.start_soon(stranger, k)
        assert relay.statistics().refused.get("control_handshake", 0) >= 1
        # still serving: the next stranger is refused in words, not by a relay that is gone
        async with open_websocket_url(url, trusting) as ws:
            await ws.get_message()
            await ws.send_message(b"not a hello")
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
        assert closed.value.reason is not None and closed.value.reason.code == messages.CLOSE_POLICY
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
