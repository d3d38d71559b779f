"""An opt-in record of when frames and ticks pass each stage of a node, to see where a token's time goes.

A decode token crosses about twenty stages on a route (the seam's transport threads, the
session, the batcher, the engine's worker thread), each some tens to hundreds of
microseconds. Counters and histograms cannot show which of them add up; timestamps
taken at each stage can, because every process on one machine reads the same monotonic
clock (``time.perf_counter_ns`` is ``CLOCK_MONOTONIC`` on Linux).

Off unless asked for: with ``NODERUNTIME_TIMELINE=DIR`` in its environment a process
records stages from the start and writes ``DIR/timeline-PID.json`` when it exits; a
process can also :func:`start` recording itself and read :func:`events`. A stage
costs one ``deque.append`` when on and one global lookup when off. The record is
bounded (the oldest stages go first).

Stage names are ``where.what``: ``step.submitted``, ``tick.started``,
``engine.started``/``engine.finished`` (on the worker thread), ``tick.finished``;
``up.*``, ``down.*`` and ``client.*`` for a session's seams (``received``: a frame came
out of the transport; ``decoded``: it became an event; ``sent``: an event's frame goes
into the transport); ``grpc.client.*`` / ``grpc.server.*`` on the gRPC transport's
asyncio thread (``read``: a frame came off the HTTP/2 stream; ``writing`` / ``written``:
around grpclib's send).
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ENV = "NODERUNTIME_TIMELINE"
LIMIT = 1 << 18  # stages kept; a 2-shard route records about 20 per token

_events: collections.deque[tuple[str, int, str]] | None = None


def start(limit: int = LIMIT) -> None:
    """Start recording in this process (again: from empty)."""
    global _events
    _events = collections.deque(maxlen=limit)


def stop() -> None:
    """Stop recording and drop what was recorded."""
    global _events
    _events = None


def mark(stage: str) -> None:
    """Record that ``stage`` happened now, on this thread."""
    events = _events
    if events is not None:
        events.append((stage, time.perf_counter_ns(), threading.current_thread().name))


def events() -> list[tuple[str, int, str]]:
    """What was recorded: ``(stage, perf_counter_ns, thread name)`` in the order recorded."""
    return list(_events or ())


def write(path: Path) -> None:
    """Write this process's record (and its command line, to tell the processes apart) as JSON."""
    document: dict[str, Any] = {"pid": os.getpid(), "argv": sys.argv, "events": events()}
    path.write_text(json.dumps(document))


def read(directory: Path) -> list[dict[str, Any]]:
    """Every record written into ``directory``."""
    records: list[dict[str, Any]] = []
    for path in sorted(directory.glob("timeline-*.json")):
        records.append(json.loads(path.read_text()))
    return records


def _write_at_exit(directory: str) -> None:
    try:
        write(Path(directory) / f"timeline-{os.getpid()}.json")
    except OSError as exc:  # a diagnostic must not fail the exit
        print(f"noderuntime: could not write the timeline into {directory}: {exc}", file=sys.stderr)


if os.environ.get(ENV):
    start()
    atexit.register(_write_at_exit, os.environ[ENV])
