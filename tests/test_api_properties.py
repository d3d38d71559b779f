"""Property-based cases of the tracker's and the gateway's HTTP APIs (schemathesis, bounded): no 5xx but
the tracker's stated 503 for no route."""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import trio

from noderuntime.access.identity import Identity
from noderuntime.gateway.app import Gateway
from noderuntime.operations.httpserve import serve_http
from noderuntime.tracker.app import Tracker
from noderuntime.tracker.messages import Registration
from noderuntime.tracker.records import NodeRecord
from tests.adversary_swarm import registration

# --- every number bounded: property-based tests of the HTTP APIs

SCHEMA_EXAMPLES = 6  # per operation: a bounded test, not a fuzzing campaign (benchmarks.fuzz_network is that)
SCHEMA_SECONDS = 90.0  # operations not reached by then are left for the next run


@contextlib.contextmanager
def served_in_thread(app: Any) -> Iterator[str]:
    """``app`` served over HTTP on loopback by a trio loop in a thread of its own: its base URL."""
    ready: queue.Queue[tuple[str, trio.lowlevel.TrioToken, trio.CancelScope]] = queue.Queue()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_http, app, "127.0.0.1:0")
            ready.put((url, trio.lowlevel.current_trio_token(), nursery.cancel_scope))

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    url, token, scope = ready.get(timeout=30)
    try:
        yield url
    finally:
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
        thread.join(timeout=30)


def no_server_errors(base: str) -> collections.Counter[str]:
    """Every operation of ``base``'s OpenAPI document, called with a few generated cases (a fixed
    seed): the statuses, and each 5xx with what asked for it."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    statuses: collections.Counter[str] = collections.Counter()
    errors: list[str] = []
    deadline = time.monotonic() + SCHEMA_SECONDS
    with requests.Session() as session:
        for result in schema.get_all_operations():
            if time.monotonic() > deadline:
                break
            operation = cast(Any, result).ok()

            @settings(
                max_examples=SCHEMA_EXAMPLES,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy())
            def run(case: Any) -> None:
                response = case.call(base_url=base, session=session, timeout=30)
                statuses[str(response.status_code)] += 1
                # the one 5xx the API states: 503 "no route exists now" (its JSON says so), not a fault
                stated = response.status_code == 503 and response.text.startswith('{"error"')
                if response.status_code >= 500 and not stated:
                    errors.append(f"{case.method} {case.formatted_path} {case.body!r:.200} -> {response.text[:200]}")

            run()
    assert not errors, errors
    return statuses


def test_the_trackers_api_never_answers_5xx_to_generated_requests() -> None:
    """Schemathesis cases of every tracker operation, against a tracker with two nodes."""
    tracker = Tracker(Identity.generate())
    for layers in ((0, 15), (15, 30)):
        body = Registration.model_validate(registration(Identity.generate(), layers))
        record = NodeRecord.of(body)
        tracker.state.register(record, time.time())
    with served_in_thread(tracker.app) as url:
        statuses = no_server_errors(url)
    assert sum(statuses.values()) > 0


def test_the_gateways_api_never_answers_5xx_to_generated_requests() -> None:
    """Schemathesis cases of every gateway operation, against a gateway whose tracker is not there."""
    gateway = Gateway([], "http://127.0.0.1:9", None)
    with served_in_thread(gateway.app) as url:
        statuses = no_server_errors(url)
    assert sum(statuses.values()) > 0
