"""Benchmarks keep running: each quick run writes JSON with figures, recipe and machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["codec", "fuzz_frames", "engine"])
def test_quick_benchmark_writes_json(name: str, tmp_path: Path) -> None:
    out = tmp_path / f"{name}.json"
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == name and doc["quick"] is True
    assert doc["figures"] and doc["machine"]["logical_cpus"]
    assert "wrote" in done.stdout


@pytest.mark.slow
def test_two_minute_soak_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    """The soak's ``make test`` version: every way of ending a request, for two minutes."""
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())["figures"]
    assert figures["requests"] >= 40 and figures["completed"] >= 10 and figures["cancelled_by_client"] >= 10
    assert all(figures["requests_by_ending"].values())  # every ending was tried
    assert figures["errors"] == 0, figures["errors_by_kind"]
    assert figures["mismatches"] == 0 and figures["checked_against_reference"] >= 5
    assert figures["idle_at_end"], figures["nodes_at_end"]  # no slot, no KV cell held anywhere
    assert figures["serves_after"]
    for process, leak in figures["leaks"].items():
        assert leak["tasks"] <= 0, (process, leak)
        assert leak["fds"] <= 8, (process, leak)  # a few pooled connections may stay open
        assert leak["rss_mib"] < 64, (process, leak)


def _run_quick(name: str, out: Path, timeout: float = 900) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    figures: dict[str, object] = json.loads(out.read_text())["figures"]
    return figures


@pytest.mark.slow
def test_fuzzing_every_network_entry_crashes_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    """gRPC seams, relay, tracker and gateway bodies (schemathesis too): typed answers only."""
    figures: dict[str, Any] = _run_quick("fuzz_network", tmp_path / "fuzz.json")
    assert figures["passed"]
    assert figures["crashes"] == {
        "processes_died": [],
        "tracker_5xx_or_dropped": 0,
        "gateway_5xx_or_dropped": 0,
        "grpc_undecodable_replies": 0,
    }
    assert not figures["leaks"]["nodes_not_idle"] and figures["same_answer_after"]
    for entry in ("grpc_seam", "relay", "tracker_api", "gateway_http"):
        assert figures["entries"][entry]["inputs"] >= 100, entry


@pytest.mark.slow
def test_a_model_twice_a_nodes_cap_is_served_by_capped_nodes(tmp_path: Path) -> None:
    """The fit lane's CI size: ~1.5 GB model, 1 GiB cgroup caps."""
    from noderuntime.cgroups import available

    reason = available()
    if reason is not None:
        pytest.skip(reason)
    figures: dict[str, Any] = _run_quick("fit", tmp_path / "fit.json")
    cap = figures["cap_bytes"]
    assert figures["model_bytes"] > 1.4 * cap
    refused = figures["admission_refused"]
    assert refused["exit_status"] == 1 and "layers would fit" in refused["message"]
    forced = figures["forced_whole_capped"]
    assert forced["exit_status"] == -9 and forced["oom_kills"] >= 1
    route = figures["route"]
    assert len(route["nodes"]) >= 2 and figures["every_node_under_cap"]
    for node in route["nodes"]:
        assert node["alive"] and node["oom_kills"] == 0 and node["peak_rss_bytes"] < cap, node
    assert all(run["tokens"] >= 2 for run in route["runs"]) and route["decode_tokens_per_s"] > 0
    assert figures["whole"]["decode_tokens_per_s"] > 0
