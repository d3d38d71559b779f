"""Relayed seams sealed end to end: the handshake of :mod:`protocol.channel` over a paired websocket, then frames.

The relay pairs the two websocket connections; both ends then run the handshake in
them (:func:`open_dialer_side`, :func:`open_acceptor_side`) and exchange sealed frames
(:class:`SealedFrameStream`). Nothing here trusts what the relay adds: a close it
sends once the channel is up reads as a cut seam (UNAVAILABLE), whatever code it
names; the peer's own end comes in a sealed close record.
"""

from __future__ import annotations

import contextlib
import os
from typing import NoReturn

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from noderuntime.access.identity import verify
from noderuntime.transport import relay_messages as m
from noderuntime.transport.base import PeerAuthentication, StreamBroken, StreamClosed
from protocol import StatusCode
from protocol.channel import (
    AcceptorHandshake,
    Binding,
    ChannelClosed,
    ChannelError,
    ChannelKeys,
    DialerHandshake,
    SealedChannel,
)

# the three handshake messages take a round trip and a half through the relay
HANDSHAKE_TIMEOUT = 10.0

# Benchmarks only: with this set to 1 on both ends, relayed seams go unencrypted, so that
# benchmarks.seams can measure what sealing costs side by side. A node without it refuses
# such a seam (fail closed), and one with it cannot talk to one without.
PLAINTEXT_ENV = "NODERUNTIME_BENCHMARK_PLAINTEXT_RELAY_SEAMS"


def plaintext_for_benchmarks() -> bool:
    """Whether this process runs its relayed seams unencrypted (see :data:`PLAINTEXT_ENV`)."""
    return os.environ.get(PLAINTEXT_ENV) == "1"


def _status_of(exc: ConnectionClosed) -> tuple[StatusCode, str]:
    """The status a websocket close names (unauthenticated: the relay may have written it)."""
    reason = exc.reason
    code = reason.code if reason is not None else None
    text = (reason.reason or "") if reason is not None else ""
    if m.is_status_close(code):
        assert code is not None
        return StatusCode.coerce(code - m.CLOSE_STATUS_BASE), text
    return StatusCode.UNAVAILABLE, f"closed ({code}{': ' + text if text else ''})"


async def _close_with(ws: WebSocketConnection, code: StatusCode, message: str) -> None:
    """End a websocket whose channel is not up, with ``code`` in its close code (the relay passes it on)."""
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        await ws.aclose(m.CLOSE_STATUS_BASE + int(code), message.encode()[:120].decode(errors="ignore"))


class SealedFrameStream:
    """The FrameStream interface over a relayed websocket whose every message is sealed (see module doc)."""

    kind = "relay"

    def __init__(self, ws: WebSocketConnection, relay: str, channel: SealedChannel) -> None:
        self.ws = ws
        self.peer = relay
        self._channel = channel
        self.authenticated: PeerAuthentication | None = PeerAuthentication(
            channel.peer, channel.binding.session_id, channel.binding.epoch
        )
        self.closed = trio.Event()
        # sealing takes the next nonce: a message must go out in the order it was sealed
        self._sending = trio.StrictFIFOLock()
        self._heard = False  # a sealed message came in: from now on only sealed ends count

    async def send(self, frame: bytes) -> None:
        """Seal ``frame`` and send it as one message."""
        try:  # uncontended (one sender per seam), taking the turn costs no checkpoint
            self._sending.acquire_nowait()
        except trio.WouldBlock:
            await self._sending.acquire()
        try:
            try:
                message = self._channel.seal(frame)
            except ChannelError as exc:
                raise StreamClosed(f"the seam through {self.peer} is closed: {exc}") from None
            try:
                await self.ws.send_message(message)
            except ConnectionClosed as exc:
                self.closed.set()
                raise self._cut(exc) from None
        finally:
            self._sending.release()

    async def receive(self) -> bytes:
        """The next frame; a message that does not open ends the seam (DATA_LOSS)."""
        try:
            message = await self.ws.get_message()
        except ConnectionClosed as exc:
            self.closed.set()
            raise self._cut(exc) from None
        if not isinstance(message, bytes):
            await self._fail(ChannelError("a text message on a sealed seam", StatusCode.DATA_LOSS))
        try:
            frame = self._channel.open(message)
        except ChannelClosed as end:
            self.closed.set()
            if end.code == StatusCode.OK:
                raise StreamClosed(f"the peer through {self.peer} closed the seam") from None
            raise StreamBroken(f"the peer through {self.peer} ended the seam: {end.reason}", end.code) from None
        except ChannelError as exc:
            await self._fail(exc)
        self._heard = True
        return frame

    async def _fail(self, exc: ChannelError) -> NoReturn:
        # nothing more is read on it; the sending direction is intact, so the peer hears why, sealed
        await self._end(exc.code, str(exc), sealed=True)
        raise StreamBroken(f"the seam through {self.peer}: {exc}", exc.code)

    def _cut(self, exc: ConnectionClosed) -> StreamBroken:
        code, text = _status_of(exc)
        if self._heard:
            # the peer ends a seam in a sealed record; a bare close came from the path
            return StreamBroken(f"the seam through {self.peer} was cut ({text})", StatusCode.UNAVAILABLE)
        return StreamBroken(f"the seam through {self.peer} closed before it answered: {text}", code)

    async def _end(self, code: StatusCode, message: str, *, sealed: bool) -> None:
        self.closed.set()
        with trio.CancelScope(shield=True):
            # after the send under way (a heartbeat, say); a sender stuck on a peer that stops
            # reading holds the turn past the wait, and then the close goes unsealed
            with trio.move_on_after(0.5):
                if sealed and not self._channel.closed:
                    async with self._sending:
                        if not self._channel.closed:
                            with contextlib.suppress(ConnectionClosed):
                                await self.ws.send_message(self._channel.seal_close(code, message))
            with trio.move_on_after(1.0):
                await self.ws.aclose()

    async def aclose(self) -> None:
        """End the seam cleanly (a sealed close, then the websocket's); idempotent, bounded."""
        await self._end(StatusCode.OK, "", sealed=True)

    async def abort(self, code: StatusCode, message: str) -> None:
        """End the seam telling the peer ``code`` and ``message``, sealed."""
        await self._end(code, message, sealed=True)


