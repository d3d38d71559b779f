"""Both client sides of the relay: a node listening through it, and a peer dialling through it.

Once the relay pairs them, the two run the end-to-end handshake of :mod:`noderuntime.transport.sealed`
in the paired connection: what the relay forwards after that is sealed.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable

import trio
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection, connect_websocket_url

from noderuntime.access.identity import Identity, channel_keys
from noderuntime.transport import relay_messages as m
from noderuntime.transport.base import FrameStream, StreamBroken
from noderuntime.transport.sealed import seal_acceptor, seal_dialer
from noderuntime.transport.websocket import (
    KEEPALIVE_SECONDS,
    MAX_MESSAGE_BYTES,
    MESSAGE_QUEUE,
    RECEIVE_BUFFER_BYTES,
    WebSocketFrameStream,
    until_silent,
)
from protocol import StatusCode
from protocol.channel import Binding, ChannelKeys

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0


async def _connect(nursery: trio.Nursery, url: str, tls: ssl.SSLContext | None) -> WebSocketConnection:
    try:
        return await connect_websocket_url(
            nursery,
            url,
            tls,
            message_queue_size=MESSAGE_QUEUE,
            max_message_size=MAX_MESSAGE_BYTES,
            receive_buffer_size=RECEIVE_BUFFER_BYTES,
        )
    except (OSError, HandshakeError, trio.TooSlowError) as exc:
        raise StreamBroken(f"cannot reach the relay at {url}: {exc}", StatusCode.UNAVAILABLE) from None
    except ValueError as exc:  # not a ws:// or wss:// URL; a route plan's relay is the peer's word
        raise StreamBroken(f"cannot dial the relay {url!r}: {exc}", StatusCode.INVALID_ARGUMENT) from None


async def _expect_paired(ws: WebSocketConnection, url: str) -> None:
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            m.decode(await ws.get_message(), m.Paired)
    except ConnectionClosed as exc:
        reason = exc.reason
        code = reason.code if reason else None
        status = {
            m.CLOSE_FORBIDDEN: StatusCode.PERMISSION_DENIED,
            m.CLOSE_NOT_CONNECTED: StatusCode.UNAVAILABLE,
            m.CLOSE_BUSY: StatusCode.RESOURCE_EXHAUSTED,
        }.get(code or 0, StatusCode.UNAVAILABLE)
        raise StreamBroken(
            f"the relay at {url} refused the seam: {reason.reason if reason else code}", status
        ) from None
    except (m.ControlError, trio.TooSlowError) as exc:
        await ws.aclose(m.CLOSE_POLICY, "expected paired")
        raise StreamBroken(f"the relay at {url} did not pair the seam: {exc}", StatusCode.UNAVAILABLE) from None


class RelayDialer:
    """Opens seams to nodes that are reachable only through a relay."""

    def __init__(
        self,
        nursery: trio.Nursery,
        keys: ChannelKeys,
        tls: ssl.SSLContext | None = None,
        *,
        plaintext: bool = False,
    ) -> None:
        """``nursery`` hosts each connection's background reader; it must outlive the seams.

        ``keys``: the dialling side's (:func:`noderuntime.access.identity.channel_keys`); the
        ticket of each session dialled must name their node id before the node dialled.
        ``plaintext``: seams without the end-to-end channel (``--insecure-plaintext-seams``:
        measuring what sealing costs, and tests of old peers), only with peers started so.
        """
        self._nursery = nursery
        self._tls = tls
        self.keys = keys
        self._plaintext = plaintext

    @property
    def node_id(self) -> bytes:
        """Whom this dialer proves to be to the nodes it reaches."""
        return self.keys.node_id

    async def dial(self, relay_url: str, target: bytes, *, session_id: bytes, epoch: int, ticket: bytes) -> FrameStream:
        """A sealed seam to ``target`` through ``relay_url`` (ws:// or wss://), its handshake done."""
        url = relay_url.rstrip("/") + "/dial"
        ws = await _connect(self._nursery, url, self._tls)
        try:
            await ws.send_message(m.Dial(target, session_id, epoch, ticket).encode())
            await _expect_paired(ws, relay_url)
            if self._plaintext:
                return WebSocketFrameStream(ws, relay_url)
            binding = Binding(session_id, epoch, self.keys.node_id, target)
            stream = WebSocketFrameStream(ws, relay_url)
            return await seal_dialer(stream, self.keys, binding, f"the node behind {relay_url}")
        except ConnectionClosed:
            raise StreamBroken(f"the relay at {relay_url} closed the dial", StatusCode.UNAVAILABLE) from None
        except BaseException:
            with trio.move_on_after(1.0) as scope:
                scope.shield = True
                await ws.aclose()
            raise


class RelayListener:
    """Keeps a node's authenticated control connection to a relay, and accepts the seams it pairs."""

    def __init__(
        self,
        relay_url: str,
        identity: Identity,
        on_stream: Callable[[FrameStream], None],
        *,
        tls: ssl.SSLContext | None = None,
        retry_seconds: float = 1.0,
        keepalive: float = KEEPALIVE_SECONDS,
        plaintext: bool = False,
    ) -> None:
        """``plaintext``: as :class:`RelayDialer`'s."""
        self.url = relay_url.rstrip("/")
        self.identity = identity
        self._keys = channel_keys(identity)
        self._plaintext = plaintext
        self._on_stream = on_stream
        self._tls = tls
        self._retry = retry_seconds
        self._keepalive = keepalive
        self.connected = False
        self.accepted = 0
        self.refused = 0  # paired seams whose dialer failed the handshake
        self._running = trio.CancelScope()

    def stop(self) -> None:
        """End :meth:`run` (idempotent); it closes the control connection with its handshake.

        Cancelling :meth:`run` from outside ends the connection's reader with it, so the
        close can only wait out its second for the relay's answer.
        """
        self._running.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the control connection, reconnecting with backoff; ``started`` after the first welcome.

        Runs once; :meth:`stop` ends it.
        """
        async with trio.open_nursery() as nursery:
            with self._running:
                await self._hold(nursery, task_status)
            nursery.cancel_scope.cancel()  # seams being accepted, and the connection's reader

    async def _hold(self, nursery: trio.Nursery, task_status: trio.TaskStatus[None]) -> None:
        started = False
        delay = self._retry
        while True:
            try:
                ws = await _connect(nursery, self.url + "/control", self._tls)
                watching = trio.CancelScope()
                try:
                    await self._hello(ws)
                    self.connected = True
                    delay = self._retry
                    if not started:
                        started = True
                        task_status.started()
                    log.info("listening through the relay %s", self.url)
                    with trio.CancelScope() as listening:
                        # a relay that went away without a close (its host, a NAT mapping)
                        # must be found out, or this node stays unreachable for good
                        nursery.start_soon(self._watch, ws, listening, watching)
                        while True:
                            incoming = m.decode(await ws.get_message(), m.Incoming)
                            nursery.start_soon(self._accept, nursery, incoming.pair.hex())
                    log.warning("the relay %s stopped answering pings; reconnecting", self.url)
                finally:
                    watching.cancel()
                    self.connected = False
                    with trio.move_on_after(1.0) as scope:
                        scope.shield = True
                        await ws.aclose()
            except (StreamBroken, ConnectionClosed, m.ControlError, trio.TooSlowError) as exc:
                log.warning("relay control connection to %s lost: %s; retrying in %.1f s", self.url, exc, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, 10.0)  # a restarted relay is found again within seconds

    async def _watch(self, ws: WebSocketConnection, listening: trio.CancelScope, watching: trio.CancelScope) -> None:
        with watching:  # cancelled when this connection ends, whichever way
            try:
                await until_silent(ws, self._keepalive)
            except ConnectionClosed:
                return  # the listening loop sees the close itself
            listening.cancel()

    async def _hello(self, ws: WebSocketConnection) -> None:
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            challenge = m.decode(await ws.get_message(), m.Challenge)
            signature = self.identity.sign(m.CONTROL_DOMAIN, challenge.nonce)
            await ws.send_message(m.Hello(self.identity.node_id, signature).encode())
            m.decode(await ws.get_message(), m.Welcome)

    async def _accept(self, nursery: trio.Nursery, pair: str) -> None:
        try:
            ws = await _connect(nursery, f"{self.url}/accept/{pair}", self._tls)
            await _expect_paired(ws, self.url)
            stream: FrameStream = WebSocketFrameStream(ws, self.url)
            if not self._plaintext:
                sealed = seal_acceptor(stream, self._keys, f"the dialer through {self.url}")
                await sealed.handshake()
                stream = sealed
        except StreamBroken as exc:
            log.warning("could not accept a relayed seam: %s", exc)
            self.refused += 1
            return
        self.accepted += 1
        self._on_stream(stream)
