"""Direct seams over gRPC: grpclib on an asyncio loop in one thread, bridged into trio.

This is the only module that imports grpclib or asyncio. grpclib runs on asyncio
only, so every process that speaks gRPC runs one asyncio loop in a dedicated thread
(:class:`AsyncioThread`); grpclib's Server and Channel objects are created on that
thread, because they capture the running loop. Frames cross between the loops
through bounded pipes (``_Pipe``): a trio sender waits while the asyncio side has not
taken its frames, and grpclib's HTTP/2 flow control makes the asyncio side wait for
the peer, so backpressure reaches the session that produces the frames.

One seam of one route session is one long-lived bidirectional stream of the method
``/noderuntime.seam.v1.Seam/Open``. Messages are the protocol's frame bytes as they
are (a pass-through codec), so the same frames travel here as over memory or a relay.
Closing a stream ends our side and waits briefly for the peer to end its side;
cancelling the trio side, or a peer that does not end, resets the HTTP/2 stream
(RST_STREAM), which cancels the peer's handler within milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import ssl
import struct
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import attrs
import grpclib.const
import grpclib.exceptions
import grpclib.metadata
import grpclib.server
import trio
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.encoding.base import CodecBase
from grpclib.server import Server

from noderuntime.access import untrusted
from noderuntime.operations import timeline
from noderuntime.transport.base import FrameStream, StreamBroken, StreamClosed, TransportError
from protocol import StatusCode

log = logging.getLogger(__name__)

SEAM_METHOD = "/noderuntime.seam.v1.Seam/Open"
PIPE_CAPACITY = 8
CLOSE_GRACE = 2.0  # seconds a closed stream waits for the peer to end its side before resetting
_T = TypeVar("_T")


KEEPALIVE_SECONDS = 10.0  # a connection pings its peer this often, idle or not
KEEPALIVE_TIMEOUT = 20.0  # and closes when a ping goes unanswered this long


def _config() -> Configuration:
    # keepalive finds a dead peer (a hung host, a cut link) even on an idle seam or spare
    return Configuration(
        _keepalive_time=KEEPALIVE_SECONDS,
        _keepalive_timeout=KEEPALIVE_TIMEOUT,
        _keepalive_permit_without_calls=True,
        _http2_max_pings_without_data=0,
        # grpclib sends no ping within this long of its last one, whether or not data
        # flowed since; at its default (300 s) a connection pings once and then goes blind
        _http2_min_sent_ping_interval_without_data=KEEPALIVE_SECONDS / 2,
    )


class _FrameCodec(CodecBase):
    """Messages are protocol frames: bytes in, the same bytes out."""

    __content_subtype__ = "noderuntime-frames"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


class AsyncioThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="grpc-asyncio", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def call(self, factory: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        """Run ``factory()`` on the asyncio loop and wait for it from trio (cancellation crosses over)."""
        future = asyncio.run_coroutine_threadsafe(factory(), self.loop)
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: object) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        future.add_done_callback(wake)
        try:
            await done.wait()
        except BaseException:
            future.cancel()
            raise
        return future.result()

    def close(self) -> None:
        """Cancel what still runs on the loop, then stop it and its thread (idempotent)."""
        if not self.loop.is_running():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


class _Pipe:
    """A bounded single-producer, single-consumer queue between the trio and asyncio threads.

    ``trio_to_aio`` says which side produces. The consumer may also be told the stream
    ended (``finish``): with ``None`` for a clean end, or a :class:`TransportError`.

    A side that has to wait leaves an event under the lock; the other side takes it,
    under the same lock, when it changes the queue, and wakes only that waiter. A decode
    step moves one frame at a time, so a producer hardly ever waits for room: waking the
    other thread after every frame taken would cost a thread wake-up per frame for nothing.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, token: trio.lowlevel.TrioToken, *, trio_to_aio: bool) -> None:
        self._loop = loop
        self._token = token
        self._trio_to_aio = trio_to_aio
        self._lock = threading.Lock()
        self._items: deque[bytes] = deque()
        self._end: TransportError | None = None
        self._ended = False
        self._trio_waiter: trio.Event | None = None
        self._aio_waiter: asyncio.Event | None = None

    def _take_waiters(self, *, trio_side: bool, aio_side: bool) -> Callable[[], None]:
        """Take the named sides' waiters (lock held); returns what wakes them (call it unlocked)."""
        trio_event = aio_event = None
        if trio_side:
            trio_event, self._trio_waiter = self._trio_waiter, None
        if aio_side:
            aio_event, self._aio_waiter = self._aio_waiter, None

        def wake() -> None:
            # each wake-up runs on the waiter's own thread
            if trio_event is not None:
                with contextlib.suppress(trio.RunFinishedError):
                    self._token.run_sync_soon(trio_event.set)
            if aio_event is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    self._loop.call_soon_threadsafe(aio_event.set)

        return wake

    async def _trio_wait(self, ready: Callable[[], bool]) -> None:
        while True:
            with self._lock:
                if ready():
                    return
                event = self._trio_waiter = trio.Event()
            try:
                await event.wait()
            finally:
                with self._lock:
                    if self._trio_waiter is event:
                        self._trio_waiter = None

    async def _aio_wait(self, ready: Callable[[], bool]) -> None:
        while True:
            with self._lock:
                if ready():
                    return
                event = self._aio_waiter = asyncio.Event()
            try:
                await event.wait()
            finally:
                with self._lock:
                    if self._aio_waiter is event:
                        self._aio_waiter = None

    def _room(self) -> bool:
        return len(self._items) < PIPE_CAPACITY or self._ended

    def _something(self) -> bool:
        return bool(self._items) or self._ended

    async def put(self, frame: bytes) -> None:
        """Producer side: wait for room, then queue ``frame``."""
        if self._trio_to_aio:
            await self._trio_wait(self._room)
        else:
            await self._aio_wait(self._room)
        with self._lock:
            if self._ended:
                raise self._end or StreamClosed("the seam is closed")
            self._items.append(frame)
            wake = self._take_waiters(trio_side=not self._trio_to_aio, aio_side=self._trio_to_aio)
        wake()

    async def get(self) -> bytes | None:
        """Consumer side: the next frame, ``None`` at a clean end; raises the end's error."""
        if self._trio_to_aio:
            await self._aio_wait(self._something)
        else:
            await self._trio_wait(self._something)
        with self._lock:
            if not self._items:
                if self._end is not None:
                    raise self._end
                return None
            frame = self._items.popleft()
            wake = self._take_waiters(trio_side=self._trio_to_aio, aio_side=not self._trio_to_aio)
        wake()
        return frame

    def finish(self, error: TransportError | None = None) -> None:
        """No more frames (thread-safe: wakes both sides)."""
        with self._lock:
            if not self._ended:
                # frames already queued are still delivered (the peer's last Cancel or Error among them)
                self._ended = True
                self._end = error
            wake = self._take_waiters(trio_side=True, aio_side=True)
        wake()

    def drop(self, error: TransportError) -> None:
        """End now, discarding queued frames: nobody will take them (thread-safe)."""
        with self._lock:
            self._items.clear()
        self.finish(error)


