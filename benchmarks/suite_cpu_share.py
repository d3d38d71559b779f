"""Where the test suite's time goes, test by test: the CPU each test's processes used, and its waits.

    python -m benchmarks.suite_cpu_share [--quick] [--out PATH] [--rows FILE] [--workers N]

Runs ``pytest`` over the whole suite as ``make test`` does (two pytest-xdist workers, each
pinned to its share of the cores by ``tests/conftest.py``; ``--workers 0``: serially;
``--quick``: two modules of the ``memory`` tier, serially) with this module as a plugin.
Each worker moves into a cgroup of its own at start, so that the kernel sums the CPU time
of the worker and of every process it starts (nodes, trackers, benchmarks' children) until
they exit. Around each test (setup, call and teardown) the plugin reads that sum: a test's
``cpu_s``. On a worker pinned to one core, ``wall_s - cpu_s`` is how long that core waited
for the test (deadlines, expiries, keep-alives, sleeps), which only a shorter wait gives
back. It also reads the machine's busy and idle time from ``/proc/stat``, which counts
every worker at once. Where no cgroup can be made (no writable hierarchy) ``cpu_s`` is
absent and the machine's figures remain; on a machine with cgroup v2 alone the capped fit
lane cannot make its memory groups under a worker's. ``--rows FILE`` summarises the rows an earlier
run wrote instead of running the suite again (a whole run takes as long as ``make test``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _common
from noderuntime.services import cgroups

NAME = "suite_cpu_share"
# --quick names its modules: selecting a tier by marker alone collects every module, and
# importing them (torch, the client libraries) took most of a quick run's 29 s
QUICK_MODULES = ("tests/test_batcher.py", "tests/test_sessions.py")
ROWS_ENV = "NODERUNTIME_CPU_SHARE_ROWS"
CGROUPS = cgroups.ROOT
_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_ticks() -> tuple[int, int]:
    """(busy, idle) clock ticks of all cores since boot."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    return user + nice + system + irq + softirq + steal, idle + iowait


class CpuGroup:
    """A cgroup holding this process and every process it starts from then on: the CPU seconds
    the kernel counted for all of them (v2 ``cpu.stat``, or v1 ``cpuacct.usage``)."""

    def __init__(self, name: str) -> None:
        """Create the group (``OSError`` where no hierarchy is writable) and move this process in."""
        errors = []
        for home, usage, scale in self._candidates():
            group = home / f"{name}-{uuid.uuid4().hex[:8]}"
            try:
                group.mkdir()
                (group / "cgroup.procs").write_text(str(os.getpid()))
            except OSError as exc:
                errors.append(f"{group}: {exc}")
                with contextlib.suppress(OSError):
                    group.rmdir()
                continue
            self.path, self._usage, self._scale, self._home = group, group / usage, scale, home
            return
        raise OSError("no cgroup to count CPU time in: " + ("; ".join(errors) or "none is mounted"))

    @staticmethod
    def _candidates() -> Iterator[tuple[Path, str, float]]:
        # (this process's group, under which the new one goes; the file of its CPU time; seconds a unit).
        # v1's cpuacct first where it is mounted: a v2 group of the worker's own would be where the
        # capped fit lane makes its memory groups, and v2 lets a group that holds a process (the
        # worker) give none of its children a memory controller
        if (CGROUPS / "cpuacct" / "cpuacct.usage").exists():
            yield CGROUPS / "cpuacct" / cgroups.own_path(1, "cpuacct").lstrip("/"), "cpuacct.usage", 1e-9
        for mount in (CGROUPS, CGROUPS / "unified"):
            if (mount / "cgroup.controllers").exists():
                yield mount / cgroups.own_path(2).lstrip("/"), "cpu.stat", 1e-6

    def seconds(self) -> float:
        """CPU seconds of the group's processes, those that exited included."""
        text = self._usage.read_text()
        if self._usage.name == "cpu.stat":
            text = next(line.split()[1] for line in text.splitlines() if line.startswith("usage_usec"))
        return int(text) * self._scale

    def leave(self, within: float = 10.0) -> None:
        """Move this process back where it was and remove the group once the processes it started
        have left it too (exited), waiting up to ``within`` seconds; idempotent."""
        with contextlib.suppress(OSError):
            (self._home / "cgroup.procs").write_text(str(os.getpid()))
        deadline = time.monotonic() + within
        while self.path.exists():
            try:
                self.path.rmdir()
            except OSError:
                # a child still exiting keeps the group busy
                if time.monotonic() > deadline:
                    print(f"suite_cpu_share: {self.path} still holds processes; left in place", file=sys.stderr)
                    return
                time.sleep(0.1)


_rows: list[dict[str, Any]] = []
_group: CpuGroup | None = None
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")


