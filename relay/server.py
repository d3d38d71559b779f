"""The relay: pairs a peer with a node that cannot be dialled directly, and forwards bytes.

Nodes behind NAT keep an authenticated control connection (``/control``). A peer that
needs a seam to such a node dials ``/dial`` with a session ticket naming that node;
the relay checks the ticket, tells the node over its control connection to dial
``/accept/<pair>``, pairs the two connections and forwards every binary message
both ways as it is. The two ends seal what they send end to end
(:mod:`protocol.channel`): the relay holds no key and reads nothing but its own control
messages. Buffers are bounded (one queued message per connection), so a side that
stops reading stalls the other side instead of growing memory. See
:mod:`noderuntime.transport.relay_messages` for the control vocabulary.

This package is what a public relay runs: it imports the protocol and the transport
pieces it needs, never the engine, a node or the gateway (``tests/test_layers.py``), and
runs from the light install (``pip install noderuntime``, no llama.cpp).
"""

from __future__ import annotations

import collections
import functools
import ipaddress
import logging
import os
import ssl
import time
from typing import Any, cast

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, WebSocketServer

from noderuntime.access.identity import verify
from noderuntime.access.tickets import TicketError, TicketVerifier
from noderuntime.operations.connections import source
from noderuntime.operations.telemetry import RelayMetrics, exposition
from noderuntime.transport import relay_messages as m
from noderuntime.transport.websocket import (
    KEEPALIVE_SECONDS,
    MAX_MESSAGE_BYTES,
    MESSAGE_QUEUE,
    RECEIVE_BUFFER_BYTES,
    until_silent,
)

log = logging.getLogger(__name__)

# how long a new connection may take to send its upgrade request; past it the websocket
# server closes the connection
CONNECT_TIMEOUT = 10.0


@attrs.define(eq=False)
class _Pair:
    dialer: WebSocketConnection
    target: bytes
    accepted: trio.Event = attrs.Factory(trio.Event)
    acceptor: WebSocketConnection | None = None
    done: trio.Event = attrs.Factory(trio.Event)
    # a status one side closed its seam with, passed on to the other side
    status: tuple[int, str] | None = None


@attrs.frozen
class RelayLimits:
    """What one relay holds at most; past a limit it refuses with a typed close or HTTP status.

    Anyone can make a node key, so control connections are capped (``max_nodes``), and
    connections that have not yet proved anything (a key, a ticket, a pair) are capped
    per source address and in all, from the moment they are accepted, so that one host
    cannot hold the relay's sockets with handshakes it never finishes, or never even
    starts. Proven connections do not count against the per-address cap: a gateway or a
    node behind NAT carries many sessions from one address.
    """

    max_nodes: int = 1024
    # proven nodes from one address: a site behind one NAT runs a few, a key spammer many
    max_nodes_per_host: int = 64
    max_pairs: int = 4096
    max_handshakes: int = 1024
    # a handshake lasts a round trip or two; a gateway opening a burst of sessions stays well under
    max_handshakes_per_host: int = 64

    def __attrs_post_init__(self) -> None:
        for name, value in attrs.asdict(self).items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")


def _connection_key(address: object, port: int) -> tuple[str, int]:
    """One TCP connection's key, the same whether read from the socket or from the websocket request."""
    try:
        return str(ipaddress.ip_address(str(address))), port
    except ValueError:
        return str(address), port


def _source(remote: object) -> str:
    """Whose connection this is, for the per-address cap: the address, or its /64 for IPv6."""
    return source(str(getattr(remote, "address", remote)))


class _Handshake:
    """A connection's place among those not yet proven; released once, when it proves itself or ends."""

    def __init__(self, counts: collections.Counter[str], host: str) -> None:
        self.host = host
        self._counts = counts
        self._keys = (host, "")  # its address, and the total under a key no address has
        self._held = True
        for key in self._keys:
            counts[key] += 1

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        for key in self._keys:
            _decrement(self._counts, key)


def _decrement(counts: collections.Counter[str], key: str) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


