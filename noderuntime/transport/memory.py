"""In-memory frame streams: two ends joined by bounded trio channels (tests, in-process routes)."""

from __future__ import annotations

import trio

from noderuntime.transport.base import PeerAuthentication, StreamBroken, StreamClosed
from protocol import StatusCode


class MemoryFrameStream:
    """One end of an in-memory seam."""

    kind = "memory"
    authenticated: PeerAuthentication | None = None  # nothing proven of the peer here
    source = ""  # in-process tests may name one

    def __init__(
        self,
        send: trio.MemorySendChannel[bytes],
        receive: trio.MemoryReceiveChannel[bytes],
        ends: list[StreamBroken | None],
        index: int,
    ) -> None:
        self._send = send
        self._receive = receive
        # how each end was aborted, if it was: the other end's receive raises it
        self._ends = ends
        self._index = index

    async def send(self, frame: bytes) -> None:
        """Send one frame; blocks while the peer's buffer is full."""
        try:
            await self._send.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self._ends[1 - self._index] or StreamClosed("the peer closed the seam") from None

    async def receive(self) -> bytes:
        """The next frame; :class:`StreamClosed` once the peer closed."""
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError, trio.BrokenResourceError):
            raise self._ends[1 - self._index] or StreamClosed("the peer closed the seam") from None

    async def aclose(self) -> None:
        """Close both directions (idempotent, never blocks)."""
        self._send.close()
        self._receive.close()

    async def abort(self, code: StatusCode, message: str) -> None:
        """Close both directions; the peer's receive raises ``StreamBroken(message, code)``."""
        if self._ends[self._index] is None:
            self._ends[self._index] = StreamBroken(message, code)
        await self.aclose()


def memory_stream_pair(buffer: int = 4) -> tuple[MemoryFrameStream, MemoryFrameStream]:
    """Two connected ends, each direction buffering at most ``buffer`` frames."""
    a_send, b_receive = trio.open_memory_channel[bytes](buffer)
    b_send, a_receive = trio.open_memory_channel[bytes](buffer)
    ends: list[StreamBroken | None] = [None, None]
    return MemoryFrameStream(a_send, a_receive, ends, 0), MemoryFrameStream(b_send, b_receive, ends, 1)
