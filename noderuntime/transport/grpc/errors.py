"""Where grpclib's, asyncio's, the OS's and ssl's errors become the transport's own.

Callers of this package see only :class:`~noderuntime.transport.base.TransportError`. Each
boundary a foreign error crosses names the :class:`ErrorMap` that fits it, and
:func:`map_exceptions` translates there, as httpcore's ``map_exceptions`` does: ``raise
StreamBroken(...) from None``, the foreign error's text kept in the message. The maps
differ on purpose, and each says why; :func:`as_call_status` is the way back, a
transport error ending a served call as its gRPC status.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Iterator

import attrs
import grpclib.const
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from noderuntime.transport.base import StreamBroken, TransportError
from protocol import StatusCode


@attrs.frozen
class ErrorMap:
    """Which foreign errors become a :class:`StreamBroken`, with which status and what message."""

    catches: tuple[type[Exception], ...]
    code: StatusCode | None  # None: the status the peer sent (a GRPCError's), and its message
    says: str  # what happened, naming ``{peer}``; the foreign error's text follows

    def translate(self, exc: Exception, peer: str) -> StreamBroken:
        """The transport's error for ``exc``, one of :attr:`catches`."""
        said = self.says.format(peer=peer)
        if self.code is None and isinstance(exc, GRPCError):
            code = StatusCode.coerce(int(exc.status.value))
            return StreamBroken(f"{said}: {exc.message or code.name}", code)
        return StreamBroken(f"{said}: {exc}", StatusCode.UNKNOWN if self.code is None else self.code)


# Once a seam is open, the peer ends it one of two ways: with a status of its own, passed on as it is,
PEER_STATUS = ErrorMap((GRPCError,), None, "{peer} ended the seam")
# or by a reset or a lost connection, which ends the seam mid-way: CANCELLED.
RESET = ErrorMap(
    (StreamTerminatedError, ProtocolError, ConnectionError, asyncio.IncompleteReadError),
    StatusCode.CANCELLED,
    "the seam with {peer} was reset",
)

# Before a seam's first frame, anything that fails means the peer cannot be reached now,
# so it is UNAVAILABLE (and the node falls back to the relay), even a status the peer sent:
# there was no seam yet for it to end. ValueError: a name the resolver refuses (UnicodeError).
_UNREACHABLE = (
    TimeoutError,
    OSError,
    ValueError,
    GRPCError,
    ProtocolError,
    StreamTerminatedError,
    ssl.SSLError,
)
UNREACHABLE = ErrorMap(_UNREACHABLE, StatusCode.UNAVAILABLE, "cannot open a seam to {peer}")
# fetching a pinned certificate is plain asyncio TLS: grpclib's errors cannot arise there
HANDSHAKE = ErrorMap(_UNREACHABLE, StatusCode.UNAVAILABLE, "TLS handshake with {peer} failed")
# An address the route plan names is the peer's word: a malformed one is the plan's fault.
BAD_ADDRESS = ErrorMap((ValueError,), StatusCode.INVALID_ARGUMENT, "cannot dial the next hop")


@contextlib.contextmanager
def map_exceptions(
    errors: ErrorMap, peer: str, *, into: Callable[[StreamBroken], None] | None = None
) -> Iterator[None]:
    """Raise what ``errors`` makes of a foreign error that escapes the block; others pass as they are.

    With ``into``, the translation is handed to it and the block ends quietly instead:
    a reader records how the peer ended its side, and the writer carries on.
    """
    try:
        yield
    except errors.catches as exc:
        error = errors.translate(exc, peer)
        if into is None:
            raise error from None
        into(error)


@contextlib.contextmanager
def as_call_status() -> Iterator[None]:
    """On the serving side, a transport error that ends the handler ends the call with its status."""
    try:
        yield
    except TransportError as exc:
        raise GRPCError(grpclib.const.Status(int(exc.code)), str(exc)) from None
