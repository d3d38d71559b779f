"""What the small HTTP surface does with its connections, seen over a raw loopback socket.

A client library's pool would hide when the server lets a connection go; here the test
holds the socket, so the server's side is what is measured (its live trio tasks).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from noderuntime.operations import httpserve
from noderuntime.operations.httpserve import BodyLimit, Routes, json_handler, serve_http
from noderuntime.operations.telemetry import trio_tasks

REQUEST = b"GET /ping HTTP/1.1\r\nhost: test\r\n\r\n"


async def _pong() -> dict[str, str]:
    return {"ping": "pong"}


@asynccontextmanager
async def _served(app: Any = None, per_host: int = httpserve.CONNECTIONS_PER_HOST) -> AsyncIterator[tuple[str, int]]:
    app = app or Routes({"/ping": json_handler(_pong)})
    async with trio.open_nursery() as nursery:
        url = await nursery.start(functools.partial(serve_http, app, "127.0.0.1:0", per_host=per_host))
        host, port = url.removeprefix("http://").rsplit(":", 1)
        yield host, int(port)
        nursery.cancel_scope.cancel()


async def _ask(stream: trio.SocketStream) -> bytes:
    await stream.send_all(REQUEST)
    got = b""
    while b"pong" not in got:
        chunk = await stream.receive_some()
        assert chunk, got
        got += chunk
    return got


async def _back_to(count: int, within: float) -> bool:
    with trio.move_on_after(within):
        while trio_tasks() > count:
            await trio.sleep(0.02)
        return True
    return False


@pytest.mark.trio
async def test_a_connection_its_client_closes_is_let_go_at_once() -> None:
    async with _served() as (host, port):
        before = trio_tasks()
        # closed at once, and closed once the connection has gone idle: hypercorn 0.18 kept
        # the latter (its task, its descriptor in CLOSE-WAIT) for the whole keep-alive
        for pause in (0.0, 0.05, 0.2):
            stream = await trio.open_tcp_stream(host, port)
            assert (await _ask(stream)).startswith(b"HTTP/1.1 200 ")
            assert trio_tasks() > before
            await trio.sleep(pause)
            await stream.aclose()
            assert await _back_to(before, within=1.0), (pause, trio_tasks() - before)  # not after the 10 s keep-alive


@pytest.mark.trio
async def test_an_open_connection_serves_again_and_is_closed_once_idle_past_the_keep_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(httpserve, "KEEP_ALIVE_SECONDS", 0.5)
    async with _served() as (host, port):
        before = trio_tasks()
        stream = await trio.open_tcp_stream(host, port)
        for _ in range(3):
            assert (await _ask(stream)).startswith(b"HTTP/1.1 200 ")
            await trio.sleep(0.2)  # idle, within the keep-alive
        with trio.fail_after(2.0):
            assert await stream.receive_some() == b""  # the server closed it
        await stream.aclose()
        assert await _back_to(before, within=1.0), trio_tasks() - before


async def _answer_or_close(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    got = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some():
            got += chunk
    return got


@pytest.mark.trio
async def test_a_body_that_does_not_arrive_in_time_is_answered_408_and_its_connection_closed() -> None:
    """A client that sends its headers and trickles (or stops) its body held its connection as long as it liked."""
    async with _served(BodyLimit(Routes({}), limit=1000, seconds=0.5)) as (host, port):
        before = trio_tasks()
        stream = await trio.open_tcp_stream(host, port)
        started = trio.current_time()
        await stream.send_all(b"POST /x HTTP/1.1\r\nhost: test\r\ncontent-length: 100\r\n\r\n{")
        answer = await _answer_or_close(stream)
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"body_timeout"' in answer, answer
        assert 0.5 <= trio.current_time() - started < 3.0
        await stream.aclose()
        assert await _back_to(before, within=1.0), trio_tasks() - before
        # a whole body in time is the app's to answer (404 here: the app has no POST)
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(b"POST /x HTTP/1.1\r\nhost: test\r\ncontent-length: 2\r\n\r\n{}")
        assert (await stream.receive_some()).startswith(b"HTTP/1.1 404 ")
        await stream.aclose()


@pytest.mark.trio
async def test_one_address_holds_at_most_its_cap_of_connections() -> None:
    """Past the cap a new connection from the same address is closed unanswered; one that ends makes room."""
    async with _served(per_host=3) as (host, port):
        before = trio_tasks()
        held = [await trio.open_tcp_stream(host, port) for _ in range(3)]
        for stream in held:
            assert (await _ask(stream)).startswith(b"HTTP/1.1 200 ")
        with_three = trio_tasks()
        extra = await trio.open_tcp_stream(host, port)  # the kernel accepts it; the server closes it
        with contextlib.suppress(trio.BrokenResourceError):
            await extra.send_all(REQUEST)
        with contextlib.suppress(trio.BrokenResourceError):
            assert await _answer_or_close(extra) == b""
        await extra.aclose()
        await held.pop().aclose()
        # counted out as soon as the server reads its end (its tasks gone), and a newcomer is served
        assert await _back_to(with_three - (with_three - before) // 3, within=1.0)
        again = await trio.open_tcp_stream(host, port)
        assert (await _ask(again)).startswith(b"HTTP/1.1 200 ")
        for stream in [*held, again]:
            await stream.aclose()
