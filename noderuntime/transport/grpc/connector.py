"""The dialing side: seam streams to peers, each on its own connection, with a spare kept per peer."""

from __future__ import annotations

import asyncio
import logging
import ssl

import attrs
import grpclib.const
import trio
from grpclib.client import Channel

from noderuntime.transport.base import StreamBroken
from noderuntime.transport.grpc import _grpclib_private
from noderuntime.transport.grpc.bridge import AsyncioThread
from noderuntime.transport.grpc.errors import BAD_ADDRESS, UNREACHABLE, map_exceptions
from noderuntime.transport.grpc.stream import GrpcFrameStream, pump, trailer_status
from noderuntime.transport.grpc.tls import pinned_context
from noderuntime.transport.grpc.wire import SEAM_METHOD, FrameCodec, configuration, parse_address
from protocol import StatusCode

log = logging.getLogger(__name__)

SPARE_SECONDS = 30.0  # a spare connection nobody took is closed after this long
SPARE_PROBE_SECONDS = 1.0  # a spare must answer a PING this soon to carry a seam
PINS_KEPT = 256  # pinned TLS contexts kept, one per peer and pin


@attrs.frozen
class _Peer:
    host: str
    port: int
    tls_cert_sha256: bytes


@attrs.frozen
class _Spare:
    channel: Channel
    expiry: asyncio.TimerHandle


def _close_channel(channel: Channel, *, abort: bool) -> None:
    """Close a connection; ``abort`` drops unsent bytes and resets it rather than flushing first.

    A plain close waits for asyncio to flush the socket, which for a stalled link is never.
    """
    if abort:
        _grpclib_private.abort_connection(channel)
    channel.close()


