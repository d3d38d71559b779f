"""Above capacity, requests wait in line (runner/line.py) on a real system of one node with 2 slots.

Three times the slots in concurrent streams all complete; a request beyond the line's
bound, or one whose wait outlasts ``--queue-timeout``, gets a 429 with ``Retry-After``;
a client that leaves while it waits leaves nothing behind, on the gateway or the node;
turns in line go round the API keys.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from noderuntime.services import localsystem
from noderuntime.services.cluster import ManagedProcess, stop_all
from noderuntime.services.ready import GatewayReady, expect
from tests.conftest import local_system

SLOTS = 2
LONG = {"prompt": "1, 2, 3, 4,", "max_tokens": 900, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def system(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[localsystem.LocalSystem]:
    """One node serving every layer with 2 slots; its gateway lets a request wait up to 2 minutes."""
    yield from local_system(
        tmp_path_factory.mktemp("queueing"),
        cuts=(0, 30),
        slots=SLOTS,
        ctx=1024,
        gateway_options=("--queue-timeout", "120"),
    )


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        data: dict[str, Any] = json.loads(response.read())
        return data


def _node_status(system: localsystem.LocalSystem) -> dict[str, Any]:
    (node,) = [p for p in system.processes if p.name.startswith("node")]
    return _get(node.info.http + "/status")


def _wait_for(check: Any, what: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"not {what} within {within} s"
        time.sleep(0.05)


def _idle(system: localsystem.LocalSystem) -> bool:
    s = _node_status(system)
    return bool(s["active_sessions"] == 0 and s["slots_leased"] == 0 and s["slots_draining"] == 0)


@contextlib.contextmanager
def _holding(url: str, model: str, count: int) -> Iterator[None]:
    """``count`` long streams, each past its first tokens (each holds a slot) until the block ends."""
    with httpx.Client(timeout=120) as http, contextlib.ExitStack() as streams:
        for _ in range(count):
            opening = http.stream("POST", url + "/v1/completions", json={**LONG, "model": model})
            response = streams.enter_context(opening)
            assert response.status_code == 200
            next(streams.enter_context(contextlib.closing(response.iter_lines())))
        yield


def _stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed completion read to its end: status, seconds to the first byte and in all, its events."""
    started = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        first = time.monotonic() - started
        events = [line for line in response.iter_lines() if line]
        return {
            "status": response.status_code,
            "retry_after": response.headers.get("retry-after"),
            "first_s": first,
            "total_s": time.monotonic() - started,
            "events": events,
        }


