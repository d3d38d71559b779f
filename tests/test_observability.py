"""Metrics of every process, session-tagged logs, and the usage ledger, on the running local system."""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from openai import OpenAI

from noderuntime.access.identity import Identity
from noderuntime.control.ledger import USAGE_DOMAIN, CheckedRecord, Ledger, UsageBody, check
from noderuntime.operations.telemetry import SessionLog
from noderuntime.services import localsystem
from noderuntime.services.ready import Ready
from protocol import Hop, Span, UsageRecord

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def system(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[localsystem.LocalSystem]:
    running = localsystem.start(
        listen="127.0.0.1:0", data_root=tmp_path_factory.mktemp("system"), slots=4, ctx=1024, quiet=True
    )
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def client(system: localsystem.LocalSystem) -> OpenAI:
    return OpenAI(base_url=system.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
        assert response.headers["content-type"].startswith("text/plain")
        return body.decode()


def _sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text exposition."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in metrics.splitlines():
        if line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        if match and match.group(1) == name:
            have = ",".join(sorted((match.group(2) or "").split(","))) if match.group(2) else ""
            if have == want:
                return float(match.group(3))
    raise AssertionError(f"no sample {name}{{{want}}}")


def _ask(client: OpenAI, system: localsystem.LocalSystem, *, stream: bool, max_tokens: int = 8) -> int:
    messages = [{"role": "user", "content": "Name a colour."}]
    if stream:
        chunks = client.chat.completions.create(
            model=system.model_id,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [c.usage for c in chunks if c.usage is not None]
        return usage[-1].completion_tokens
    done = client.chat.completions.create(
        model=system.model_id,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
    )
    assert done.usage is not None
    return done.usage.completion_tokens


def _process(system: localsystem.LocalSystem, name: str) -> Ready:
    return next(p.info for p in system.processes if p.name == name)


def test_every_process_exports_prometheus_metrics(client: OpenAI, system: localsystem.LocalSystem) -> None:
    produced = _ask(client, system, stream=True) + _ask(client, system, stream=False)

    gateway = _text(system.gateway_url + "/metrics")
    assert _sample(gateway, "noderuntime_gateway_time_to_first_token_seconds_count") >= 2
    assert _sample(gateway, "noderuntime_gateway_inter_token_latency_seconds_count") >= 1
    assert _sample(gateway, "noderuntime_gateway_completion_tokens_total") >= produced
    assert _sample(gateway, "noderuntime_gateway_requests_total", endpoint="/v1/chat/completions", status="200") >= 2
    assert _sample(gateway, "noderuntime_gateway_usage_records_total", valid="true") >= 4  # two hops, two requests

    for name, seam in (("node0", "grpc"), ("node1", "relay")):
        node = _text(_process(system, name).http + "/metrics")
        assert _sample(node, "noderuntime_sessions_opened_total") >= 2
        assert _sample(node, "noderuntime_sessions_ended_total", reason="released") >= 2
        assert _sample(node, "noderuntime_node_decode_tokens_total") >= produced - 2
        assert _sample(node, "noderuntime_node_prefill_tokens_total") > 0
        assert _sample(node, "noderuntime_node_batch_rows_count") > 0
        assert _sample(node, "noderuntime_node_tick_seconds_sum") > 0
        assert _sample(node, "noderuntime_node_sequence_slots") == 4
        # every request has finished: nothing is held (a release may still be on its way)
        for gauge in ("noderuntime_node_sequence_slots_in_use", "noderuntime_node_kv_cells_in_use"):
            deadline = time.monotonic() + 10
            while _sample(_text(_process(system, name).http + "/metrics"), gauge) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _sample(_text(_process(system, name).http + "/metrics"), gauge) == 0, gauge
        assert _sample(node, "noderuntime_node_probes_total") >= 1  # the tracker probed it before routing to it
        # the head sends activations into the tail's relay seam; the tail receives them there
        frames = _sample(node, "noderuntime_seam_frames_total", transport=seam, direction="in")
        assert frames > 0
        # a frame is a header and more: its bytes outnumber its frames, each pair counted apart
        assert _sample(node, "noderuntime_seam_bytes_total", transport=seam, direction="in") > 10 * frames
        assert _sample(node, "noderuntime_seam_frames_total", transport=seam, direction="out") > 0
    head = _text(_process(system, "node0").http + "/metrics")
    assert _sample(head, "noderuntime_seam_round_trip_seconds_count", transport="relay") > 0

    tracker = _text(system.tracker_url + "/metrics")
    assert _sample(tracker, "noderuntime_tracker_nodes") == 2
    assert _sample(tracker, "noderuntime_tracker_routes_total", outcome="issued") >= 2
    assert _sample(tracker, "noderuntime_tracker_probes_total", result="passed") == 2

    relay = _text(_process(system, "relay").http + "/metrics")
    assert _sample(relay, "noderuntime_relay_nodes_connected") == 1
    assert _sample(relay, "noderuntime_relay_bytes_forwarded_total") > 0


def test_usage_is_signed_by_each_shard_and_ledgered_per_request(
    client: OpenAI, system: localsystem.LocalSystem, tmp_path: Path
) -> None:
    before = Ledger(system.ledger).totals()
    produced = [_ask(client, system, stream=s, max_tokens=6) for s in (False, True, False)]
    after = Ledger(system.ledger).totals()

    requests = {m["model"]: m for m in after["models"]}[system.model_id]
    earlier = {m["model"]: m for m in before["models"]}.get(system.model_id, {"requests": 0, "completion_tokens": 0})
    assert requests["requests"] - earlier["requests"] == 3
    assert requests["completion_tokens"] - earlier["completion_tokens"] == sum(produced)
    assert not after["flagged"]
    nodes = {n["node_id"]: n for n in after["nodes"]}
    old = {n["node_id"]: n for n in before["nodes"]}
    assert len(nodes) == 2
    for node_id, totals in nodes.items():
        gained = {k: v - old.get(node_id, {}).get(k, 0) for k, v in totals.items() if k != "node_id"}
        assert gained["sessions"] == 3
        # every shard ran every generated token but the last (and the stop token, when one ended it)
        assert sum(produced) - 3 <= gained["decode_tokens"] <= sum(produced)
        assert gained["prefill_tokens"] > 0 and gained["compute_ms"] > 0
        assert gained["bytes_in"] > 0 and gained["bytes_out"] > 0

    shown = subprocess.run(
        [sys.executable, "-m", "noderuntime", "usage", "--ledger", str(system.ledger), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == after

    # a record edited after signing is flagged, kept, and never counted
    copy = tmp_path / "ledger.sqlite"
    source, target = sqlite3.connect(system.ledger), sqlite3.connect(copy)
    source.backup(target)  # the ledger is in WAL mode: a file copy could miss the newest entries
    source.close()
    target.close()
    with sqlite3.connect(copy) as db:
        request_id, node_id, start, end, body, signature = db.execute(
            "SELECT request_id, node_id, layer_start, layer_end, body, signature FROM records ORDER BY rowid DESC"
        ).fetchone()
    fields = json.loads(body)
    fields["decode_tokens"] += 1000
    edited = UsageRecord(json.dumps(fields, sort_keys=True).encode(), bytes.fromhex(node_id), signature)
    hops = [Hop(bytes.fromhex(node_id), Span(start, end), "x:1", "", b"")]
    verdict = check(edited, request_id=request_id, hops=hops)
    assert not verdict.valid and verdict.problem == "signature does not verify"
    genuine = check(UsageRecord(body, bytes.fromhex(node_id), signature), request_id=request_id, hops=hops)
    assert genuine.valid
    assert not check(UsageRecord(body, bytes.fromhex(node_id), signature), request_id="other", hops=hops).valid
    forged_by = Identity.generate()  # signed, but by a node that is not on the route
    forged_body = json.dumps({**fields, "node_id": forged_by.node_id.hex()}).encode()
    forged = UsageRecord(forged_body, forged_by.node_id, forged_by.sign(USAGE_DOMAIN, forged_body))
    assert check(forged, request_id=request_id, hops=hops).problem == "node or layers not on the request's route"

    ledger = Ledger(copy)
    ledger.append(
        request_id="tampered",
        model=system.model_id,
        artifact="ab" * 32,
        created=0,
        prompt_tokens=1,
        completion_tokens=1,
        finish_reason="stop",
        records=[verdict, check(forged, request_id=request_id, hops=hops)],
    )
    totals = ledger.totals()
    assert {n["node_id"]: n for n in totals["nodes"]} == nodes  # nothing of them was counted
    assert [f["problem"] for f in totals["flagged"]] == [
        "signature does not verify",
        "node or layers not on the request's route",
    ]
    printed = subprocess.run(
        [sys.executable, "-m", "noderuntime", "usage", "--ledger", str(copy)], capture_output=True, text=True
    )
    assert "2 record(s) flagged and not counted" in printed.stdout
    assert isinstance(verdict, CheckedRecord)


def test_session_log_lines_name_the_session_and_epoch(caplog: pytest.LogCaptureFixture) -> None:
    log = SessionLog(logging.getLogger("noderuntime.test"), "0123456789ab/3", "req-1")
    with caplog.at_level(logging.INFO, logger="noderuntime.test"):
        log.info("opened: layers %s", "0:15")
    assert caplog.messages == ["session=0123456789ab/3 request=req-1 opened: layers 0:15"]


def test_a_usage_body_a_node_signs_is_what_the_ledger_checks() -> None:
    node = Identity.generate()
    body = UsageBody(node.node_id.hex(), (0, 15), "req-9", "ab" * 16, 0, "cd" * 32, 12, 5, 3.25, 100, 200, 1.0, 2.0)
    record = UsageRecord(body.encode(), node.node_id, node.sign(USAGE_DOMAIN, body.encode()))
    hops = [Hop(node.node_id, Span(0, 15))]
    checked = check(record, request_id="req-9", hops=hops)
    assert checked.valid and checked.fields["decode_tokens"] == 5 and checked.fields["layers"] == [0, 15]
    # canonical: the bytes signed do not depend on how the body was built
    assert body.encode() == attrs.evolve(body).encode() and b" " not in body.encode()
    forged = attrs.evolve(body, decode_tokens=-5).encode()
    lying = UsageRecord(forged, node.node_id, node.sign(USAGE_DOMAIN, forged))
    assert not check(lying, request_id="req-9", hops=hops).valid
