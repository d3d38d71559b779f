"""Turns on the cores: co-located node processes never run two engine calls on the same cores at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import trio

from noderuntime.engine.cores import CoreTurns, machine_cores
from noderuntime.engine.llama import EngineError, Recipe, ShardEngine, pinned_cores
from noderuntime.engine.thread import EngineThread
from noderuntime.services.cluster import ManagedProcess

# A second process that takes its turn on the cores named in argv, says so, and holds it
# until stdin closes (or it is killed).
HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from noderuntime.engine.cores import CoreTurns
    turns = CoreTurns([int(c) for c in sys.argv[2].split(",")], Path(sys.argv[1]))
    with turns.held():
        print("held", flush=True)
        sys.stdin.read()
    """
)


def _holder(directory: Path, cores: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), cores], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


_PENDING: list[threading.Thread] = []


def _waits(turns: CoreTurns, seconds: float = 0.3) -> bool:
    """Whether taking ``turns`` waits longer than ``seconds``.

    Taken on a thread of its own, given back at once; a thread still waiting is kept for
    :func:`_join_waiters`, which a test calls before it closes ``turns``.
    """
    got = threading.Event()

    def take() -> None:
        with turns.held():
            got.set()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    waited = not got.wait(seconds)
    if waited:
        _PENDING.append(thread)
    else:
        thread.join()
    return waited


def _join_waiters() -> None:
    """Let every thread still waiting for a turn get it and give it back."""
    while _PENDING:
        thread = _PENDING.pop()
        thread.join(10)
        assert not thread.is_alive(), "a turn never came"


def test_a_turn_held_by_another_process_waits_until_it_ends(tmp_path: Path) -> None:
    holder = _holder(tmp_path, "0,1")
    mine = CoreTurns([1], tmp_path)
    try:
        assert _waits(mine)  # core 1 is the other process's
        assert holder.stdin is not None
        holder.stdin.close()  # it lets go
        holder.wait(10)
        _join_waiters()  # the waiting thread got its turn
        assert not _waits(mine)
    finally:
        holder.kill()
        _join_waiters()
        mine.close()


def test_a_killed_holder_gives_its_turn_back(tmp_path: Path) -> None:
    holder = _holder(tmp_path, "0")
    mine = CoreTurns([0], tmp_path)
    try:
        assert _waits(mine)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        _join_waiters()  # the kernel let go of the dead process's lock
        with mine.held():
            pass
    finally:
        _join_waiters()
        mine.close()


def test_a_holder_that_hangs_holds_nobody_up_past_the_patience(tmp_path: Path) -> None:
    """A stopped holder keeps its turn; its neighbour runs without it, then takes turns again."""
    holder = _holder(tmp_path, "0,1")
    mine = CoreTurns([0, 1], tmp_path, patience=0.5)
    probe = CoreTurns([0, 1], tmp_path)  # a third party: whether the files are taken
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        began = time.monotonic()
        with mine.held():
            pass
        assert 0.5 <= time.monotonic() - began < 3 and mine.skipped == 1
        began = time.monotonic()
        with mine.held():  # while the turn is stuck, later calls do not wait again
            pass
        assert time.monotonic() - began < 0.2 and mine.skipped == 2
        os.kill(holder.pid, signal.SIGKILL)  # the holder's turn goes with it
        holder.wait(10)
        deadline = time.monotonic() + 10
        while mine._stuck is not None and not mine._stuck.done.is_set():
            assert time.monotonic() < deadline, "the abandoned wait never ended"
            time.sleep(0.05)
        with mine.held():  # the turn is taken again, and held: a third party waits for it
            assert _waits(probe, 0.2)
        _join_waiters()
        assert mine.skipped == 2
    finally:
        holder.kill()
        _join_waiters()
        mine.close()
        probe.close()


def test_disjoint_cores_never_wait(tmp_path: Path) -> None:
    holder = _holder(tmp_path, "0")
    mine = CoreTurns([1, 2], tmp_path)
    try:
        assert not _waits(mine)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(10)
        mine.close()