class GrpcConnector:
    """Opens seam streams to peers, each on an HTTP/2 connection of its own.

    Sessions do not share connections because they would share flow control: a session
    whose next hop stops reading fills the connection's window, and every later session on
    that connection then stalls with it until keepalive declares the link dead, tens of
    seconds later. A seam that ends badly aborts its connection, which drops what it had
    queued and tells the peer at once.

    A connection costs a TCP (and TLS) handshake, so the connector keeps one spare,
    connected and unused, for every peer it opened a seam to in the last
    ``SPARE_SECONDS``: the next seam to that peer takes it and starts with its first
    frame, and a new spare is connected in the background. A spare whose peer went away
    is noticed by the connection itself when the peer said so (reset, end of stream) or
    keepalive gave up on it; a link cut silently looks alive for up to
    ``wire.KEEPALIVE_SECONDS + wire.KEEPALIVE_TIMEOUT``, so a spare must also answer a PING within
    ``SPARE_PROBE_SECONDS`` before it is handed out. One round trip is what a new plain
    connection's handshake costs too, and a spare that does not answer is dropped for a
    new connection, which fails fast on a dead host (and the node falls back to the
    relay) instead of a seam that stalls. A pinned certificate is fetched once per peer
    and pin, not per seam.
    """

    def __init__(self, runtime: AsyncioThread, *, max_frame_bytes: int, connect_timeout: float = 5.0) -> None:
        self._runtime = runtime
        self._limit = max_frame_bytes
        self._timeout = connect_timeout
        self._channels: set[Channel] = set()  # touched on the asyncio thread only
        self._spares: dict[_Peer, _Spare] = {}  # asyncio thread only
        self._connecting: dict[_Peer, asyncio.Task[None]] = {}  # spares on their way; asyncio thread only
        self._pins: dict[_Peer, ssl.SSLContext] = {}  # trio thread only
        self._closed = False
        self.spares_dropped = 0  # spares found dead when a seam wanted them

    @property
    def spares(self) -> int:
        """Spare connections held now, connected and unused (a snapshot, readable from any thread)."""
        return len(self._spares)

    async def open(
        self, address: str, *, tls_cert_sha256: bytes = b"", stream_seconds: float | None = None
    ) -> GrpcFrameStream:
        """A new seam stream to ``host:port`` (TLS pinned to a certificate hash when given)."""
        with map_exceptions(BAD_ADDRESS, address):
            host, port = parse_address(address)
        peer = _Peer(host, port, tls_cert_sha256)
        tls = None
        if tls_cert_sha256:
            tls = self._pins.get(peer)
            if tls is None:
                tls = await pinned_context(self._runtime, host, port, tls_cert_sha256)
                if len(self._pins) >= PINS_KEPT:
                    del self._pins[next(iter(self._pins))]  # the oldest: peers come and go
                self._pins[peer] = tls
        token = trio.lowlevel.current_trio_token()
        ours = GrpcFrameStream(self._runtime, token, address)
        opened: asyncio.Future[None] | None = None

        async def run() -> None:
            assert opened is not None
            channel = await self._take_spare(peer) or self._new_channel(peer, tls)
            self._channels.add(channel)
            call = None
            clean = False
            try:
                async with channel.request(
                    SEAM_METHOD, grpclib.const.Cardinality.STREAM_STREAM, bytes, bytes, timeout=stream_seconds
                ) as stream:
                    call = stream
                    await asyncio.wait_for(stream.send_request(), self._timeout)
                    if not opened.done():
                        opened.set_result(None)
                    # the peer answers: worth a spare (a dead one would only fail it again)
                    self._keep_spare(peer, tls)
                    await pump(stream, ours, self._limit, client=True)
                clean = True
            except BaseException as exc:
                if not opened.done():
                    opened.set_exception(exc)
                if not isinstance(exc, asyncio.CancelledError):
                    # no error map: whatever ended the call, the trio side reads the peer as unavailable
                    # (``opened`` gets the error as it is, for UNREACHABLE below), unless a send
                    # failed because the server ended the call: then its status is the reason
                    status = trailer_status(call, address) if call is not None else None
                    ours.inbound.finish(
                        status or StreamBroken(f"the seam with {address} failed: {exc}", StatusCode.UNAVAILABLE)
                    )
                raise
            finally:
                self._channels.discard(channel)
                _close_channel(channel, abort=not clean)

        async def launch() -> None:
            nonlocal opened
            opened = asyncio.get_running_loop().create_future()
            task = asyncio.ensure_future(run())
            task.add_done_callback(_quiet)
            ours.own(task)
            await opened

        try:
            with map_exceptions(UNREACHABLE, address):
                await self._runtime.call(launch)
        except StreamBroken:  # the map's: launch raises grpclib's, asyncio's and the OS's own errors
            self._pins.pop(peer, None)  # the peer may have a new certificate: fetch it again next time
            raise
        except BaseException:
            ours.reset()
            raise
        return ours

    async def close(self) -> None:
        """Abort every connection still open, spares included (idempotent)."""

        async def close_all() -> None:
            self._closed = True
            for task in self._connecting.values():
                task.cancel()
            spares, self._spares = self._spares, {}
            for spare in spares.values():
                spare.expiry.cancel()
                _close_channel(spare.channel, abort=True)
            channels, self._channels = self._channels, set()
            for channel in channels:
                _close_channel(channel, abort=True)

        with trio.CancelScope(shield=True):
            await self._runtime.call(close_all)

    # --- spare connections (asyncio thread)

    def _new_channel(self, peer: _Peer, tls: ssl.SSLContext | None) -> Channel:
        return Channel(peer.host, peer.port, ssl=tls, codec=FrameCodec(), config=configuration())

    async def _take_spare(self, peer: _Peer) -> Channel | None:
        spare = self._spares.pop(peer, None)
        if spare is None:
            return None
        spare.expiry.cancel()
        try:
            # not connected: the peer reset or ended it, or keepalive gave up on it
            alive = _grpclib_private.is_connected(spare.channel) and await _grpclib_private.answers_ping(
                spare.channel, min(SPARE_PROBE_SECONDS, self._timeout)
            )
        except BaseException:  # the seam was cancelled while it waited: nobody holds the spare now
            _close_channel(spare.channel, abort=True)
            raise
        if not alive:
            self.spares_dropped += 1
            _close_channel(spare.channel, abort=True)
            return None
        return spare.channel

    def _keep_spare(self, peer: _Peer, tls: ssl.SSLContext | None) -> None:
        """Connect a spare to ``peer`` in the background, unless one exists or is on its way."""
        if self._closed or peer in self._spares or peer in self._connecting:
            return
        channel = self._new_channel(peer, tls)

        async def connect() -> None:
            try:
                await asyncio.wait_for(_grpclib_private.connect(channel), self._timeout)
            except BaseException:
                _close_channel(channel, abort=True)
                raise
            if self._closed or peer in self._spares:
                _close_channel(channel, abort=True)
                return
            loop = asyncio.get_running_loop()
            self._spares[peer] = _Spare(channel, loop.call_later(SPARE_SECONDS, self._expire, peer, channel))

        def connected(task: asyncio.Task[None]) -> None:
            if self._connecting.get(peer) is task:
                del self._connecting[peer]
            if not task.cancelled() and task.exception() is not None:
                log.debug("no spare connection to %s:%d: %r", peer.host, peer.port, task.exception())

        task = self._connecting[peer] = asyncio.ensure_future(connect())
        task.add_done_callback(connected)

    def _expire(self, peer: _Peer, channel: Channel) -> None:
        spare = self._spares.get(peer)
        if spare is not None and spare.channel is channel:
            del self._spares[peer]
            _close_channel(channel, abort=False)


def _quiet(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("seam stream ended: %r", task.exception())
