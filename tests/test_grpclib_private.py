"""grpclib's internals that the gRPC transport reaches into are all still there.

Every such reach is a function of ``noderuntime/transport/grpc/_grpclib_private.py``. Here
each one runs against real grpclib objects whose peer is an h2 server connection in
memory (no socket), so an upgrade that renames or moves one fails here, by name, instead
of breaking seams one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Coroutine
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import grpclib.client
import grpclib.const
import grpclib.exceptions
import grpclib.protocol
import grpclib.server
import grpclib.utils
import h2.config
import h2.connection
import h2.events
import pytest
from grpclib.config import Configuration

from noderuntime.transport.grpc import _grpclib_private
from noderuntime.transport.grpc.stream import trailer_status
from noderuntime.transport.grpc.wire import SEAM_METHOD, FrameCodec
from protocol import StatusCode

PACKAGE = Path(__file__).resolve().parents[1] / "noderuntime" / "transport" / "grpc"
_T = TypeVar("_T")


def _run(test: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    # grpclib's objects capture the running loop when they are made
    return asyncio.run(test())


class _H2Server:
    """A client connection's transport: its bytes go to an h2 server connection, whose answers come back."""

    def __init__(self, *, answers: bool = True) -> None:
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="ascii"))
        self.h2.initiate_connection()
        self.answers = answers
        self.events: list[h2.events.Event] = []
        self.aborted = False
        self.client = grpclib.protocol.H2Protocol(
            grpclib.client.Handler(),
            Configuration().__for_client__(),
            h2.config.H2Configuration(client_side=True, header_encoding="ascii"),
        )
        self.client.connection_made(self)  # type: ignore[arg-type]

    def channel(self) -> grpclib.client.Channel:
        """A channel connected through this server, as ``Channel.__connect__`` leaves one over a socket."""
        channel = grpclib.client.Channel("127.0.0.1", 1, codec=FrameCodec())
        channel._protocol = self.client
        return channel

    def write(self, data: bytes) -> None:
        self.events += self.h2.receive_data(data)
        if self.answers:
            self.answer()

    def answer(self) -> None:
        """Send the client what the server has queued."""
        data = self.h2.data_to_send()
        if data:
            asyncio.get_running_loop().call_soon(self.client.data_received, data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.aborted = True


def test_the_installed_grpclib_is_the_one_the_private_reaches_were_checked_against() -> None:
    assert metadata.version("grpclib") == _grpclib_private.REVIEWED_FOR, (
        "grpclib changed: check each function of noderuntime/transport/grpc/_grpclib_private.py, then REVIEWED_FOR"
    )


def test_grpclib_takes_the_experimental_keepalive_settings() -> None:
    config = _grpclib_private.keepalive_configuration(10.0, 20.0)
    assert config._keepalive_time == 10.0 and config._keepalive_timeout == 20.0
    assert config._keepalive_permit_without_calls and config._http2_max_pings_without_data == 0
    assert config._http2_min_sent_ping_interval_without_data == 5.0


def test_a_server_shows_the_sockets_it_listens_on() -> None:
    async def test() -> None:
        server = grpclib.server.Server([])
        assert server._server is None and _grpclib_private.listening_sockets(server) == []

    _run(test)


def test_a_servers_connections_are_admitted_by_the_hook_it_is_given() -> None:
    class Transport:
        aborted = False

        def get_extra_info(self, name: str, default: Any = None) -> Any:
            return ("192.0.2.7", 40000) if name == "peername" else default

        def abort(self) -> None:
            self.aborted = True

    async def test() -> None:
        server = grpclib.server.Server([])
        asked: list[str] = []
        _grpclib_private.admit_connections(server, lambda address: asked.append(address) or None, asked.append)
        protocol = server._protocol_factory()
        assert isinstance(protocol, grpclib.protocol.H2Protocol)
        transport = Transport()
        protocol.connection_made(transport)  # type: ignore[arg-type]
        assert (
            asked == ["192.0.2.7"] and transport.aborted and not hasattr(protocol, "connection")
        )  # grpclib never saw it
        protocol.connection_lost(None)  # asyncio's call after the abort: nothing to release
        assert asked == ["192.0.2.7"]

    _run(test)


def test_a_channel_is_connected_pinged_and_aborted() -> None:
    async def test() -> None:
        server = _H2Server()
        channel = server.channel()
        await _grpclib_private.connect(channel)  # connected already: returns at once
        assert channel._protocol is server.client and _grpclib_private.is_connected(channel)
        assert await _grpclib_private.answers_ping(channel, 5.0)
        assert any(isinstance(event, h2.events.PingReceived) for event in server.events)
        connection = server.client.connection
        assert "ping_ack_process" not in vars(connection)  # the probe put grpclib's own back
        server.answers = False
        assert not await _grpclib_private.answers_ping(channel, 0.05)
        assert "ping_ack_process" not in vars(connection)
        assert connection._transport is server
        _grpclib_private.abort_connection(channel)
        assert server.aborted
        server.client.connection_lost(None)
        assert not _grpclib_private.is_connected(channel)
        channel.close()

    _run(test)


def test_a_calls_data_headers_and_trailers_are_read_where_grpclib_keeps_them() -> None:
    async def test() -> None:
        server = _H2Server()
        channel = server.channel()
        with pytest.raises(grpclib.exceptions.GRPCError) as ended:
            async with channel.request(SEAM_METHOD, grpclib.const.Cardinality.STREAM_STREAM, bytes, bytes) as stream:
                assert isinstance(_grpclib_private.reading(stream), grpclib.utils.Wrapper)
                assert _grpclib_private.received_headers(stream) == (None, None)  # no call yet
                await stream.send_request()
                assert isinstance(stream._stream, grpclib.protocol.Stream)
                assert _grpclib_private.received_headers(stream) == (None, None)
                (request,) = [e for e in server.events if isinstance(e, h2.events.RequestReceived)]
                server.h2.send_headers(
                    request.stream_id, [(":status", "200"), ("content-type", "application/grpc+noderuntime-frames")]
                )
                server.h2.send_data(request.stream_id, b"\0\0\0\0\3abc")
                server.h2.send_headers(request.stream_id, [("grpc-status", "5"), ("grpc-message", "gone")], True)
                server.answer()
                with _grpclib_private.reading(stream):
                    assert await _grpclib_private.recv_data(stream, 5) == b"\0\0\0\0\3"
                    assert await _grpclib_private.recv_data(stream, 3) == b"abc"
                    assert await _grpclib_private.recv_data(stream, 5) == b""
                trailers, headers = _grpclib_private.received_headers(stream)
                assert dict(headers or ())[":status"] == "200" and dict(trailers or ())["grpc-status"] == "5"
                status = trailer_status(stream, "peer")
                assert status is not None and (status.code, str(status)) == (
                    StatusCode.NOT_FOUND,
                    "peer ended the seam: gone",
                )
                await stream.end()  # grpclib reads the status itself at the end of the call
        assert ended.value.status == grpclib.const.Status.NOT_FOUND  # grpclib read the same trailers
        channel.close()

    _run(test)


def test_a_served_calls_http2_stream_is_where_the_transport_reads_it() -> None:
    async def test() -> None:
        inner = _H2Server().client.connection.create_stream()
        stream = grpclib.server.Stream(
            inner,
            SEAM_METHOD,
            grpclib.const.Cardinality.STREAM_STREAM,
            bytes,
            bytes,
            codec=FrameCodec(),
            status_details_codec=None,
            dispatch=None,  # only stored when a stream is made
        )
        assert stream._stream is inner and callable(inner.recv_data)
        assert (inner.headers, inner.trailers) == (None, None)
        assert isinstance(_grpclib_private.reading(stream), contextlib.nullcontext)  # the server wraps its handler

    _run(test)


# what each reach looks like in source; only _grpclib_private.py may show one
_PRIVATE = re.compile(
    r"(?<!self)[.\"](?:_stream|_wrapper|_connected|_protocol|_transport|_connection|_server)\b"
    r"|ping_ack_process|__connect__|_keepalive_|_http2_"
)


def test_no_other_module_of_the_package_reaches_into_grpclib() -> None:
    found = {
        f"{path.name}:{number}: {line.strip()}"
        for path in PACKAGE.glob("*.py")
        if path.name != "_grpclib_private.py"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _PRIVATE.search(line) and not line.lstrip().startswith("#")
    }
    assert found == set()
