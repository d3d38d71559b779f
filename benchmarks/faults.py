"""Faults: the fault-injection suite, run as a benchmark that publishes what each case measured.

    python -m benchmarks.faults [--quick] [--out PATH]

Runs ``tests/test_faults.py`` (real processes: tracker, relay, shard nodes, gateway)
and collects, per case, how long the affected client waited for its typed error
against the stated deadline, how soon every surviving node held no session, slot or
KV cell, and whether the system served again (through another route, or after a
restart). Cases: a shard SIGKILLed mid-decode, a shard SIGSTOPped (hung), a link
that stalls and one that trickles at 300 B/s (a proxy between hops), a peer that
stops reading (the head's RSS across 96 requests into it; 32 with ``--quick``, as in
``make test``), the relay and the tracker SIGKILLed and restarted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import _common
from noderuntime.engine.llama import Recipe

NAME = "faults"
ROOT = Path(__file__).resolve().parents[1]
WAVES, WAVES_QUICK = 24, 5  # waves of 4 long prompts into a peer that stops reading


def _run_cases(waves: int) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        collected = Path(tmp) / "faults.json"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_faults.py"],
            cwd=ROOT,
            env={
                **os.environ,
                "NODERUNTIME_FAULTS_JSON": str(collected),
                "NODERUNTIME_FAULTS_WAVES": str(waves),
            },
            capture_output=True,
            text=True,
            timeout=1800,
        )
        return done, json.loads(collected.read_text()) if collected.exists() else {}


def main() -> None:
    """Run the fault cases and write their JSON."""
    args = _common.parser(NAME, __doc__ or "").parse_args()
    out = _common.out_path(NAME, args)
    waves = WAVES_QUICK if args.quick else WAVES
    done, cases = _run_cases(waves)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    figures: dict[str, object] = {"passed": done.returncode == 0, "pytest": summary, "cases": cases}
    recipe = {
        "model": "SmolLM2-135M-Instruct Q4_1",
        "shards": ["0:15", "15:30"],
        "stalled_link_shards": ["0:3", "3:30"],  # the link stalls after a three-layer head
        "slots": 4,
        "ctx": 1024,
        "idle_timeout_s": 3.0,
        **Recipe(n_threads=1, n_ctx_per_seq=1024, n_seq_max=4).describe("Q4_1"),
    }
    _common.write(out, NAME, args, recipe, figures)
    rows = []
    for case, values in cases.items():
        took = values.get("error_after_s", values.get("new_request_refused_after_s", ""))
        rows.append([case, took, values.get("deadline_s", ""), values.get("served_after", "")])
    print(_common.table(["case", "error after s", "deadline s", "served after"], rows))
    print(summary)
    print(f"wrote {out}")
    if done.returncode != 0:
        print(done.stdout[-6000:])
        raise SystemExit(1)


if __name__ == "__main__":
    main()
