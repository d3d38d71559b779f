"""Every reach into grpclib's private internals, each a small named function.

grpclib offers no public way to do these things. They were written against grpclib
``REVIEWED_FOR`` (pinned in ``pyproject.toml``); ``tests/test_grpclib_private.py`` checks
that each attribute they use is still there, so an upgrade fails that test, loudly,
instead of breaking seams one at a time. No other module of the package touches
grpclib's private names.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.server import Server

REVIEWED_FOR = "0.4.9"  # the grpclib these functions were checked against


def keepalive_configuration(every: float, timeout: float) -> Configuration:
    """Ping the peer every ``every`` seconds, idle or not; close when a ping goes unanswered ``timeout``."""
    # grpclib names its keepalive settings with a leading underscore: experimental
    return Configuration(
        _keepalive_time=every,
        _keepalive_timeout=timeout,
        _keepalive_permit_without_calls=True,
        _http2_max_pings_without_data=0,
        # grpclib sends no ping within this long of its last one, whether or not data
        # flowed since; at its default (300 s) a connection pings once and then goes blind
        _http2_min_sent_ping_interval_without_data=every / 2,
    )


def reading(stream: Any) -> AbstractContextManager[Any]:
    """What a read of a call's raw data must run inside: a client stream's wrapper, nothing on a server's."""
    # a client stream's reads must run inside its wrapper: that is how grpclib wakes them
    # when the connection is lost (the server wraps its whole handler already)
    wrapper: AbstractContextManager[Any] | None = getattr(stream, "_wrapper", None)
    return wrapper or contextlib.nullcontext()


async def recv_data(stream: Any, size: int) -> bytes:
    """The next ``size`` bytes of a call's HTTP/2 data, past grpclib's message reader; ``b""`` at its end."""
    # grpclib's reader takes a whole message into memory before any codec sees it
    data: bytes = await stream._stream.recv_data(size)
    return data


def received_headers(stream: Any) -> tuple[list[tuple[str, str]] | None, list[tuple[str, str]] | None]:
    """The trailers and the headers the peer has sent on a call so far (``None``: not yet, or no call)."""
    # grpclib reads them only once the call ends well; a reset after them hides them otherwise
    inner = getattr(stream, "_stream", None)
    return getattr(inner, "trailers", None), getattr(inner, "headers", None)


def admit_connections(server: Server, admit: Callable[[str], str | None], release: Callable[[str], None]) -> None:
    """Have ``server`` close each new connection at once unless ``admit(its peer's address)`` gives a key,
    and call ``release(key)`` when an admitted one ends. Before :meth:`Server.start`."""
    make = server._protocol_factory  # grpclib makes each connection's protocol with it, looked up at start

    def factory() -> Any:
        protocol = make()
        made, lost = protocol.connection_made, protocol.connection_lost
        key: str | None = None

        def connection_made(transport: Any) -> None:
            nonlocal key
            peer = transport.get_extra_info("peername")
            key = admit(str(peer[0]) if peer else "")
            if key is None:
                transport.abort()  # before grpclib saw it: no HTTP/2 preface, no task
                return
            made(transport)

        def connection_lost(exc: BaseException | None) -> None:
            if key is not None:
                release(key)
                lost(exc)

        protocol.connection_made = connection_made  # type: ignore[method-assign]
        protocol.connection_lost = connection_lost  # type: ignore[method-assign]
        return protocol

    server._protocol_factory = factory  # type: ignore[method-assign]


def listening_sockets(server: Server) -> list[socket.socket]:
    """The sockets a started server listens on."""
    listener: Any = server._server  # grpclib keeps the asyncio server private
    return list(listener.sockets) if listener is not None else []


def is_connected(channel: Channel) -> bool:
    """Whether a channel's connection is up: the peer did not reset or end it, nor keepalive give up on it."""
    return bool(channel._connected)


async def connect(channel: Channel) -> None:
    """Connect a channel now; grpclib would connect on its first call."""
    await channel.__connect__()


def abort_connection(channel: Channel) -> None:
    """Drop a channel's unsent bytes and reset its socket (a ``close`` alone waits to flush them)."""
    protocol = getattr(channel, "_protocol", None)  # grpclib keeps the connection private
    transport = getattr(getattr(protocol, "connection", None), "_transport", None)
    if transport is not None:
        transport.abort()


async def answers_ping(channel: Channel, seconds: float) -> bool:
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