class GrpcFrameStream:
    """The trio end of one gRPC seam stream."""

    kind = "grpc"

    def __init__(
        self, runtime: AsyncioThread, token: trio.lowlevel.TrioToken, peer: str, *, server_side: bool = False
    ) -> None:
        self.peer = peer
        self.server_side = server_side
        self._runtime = runtime
        self.outbound = _Pipe(runtime.loop, token, trio_to_aio=True)
        self.inbound = _Pipe(runtime.loop, token, trio_to_aio=False)
        self.task: asyncio.Task[None] | None = None  # the asyncio task that owns the HTTP/2 stream
        self._closed = False
        # the pipe keeps one waiting producer; a closing notice may race a blocked data send
        self._sending = trio.Lock()

    async def send(self, frame: bytes) -> None:
        """Send one frame (waits while the peer is not reading)."""
        if self._closed:
            raise StreamClosed("the seam is closed")
        if self.inbound._end is not None and not isinstance(self.inbound._end, StreamClosed):
            raise self.inbound._end
        try:
            self._sending.acquire_nowait()  # the usual case, and no checkpoint on the hot path
        except trio.WouldBlock:
            await self._sending.acquire()
        try:
            await self.outbound.put(frame)
        finally:
            self._sending.release()

    async def receive(self) -> bytes:
        """The next frame from the peer."""
        if self._closed:
            raise StreamClosed("the seam is closed")
        frame = await self.inbound.get()
        if frame is None:
            raise StreamClosed(f"{self.peer} ended the seam")
        return frame

    async def aclose(self) -> None:
        """End our side; the stream is reset if the peer does not end its side soon."""
        if self._closed:
            return
        self._closed = True
        self.outbound.finish()
        task = self.task
        if task is not None:
            loop = self._runtime.loop
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(lambda: loop.call_later(CLOSE_GRACE, task.cancel))

    async def abort(self, code: StatusCode, message: str) -> None:
        """End the stream now with ``code``: as the call's status on the serving side, a reset on the calling side."""
        if not self.server_side:
            self.reset()  # a gRPC client cannot send a status
            return
        self._closed = True
        # the writer meets the error in place of a frame and ends the call with it (see GrpcServer._handle)
        self.outbound.drop(StreamBroken(message, code))
        self.inbound.drop(StreamClosed("the seam was aborted"))

    def reset(self) -> None:
        """Reset the stream now (RST_STREAM); idempotent."""
        self._closed = True
        # a reset seam is usually a stuck one: free its queued frames now, not when the
        # connection under it is finally declared dead
        gone = StreamClosed("the seam was reset")
        self.outbound.drop(gone)
        self.inbound.drop(gone)
        task = self.task
        if task is not None:
            with contextlib.suppress(RuntimeError):
                self._runtime.loop.call_soon_threadsafe(task.cancel)


