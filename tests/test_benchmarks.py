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