@attrs.frozen
class RelayStatistics:
    """A snapshot of the relay."""

    nodes_connected: int
    handshakes_open: int  # connections that have not yet shown a key, ticket or pair
    upgrades_awaited: int  # of those, connections whose websocket upgrade request has not arrived
    pairs_pending: int
    pairs_active: int
    pairs_total: int
    bytes_forwarded: int
    refused: dict[str, int]


class Relay:
    """The relay's state and websocket handler."""

    def __init__(
        self,
        verifier: TicketVerifier,
        *,
        limits: RelayLimits = RelayLimits(),
        accept_timeout: float = 10.0,
        handshake_timeout: float = 10.0,
        keepalive: float = KEEPALIVE_SECONDS,
    ) -> None:
        self.verifier = verifier
        self.limits = limits
        self.keepalive = keepalive
        self.accept_timeout = accept_timeout
        self.handshake_timeout = handshake_timeout
        self.nodes: dict[bytes, WebSocketConnection] = {}
        self._pending: dict[str, _Pair] = {}
        self._active = 0
        self._total = 0
        self._forwarded = 0
        self._refused: collections.Counter[str] = collections.Counter()
        self._handshakes: collections.Counter[str] = collections.Counter()  # by source address; "" = all
        # accepted connections whose upgrade request has not arrived, by (address, port), in
        # the order they came: each with the time after which the server has surely closed it
        self._arriving: dict[tuple[str, int], tuple[float, _Handshake]] = {}
        self._node_host: dict[bytes, str] = {}  # where each connected node's control connection comes from
        self._nodes_by_host: collections.Counter[str] = collections.Counter()
        self.metrics = RelayMetrics()

    def statistics(self) -> RelayStatistics:
        """An immutable snapshot."""
        self._expire_arrivals()
        return RelayStatistics(
            len(self.nodes),
            self._handshakes[""],
            len(self._arriving),
            len(self._pending),
            self._active,
            self._total,
            self._forwarded,
            dict(self._refused),
        )

    async def handle(self, request: WebSocketRequest) -> None:
        """Route a new connection by its path.

        Whatever one connection does (reset before its upgrade is answered, say), it ends
        that connection only: an exception out of here would end the whole server.
        """
        try:
            await self._handle(request)
        except (ConnectionClosed, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("a relay connection ended early: %r", exc)

    def admit(self, address: str, port: int, *, connect_timeout: float) -> tuple[int, str] | None:
        """Count a newly accepted connection among the unproven ones, before it says anything.

        Returns the HTTP status and reason to refuse it with when its address, or the
        relay, already holds its share of unproven connections; ``None`` when admitted.
        ``connect_timeout``: how long the server waits for its upgrade request.
        """
        self._expire_arrivals()
        host = _source(address)
        if self._handshakes[host] >= self.limits.max_handshakes_per_host:
            status, reason, kind = 429, "too many unfinished handshakes from this address", "host_handshakes"
        elif self._handshakes[""] >= self.limits.max_handshakes:
            status, reason, kind = 503, "too many unfinished handshakes", "handshakes"
        else:
            key = _connection_key(address, port)
            earlier = self._arriving.pop(key, None)
            if earlier is not None:  # its port is in use again, so that connection is gone
                earlier[1].release()
            deadline = time.monotonic() + connect_timeout + 1.0
            self._arriving[key] = (deadline, _Handshake(self._handshakes, host))
            return None
        self._count_refusal(kind, reason)
        return status, reason

    def _expire_arrivals(self) -> None:
        # the websocket server closes a connection that sent no upgrade request within
        # connect_timeout, without calling the handler; its count ends by the deadline
        now = time.monotonic()
        while self._arriving:
            key, (deadline, handshake) = next(iter(self._arriving.items()))
            if deadline > now:
                break
            del self._arriving[key]
            handshake.release()

    async def _handle(self, request: WebSocketRequest) -> None:
        remote = request.remote
        arrived = self._arriving.pop(_connection_key(getattr(remote, "address", ""), getattr(remote, "port", -1)), None)
        # serve's listener admitted it; only a handler served some other way counts it here
        handshake = arrived[1] if arrived is not None else _Handshake(self._handshakes, _source(remote))
        try:
            path = request.path
            if path == "/control":
                await self._control(await request.accept(), handshake)
            elif path == "/dial":
                await self._dial(await request.accept(), handshake)
            elif path.startswith("/accept/"):
                await self._accept(await request.accept(), path.removeprefix("/accept/"), handshake)
            else:
                await request.reject(404, body=b"unknown relay path\n")
        finally:
            handshake.release()

    def _count_refusal(self, kind: str, reason: str) -> None:
        self._refused[kind] += 1
        self.metrics.refused.labels(kind).inc()
        log.info("relay refused a connection: %s", reason)

    async def metrics_exposition(self) -> tuple[int, str, bytes]:
        """The ``/metrics`` response."""
        self.metrics.nodes.set(len(self.nodes))
        self.metrics.pairs.set(self._active)
        return exposition(self.metrics.registry)

    async def _refuse(self, ws: WebSocketConnection, code: int, reason: str, kind: str) -> None:
        """Refuse after the upgrade, with a websocket close code."""
        self._count_refusal(kind, reason)
        with trio.move_on_after(1.0):
            await ws.aclose(code, reason[:120])

    async def _control(self, ws: WebSocketConnection, handshake: _Handshake) -> None:
        nonce = os.urandom(32)
        try:
            with trio.fail_after(self.handshake_timeout):
                await ws.send_message(m.Challenge(nonce).encode())
                hello = m.decode(await ws.get_message(), m.Hello)
        except (m.ControlError, trio.TooSlowError) as exc:
            await self._refuse(ws, m.CLOSE_POLICY, f"bad control handshake: {exc}", "control_handshake")
            return
        except ConnectionClosed:
            return
        node_id = hello.node_id
        if not verify(node_id, m.CONTROL_DOMAIN, nonce, hello.signature):
            await self._refuse(ws, m.CLOSE_UNAUTHENTICATED, "control signature does not verify", "control_auth")
            return
        handshake.release()
        host = handshake.host
        if node_id not in self.nodes and len(self.nodes) >= self.limits.max_nodes:
            await self._refuse(ws, m.CLOSE_BUSY, "the relay holds its maximum of nodes", "nodes")
            return
        if node_id not in self.nodes and self._nodes_by_host[host] >= self.limits.max_nodes_per_host:
            await self._refuse(ws, m.CLOSE_BUSY, "the relay holds its maximum of nodes from this address", "host_nodes")
            return
        previous = self.nodes.get(node_id)
        if previous is not None:
            _decrement(self._nodes_by_host, self._node_host[node_id])
        self.nodes[node_id] = ws
        self._node_host[node_id] = host
        self._nodes_by_host[host] += 1
        if previous is not None:
            with trio.move_on_after(1.0):
                await previous.aclose(m.CLOSE_NORMAL, "replaced by a newer control connection")
        log.info("node %s connected to the relay", node_id.hex()[:12])
        try:
            await ws.send_message(m.Welcome().encode())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keep_alive, ws, node_id, nursery.cancel_scope)
                try:
                    while True:  # nothing is expected from the node; reading notices its departure
                        await ws.get_message()
                except ConnectionClosed:
                    nursery.cancel_scope.cancel()
        except ConnectionClosed:
            pass
        finally:
            if self.nodes.get(node_id) is ws:
                del self.nodes[node_id]
                _decrement(self._nodes_by_host, self._node_host.pop(node_id))
                log.info("node %s left the relay", node_id.hex()[:12])

    async def _keep_alive(self, ws: WebSocketConnection, node_id: bytes, scope: trio.CancelScope) -> None:
        # nothing else is ever sent on a control connection: without pings a dead node
        # would hold one of the relay's node places for good
        try:
            await until_silent(ws, self.keepalive)
        except ConnectionClosed:
            pass
        else:
            self._count_refusal("keepalive", f"node {node_id.hex()[:12]} did not answer pings; dropped")
        scope.cancel()

    async def _dial(self, ws: WebSocketConnection, handshake: _Handshake) -> None:
        try:
            with trio.fail_after(self.handshake_timeout):
                dial = m.decode(await ws.get_message(), m.Dial)
        except (m.ControlError, trio.TooSlowError) as exc:
            await self._refuse(ws, m.CLOSE_POLICY, f"bad dial request: {exc}", "dial_malformed")
            return
        except ConnectionClosed:
            return
        check = functools.partial(
            self.verifier.check,
            dial.ticket,
            session_id=dial.session,
            epoch=dial.epoch,
            artifact=None,
            hops=None,
            node_id=dial.target,
        )
        try:
            check(consume=False)
        except TicketError as exc:
            await self._refuse(ws, m.CLOSE_FORBIDDEN, f"ticket refused: {exc}", "ticket")
            return
        handshake.release()
        # the ticket is spent only on a dial the relay can carry out: a dial to a node not here (yet),
        # or past the pair limit, leaves it good for another try, here or at the node's next relay
        control = self.nodes.get(dial.target)
        if control is None:
            await self._refuse(
                ws, m.CLOSE_NOT_CONNECTED, "the target node is not connected to this relay", "not_connected"
            )
            return
        if len(self._pending) + self._active >= self.limits.max_pairs:
            await self._refuse(ws, m.CLOSE_BUSY, "the relay is at its pair limit", "busy")
            return
        try:
            check(consume=True)  # no await since the checks above: the target is still here
        except TicketError as exc:
            await self._refuse(ws, m.CLOSE_FORBIDDEN, f"ticket refused: {exc}", "ticket")
            return
        pair_id = os.urandom(16)
        pair = _Pair(ws, dial.target)
        self._pending[pair_id.hex()] = pair
        try:
            try:
                await control.send_message(m.Incoming(pair_id).encode())
                with trio.fail_after(self.accept_timeout):
                    await pair.accepted.wait()
            except (ConnectionClosed, trio.TooSlowError):
                await self._refuse(ws, m.CLOSE_TIMEOUT, "the target node did not dial in", "accept_timeout")
                return
            finally:
                self._pending.pop(pair_id.hex(), None)
            assert pair.acceptor is not None
            await self._forward(pair)
        finally:
            pair.done.set()

    async def _accept(self, ws: WebSocketConnection, pair_id: str, handshake: _Handshake) -> None:
        pair = self._pending.get(pair_id)
        if pair is None or pair.acceptor is not None:
            await self._refuse(ws, m.CLOSE_FORBIDDEN, "unknown or used pair", "unknown_pair")
            return
        handshake.release()
        pair.acceptor = ws
        pair.accepted.set()
        await pair.done.wait()  # the dialling side's task forwards; this connection lives until then

    async def _forward(self, pair: _Pair) -> None:
        assert pair.acceptor is not None
        a, b = pair.dialer, pair.acceptor
        self._active += 1
        self._total += 1
        try:
            for ws in (a, b):
                await ws.send_message(m.Paired().encode())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pipe, pair, a, b, nursery.cancel_scope)
                nursery.start_soon(self._pipe, pair, b, a, nursery.cancel_scope)
        except ConnectionClosed:
            pass
        finally:
            self._active -= 1
            with trio.move_on_after(1.0) as scope:
                scope.shield = True
                code, reason = pair.status or (m.CLOSE_PEER_GONE, "the other side of the seam left")
                for ws in (a, b):
                    await ws.aclose(code, reason)

    async def _pipe(
        self, pair: _Pair, src: WebSocketConnection, dst: WebSocketConnection, scope: trio.CancelScope
    ) -> None:
        try:
            while True:
                message = await src.get_message()
                if not isinstance(message, bytes):
                    break  # after pairing only binary seam frames pass
                await dst.send_message(message)
                self._forwarded += len(message)
                self.metrics.bytes.inc(len(message))
        except ConnectionClosed as exc:
            closed = exc.reason
            if closed is not None and m.is_status_close(closed.code) and pair.status is None:
                pair.status = (closed.code, closed.reason or "")
        finally:
            scope.cancel()


