"""Turns on a machine's cores for the engines of the node processes that share it.

llama.cpp's CPU backend runs a graph on an OpenMP team whose threads meet at a barrier
after every op. Two teams on the same cores stall each other at every barrier: on a
2-core machine two shards of one route with two threads each served 8 clients at
9 tok/s, against 67 with one thread each (``benchmarks.serving``, AMD EPYC). Splitting
the cores avoids that but halves each shard's speed whenever it computes alone, which
on a route is most of the time: a single session's token goes through the shards one
after the other (39 tok/s with one thread each, 52 with two).

So co-located nodes take turns instead. Each engine call (a tick, a probe, loading)
holds a turn on every core its process may run on, and a team of as many threads as
those cores computes with nobody in its way; the other node's next tick waits for the
end of this one, which on a full machine it would have done anyway, in effect. A turn
is an advisory ``flock`` on one file per core under the user's runtime directory,
taken in core order (so two nodes on overlapping core sets cannot deadlock), and let go
by the kernel if the process dies. Nodes pinned to disjoint cores (``taskset``, a
cgroup's cpuset) share no file and never wait for each other.

An uncontended turn costs one ``flock`` call per core per tick (microseconds). Within
its turn each thread of the team keeps to one core (``engine.llama.pinned_cores``), so
that another process waking on one core cannot leave two of them stacked on the other.

A turn is waited for at most ``PATIENCE_SECONDS``, longer than any engine call takes: a
holder that keeps it longer is stopped or hung (``SIGSTOP``, a stalled device), and its
neighbours must not hang with it. The waiter then runs without its turn, and so do its
later calls, until the stuck turn is let go; it says so in its log and counts the calls.

This is not a lock around model execution inside a node (Petals' handler serializes its
requests with one): a node still runs every ready session's step in one batched tick,
and takes one turn per tick. The turn is between processes whose OpenMP teams would
otherwise share cores, which the kernel cannot schedule well.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import platformdirs

log = logging.getLogger(__name__)

# Longer than any engine call (a long prefill chunk of a large shard takes seconds; a
# model's load, which also holds the turn, may take longer and then costs a neighbour
# one call run without its turn): past it, the holder is taken to be stuck.
PATIENCE_SECONDS = 10.0


def _cores(cores: Sequence[int]) -> str:
    return ",".join(str(c) for c in cores)


def machine_cores() -> tuple[int, ...]:
    """The cores this process may run on (its CPU affinity), in order."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux: every core the machine reports
        return tuple(range(os.cpu_count() or 1))


def default_directory() -> Path:
    """Where the turn files live: the user's runtime directory, or the temporary one."""
    with warnings.catch_warnings():
        # without XDG_RUNTIME_DIR (a service, a container) platformdirs warns at every node's
        # start that it falls back to /tmp/runtime-UID: a fine home for turn files
        warnings.simplefilter("ignore", platformdirs.RuntimeDirWarning)
        runtime = Path(platformdirs.user_runtime_dir("noderuntime"))
    try:
        runtime.mkdir(parents=True, exist_ok=True)
        return runtime / "cores"
    except OSError:
        return Path(tempfile.gettempdir()) / f"noderuntime-{os.getuid()}" / "cores"


class _Wait:
    """A blocking wait for the rest of a turn, on the waiter thread, that its caller may give up."""

    def __init__(self, fds: Sequence[int]) -> None:
        self.fds = tuple(fds)
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._taken = False
        self._abandoned = False

    def run(self) -> None:
        for fd in self.fds:
            fcntl.flock(fd, fcntl.LOCK_EX)
        with self._lock:
            self._taken = True
            if self._abandoned:  # its caller went on without it: let go at once
                for fd in reversed(self.fds):
                    fcntl.flock(fd, fcntl.LOCK_UN)
        self.done.set()

    def abandon(self) -> bool:
        """Give up waiting; True when the turn was taken meanwhile (and is the caller's after all)."""
        with self._lock:
            if self._taken:
                return True
            self._abandoned = True
            return False


class CoreTurns:
    """This process's turn on its cores: ``with turns.held(): ...`` around each engine call.

    Opened once per process (the files stay open); :meth:`close` is idempotent. Meant for
    the one thread that runs the engine. ``skipped`` counts the calls that ran without
    their turn because another process kept it past ``patience`` seconds.
    """

    def __init__(
        self, cores: Sequence[int] | None = None, directory: Path | None = None, *, patience: float = PATIENCE_SECONDS
    ) -> None:
        self.cores = tuple(sorted(set(cores if cores is not None else machine_cores())))
        if not self.cores:
            raise ValueError("a turn needs at least one core")
        self.directory = directory or default_directory()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.patience = patience
        self.skipped = 0
        self._fds: list[int] = []
        # a contended turn is waited for on a thread of its own, so that the wait can be
        # given up (a blocking flock cannot be); a daemon, so that a wait that never ends
        # does not keep the process from exiting; one wait at most is ever outstanding (while
        # one is stuck, calls do not wait), so the queue holds one
        self._waits: queue.Queue[_Wait] = queue.Queue(maxsize=1)
        self._waiter: threading.Thread | None = None
        self._stuck: _Wait | None = None
        try:
            for core in self.cores:
                self._fds.append(os.open(self.directory / f"cpu{core}.lock", os.O_RDWR | os.O_CREAT, 0o600))
        except OSError:
            self.close()
            raise

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Wait for every core's turn (in core order), hold them for the block, then let go.

        Past ``patience`` seconds of waiting, the block runs without the turn (see the module).
        """
        taken = self._take()
        try:
            yield
        finally:
            for fd in reversed(self._fds[:taken]):
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _take(self) -> int:
        """Take the turn; how many of the files are now held (all of them, or none)."""
        if self._stuck is not None:
            if not self._stuck.done.is_set():
                self.skipped += 1
                return 0
            self._stuck = None
            log.warning("the turn on cores %s was let go: engine calls take turns again", _cores(self.cores))
        taken = 0
        for fd in self._fds:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                break
            taken += 1
        if taken == len(self._fds):
            return taken
        wait = _Wait(self._fds[taken:])
        self._start_waiter()
        self._waits.put_nowait(wait)
        if wait.done.wait(self.patience) or wait.abandon():
            return len(self._fds)
        for fd in reversed(self._fds[:taken]):
            fcntl.flock(fd, fcntl.LOCK_UN)
        self._stuck = wait
        self.skipped += 1
        log.warning(
            "the turn on cores %s has been held for over %.0f s by another process (stopped or hung?): "
            "engine calls run without it until it is let go",
            _cores(self.cores),
            self.patience,
        )
        return 0

    def _start_waiter(self) -> None:
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_for_turns, name="core-turns", daemon=True)
            self._waiter.start()

    def _wait_for_turns(self) -> None:
        while True:
            self._waits.get().run()

    def close(self) -> None:
        """Close the files (a turn still held is let go with them); those a stuck wait still
        blocks on stay open until the process ends, so that no later file takes their numbers."""
        fds, self._fds = self._fds, []
        waiting = set(self._stuck.fds) if self._stuck is not None and not self._stuck.done.is_set() else set()
        for fd in fds:
            if fd not in waiting:
                with contextlib.suppress(OSError):
                    os.close(fd)