async def open_dialer_side(
    ws: WebSocketConnection, keys: ChannelKeys, binding: Binding, relay: str
) -> SealedFrameStream:
    """Run the dialer's half of the handshake on a paired connection; the sealed stream, or StreamBroken."""
    handshake = DialerHandshake(keys, binding, verify)
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            await ws.send_message(handshake.first())
            answer = await ws.get_message()
            if not isinstance(answer, bytes):
                raise ChannelError("the handshake's answer is not binary", StatusCode.INVALID_ARGUMENT)
            await ws.send_message(handshake.read_second(answer))
    except ConnectionClosed as exc:
        code, text = _status_of(exc)
        raise StreamBroken(
            f"the node behind {relay} refused the end-to-end seam handshake ({text}); a node that does not speak "
            "it cannot be reached through a relay",
            code if code != StatusCode.UNAVAILABLE else StatusCode.FAILED_PRECONDITION,
        ) from None
    except ChannelError as exc:
        await _close_with(ws, exc.code, str(exc))
        raise StreamBroken(f"the seam through {relay}: {exc}", exc.code) from None
    except trio.TooSlowError:
        await _close_with(ws, StatusCode.DEADLINE_EXCEEDED, "the handshake took too long")
        raise StreamBroken(
            f"the node behind {relay} did not finish the seam handshake in {HANDSHAKE_TIMEOUT:.0f} s",
            StatusCode.UNAVAILABLE,
        ) from None
    return SealedFrameStream(ws, relay, handshake.channel())


async def open_acceptor_side(ws: WebSocketConnection, keys: ChannelKeys, relay: str) -> SealedFrameStream:
    """Run the acceptor's half of the handshake on a paired connection; the sealed stream, or StreamBroken.

    A dialer that fails the handshake hears why in the websocket's close (there is no
    channel yet to seal it in).
    """
    handshake = AcceptorHandshake(keys, verify)
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            first = await ws.get_message()
            if not isinstance(first, bytes):
                raise ChannelError("a text message in place of the seam handshake", StatusCode.INVALID_ARGUMENT)
            await ws.send_message(handshake.read_first(first))
            third = await ws.get_message()
            if not isinstance(third, bytes):
                raise ChannelError("a text message in place of the seam handshake", StatusCode.INVALID_ARGUMENT)
            channel = handshake.read_third(third)
    except ConnectionClosed as exc:
        _code, text = _status_of(exc)
        raise StreamBroken(
            f"the dialer left {relay} during the seam handshake ({text})", StatusCode.UNAVAILABLE
        ) from None
    except ChannelError as exc:
        await _close_with(ws, exc.code, str(exc))
        raise StreamBroken(f"refused a seam through {relay}: {exc}", exc.code) from None
    except trio.TooSlowError:
        await _close_with(ws, StatusCode.DEADLINE_EXCEEDED, "the seam handshake took too long")
        raise StreamBroken(
            f"a dialer through {relay} did not finish the seam handshake", StatusCode.UNAVAILABLE
        ) from None
    return SealedFrameStream(ws, relay, channel)
