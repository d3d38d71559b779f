"""A frame stream over a trio-websocket connection (one binary message per frame)."""

from __future__ import annotations

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from noderuntime.transport import relay_messages as m
from noderuntime.transport.base import PeerAuthentication, StreamBroken, StreamClosed
from protocol import Limits, StatusCode
from protocol.channel import sealed_size

# One message carries one seam frame, sealed (protocol.channel), and the encoder cuts every
# step into frames of at most max_frame_bytes (trio-websocket's default of 1 MiB would close
# the connection on a larger prefill chunk). No more: a relay holds up to this much, twice,
# for each connection that has not yet proven anything.
MAX_MESSAGE_BYTES = sealed_size(Limits().max_frame_bytes)
# The default 4 KiB receive buffer caps throughput at ~66 MB/s on this machine; 256 KiB reaches ~160.
RECEIVE_BUFFER_BYTES = 256 << 10
# One queued message per connection: the sender waits for the reader (backpressure).
MESSAGE_QUEUE = 1


# How often a control connection is pinged, and how long a pong may take: a peer whose
# host lost power or whose NAT mapping expired never closes its connection.
KEEPALIVE_SECONDS = 30.0


async def until_silent(ws: WebSocketConnection, every: float = KEEPALIVE_SECONDS) -> None:
    """Ping ``ws`` every ``every`` seconds; return once a ping goes unanswered that long.

    Raises ``ConnectionClosed`` when the connection closes first.
    """
    while True:
        await trio.sleep(every)
        with trio.move_on_after(every) as waited:
            await ws.ping()
        if waited.cancelled_caught:
            return


class WebSocketFrameStream:
    """The FrameStream interface over one websocket connection."""

    kind = "relay"
    authenticated: PeerAuthentication | None = None  # nothing proven of the peer here
    source = ""  # every relayed seam comes from the relay

    def __init__(self, ws: WebSocketConnection, peer: str) -> None:
        self.ws = ws
        self.peer = peer
        self.closed = trio.Event()

    async def send(self, frame: bytes) -> None:
        """Send one frame as one binary message."""
        try:
            await self.ws.send_message(frame)
        except ConnectionClosed as exc:
            self.closed.set()
            raise _translate(exc, self.peer) from None

    async def receive(self) -> bytes:
        """The next frame; text messages are refused."""
        try:
            message = await self.ws.get_message()
        except ConnectionClosed as exc:
            self.closed.set()
            raise _translate(exc, self.peer) from None
        if not isinstance(message, bytes):
            await self.aclose()
            raise StreamBroken(f"{self.peer} sent a text message on a seam", StatusCode.INVALID_ARGUMENT)
        return message

    async def aclose(self) -> None:
        """Close the websocket; idempotent, bounded."""
        self.closed.set()
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            await self.ws.aclose()

    async def abort(self, code: StatusCode, message: str) -> None:
        """Close with ``code`` carried in the close code (the relay passes it on), ``message`` as reason."""
        self.closed.set()
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            # a close reason is at most 123 bytes of UTF-8
            reason = message.encode()[:120].decode(errors="ignore")
            await self.ws.aclose(m.CLOSE_STATUS_BASE + int(code), reason)


def _translate(exc: ConnectionClosed, peer: str) -> StreamClosed | StreamBroken:
    code = exc.reason.code if exc.reason is not None else None
    reason = exc.reason.reason if exc.reason is not None else ""
    if code == 1000:
        return StreamClosed(f"{peer} closed the seam")
    if m.is_status_close(code):
        assert code is not None
        return StreamBroken(f"{peer} ended the seam: {reason}", StatusCode.coerce(code - m.CLOSE_STATUS_BASE))
    return StreamBroken(
        f"the seam through {peer} closed ({code}{': ' + reason if reason else ''})", StatusCode.UNAVAILABLE
    )
