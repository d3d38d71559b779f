"""Seams sealed end to end: the handshake of :mod:`protocol.channel` over a frame stream, then sealed frames.

Every seam is sealed, direct as relayed: the dialer runs its half of the handshake over
the stream it opened (:func:`seal_dialer`: a gRPC stream, or a websocket a relay
paired), the acceptor its half over the stream it was handed
(:func:`seal_acceptor`), and each frame then crosses as one sealed message of the
stream underneath (:class:`SealedStream`). The handshake pins the acceptor to the node
id the route plan names and proves the dialer's node id, which the acceptor checks
against the session's ticket; both hashes cover the session id and epoch.

Nothing the path adds is believed. A stream's own end (a gRPC status, a websocket
close code) can be written by whoever carries it: a relay, or anyone on a direct link.
Before the peer sealed its first record such an end is reported as the path's word,
with UNAVAILABLE; once the channel is up, only a sealed close record ends a seam with
the peer's code, and any other end reads as a cut.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import trio

from noderuntime.access.identity import verify
from noderuntime.transport.base import (
    FrameStream,
    PeerAuthentication,
    StreamBroken,
    StreamClosed,
    TransportError,
)
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

# the three handshake messages take a round trip and a half (through a relay, or direct):
# how long an acceptor waits for a dialer to finish it (a slow dialer costs only its own seam)
HANDSHAKE_TIMEOUT = 10.0
# how long a dialer waits for the acceptor's answer: a route waits on it, so a next hop
# that took the connection and stopped is given up on sooner than that, with room for a
# loaded peer that a new seam reaches cold (a live hop given up on is excluded from the
# session's repairs: a false alarm costs more than a late one)
ANSWER_TIMEOUT = 5.0
# how long an end waits to send its sealed close record before it resets the stream instead
CLOSE_RECORD_SECONDS = 0.5


def _path_word(exc: TransportError) -> str:
    return f"{type(exc).__name__}, status {exc.code.name}: {exc}"


class SealedStream:
    """The FrameStream interface over another stream whose every frame is one sealed message.

    Made by :func:`seal_dialer` with its channel up, or by :func:`seal_acceptor` with the
    handshake still to come: an acceptor's stream runs it on its first :meth:`receive`
    (or on :meth:`handshake`), so that a node's wait for a seam's first frame bounds the
    handshake too. ``authenticated`` is None until the handshake is done.
    """

    def __init__(
        self,
        inner: FrameStream,
        peer: str,
        *,
        channel: SealedChannel | None = None,
        accepting: ChannelKeys | None = None,
    ) -> None:
        assert (channel is None) != (accepting is None)
        self.inner = inner
        self.peer = peer
        self.kind: str = getattr(inner, "kind", "sealed")
        self._channel = channel
        self._keys = accepting
        self._handshake_failed: StreamBroken | None = None
        # sealing takes the next nonce: a message must go out in the order it was sealed
        self._sending = trio.StrictFIFOLock()
        self._heard = False  # a sealed record came in: from now on only sealed ends count
        self._ended = False

    @property
    def authenticated(self) -> PeerAuthentication | None:
        """The node id and session the handshake proved, once it is done."""
        channel = self._channel
        if channel is None:
            return None
        return PeerAuthentication(channel.peer, channel.binding.session_id, channel.binding.epoch)

    @property
    def source(self) -> str:
        """The address of the stream underneath (see :class:`~noderuntime.transport.base.FrameStream`)."""
        return self.inner.source

    async def send(self, frame: bytes) -> None:
        """Seal ``frame`` and send it as one message of the stream underneath."""
        channel = self._channel
        if channel is None:
            raise StreamClosed(f"the seam with {self.peer} has no channel yet: the dialer speaks first")
        try:  # uncontended (one sender per seam), taking the turn costs no checkpoint
            self._sending.acquire_nowait()
        except trio.WouldBlock:
            await self._sending.acquire()
        try:
            try:
                message = channel.seal(frame)
            except ChannelError as exc:
                raise StreamClosed(f"the seam with {self.peer} is closed: {exc}") from None
            try:
                await self.inner.send(message)
            except TransportError as exc:
                raise self._cut(exc) from None
        finally:
            self._sending.release()

    async def receive(self) -> bytes:
        """The next frame; a message that does not open ends the seam (DATA_LOSS)."""
        channel = self._channel
        if channel is None:
            channel = await self.handshake()
        try:
            message = await self.inner.receive()
        except TransportError as exc:
            raise self._cut(exc) from None
        try:
            frame = channel.open(message)
        except ChannelClosed as end:
            self._ended = True
            await self._close_inner()
            if end.code == StatusCode.OK:
                raise StreamClosed(f"{self.peer} closed the seam") from None
            raise StreamBroken(f"{self.peer} ended the seam: {end.reason}", end.code) from None
        except ChannelError as exc:
            await self._fail(exc)
        self._heard = True
        return frame

    async def handshake(self) -> SealedChannel:
        """The acceptor's half of the handshake (once); :class:`StreamBroken` if it fails.

        A dialer that fails it hears why in the stream's own end, there being no channel
        yet to seal it in.
        """
        if self._channel is not None:
            return self._channel
        if self._handshake_failed is not None:
            raise self._handshake_failed
        assert self._keys is not None
        handshake = AcceptorHandshake(self._keys, verify)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await self.inner.send(handshake.read_first(await self.inner.receive()))
                self._channel = handshake.read_third(await self.inner.receive())
        except TransportError as exc:
            self._handshake_failed = StreamBroken(
                f"the dialer from {self.peer} left during the seam handshake ({_path_word(exc)})",
                StatusCode.UNAVAILABLE,
            )
        except ChannelError as exc:
            await self.inner.abort(exc.code, str(exc))
            self._handshake_failed = StreamBroken(f"refused a seam from {self.peer}: {exc}", exc.code)
        except trio.TooSlowError:
            await self.inner.abort(StatusCode.DEADLINE_EXCEEDED, "the seam handshake took too long")
            self._handshake_failed = StreamBroken(
                f"a dialer from {self.peer} did not finish the seam handshake", StatusCode.UNAVAILABLE
            )
        if self._handshake_failed is not None:
            raise self._handshake_failed
        assert self._channel is not None
        return self._channel

    def _cut(self, exc: TransportError) -> StreamBroken:
        """What an end of the stream underneath means: never the peer's word, which comes sealed."""
        if self._heard:
            return StreamBroken(f"the seam with {self.peer} was cut ({exc})", StatusCode.UNAVAILABLE)
        return StreamBroken(
            f"the seam with {self.peer} ended before the peer sealed a word; the path says: {_path_word(exc)}",
            StatusCode.UNAVAILABLE,
        )

    async def _fail(self, exc: ChannelError) -> NoReturn:
        # nothing more is read on it; the sending direction is intact, so the peer hears why, sealed
        await self._end(exc.code, str(exc))
        raise StreamBroken(f"the seam with {self.peer}: {exc}", exc.code)

    async def _end(self, code: StatusCode, message: str) -> None:
        if self._ended:
            return
        self._ended = True
        sent = False
        channel = self._channel
        with trio.CancelScope(shield=True):
            if channel is not None and not channel.closed:
                # after the send under way (a heartbeat, say); a sender stuck on a peer that
                # stops reading holds the turn past the wait, and then the stream is reset
                with trio.move_on_after(CLOSE_RECORD_SECONDS):
                    async with self._sending:
                        if not channel.closed:
                            try:
                                await self.inner.send(channel.seal_close(code, message))
                                sent = True
                            except TransportError:
                                pass  # the stream is gone already: there is nobody to tell
            if sent or code == StatusCode.OK:
                await self._close_inner()
            else:
                await self.inner.abort(code, message)

    async def _close_inner(self) -> None:
        with trio.CancelScope(shield=True):
            await self.inner.aclose()

    async def aclose(self) -> None:
        """End the seam cleanly (a sealed close, then the stream's own end); idempotent, bounded."""
        await self._end(StatusCode.OK, "")

    async def abort(self, code: StatusCode, message: str) -> None:
        """End the seam telling the peer ``code`` and ``message``: sealed once the channel is up."""
        if self._channel is None:
            self._ended = True
            with trio.CancelScope(shield=True):
                await self.inner.abort(code, message)
            return
        await self._end(code, message)