async def _recv_bounded(stream: Any, limit: int) -> bytes | None:
    # grpclib reads a whole message into memory before any codec sees it; a hostile
    # peer could declare 4 GiB. Read the 5-byte prefix ourselves and refuse oversize
    # frames before reading the body. (grpclib 0.4.9 internals, pinned.) A client stream's
    # reads must run inside its wrapper: that is how grpclib wakes them when the
    # connection is lost (the server wraps its whole handler already).
    with getattr(stream, "_wrapper", None) or contextlib.nullcontext():
        return await _recv_prefixed(stream, limit)


async def _recv_prefixed(stream: Any, limit: int) -> bytes | None:
    meta = await stream._stream.recv_data(5)
    if not meta:
        return None
    compressed, length = struct.unpack(">?I", meta)
    if compressed:
        raise StreamBroken("compressed gRPC messages are not accepted", StatusCode.UNIMPLEMENTED)
    if length > limit:
        raise StreamBroken(
            f"gRPC message of {length} bytes exceeds the {limit}-byte limit", StatusCode.RESOURCE_EXHAUSTED
        )
    data: bytes = await stream._stream.recv_data(length)
    return data


def _trailer_status(grpc_stream: Any, peer: str) -> StreamBroken | None:
    """The non-OK status in trailers the server already sent, if any.

    A server that ends a call before the client ended its side resets the stream right
    after the trailers; the reset must not hide the status. (grpclib 0.4.9 internals.)
    """
    inner = getattr(grpc_stream, "_stream", None)
    for headers in (getattr(inner, "trailers", None), getattr(inner, "headers", None)):
        fields = dict(headers or ())
        if "grpc-status" not in fields:
            continue
        try:
            code = StatusCode.coerce(int(fields["grpc-status"]))
        except ValueError:
            code = StatusCode.UNKNOWN
        if code == StatusCode.OK:
            return None
        message = grpclib.metadata.decode_grpc_message(fields.get("grpc-message", "")) or code.name
        return StreamBroken(f"{peer} ended the seam: {message}", code)
    return None


