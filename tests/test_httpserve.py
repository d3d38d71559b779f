"""What the small HTTP surface does with its connections, seen over a raw loopback socket.

A client library's pool would hide when the server lets a connection go; here the test
holds the socket, so the server's side is what is measured (its live trio tasks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from noderuntime.operations import httpserve
from noderuntime.operations.httpserve import Routes, json_handler, serve_http
from noderuntime.operations.telemetry import trio_tasks

REQUEST = b"GET /ping HTTP/1.1\r\nhost: test\r\n\r\n"


async def _pong() -> dict[str, str]:
    return {"ping": "pong"}


@asynccontextmanager
async def _served() -> AsyncIterator[tuple[str, int]]:
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, Routes({"/ping": json_handler(_pong)}), "127.0.0.1:0")
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
