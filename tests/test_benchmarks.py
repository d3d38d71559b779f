"""Benchmarks keep running: each quick run writes JSON with figures, recipe and machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