def pytest_configure(config: pytest.Config) -> None:
    """Put this pytest process (a worker, or the serial run; not the xdist controller) in its group."""
    global _group
    if os.environ.get(ROWS_ENV) and (_WORKER != "main" or not getattr(config.option, "numprocesses", None)):
        try:
            _group = CpuGroup(f"noderuntime-suite-{_WORKER}")
        except OSError as exc:
            print(f"suite_cpu_share: {exc}; the rows have the machine's figures only", file=sys.stderr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Measure one test, its fixtures' setup and teardown included."""
    busy, idle = _cpu_ticks()
    cpu = _group.seconds() if _group else 0.0
    started = time.monotonic()
    yield
    busy_after, idle_after = _cpu_ticks()
    row = {
        "test": item.nodeid,
        "worker": _WORKER,
        "wall_s": round(time.monotonic() - started, 3),
        "busy_core_s": round((busy_after - busy) / _TICKS, 2),
        "idle_core_s": round((idle_after - idle) / _TICKS, 2),
    }
    if _group is not None:
        row["cpu_s"] = round(_group.seconds() - cpu, 3)
    _rows.append(row)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write this process's rows where the benchmark asked for them, and leave the group."""
    out = os.environ.get(ROWS_ENV)
    if out and _rows:
        Path(f"{out}.{_WORKER}").write_text(json.dumps(_rows, indent=1) + "\n")
    if _group is not None:
        _group.leave()


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals, the busy share, and the tests and modules that compute and wait the most."""
    counted = all("cpu_s" in r for r in rows)
    keys = ("wall_s", "busy_core_s", "idle_core_s", *(("cpu_s", "waiting_s") if counted else ()))
    for r in rows:
        if counted:
            r["waiting_s"] = round(max(0.0, r["wall_s"] - r["cpu_s"]), 3)
    by_module: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(keys, 0.0))
    for r in rows:
        module = by_module[r["test"].split("::")[0]]
        for key in keys:
            module[key] = round(module[key] + r[key], 2)
    busy = sum(r["busy_core_s"] for r in rows)
    idle = sum(r["idle_core_s"] for r in rows)
    summary: dict[str, Any] = {
        "tests": len(rows),
        "workers": sorted({r.get("worker", "main") for r in rows}),
        **{key: round(sum(r[key] for r in rows), 1) for key in keys},
        # the machine's cores over each test's time: with several workers each test's
        # window counts the others' work too, so this share is of the whole run
        "busy_share": round(busy / (busy + idle), 3) if busy + idle else 0.0,
    }
    if counted:
        summary["cpu_share_of_worker_time"] = (
            round(summary["cpu_s"] / summary["wall_s"], 3) if summary["wall_s"] else 0.0
        )
        summary["most_cpu_tests"] = sorted(rows, key=lambda r: -r["cpu_s"])[:25]
        summary["most_waiting_tests"] = sorted(rows, key=lambda r: -r["waiting_s"])[:25]
    else:
        summary["most_idle_tests"] = sorted(rows, key=lambda r: -r["idle_core_s"])[:25]
    summary["modules"] = dict(sorted(by_module.items(), key=lambda kv: -kv[1]["wall_s"]))
    return summary


def main() -> None:
    """Run the suite under the plugin (or read ``--rows``) and write the summary."""
    parser = _common.parser(NAME, __doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=Path, help="summarise this rows file instead of running the suite")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers, as make test (0: serial)")
    args = parser.parse_args()
    workers = 0 if args.quick else args.workers
    out = _common.out_path(NAME, args)
    started = time.monotonic()
    if args.rows is not None:
        rows = json.loads(args.rows.read_text())
        exit_status = None
    else:
        with tempfile.TemporaryDirectory(prefix="cpu-share-") as tmp:
            rows_file = Path(tmp) / "rows.json"
            selection = [*QUICK_MODULES, "-m", "memory"] if args.quick else []
            parallel = ["-n", str(workers), "--dist", "worksteal"] if workers else ["-p", "no:xdist"]
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
                    *parallel,
                    *selection,
                ],
                cwd=Path(__file__).resolve().parents[1],
                # as make test runs it: pytest keeps its rewritten test modules (Makefile)
                env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
                | {ROWS_ENV: str(rows_file)},
            )
            exit_status = done.returncode
            rows = [row for part in sorted(Path(tmp).glob("rows.json.*")) for row in json.loads(part.read_text())]
            if not rows:
                raise SystemExit(f"pytest wrote no rows (exit status {exit_status})")
    figures: dict[str, Any] = {"pytest_exit_status": exit_status, "run_wall_s": round(time.monotonic() - started, 1)}
    figures.update(summarise(rows))
    recipe = {
        "runner": f"pytest, {workers} pinned xdist workers, worksteal" if workers else "pytest, serial",
        "selection": f"memory tier of {', '.join(QUICK_MODULES)}" if args.quick else "every tier",
        "cpu": "each worker's cgroup: the worker and every process it started" if "cpu_s" in figures else "none",
    }
    _common.write(out, NAME, args, recipe, figures, rows=rows)
    totals = ["tests", "wall_s", "cpu_s", "waiting_s", "busy_core_s", "idle_core_s"]
    print(_common.table(totals, [[figures.get(k, "") for k in totals]]))
    ranked = "most_waiting_tests" if "cpu_s" in figures else "most_idle_tests"
    print(
        _common.table(
            [ranked.replace("_", " "), "wall s", "cpu s", "idle core-s"],
            [[r["test"][:90], r["wall_s"], r.get("cpu_s", ""), r["idle_core_s"]] for r in figures[ranked][:10]],
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
