"""The relay's process (``noderuntime relay``): the relay of :mod:`relay.server`, its status page and ready line.

Runs from the light install (no engine): see docs/operating.md, "Running a public relay or tracker".
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
from typing import Any

import attrs
import trio

from noderuntime.access.tickets import TicketVerifier
from noderuntime.operations.httpserve import Routes, json_handler, serve_http
from noderuntime.operations.telemetry import trio_tasks
from noderuntime.services.ready import RelayReady
from noderuntime.services.running import run_main
from relay.server import Relay, RelayLimits, serve

log = logging.getLogger(__name__)


async def run_relay(
    host: str,
    port: int,
    issuer_keys: tuple[bytes, ...],
    *,
    tls: ssl.SSLContext | None = None,
    http: str | None = "127.0.0.1:0",
    limits: RelayLimits | None = None,
    task_status: trio.TaskStatus[RelayReady] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a relay until cancelled; ``http`` serves its ``/status``."""
    relay = Relay(TicketVerifier(issuer_keys), limits=limits or RelayLimits())
    async with trio.open_nursery() as nursery:
        server = await nursery.start(functools.partial(serve, relay, host, port, tls=tls))
        bound = server.port
        scheme = "wss" if tls else "ws"
        http_url = ""
        if http is not None:

            async def status() -> dict[str, Any]:
                return {**attrs.asdict(relay.statistics()), "tasks": trio_tasks()}

            routes = Routes({"/status": json_handler(status), "/metrics": relay.metrics_exposition})
            http_url = await nursery.start(serve_http, routes, http)
        task_status.started(RelayReady(url=f"{scheme}://{host}:{bound}", port=bound, pid=os.getpid(), http=http_url))
        log.info("relay listening on %s://%s:%d", scheme, host, bound)


def main_relay(
    host: str,
    port: int,
    issuer_keys: tuple[bytes, ...],
    tls: ssl.SSLContext | None,
    http: str | None,
    limits: RelayLimits | None = None,
) -> int:
    """Run a relay in this process until a signal; the exit status."""
    return run_main(lambda **kw: run_relay(host, port, issuer_keys, tls=tls, http=http, limits=limits, **kw))
