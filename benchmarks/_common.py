"""Shared plumbing of the benchmarks: arguments, machine description, JSON and tables."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

RESULTS = Path(__file__).resolve().parent / "results"
_T = TypeVar("_T")


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes: ``--quick`` and ``--out PATH``."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description)
    p.add_argument("--quick", action="store_true", help="a short run (used by tests and CI)")
    p.add_argument("--out", type=Path, default=None, help=f"JSON output (default benchmarks/results/{name}.json)")
    return p


def out_path(name: str, args: argparse.Namespace) -> Path:
    """Where the JSON goes: ``--out`` or the committed results directory."""
    if args.out is not None:
        path: Path = args.out
        return path
    return RESULTS / (f"{name}.quick.json" if args.quick else f"{name}.json")


def cache_dir(name: str) -> Path:
    """Where benchmark ``name`` keeps what it makes once (large model files): ``benchmarks/NAME``
    beside the pulled models' directory, outside the clone (the user cache directory's
    ``noderuntime/``, or the parent of ``$NODERUNTIME_MODELS`` where that is set, as Gate A's lanes)."""
    from noderuntime.models.catalogue import models_dir

    return models_dir().parent / "benchmarks" / name


def machine() -> dict[str, Any]:
    """The machine the figures were measured on."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_total = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_total = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "memory_bytes": mem_total,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def peak_rss(pid: int) -> int:
    """Peak resident set of a running process, in bytes (Linux VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def stat_cpu(stat_file: str | Path) -> tuple[str, float, float]:
    """A process's or thread's name and its CPU seconds so far, user and system, from its
    ``/proc/.../stat`` file (raises ``OSError`` once it has ended)."""
    stat = Path(stat_file).read_text()
    # "pid (name) state ...": the name may hold spaces and parentheses, the fields after it not
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    tick = os.sysconf("SC_CLK_TCK")
    return name, int(fields[11]) / tick, int(fields[12]) / tick  # utime and stime: the 14th and 15th fields


def git_commit() -> str:
    """The project commit the benchmark ran on (with a ``-dirty`` mark).

    A copy of the tree without its repository names its commit in ``NODERUNTIME_PROJECT_COMMIT``.
    """
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists() and os.environ.get("NODERUNTIME_PROJECT_COMMIT"):
        return os.environ["NODERUNTIME_PROJECT_COMMIT"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command(name: str, args: argparse.Namespace) -> str:
    """The command that reproduces a run: its flags and every option given a value (not ``--out``)."""
    words = [f"python -m benchmarks.{name}"]
    for key, value in vars(args).items():
        if key == "out" or value is None or value is False:
            continue
        words.append(f"--{key.replace('_', '-')}")
        if value is not True:
            words.append(shlex.quote(",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)))
    return " ".join(words)


def write(
    path: Path, name: str, args: argparse.Namespace, recipe: dict[str, Any], figures: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    """Write the result document and return it."""
    doc = {
        "benchmark": name,
        "command": command(name, args),
        "quick": bool(args.quick),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "project_commit": git_commit(),
        "machine": machine(),
        "recipe": recipe,
        **extra,
        "figures": figures,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table."""
    cells = [[str(h) for h in headers]] + [
        [f"{c:.4g}" if isinstance(c, float) else str(c) for c in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _send_result(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    conn.send(fn(*args))


def in_fresh_process(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` in a new (spawned) process; its return value comes back pickled.

    For engine lanes: llama.cpp's OpenMP team belongs to the thread that runs a graph and
    stays parked after it, and two teams in one process throttle each other's barriers
    (see noderuntime.engine.thread), so each measurement starts from a clean process.
    """
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_send_result, args=(child, fn, args))
    proc.start()
    result: _T = parent.recv()
    proc.join()
    return result


def lowest_tasks(
    sample: Callable[[], dict[str, int]],
    *,
    within: float,
    until: Callable[[dict[str, int]], bool] | None = None,
    every: float = 0.25,
) -> tuple[dict[str, int], float]:
    """Each process's lowest live-task count over repeated samples, and the seconds sampled.

    Samples every ``every`` seconds until ``until(lowest)`` holds, or for ``within``
    seconds (always, when ``until`` is None). A leaked task stays in every sample; a
    periodic one (a heartbeat in flight, a keep-alive ping) comes and goes, so a process's
    lowest count is its settled one. Asking instead that every process be at its baseline
    in one and the same sample waited on chance: 0 to 24 s after one network fuzz run.
    """
    started = time.monotonic()
    lowest = sample()
    while not (until is not None and until(lowest)) and time.monotonic() - started < within:
        time.sleep(every)
        lowest = {name: min(count, lowest.get(name, count)) for name, count in sample().items()}
    return lowest, time.monotonic() - started


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def plot(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    logx: bool = False,
) -> Path:
    """A simple line chart (PNG) beside the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
