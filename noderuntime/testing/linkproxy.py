"""A TCP proxy between two hops that can delay what it forwards, stop, or slow to a trickle.

There is no ``tc netem`` here, so a link's faults are made in user space: the proxy
runs trio in a thread of the test or benchmark process, and its mode can be switched at
any time:

- ``pass``: forward everything, each piece ``delay`` seconds after it arrived (each way,
  in order: a link ``delay`` long, with a round trip of twice it; 0 by default);
- ``stall``: stop reading either side (the sender's window fills, as on a dead link);
- ``deaf``: stop reading what the connecting side sends, and forward all the other way (a
  target that stops reading its input but still writes: its heartbeats arrive);
- ``trickle``: forward ``rate`` bytes per second in small pieces.

:meth:`LinkProxy.cut` goes further, for good: open links stall and new connections are
refused, as when the host behind the link drops off the network.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Literal

import trio

Mode = Literal["pass", "stall", "deaf", "trickle"]
PIECE = 64
IN_FLIGHT = 1024  # pieces a delayed direction holds before it stops reading (as a full window would)


@contextlib.asynccontextmanager
async def link_proxy(port: int) -> AsyncIterator[LinkProxy]:
    """A proxy in front of loopback ``port``, started and stopped from trio."""
    proxy = LinkProxy()
    proxy.target = port
    await trio.to_thread.run_sync(proxy.start)  # its own trio, in its own thread
    try:
        yield proxy
    finally:
        await trio.to_thread.run_sync(proxy.close)


class LinkProxy:
    """Listens on a loopback port and forwards every connection to ``target`` (set before use)."""

    def __init__(self, rate: float = 200.0) -> None:
        self.mode: Mode = "pass"
        self.rate = rate
        self.delay = 0.0  # seconds each piece waits, each way
        self.target: int | None = None
        self.port = 0
        self.connections = 0
        self.bytes_up: list[int] = []  # client -> target bytes, per connection in order of arrival
        # with ``record``, what a tap on the link reads: (connection, "up" or "down") -> the bytes
        self.record = False
        self.recorded: dict[tuple[int, str], bytearray] = {}
        self._links: set[trio.CancelScope] = set()
        self._listeners: list[trio.SocketListener] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), name="link-proxy", daemon=True)

    def start(self) -> int:
        """Start listening; the port."""
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the link proxy did not start")
        return self.port

    @property
    def open_links(self) -> int:
        """Connections being forwarded now."""
        return len(self._links)

    def drop(self) -> None:
        """Close every connection open now, both ends; go on accepting new ones."""
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._drop, trio_token=self._token)

    def _drop(self) -> None:
        for scope in self._links:
            scope.cancel()

    def cut(self) -> None:
        """Stall every open link and refuse new connections from now on (no reset, no end)."""
        self.mode = "stall"
        if self._token is not None:
            trio.from_thread.run(self._stop_listening, trio_token=self._token)

    async def _stop_listening(self) -> None:
        for listener in self._listeners:
            await listener.aclose()

    def close(self) -> None:
        """Stop the proxy and drop every connection (idempotent)."""
        if self._token is not None and self._scope is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(10)

    async def _main(self) -> None:
        with trio.CancelScope() as scope:
            self._scope = scope
            self._token = trio.lowlevel.current_trio_token()
            self._listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            self.port = self._listeners[0].socket.getsockname()[1]
            self._ready.set()
            async with trio.open_nursery() as nursery:
                for listener in self._listeners:
                    nursery.start_soon(self._accept, listener, nursery)

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return  # cut: the links already open stay, stalled
            nursery.start_soon(self._handle, stream)

    async def _handle(self, client: trio.SocketStream) -> None:
        if self.target is None:
            await client.aclose()
            return
        index = self.connections
        self.connections += 1
        self.bytes_up.append(0)
        try:
            server = await trio.open_tcp_stream("127.0.0.1", self.target)
        except OSError:
            await client.aclose()
            return
        link = trio.CancelScope()
        self._links.add(link)
        try:
            with link:
                async with client, server, trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, client, server, nursery.cancel_scope, index)
                    nursery.start_soon(self._pump, server, client, nursery.cancel_scope, None, index)
        finally:
            self._links.discard(link)

    async def _pump(
        self,
        src: trio.SocketStream,
        dst: trio.SocketStream,
        done: trio.CancelScope,
        index: int | None,
        down_of: int | None = None,
    ) -> None:
        send, pending = trio.open_memory_channel[tuple[float, bytes]](IN_FLIGHT)
        up = index is not None  # what the connecting side sends (a deaf target stops reading it)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._deliver, pending, dst, done)
            async with send:
                try:
                    while True:
                        await self._hold_while_dark(up=up)
                        size = PIECE if self.mode == "trickle" else 65536
                        data = await src.receive_some(size)
                        if not data:
                            break
                        # it went dark while we waited: what came stays here
                        await self._hold_while_dark(up=up)
                        if index is not None:
                            self.bytes_up[index] += len(data)  # counted before the target can see it
                        if self.record:
                            key = (index, "up") if index is not None else (down_of or 0, "down")
                            self.recorded.setdefault(key, bytearray()).extend(data)
                        await send.send((trio.current_time() + self.delay, data))
                        if self.mode == "trickle":
                            await trio.sleep(len(data) / self.rate)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    done.cancel()
        done.cancel()

    @staticmethod
    async def _deliver(
        pending: trio.MemoryReceiveChannel[tuple[float, bytes]], dst: trio.SocketStream, done: trio.CancelScope
    ) -> None:
        """Send each piece when its delay is up, in the order the pieces came."""
        try:
            async with pending:
                async for due, data in pending:
                    await trio.sleep_until(due)
                    await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            done.cancel()  # the far end is gone: so is the link

    async def _hold_while_dark(self, *, up: bool) -> None:
        # the mode is switched from another thread: a poll, not an event of this trio run
        while self.mode == "stall" or (up and self.mode == "deaf"):  # noqa: ASYNC110
            await trio.sleep(0.05)