def test_turns_need_a_core_and_close_twice(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one core"):
        CoreTurns([], tmp_path)
    turns = CoreTurns(None, tmp_path)
    assert turns.cores == machine_cores()
    turns.close()
    turns.close()


def test_each_engine_call_holds_the_turn(tmp_path: Path) -> None:
    """While a call runs on the engine thread another process cannot take the turn; between calls it can."""
    probe = CoreTurns(machine_cores(), tmp_path)  # stands for a second node: a lock from another open file
    thread = EngineThread("test-engine", turns=CoreTurns(machine_cores(), tmp_path))
    seen: list[bool] = []

    def call() -> None:
        seen.append(_waits(probe, 0.2))

    async def main() -> None:
        await thread.run(call)
        await thread.run(lambda: None)

    try:
        trio.run(main)
        assert seen == [True]
        _join_waiters()  # the waiter inside the call got the turn once the call ended
        assert not _waits(probe, 2.0)
    finally:
        _join_waiters()
        thread.close()
        probe.close()


# Builds the same model twice in a process free to run on two cores, once with its team
# left free and once pinned, and says what each computed and where the threads may run.
PINNED = textwrap.dedent(
    """
    import json, os, sys
    os.sched_setaffinity(0, range(os.cpu_count()))  # out of the test worker's share, before any thread
    import numpy as np
    from noderuntime.engine.llama import Recipe, Rows, ShardEngine
    cores = sorted(os.sched_getaffinity(0))[:2]
    recipe = Recipe(n_threads=2, n_ctx_per_seq=256, n_seq_max=2, n_batch=64, n_ubatch=64)
    rows = Rows(np.zeros(9, np.int32), np.arange(9, dtype=np.int32), np.arange(9) == 8,
                tokens=np.arange(3, 12, dtype=np.int32))
    logits = []
    for pin in (None, cores):
        engine = ShardEngine(sys.argv[1], recipe, cores=pin)
        logits.append(engine.run(rows, want_logits=True).logits.tobytes().hex())
        engine.close()
    threads = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")]
    print(json.dumps({"cores": cores, "caller": sorted(os.sched_getaffinity(0)), "threads": threads,
                      "same": logits[0] == logits[1]}))
    """
)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs two cores")
def test_a_pinned_team_keeps_a_thread_to_each_core_and_computes_the_same(tiny_model: Path) -> None:
    done = subprocess.run([sys.executable, "-c", PINNED, str(tiny_model)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    first, second = seen["cores"]
    assert seen["same"]  # where the threads run is not what they compute
    assert [first, second] == seen["caller"][:2]  # the calling thread got its own cores back
    assert [second] in seen["threads"]  # the team's other thread keeps to the second core
    assert [first] not in seen["threads"]


def test_a_team_is_pinned_only_with_a_thread_for_each_core(tiny_model: Path) -> None:
    assert pinned_cores(2, (0, 1)) == (0, 1)
    assert pinned_cores(4, (2, 3, 5, 7)) == (2, 3, 5, 7)
    assert pinned_cores(1, (0,)) is None  # no partner to wait for
    assert pinned_cores(2, (0, 1, 2, 3)) is None  # cores to spare: the kernel has somewhere to go
    assert pinned_cores(4, (0, 1)) is None  # more threads than cores share them anyway
    with pytest.raises(EngineError, match="cannot pin 2 threads"):
        ShardEngine(tiny_model, Recipe(n_threads=2, n_ctx_per_seq=256, n_seq_max=1), cores=(0,))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs two cores")
def test_a_node_on_two_cores_pins_its_team(tiny_model: Path, tmp_path: Path) -> None:
    """A node whose threads take every core it may run on keeps one of them to each."""
    cores = sorted(range(os.cpu_count() or 2))[:2]
    args = ["up", "--model", str(tiny_model), "--listen", "127.0.0.1:0", "--issuer-key", "00" * 32]
    args += ["--data-dir", str(tmp_path / "node")]
    node = ManagedProcess("node", args, prefix=["taskset", "-c", ",".join(map(str, cores))])
    try:
        node.start()  # measured its engine before saying it is ready
        threads = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{node.pid}/task")]
    finally:
        node.stop()
    assert [cores[1]] in threads
    assert [cores[0]] not in threads  # the engine thread was given its cores back
    assert threads.count(cores) == len(threads) - 1
