"""The kernel's name for the calling thread, so that ``top -H``, ``perf`` and ``/proc`` tell threads apart.

Python names its threads for itself only (before 3.14): the kernel sees every thread of a
node as ``python``, and the engine's OpenMP team, started from the engine thread, inherits
whatever that thread is called. Named, a node's CPU splits by thread from outside the
process: the trio thread (the process's own name), ``grpc-asyncio``, and ``engine`` with its
team (``benchmarks.breakdown`` reads them so).
"""

from __future__ import annotations

import sys
import threading

LIMIT = 15  # bytes the kernel keeps of a thread's name


def name_this_thread(name: str) -> None:
    """Name the calling OS thread ``name`` (cut to 15 bytes); nothing where the platform has no ``/proc``."""
    if not sys.platform.startswith("linux"):
        return
    path = f"/proc/self/task/{threading.get_native_id()}/comm"
    try:
        with open(path, "wb") as comm:
            comm.write(name.encode()[:LIMIT])
    except OSError:
        pass  # a /proc mounted read-only or without the task: the name is a convenience