def test_three_times_the_slots_in_concurrent_streams_all_complete(system: localsystem.LocalSystem) -> None:
    _wait_for(lambda: _idle(system), "idle")
    before = _node_status(system)
    body = {"model": system.model_id, "prompt": "1, 2, 3, 4,", "max_tokens": 32, "temperature": 0, "stream": True}
    with ThreadPoolExecutor(3 * SLOTS) as pool:
        results = list(pool.map(lambda _: _stream(system.gateway_url, body), range(3 * SLOTS)))
    assert [r["status"] for r in results] == [200] * (3 * SLOTS), [r["events"][:1] for r in results]
    for r in results:
        assert r["events"][-1] == "data: [DONE]"
        assert not any('"error"' in e for e in r["events"])
        assert json.loads(r["events"][-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
    line = _get(system.gateway_url + "/status")["line"]
    assert line["waiting"] == 0 and line["refused"] == 0
    # the tracker counts the slots it routes to: only the odd route granted on a heartbeat
    # that left out a session still opening meets a full node (30 refusals before it did)
    refused = _node_status(system)["admissions_refused"] - before["admissions_refused"]
    assert refused <= SLOTS
    timing = sorted((r["first_s"], r["total_s"]) for r in results)
    print(
        f"\n{3 * SLOTS} streams on {SLOTS} slots: first byte, end after "
        + ", ".join(f"{first:.2f}/{total:.2f}" for first, total in timing)
        + f" s; joined the line {line['joined']}, served from it {line['served']}; sessions the node refused {refused}"
    )


def test_a_client_that_leaves_while_it_waits_leaves_no_trace(system: localsystem.LocalSystem) -> None:
    _wait_for(lambda: _idle(system), "idle")
    gateway = system.gateway_url
    before = _node_status(system)
    cancelled = _get(gateway + "/status")["counters"]["cancelled"]
    with _holding(gateway, system.model_id, SLOTS):
        # a third stream, sent by hand so that its connection can be dropped while it waits
        where = urllib.parse.urlsplit(gateway)
        body = json.dumps({**LONG, "model": system.model_id}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {where.netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection((where.hostname, where.port), timeout=10) as waiting:
            waiting.sendall(head + body)
            _wait_for(lambda: _get(gateway + "/status")["line"]["waiting"] == 1, "in line")
        left = time.monotonic()
        _wait_for(lambda: _get(gateway + "/status")["line"]["waiting"] == 0, "out of line", within=5.0)
        print(f"\nthe request left the line {time.monotonic() - left:.2f} s after its client")
        # counted when its handler has ended: from then on nothing of it is left to reach the node
        _wait_for(lambda: _get(gateway + "/status")["counters"]["cancelled"] == cancelled + 1, "counted cancelled")
    # the slots free, and nobody takes them: the request that left never reached the node
    _wait_for(lambda: _idle(system), "idle")
    after = _node_status(system)
    assert after["sessions_opened"] == before["sessions_opened"] + SLOTS
    assert after["active_sessions"] == 0 and after["kv_cells"] == 0


def test_beyond_the_lines_bound_or_its_timeout_a_request_gets_429_with_retry_after(
    system: localsystem.LocalSystem, smollm2: Path, tmp_path: Path
) -> None:
    _wait_for(lambda: _idle(system), "idle")
    # a second gateway of the same swarm, whose line holds one request for at most 2 s
    gateway = ManagedProcess(
        "gateway-small-line",
        [
            "gateway",
            "--data-dir",
            str(tmp_path / "gateway"),
            "--tracker",
            system.tracker_url,
            "--listen",
            "127.0.0.1:0",
            "--model",
            f"{system.model_id}={smollm2}",
            "--ctx",
            "1024",
            "--queue-timeout",
            "2",
            "--queue-limit",
            "1",
        ],
    )
    try:
        url = expect(gateway.start(), GatewayReady).url
        body = {"model": system.model_id, "prompt": "Hi", "max_tokens": 4, "stream": True}
        with _holding(system.gateway_url, system.model_id, SLOTS):
            waited: dict[str, Any] = {}
            waiting = threading.Thread(target=lambda: waited.update(_stream(url, body)))
            waiting.start()
            _wait_for(lambda: _get(url + "/status")["line"]["waiting"] == 1, "in line")
            line = _get(url + "/status")["line"]
            refused = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert refused.status_code == 429 and refused.headers["retry-after"].isdigit()
            assert refused.json()["error"]["code"] == "queue_full"
            # refused at once, not after a wait: it never joined the line, which the other still held
            after = _get(url + "/status")["line"]
            assert after["refused"] == line["refused"] + 1 and after["joined"] == line["joined"], (line, after)
            waiting.join(30)
            # and the other's answer came while the slots were still held: its wait timed out
            assert _node_status(system)["active_sessions"] == SLOTS
        assert waited["status"] == 429 and waited["retry_after"] is not None
        error = json.loads(waited["events"][0])["error"]
        assert error["code"] == "routes_full" and "no slot freed in the 2 s" in error["message"], error
        # the gateway's 2 s began after the client's clock did, as the request arrived
        assert waited["total_s"] >= 2.0
        print(f"\nthe line's timeout of 2 s answered 429 after {waited['total_s']:.2f} s")
    finally:
        stop_all([gateway])


def test_turns_in_line_go_round_the_api_keys(system: localsystem.LocalSystem, smollm2: Path, tmp_path: Path) -> None:
    """One key's burst does not keep another key's request waiting behind all of it."""
    _wait_for(lambda: _idle(system), "idle")
    gateway = ManagedProcess(
        "gateway-keys",
        [
            "gateway",
            "--data-dir",
            str(tmp_path / "gateway"),
            "--tracker",
            system.tracker_url,
            "--listen",
            "127.0.0.1:0",
            "--model",
            f"{system.model_id}={smollm2}",
            "--ctx",
            "1024",
            "--queue-timeout",
            "120",
            "--api-key",
            "sk-burst",
            "--api-key",
            "sk-one",
        ],
    )
    try:
        url = expect(gateway.start(), GatewayReady).url
        body = {"model": system.model_id, "prompt": "1, 2, 3, 4,", "max_tokens": 32, "temperature": 0, "stream": True}

        def ask(key: str) -> dict[str, Any]:
            started = time.monotonic()
            with httpx.stream(
                "POST", url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=300
            ) as response:
                first = time.monotonic()
                assert response.status_code == 200
                list(response.iter_lines())
            return {"key": key, "started": started, "first": first}

        status = {"authorization": "Bearer sk-one"}
        with ThreadPoolExecutor(2 * SLOTS + 1) as pool:
            burst = [pool.submit(ask, "sk-burst") for _ in range(2 * SLOTS)]  # two take the slots, two wait
            _wait_for(lambda: httpx.get(url + "/status", headers=status).json()["line"]["waiting"] == SLOTS, "waiting")
            one = pool.submit(ask, "sk-one")  # after the burst's two in line
            results = [f.result() for f in (*burst, one)]
        order = [r["key"] for r in sorted(results, key=lambda r: r["first"])]
        # the burst's first two, then turns: the burst's third and the other key's one, then the burst's last
        assert order.index("sk-one") < len(order) - 1, order
        print(f"\nfirst tokens in the order {order}")
    finally:
        stop_all([gateway])