async def _pump(grpc_stream: Any, ours: GrpcFrameStream, limit: int, *, client: bool) -> None:
    """Move frames both ways until our side ends (then end the HTTP/2 stream) or the peer does."""
    side = "client" if client else "server"
    stages = (f"grpc.{side}.read", f"grpc.{side}.writing", f"grpc.{side}.written")

    async def read() -> None:
        try:
            if client:
                await grpc_stream.recv_initial_metadata()
            while True:
                frame = await _recv_bounded(grpc_stream, limit)
                timeline.mark(stages[0])
                if frame is None:
                    # the peer is done with the seam: our sends end too (a seam closes as a whole)
                    ours.outbound.finish(StreamClosed(f"{ours.peer} ended the seam"))
                    break
                await ours.inbound.put(frame)
            if client:
                status = _trailer_status(grpc_stream, ours.peer)
                if status is not None:
                    ours.inbound.finish(status)
                    return
                await grpc_stream.recv_trailing_metadata()  # raises GRPCError for a non-OK status
            ours.inbound.finish(None)
        except TransportError as exc:
            ours.inbound.finish(exc)
            raise
        except grpclib.exceptions.GRPCError as exc:
            code = StatusCode.coerce(int(exc.status.value))
            ours.inbound.finish(StreamBroken(f"{ours.peer} ended the seam: {exc.message or code.name}", code))
        except (
            grpclib.exceptions.StreamTerminatedError,
            grpclib.exceptions.ProtocolError,
            ConnectionError,
            asyncio.IncompleteReadError,
        ) as exc:
            status = _trailer_status(grpc_stream, ours.peer) if client else None
            ours.inbound.finish(
                status or StreamBroken(f"the seam with {ours.peer} was reset: {exc}", StatusCode.CANCELLED)
            )

    async def write() -> None:
        while True:
            try:
                frame = await ours.outbound.get()
            except StreamClosed:
                frame = None
            if frame is None:
                break
            timeline.mark(stages[1])
            await grpc_stream.send_message(frame)
            timeline.mark(stages[2])
        if client:
            await grpc_stream.end()

    reader = asyncio.ensure_future(read())
    writer = asyncio.ensure_future(write())
    try:
        done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            error = task.exception()
            if error is not None:
                raise error  # a refused frame or a failed send ends the whole stream
        # one direction ended cleanly; the other follows (or the grace timer resets the stream)
        await asyncio.gather(reader, writer)
    finally:
        reader.cancel()
        writer.cancel()
        broken = StreamBroken(f"the seam with {ours.peer} ended", StatusCode.CANCELLED)
        ours.inbound.finish(broken)
        ours.outbound.drop(broken)  # frames not sent never will be; wakes a trio sender waiting for room