# refused connections answered with an HTTP status at once; past this many, closed unanswered
ANSWERED_REFUSALS = 64


def served_stream(stream: trio.SocketStream, tls: ssl.SSLContext | None) -> trio.abc.Stream:
    """What a connection is served over: ``stream`` itself, or TLS on it as HTTPS servers speak it.

    HTTPS-compatible TLS (trio-websocket's own server and client use it too) sends no
    close_notify and takes a peer's EOF without one as the end: its ``aclose`` only closes the
    socket. That matters because trio-websocket closes a server connection's stream from two
    tasks when close handshakes cross (its reader on the peer's close frame, and the wrapper
    around the handler once the handler returns); two overlapping closes that each send a
    close_notify race, and the loser's ClosedResourceError escapes the reader task and ends
    the whole relay (seen as a relay exiting 1 at SIGTERM, nodes still closing).
    """
    if tls is None:
        return stream
    return trio.SSLStream(stream, tls, server_side=True, https_compatible=True)


class _AdmittingListener(trio.abc.Listener[trio.abc.Stream]):
    """Passes on only the connections the relay admits; refuses the rest at once."""

    def __init__(
        self,
        inner: trio.SocketListener,
        relay: Relay,
        tls: ssl.SSLContext | None,
        nursery: trio.Nursery,
        connect_timeout: float,
    ) -> None:
        self._inner = inner
        self._relay = relay
        self._tls = tls
        self._nursery = nursery
        self._connect_timeout = connect_timeout
        self._answering = 0

    async def accept(self) -> trio.abc.Stream:
        while True:
            stream = await self._inner.accept()
            try:
                address, port, *_ = stream.socket.getpeername()
            except OSError:  # reset before we looked
                await trio.aclose_forcefully(stream)
                continue
            refusal = self._relay.admit(address, port, connect_timeout=self._connect_timeout)
            if refusal is None:
                return served_stream(stream, self._tls)
            # a client that gets no answer waits out its own connect timeout; a flood gets
            # only this many answers at a time (each within a second), the rest are closed
            if self._answering < ANSWERED_REFUSALS:
                self._answering += 1
                self._nursery.start_soon(self._answer, served_stream(stream, self._tls), *refusal)
            else:
                await trio.aclose_forcefully(stream)

    async def _answer(self, stream: trio.abc.Stream, status: int, reason: str) -> None:
        body = reason.encode() + b"\n"
        try:
            with trio.move_on_after(1.0):
                await stream.send_all(
                    b"HTTP/1.1 %d %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                    % (status, reason.encode(), len(body), body)
                )
                if isinstance(stream, trio.abc.HalfCloseableStream):
                    await stream.send_eof()
                # read the request to its end: closing with it unread would reset the connection
                # and could discard the answer before the peer reads it
                while await stream.receive_some(4096):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self._answering -= 1
            await trio.aclose_forcefully(stream)

    async def aclose(self) -> None:
        await self._inner.aclose()


@attrs.frozen
class Listening:
    """Where a relay listens."""

    host: str
    port: int


async def serve(
    relay: Relay,
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None = None,
    connect_timeout: float = CONNECT_TIMEOUT,
    task_status: trio.TaskStatus[Listening] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; reports where it listens (with the bound port) once it does.

    ``connect_timeout``: how long a new connection may take to send its upgrade request.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    async with trio.open_nursery() as nursery:
        server = WebSocketServer(
            relay.handle,
            # trio-websocket's annotation names trio's two listener types; it serves any trio Listener
            cast(Any, [_AdmittingListener(listener, relay, tls, nursery, connect_timeout) for listener in listeners]),
            message_queue_size=MESSAGE_QUEUE,
            max_message_size=MAX_MESSAGE_BYTES,
            receive_buffer_size=RECEIVE_BUFFER_BYTES,
            connect_timeout=connect_timeout,
            disconnect_timeout=5,
        )
        await nursery.start(server.run)
        task_status.started(Listening(host, listeners[0].socket.getsockname()[1]))
