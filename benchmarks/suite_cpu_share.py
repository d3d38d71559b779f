"""How busy the cores are while the test suite runs, test by test.

    python -m benchmarks.suite_cpu_share [--quick] [--out PATH] [--rows FILE]

Runs ``pytest`` over the whole suite (``--quick``: two modules of the ``memory`` tier) with this module
as a plugin. Around each test (setup, call and teardown) it reads the machine's busy and
idle CPU time from ``/proc/stat``, so the processes a test starts count too. A test whose
idle core-seconds are large waits (deadlines, expiries, keep-alives, sleeps) or runs on one
core of several; one whose busy core-seconds are large computes. ``--rows FILE`` summarises
the rows an earlier run wrote instead of running the suite again (a whole run takes as long
as ``make test``).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _common

NAME = "suite_cpu_share"
# --quick names its modules: selecting a tier by marker alone collects every module, and
# importing them (torch, the client libraries) took most of a quick run's 29 s
QUICK_MODULES = ("tests/test_batcher.py", "tests/test_sessions.py")
ROWS_ENV = "NODERUNTIME_CPU_SHARE_ROWS"
_TICKS = os.sysconf("SC_CLK_TCK")
_rows: list[dict[str, Any]] = []


def _cpu_ticks() -> tuple[int, int]:
    """(busy, idle) clock ticks of all cores since boot."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    return user + nice + system + irq + softirq + steal, idle + iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Measure one test, its fixtures' setup and teardown included."""
    busy, idle = _cpu_ticks()
    started = time.monotonic()
    yield
    busy_after, idle_after = _cpu_ticks()
    _rows.append(
        {
            "test": item.nodeid,
            "wall_s": round(time.monotonic() - started, 2),
            "busy_core_s": round((busy_after - busy) / _TICKS, 2),
            "idle_core_s": round((idle_after - idle) / _TICKS, 2),
        }
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the rows where the benchmark asked for them."""
    out = os.environ.get(ROWS_ENV)
    if out:
        Path(out).write_text(json.dumps(_rows, indent=1) + "\n")


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals, the busy share, and the tests and modules that wait the most."""
    busy = sum(r["busy_core_s"] for r in rows)
    idle = sum(r["idle_core_s"] for r in rows)
    by_module: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: dict.fromkeys(("wall_s", "busy_core_s", "idle_core_s"), 0.0)
    )
    for r in rows:
        module = by_module[r["test"].split("::")[0]]
        for key in module:
            module[key] = round(module[key] + r[key], 2)
    return {
        "tests": len(rows),
        "wall_s": round(sum(r["wall_s"] for r in rows), 1),
        "busy_core_s": round(busy, 1),
        "idle_core_s": round(idle, 1),
        "busy_share": round(busy / (busy + idle), 3) if busy + idle else 0.0,
        "most_idle_tests": sorted(rows, key=lambda r: -r["idle_core_s"])[:25],
        "modules": dict(sorted(by_module.items(), key=lambda kv: -kv[1]["wall_s"])),
    }


def main() -> None:
    """Run the suite under the plugin (or read ``--rows``) and write the summary."""
    parser = _common.parser(NAME, __doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=Path, help="summarise this rows file instead of running the suite")
    args = parser.parse_args()
    out = _common.out_path(NAME, args)
    if args.rows is not None:
        rows = json.loads(args.rows.read_text())
        exit_status = None
    else:
        with tempfile.TemporaryDirectory(prefix="cpu-share-") as tmp:
            rows_file = Path(tmp) / "rows.json"
            selection = [*QUICK_MODULES, "-m", "memory"] if args.quick else []
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "-p",
                    f"benchmarks.{NAME}",
                    *selection,
                ],
                cwd=Path(__file__).resolve().parents[1],
                env={**os.environ, ROWS_ENV: str(rows_file)},
            )
            exit_status = done.returncode
            if not rows_file.exists():
                raise SystemExit(f"pytest wrote no rows (exit status {exit_status})")
            rows = json.loads(rows_file.read_text())
    figures = {"pytest_exit_status": exit_status, **summarise(rows)}
    recipe = {
        "runner": "pytest, serial",
        "selection": f"memory tier of {', '.join(QUICK_MODULES)}" if args.quick else "every tier",
    }
    _common.write(out, NAME, args, recipe, figures, rows=rows)
    print(
        _common.table(
            ["tests", "wall s", "busy core-s", "idle core-s", "busy share"],
            [
                [
                    figures["tests"],
                    figures["wall_s"],
                    figures["busy_core_s"],
                    figures["idle_core_s"],
                    figures["busy_share"],
                ]
            ],
        )
    )
    print(
        _common.table(
            ["most idle test", "wall s", "busy core-s", "idle core-s"],
            [
                [r["test"][:90], r["wall_s"], r["busy_core_s"], r["idle_core_s"]]
                for r in figures["most_idle_tests"][:10]
            ],
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
