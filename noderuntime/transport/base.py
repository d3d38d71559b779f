"""The one interface every seam transport implements."""

from __future__ import annotations

from typing import Protocol

import attrs

from protocol import StatusCode


class TransportError(Exception):
    """A frame stream failed; ``code`` is the status the session ends with."""

    def __init__(self, message: str, code: StatusCode = StatusCode.UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code


class StreamClosed(TransportError):
    """The peer closed the stream (or we did): no more frames will come."""


class StreamBroken(TransportError):
    """The stream was reset or the connection failed."""


@attrs.frozen
class PeerAuthentication:
    """What a stream's own handshake proved about its peer: its node id, and the session it is bound to."""

    node_id: bytes
    session_id: bytes
    epoch: int


class FrameStream(Protocol):
    """A bidirectional, ordered stream of opaque frames (one seam of one session).

    ``send`` applies backpressure: it blocks while the peer is not reading.
    ``receive`` raises :class:`StreamClosed` when the peer closed cleanly and
    :class:`StreamBroken` on a reset. ``aclose`` is idempotent and does not wait
    for the peer. ``abort`` ends the stream with a status the peer's ``receive``
    raises (as :class:`StreamBroken` with that code): the answer to a peer whose
    bytes never became a session, so there is no session to send an Error frame in.
    ``authenticated`` is what the stream's own handshake proved of its peer (a relayed
    seam's end-to-end channel), or None where the transport proves nothing of it.
    """

    @property
    def authenticated(self) -> PeerAuthentication | None:
        """What the stream's own handshake proved of its peer, or None."""
        ...

    @property
    def source(self) -> str:
        """The address an accepted stream came from where its transport knows one (a direct
        seam's peer), else ``""`` (memory; a relayed seam, whose relay counts its dialers)."""
        ...

    async def send(self, frame: bytes) -> None:
        """Send one frame."""
        ...

    async def receive(self) -> bytes:
        """The next frame."""
        ...

    async def aclose(self) -> None:
        """Close both directions."""
        ...

    async def abort(self, code: StatusCode, message: str) -> None:
        """Close both directions at once, telling the peer ``code`` and ``message``."""
        ...