async def seal_dialer(
    inner: FrameStream, keys: ChannelKeys, binding: Binding, peer: str, *, within: float = ANSWER_TIMEOUT
) -> SealedStream:
    """Run the dialer's half of the handshake over ``inner``; the sealed stream, or StreamBroken.

    ``binding.acceptor`` is the node id the route plan names: any other key at the far
    end fails the handshake (UNAUTHENTICATED), whoever answers at the address. A peer that
    has not answered ``within`` seconds (one that accepted the connection and stopped, or a
    path that swallows it) fails it UNAVAILABLE, so that the route can go elsewhere.
    """
    handshake = DialerHandshake(keys, binding, verify)
    try:
        with trio.fail_after(within):
            await inner.send(handshake.first())
            await inner.send(handshake.read_second(await inner.receive()))
    except TransportError as exc:
        with trio.CancelScope(shield=True):
            await inner.aclose()
        raise StreamBroken(
            f"{peer} did not answer the seam handshake ({_path_word(exc)}); every seam is sealed, and a node "
            "started with --insecure-plaintext-seams answers only dialers started with it",
            StatusCode.UNAVAILABLE,
        ) from None
    except ChannelError as exc:
        with trio.CancelScope(shield=True):
            await inner.abort(exc.code, str(exc))
        raise StreamBroken(f"the seam with {peer}: {exc}", exc.code) from None
    except trio.TooSlowError:
        with trio.CancelScope(shield=True):
            await inner.abort(StatusCode.DEADLINE_EXCEEDED, "the handshake took too long")
        raise StreamBroken(
            f"{peer} did not answer the seam handshake in {within:g} s", StatusCode.UNAVAILABLE
        ) from None
    return SealedStream(inner, peer, channel=handshake.channel())


def seal_acceptor(inner: FrameStream, keys: ChannelKeys, peer: str) -> SealedStream:
    """``inner`` as a sealed stream whose handshake runs on its first receive (see :class:`SealedStream`)."""
    return SealedStream(inner, peer, accepting=keys)


def accept_sealed(on_stream: Callable[[FrameStream], None], keys: ChannelKeys) -> Callable[[FrameStream], None]:
    """A server's stream handler that hands ``on_stream`` each stream sealed (see :func:`seal_acceptor`)."""

    def accept(stream: FrameStream) -> None:
        on_stream(seal_acceptor(stream, keys, f"the dialer from {getattr(stream, 'peer', 'a peer')}"))

    return accept
