"""A seam's trio end over gRPC, and the pump that moves its frames between grpclib and the pipes."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any

import grpclib.metadata
import trio

from noderuntime.operations import timeline
from noderuntime.transport.base import PeerAuthentication, StreamBroken, StreamClosed, TransportError
from noderuntime.transport.grpc import _grpclib_private
from noderuntime.transport.grpc.bridge import AsyncioThread, Pipe, fresh
from noderuntime.transport.grpc.errors import PEER_STATUS, RESET, map_exceptions
from protocol import StatusCode

CLOSE_GRACE = 2.0  # seconds a closed stream waits for the peer to end its side before resetting


class GrpcFrameStream:
    """The trio end of one gRPC seam stream."""

    kind = "grpc"
    authenticated: PeerAuthentication | None = None  # nothing proven of the peer here

    def __init__(
        self,
        runtime: AsyncioThread,
        token: trio.lowlevel.TrioToken,
        peer: str,
        *,
        server_side: bool = False,
        source: str = "",
    ) -> None:
        self.peer = peer
        self.server_side = server_side
        self.source = source  # the peer's address, on the server's side
        self._runtime = runtime
        handover = runtime.handover(token)
        self.outbound = Pipe(handover, trio_to_aio=True)
        self.inbound = Pipe(handover, trio_to_aio=False)
        self.task: asyncio.Task[Any] | None = None  # the asyncio task that owns the HTTP/2 stream (see own)
        self._closed = False
        # the pipe keeps one waiting producer; a closing notice may race a blocked data send
        self._sending = trio.Lock()

    def own(self, task: asyncio.Task[Any]) -> None:
        """Record the asyncio task that owns the HTTP/2 stream, until it ends (asyncio thread).

        An ended task keeps the error that ended it, whose traceback holds the pump's frame,
        which holds this stream: kept past the end, that cycle waits for the cyclic collector,
        with the activations of the frames that were being sent still in it.
        """
        self.task = task
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        if self.task is task:
            self.task = None

    async def send(self, frame: bytes) -> None:
        """Send one frame (waits while the peer is not reading)."""
        if self._closed:
            raise StreamClosed("the seam is closed")
        failed = self.inbound.ended_with
        if failed is not None and not isinstance(failed, StreamClosed):
            raise fresh(failed)  # the kept one stays free of this frame
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
    # frames before reading the body.
    with _grpclib_private.reading(stream):
        return await _recv_prefixed(stream, limit)


async def _recv_prefixed(stream: Any, limit: int) -> bytes | None:
    meta = await _grpclib_private.recv_data(stream, 5)
    if not meta:
        return None
    compressed, length = struct.unpack(">?I", meta)
    if compressed:
        raise StreamBroken("compressed gRPC messages are not accepted", StatusCode.UNIMPLEMENTED)
    if length > limit:
        raise StreamBroken(
            f"gRPC message of {length} bytes exceeds the {limit}-byte limit", StatusCode.RESOURCE_EXHAUSTED
        )
    return await _grpclib_private.recv_data(stream, length)


def trailer_status(grpc_stream: Any, peer: str) -> StreamBroken | None:
    """The non-OK status in trailers the server already sent, if any.

    A server that ends a call before the client ended its side resets the stream right
    after the trailers; the reset must not hide the status.
    """
    for headers in _grpclib_private.received_headers(grpc_stream):
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


async def pump(grpc_stream: Any, ours: GrpcFrameStream, limit: int, *, client: bool) -> None:
    """Move frames both ways until our side ends (then end the HTTP/2 stream) or the peer does."""
    side = "client" if client else "server"
    stages = (f"grpc.{side}.read", f"grpc.{side}.writing", f"grpc.{side}.written")

    def reset(error: StreamBroken) -> None:
        # a reset right after the server's trailers must not hide the status they carry
        ours.inbound.finish((trailer_status(grpc_stream, ours.peer) if client else None) or error)

    async def read() -> None:
        try:
            # the peer ending its side ends our reading only: how it ended is recorded, the writer goes on
            with (
                map_exceptions(PEER_STATUS, ours.peer, into=ours.inbound.finish),
                map_exceptions(RESET, ours.peer, into=reset),
            ):
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
                    status = trailer_status(grpc_stream, ours.peer)
                    if status is not None:
                        ours.inbound.finish(status)
                        return
                    await grpc_stream.recv_trailing_metadata()  # raises GRPCError for a non-OK status
                ours.inbound.finish(None)
        except TransportError as exc:  # ours (a refused frame, the trio side gone): the whole stream ends
            ours.inbound.finish(exc)
            raise

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
        # an error leaving here holds this frame in its traceback; the tasks' own errors hold the
        # frames they were in, the frame being sent among them: whoever keeps the error (a
        # library's cycle, a log) must not keep those
        reader = writer = done = error = ours = grpc_stream = None  # type: ignore[assignment]
