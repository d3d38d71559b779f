"""What keeping an engine's threads one to a core buys, beside other busy processes.

    python -m benchmarks.placement [--quick] [--out PATH]

A node's OpenMP team computes on the same cores as the gateway, the clients and the
node's own transport threads. This times decode steps of the whole demo model (1 row,
and 8 rows one per session; ``--quick``: 1 row, 30 steps) in one process, with the team
left free or pinned one thread to a core (``engine.llama.pinned_cores``, what nodes do),
alone or beside a process that is busy ``BUSY_MS`` in every ``BUSY_MS + IDLE_MS`` (about
what a served token costs the processes around a node at one client). p50, p90 and p99
of each lane's steps, in ms.

Needs as many cores as the team has threads (every core this process may run on, at
least two); with fewer it writes why and no figures.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _common

NAME = "placement"
BUSY_MS = 1.2
IDLE_MS = 6.0
PROMPT = 40

# The neighbour: spins for BUSY_MS, sleeps for IDLE_MS, until stdin closes.
NEIGHBOUR = f"""
import sys, threading, time
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.is_set():
    t = time.perf_counter()
    while time.perf_counter() - t < {BUSY_MS / 1e3}:
        pass
    time.sleep({IDLE_MS / 1e3})
"""


def _steps(model: Path, cores: tuple[int, ...], pinned: bool, rows: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps of ``rows`` sessions, each with a prompt of ``PROMPT``."""
    from noderuntime.engine.base import Rows
    from noderuntime.engine.llama import Recipe, ShardEngine

    recipe = Recipe(n_threads=len(cores), n_ctx_per_seq=1024, n_seq_max=8, n_batch=512, n_ubatch=512)
    assert PROMPT + steps <= recipe.n_ctx_per_seq
    engine = ShardEngine(model, recipe, cores=cores if pinned else None)
    try:
        for seq in range(rows):
            last = np.arange(PROMPT) == PROMPT - 1
            prompt = np.arange(3, 3 + PROMPT, dtype=np.int32)
            engine.run(Rows(np.full(PROMPT, seq, np.int32), np.arange(PROMPT, dtype=np.int32), last, tokens=prompt))
        seq_ids = np.arange(rows, dtype=np.int32)
        times = []
        for step in range(steps):
            decode = Rows(seq_ids, np.full(rows, PROMPT + step, np.int32), np.ones(rows, bool), tokens=seq_ids + 5)
            started = time.perf_counter()
            engine.run(decode)
            times.append(time.perf_counter() - started)
        return times
    finally:
        engine.close()


def _summary(times: list[float]) -> dict[str, float]:
    ms = [t * 1e3 for t in times]
    return {f"p{q}_ms": _common.percentile(ms, q) for q in (50, 90, 99)} | {"steps": len(ms)}


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(NAME, __doc__ or "").parse_args(argv)
    from noderuntime.engine.cores import machine_cores
    from noderuntime.engine.llama import Recipe, pinned_cores
    from noderuntime.models import artifacts
    from noderuntime.models import catalogue as models

    model = models.pull(models.DEMO_MODEL, progress=False)
    cores = machine_cores()
    steps = 30 if args.quick else 400
    figures: dict[str, Any] = {"cores": list(cores)}
    rows_of = {"decode1": 1} if args.quick else {"decode1": 1, "decode8": 8}
    if pinned_cores(len(cores), cores) is None:
        figures["skipped"] = (
            f"a team of one thread per core needs two cores or more; this process may run on {list(cores)}"
        )
    else:
        for neighbour in (False, True):
            proc = None
            if neighbour:
                proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdin=subprocess.PIPE)
                time.sleep(0.2)
            try:
                for pinned in (False, True):
                    lane = ("beside_busy_process" if neighbour else "alone") + ("_pinned" if pinned else "_free")
                    figures[lane] = {
                        name: _summary(_steps(model, cores, pinned, rows, steps)) for name, rows in rows_of.items()
                    }
            finally:
                if proc is not None:
                    assert proc.stdin is not None
                    proc.stdin.close()
                    proc.wait(10)
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        Recipe(n_threads=len(cores), n_ctx_per_seq=1024, n_seq_max=8).describe(artifacts.inspect(model).quant),
        figures,
        settings={"steps": steps, "busy_ms": BUSY_MS, "idle_ms": IDLE_MS, "prompt_tokens": PROMPT},
    )
    if "skipped" in figures:
        print(figures["skipped"])
    else:
        rows = [
            [lane, name, s["p50_ms"], s["p90_ms"], s["p99_ms"]]
            for lane, by_rows in figures.items()
            if lane != "cores"
            for name, s in by_rows.items()
        ]
        print(_common.table(["lane", "step", "p50 ms", "p90 ms", "p99 ms"], rows))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
