"""Every HTTP server of the project (the gateway, the tracker, nodes' and relays' status), on hypercorn's
trio worker, with a small ASGI app for the status surfaces and a body-limiting middleware."""

from __future__ import annotations

import functools
import json
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio import serve, tcp_server

from noderuntime.operations.connections import CONNECTIONS_PER_HOST, HostCap

Handler = Callable[[], Awaitable[tuple[int, str, bytes]]]  # -> (status, content type, body)
QueryHandler = Callable[[dict[str, str]], Awaitable[tuple[int, str, bytes]]]  # the same, given the query
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def json_handler(producer: Callable[[], Awaitable[Any]]) -> Handler:
    """A GET handler answering ``producer()`` as JSON."""

    async def handle() -> tuple[int, str, bytes]:
        return 200, "application/json", json.dumps(await producer(), default=str).encode() + b"\n"

    return handle


class Routes:
    """An ASGI app serving GET on a fixed set of paths."""

    def __init__(self, routes: dict[str, Handler], queries: dict[str, QueryHandler] | None = None) -> None:
        self.routes = routes
        self.queries = queries or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] != "GET" or (path not in self.routes and path not in self.queries):
            status, ctype, body = 404, "text/plain", b"not found\n"
        elif path in self.routes:
            status, ctype, body = await self.routes[path]()
        else:
            try:
                query = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode(), strict_parsing=False))
            except UnicodeDecodeError:
                query = {}
            status, ctype, body = await self.queries[path](query)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


KEEP_ALIVE_SECONDS = 10.0
# a request's body must have arrived this long after its headers: 8 MiB (the gateway's
# limit) over 2.5 Mbit/s. A client that trickled one, or stopped sending it, held its
# connection for as long as it liked
BODY_SECONDS = 30.0


class _Config(Config):
    host_cap: HostCap | None = None


def _peer(stream: Any) -> str:
    sock = getattr(stream, "socket", None) or stream.transport_stream.socket  # plain, or under TLS
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return ""  # it left already


class _TCPServer(tcp_server.TCPServer):
    """Hypercorn's trio connection, refused past its address's cap, and let go as soon as its client closes it.

    Hypercorn 0.18 ends a connection once every task of its group has: when the client
    closes a connection that has gone idle, the reader ends but the idle timer it started
    does not, so the connection kept its task and its descriptor (in CLOSE-WAIT) for the
    whole keep-alive. A client opening and closing connections held ten seconds of them.
    """

    async def run(self) -> None:
        cap = getattr(self.config, "host_cap", None)
        if cap is None:  # served with a Config of hypercorn's own, not serve_http's
            await super().run()
            return
        host = cap.take(_peer(self.stream))
        if host is None:
            await trio.aclose_forcefully(self.stream)  # no TLS goodbye for a connection not served
            return
        try:
            await super().run()
        finally:
            cap.give(host)

    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()


# hypercorn.trio.serve builds its connections from this module-level name (0.18, pinned)
assert hypercorn_run.TCPServer in (tcp_server.TCPServer, _TCPServer)  # type: ignore[attr-defined]
hypercorn_run.TCPServer = _TCPServer  # type: ignore[attr-defined]


async def serve_http(
    app: Any,
    listen: str,
    *,
    per_host: int = CONNECTIONS_PER_HOST,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``HOST:PORT`` until cancelled; reports the base URL once listening.

    ``per_host``: connections one address (an IPv6 /64) may hold open at once (0: no cap);
    past them a new one is closed unanswered. Behind a reverse proxy every client has the
    proxy's address: raise it there, or leave the cap to the proxy.
    """
    config = _Config()
    config.host_cap = HostCap(per_host)
    config.bind = [listen]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 1.0
    # Hypercorn lets a connection go as soon as its client closes it; one the client keeps
    # open and idle (a pool, a response nobody read) holds a task and a descriptor until
    # this timeout closes it. It stays above httpx's 5 s pool expiry so that pooled clients
    # (nodes, gateway) drop an idle connection before the server does and never race a
    # request into a closing one.
    config.keep_alive_timeout = KEEP_ALIVE_SECONDS
    async with trio.open_nursery() as nursery:
        urls: list[str] = await nursery.start(functools.partial(serve, app, config, mode="asgi"))
        task_status.started(urls[0].rstrip("/"))


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 before the app sees it,
    and one that has not arrived whole ``seconds`` after the request began, 408.

    Bodies are read up front (the apps behind it read them whole anyway), so a client
    that streams a body without a length is held to the same limit.
    """

    def __init__(self, app: Any, limit: int, seconds: float | None = None) -> None:
        self.app = app
        self.limit = limit
        self.seconds = BODY_SECONDS if seconds is None else seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await _too_large(send, self.limit)
            return
        body = bytearray()
        with trio.move_on_after(self.seconds) as waited:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                if len(body) > self.limit:
                    await _too_large(send, self.limit)
                    return
                if not message.get("more_body"):
                    break
        if waited.cancelled_caught:
            # answered before the body ends, the connection closes after the answer
            await _error(send, 408, f"the request body did not arrive within {self.seconds:g} s", "body_timeout")
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, for streaming responses

        await self.app(scope, replay, send)


async def _too_large(send: Send, limit: int) -> None:
    await _error(send, 413, f"the request body exceeds {limit} bytes", "body_too_large")


async def _error(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
