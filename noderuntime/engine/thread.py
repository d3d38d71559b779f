"""The one thread that runs an engine's blocking calls, for trio tasks.

llama.cpp's CPU backend runs each graph on an OpenMP team that belongs to the calling
thread, and the team's threads stay parked in that thread's pool after the call. A
second thread that calls the engine gets a team of its own, and once a process holds
more OpenMP threads than the machine has cores, libgomp throttles the spinning in its
barriers: every op's barrier goes to sleep in the kernel. On a 2-core machine a decode
ran 1.7-2.4x slower from a second thread while the first one merely lived on. So every
call that runs a graph (loading, which warms the context up; measuring; each batch;
probes) goes to one long-lived thread per engine, not to whichever thread
``trio.to_thread`` has free; this also spares a tick the thread cache's own bookkeeping.
Calls that run no graph (removing a sequence's KV between batches, making or freeing a
sampler) stay on the trio thread.

With :class:`~noderuntime.engine.cores.CoreTurns`, each call holds this process's turn
on its cores, so node processes that share a machine never run two OpenMP teams on the
same cores at once (see that module).

Calls run one at a time, in the order their callers take turns. Like
``trio.to_thread.run_sync``, a call cannot be abandoned: a caller cancelled meanwhile
still gets its call's result, and meets the cancellation at its next checkpoint.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

from noderuntime.engine.cores import CoreTurns
from noderuntime.operations.threadnames import name_this_thread

_T = TypeVar("_T")


class EngineThread:
    """Runs blocking calls on one thread of its own; started on first use, ended by :meth:`close`."""

    def __init__(self, name: str = "engine", *, turns: CoreTurns | None = None) -> None:
        """``turns``: held around each call, and closed by the thread when it ends."""
        self.name = name
        self._turns = turns
        # one call in the thread's hands at a time (callers beyond it wait for the turn in
        # trio), and the sentinel that ends it: never more than two items. A SimpleQueue
        # hands a job over with one lock, where queue.Queue's condition variable has the
        # woken thread take the queue's mutex again: a no-op call's round trip 13-15 µs
        # shorter, 75 -> 60 µs back to back and 133 -> 119 µs after 3 ms idle in the run
        # benchmarks/results/crossings.json holds
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Callable[[outcome.Outcome[Any]], None]] | None] = (
            queue.SimpleQueue()
        )
        self._turn = trio.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    async def run(self, fn: Callable[[], _T]) -> _T:
        """Call ``fn()`` on this thread and return what it returns (or raise what it raises)."""
        # a caller already cancelled hands nothing over; past this, the call is a checkpoint
        # only where it waits: an uncontended turn takes no trip through the scheduler
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._turn.acquire_nowait()
        except trio.WouldBlock:
            await self._turn.acquire()
        try:
            if self._closed:
                raise RuntimeError(f"the {self.name} thread is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
            token = trio.lowlevel.current_trio_token()
            task = trio.lowlevel.current_task()

            def deliver(result: outcome.Outcome[Any]) -> None:
                with contextlib.suppress(trio.RunFinishedError):  # nobody is left to tell
                    token.run_sync_soon(trio.lowlevel.reschedule, task, result)

            self._jobs.put((fn, deliver))
            # the call cannot be stopped once handed over: refuse to abort, so a cancellation waits for it
            result: _T = await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        finally:
            self._turn.release()
        return result

    def close(self) -> None:
        """Let the thread end after the call it has, if any; idempotent, does not wait."""
        if not self._closed:
            self._closed = True
            if self._thread is None and self._turns is not None:
                self._turns.close()  # never started: nobody else will
            self._jobs.put(None)

    def _serve(self) -> None:
        name_this_thread(self.name)  # before the engine's first call starts its OpenMP team, which inherits it
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                fn, deliver = job
                if self._turns is None:
                    deliver(outcome.capture(fn))
                else:
                    with self._turns.held():
                        result = outcome.capture(fn)
                    deliver(result)
        finally:
            if self._turns is not None:
                self._turns.close()
