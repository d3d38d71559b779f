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

An uncontended turn costs one ``flock`` call per core per tick (microseconds).

This is not a lock around model execution inside a node (Petals' handler serializes its
requests with one): a node still runs every ready session's step in one batched tick,
and takes one turn per tick. The turn is between processes whose OpenMP teams would
otherwise share cores, which the kernel cannot schedule well.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import platformdirs


def machine_cores() -> tuple[int, ...]:
    """The cores this process may run on (its CPU affinity), in order."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux: every core the machine reports
        return tuple(range(os.cpu_count() or 1))


def default_directory() -> Path:
    """Where the turn files live: the user's runtime directory, or the temporary one."""
    runtime = Path(platformdirs.user_runtime_dir("noderuntime"))
    try:
        runtime.mkdir(parents=True, exist_ok=True)
        return runtime / "cores"
    except OSError:
        return Path(tempfile.gettempdir()) / f"noderuntime-{os.getuid()}" / "cores"


class CoreTurns:
    """This process's turn on its cores: ``with turns.held(): ...`` around each engine call.

    Opened once per process (the files stay open); :meth:`close` is idempotent. Meant for
    the one thread that runs the engine, so it holds no lock of its own.
    """

    def __init__(self, cores: Sequence[int] | None = None, directory: Path | None = None) -> None:
        self.cores = tuple(sorted(set(cores if cores is not None else machine_cores())))
        if not self.cores:
            raise ValueError("a turn needs at least one core")
        self.directory = directory or default_directory()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fds: list[int] = []
        try:
            for core in self.cores:
                self._fds.append(os.open(self.directory / f"cpu{core}.lock", os.O_RDWR | os.O_CREAT, 0o600))
        except OSError:
            self.close()
            raise

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Wait for every core's turn (in core order), hold them for the block, then let go."""
        taken = 0
        try:
            for fd in self._fds:
                fcntl.flock(fd, fcntl.LOCK_EX)
                taken += 1
            yield
        finally:
            for fd in reversed(self._fds[:taken]):
                fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close the files (a turn still held is let go with them)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
