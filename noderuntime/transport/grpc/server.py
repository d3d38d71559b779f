"""The serving side: each new seam stream is handed to the node on the trio thread."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable

import grpclib.const
import grpclib.server
import trio
from grpclib.server import Server

from noderuntime.operations.connections import CONNECTIONS_PER_HOST, HostCap, source
from noderuntime.transport.base import FrameStream, StreamBroken
from noderuntime.transport.grpc import _grpclib_private
from noderuntime.transport.grpc.bridge import AsyncioThread
from noderuntime.transport.grpc.errors import as_call_status
from noderuntime.transport.grpc.stream import GrpcFrameStream, pump
from noderuntime.transport.grpc.wire import SEAM_METHOD, FrameCodec, configuration
from protocol import StatusCode


class GrpcServer:
    """Serves seam streams; each new stream is handed to ``on_stream`` on the trio thread.

    ``per_host``: connections one address (an IPv6 /64) may hold open at once (0: no cap);
    one more is closed before a byte of HTTP/2 (``connections.refused`` counts them).
    """

    def __init__(
        self,
        runtime: AsyncioThread,
        on_stream: Callable[[FrameStream], None],
        *,
        max_frame_bytes: int,
        per_host: int = CONNECTIONS_PER_HOST,
    ) -> None:
        self._runtime = runtime
        self._on_stream = on_stream
        self._limit = max_frame_bytes
        self.connections = HostCap(per_host)  # counted on the asyncio thread, where connections come and go
        self._token = trio.lowlevel.current_trio_token()
        self._server: Server | None = None
        self.port = 0

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {SEAM_METHOD: grpclib.const.Handler(self._handle, grpclib.const.Cardinality.STREAM_STREAM, bytes, bytes)}

    async def _handle(self, stream: grpclib.server.Stream[bytes, bytes]) -> None:
        peer = stream.peer.addr() if stream.peer is not None else None
        ours = GrpcFrameStream(
            self._runtime,
            self._token,
            f"{peer[0]}:{peer[1]}" if peer else "peer",
            server_side=True,
            source=source(str(peer[0])) if peer else "",
        )
        task = asyncio.current_task()
        assert task is not None  # grpclib runs each handler in a task of its own
        ours.own(task)
        try:
            self._token.run_sync_soon(self._on_stream, ours)
        except trio.RunFinishedError:
            return
        await stream.send_initial_metadata()
        try:
            with as_call_status():
                await pump(stream, ours, self._limit, client=False)
        except asyncio.CancelledError:
            ours.inbound.finish(StreamBroken("the seam was reset", StatusCode.CANCELLED))
            raise
        finally:
            # grpclib keeps the error that ends a reset call in a reference cycle of its own,
            # with this frame in the error's traceback: the seam must not hang from it
            ours = None  # type: ignore[assignment]

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Listen; returns the bound port (pass 0 for any)."""

        async def start() -> int:
            self._server = Server([self], codec=FrameCodec(), config=configuration())
            _grpclib_private.admit_connections(self._server, self.connections.take, self.connections.give)
            await self._server.start(host, port, ssl=tls, reuse_address=True)
            sockets = _grpclib_private.listening_sockets(self._server)
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