class GrpcServer:
    """Serves seam streams; each new stream is handed to ``on_stream`` on the trio thread."""

    def __init__(
        self, runtime: AsyncioThread, on_stream: Callable[[FrameStream], None], *, max_frame_bytes: int
    ) -> None:
        self._runtime = runtime
        self._on_stream = on_stream
        self._limit = max_frame_bytes
        self._token = trio.lowlevel.current_trio_token()
        self._server: Server | None = None
        self.port = 0

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {SEAM_METHOD: grpclib.const.Handler(self._handle, grpclib.const.Cardinality.STREAM_STREAM, bytes, bytes)}

    async def _handle(self, stream: grpclib.server.Stream[bytes, bytes]) -> None:
        peer = stream.peer.addr() if stream.peer is not None else None
        ours = GrpcFrameStream(self._runtime, self._token, f"{peer[0]}:{peer[1]}" if peer else "peer", server_side=True)
        ours.task = asyncio.current_task()
        try:
            self._token.run_sync_soon(self._on_stream, ours)
        except trio.RunFinishedError:
            return
        await stream.send_initial_metadata()
        try:
            await _pump(stream, ours, self._limit, client=False)
        except TransportError as exc:
            raise grpclib.exceptions.GRPCError(grpclib.const.Status(int(exc.code)), str(exc)) from None
        except asyncio.CancelledError:
            ours.inbound.finish(StreamBroken("the seam was reset", StatusCode.CANCELLED))
            raise

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Listen; returns the bound port (pass 0 for any)."""

        async def start() -> int:
            self._server = Server([self], codec=_FrameCodec(), config=_config())
            await self._server.start(host, port, ssl=tls, reuse_address=True)
            listener: Any = self._server._server  # grpclib keeps the asyncio server private
            sockets = listener.sockets if listener is not None else []
            return int(sockets[0].getsockname()[1]) if sockets else port

        self.port = await self._runtime.call(start)
        return self.port

    async def close(self) -> None:
        """Stop listening and end open streams."""
        server = self._server
        if server is None:
            return
        self._server = None

        async def stop() -> None:
            server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 2.0)

        with trio.CancelScope(shield=True):
            await self._runtime.call(stop)


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
    ``KEEPALIVE_SECONDS + KEEPALIVE_TIMEOUT``, so a spare must also answer a PING within
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
        try:
            host, port = parse_address(address)
        except ValueError as exc:  # the address came from a route plan: the peer's word
            raise StreamBroken(f"cannot dial the next hop: {exc}", StatusCode.INVALID_ARGUMENT) from None
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
                    await _pump(stream, ours, self._limit, client=True)
                clean = True
            except BaseException as exc:
                if not opened.done():
                    opened.set_exception(exc)
                if not isinstance(exc, asyncio.CancelledError):
                    # a send that failed because the server ended the call: its status is the reason
                    status = _trailer_status(call, address) if call is not None else None
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
            ours.task = asyncio.ensure_future(run())
            ours.task.add_done_callback(_quiet)
            await opened

        try:
            await self._runtime.call(launch)
        except (
            TimeoutError,
            OSError,
            ValueError,  # a name the resolver refuses (UnicodeError), whatever parse_address let through
            grpclib.exceptions.GRPCError,
            grpclib.exceptions.ProtocolError,
            grpclib.exceptions.StreamTerminatedError,
            ssl.SSLError,
        ) as exc:
            self._pins.pop(peer, None)  # the peer may have a new certificate: fetch it again next time
            raise StreamBroken(f"cannot open a seam to {address}: {exc}", StatusCode.UNAVAILABLE) from None
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
        return Channel(peer.host, peer.port, ssl=tls, codec=_FrameCodec(), config=_config())

    async def _take_spare(self, peer: _Peer) -> Channel | None:
        spare = self._spares.pop(peer, None)
        if spare is None:
            return None
        spare.expiry.cancel()
        try:
            # not connected: the peer reset or ended it, or keepalive gave up on it
            alive = spare.channel._connected and await _answers_ping(
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
                await asyncio.wait_for(channel.__connect__(), self._timeout)
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
    protocol = getattr(channel, "_protocol", None)  # grpclib keeps the connection private
    transport = getattr(getattr(protocol, "connection", None), "_transport", None)
    if abort and transport is not None:
        transport.abort()
    channel.close()


async def _answers_ping(channel: Channel, seconds: float) -> bool:
    """Whether the peer at the other end of ``channel`` acknowledges a PING within ``seconds``."""
    # grpclib has no public PING; its connection reports each acknowledgement to
    # ``ping_ack_process`` (its keepalive's, too: an answer to either proves the link)
    connection = getattr(getattr(channel, "_protocol", None), "connection", None)
    if connection is None:
        return False
    acked = asyncio.get_running_loop().create_future()

    def ack() -> None:
        type(connection).ping_ack_process(connection)
        if not acked.done():
            acked.set_result(None)

    connection.ping_ack_process = ack
    try:
        connection._connection.ping(b"spare?\0\0")  # any 8 bytes: the answer, not its payload, counts
        connection.flush()
        await asyncio.wait_for(acked, seconds)
    except Exception:  # noqa: BLE001 - no answer, or the connection broke meanwhile: either way, not this one
        return False
    finally:
        with contextlib.suppress(AttributeError):
            del connection.ping_ack_process
    return True


def _quiet(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("seam stream ended: %r", task.exception())


def parse_address(address: str, *, listen: bool = False) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) into its parts; ``ValueError`` when malformed.

    A listen address may use port 0 (any free port).
    """
    return untrusted.host_port(address, listen=listen)


async def pinned_context(runtime: AsyncioThread, host: str, port: int, cert_sha256: bytes) -> ssl.SSLContext:
    """A TLS context that trusts exactly the certificate whose DER sha256 is ``cert_sha256``.

    The certificate is fetched once with an unverified handshake and checked against
    the pin; the returned context then requires that very certificate, so a
    man-in-the-middle in either handshake is refused.
    """

    async def fetch() -> bytes:
        probe = ssl.create_default_context()
        probe.check_hostname = False
        probe.verify_mode = ssl.CERT_NONE
        probe.set_alpn_protocols(["h2"])
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=probe), 5.0)
        try:
            ssl_object = writer.get_extra_info("ssl_object")
            der: bytes = ssl_object.getpeercert(binary_form=True)
            return der
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            del reader

    try:
        der = await runtime.call(fetch)
    except (TimeoutError, OSError, ssl.SSLError, ValueError) as exc:  # ValueError: a name the resolver refuses
        raise StreamBroken(f"TLS handshake with {host}:{port} failed: {exc}", StatusCode.UNAVAILABLE) from None
    if hashlib.sha256(der).digest() != cert_sha256:
        raise StreamBroken(
            f"{host}:{port} presented a certificate that is not the one the route names", StatusCode.UNAUTHENTICATED
        )
    context = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(der))
    context.check_hostname = False  # the pin names the certificate, not a host name
    context.set_alpn_protocols(["h2"])
    return context
