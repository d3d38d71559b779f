"""A chain of shard engines, each in its own OS process, driven step by step.

This is the engine-level harness behind ``noderuntime check parity`` and the
process-separation tests: the driver sends a batch of rows to the first process,
hands each process's hidden rows to the next, and reads the tail's result. It has
none of the node machinery (sessions, batcher, protocol); it exists to show that
disjoint ranges in separate processes compute exactly what the whole model does.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import attrs
import numpy as np

from noderuntime.engine.backends import BackendRuntime
from noderuntime.models.artifacts import LayerRange

_SHARED_DIR = "/dev/shm"  # a memory-backed directory, on Linux


def _shared_dir(size: int) -> str | None:
    """Where the tail writes a teacher-forced pass's logits: in memory where there is room
    (a container's ``/dev/shm`` may hold 64 MB), else the system's temporary directory."""
    try:
        free = os.statvfs(_SHARED_DIR)
    except OSError:
        return None
    return _SHARED_DIR if free.f_bavail * free.f_frsize > 2 * size else None


class ChainError(RuntimeError):
    """A shard process failed or died."""


@attrs.frozen(eq=False)
class ShardOutput:
    """What one shard process returned for a step."""

    hidden: np.ndarray | None
    logits: np.ndarray | None
    seconds: float


def _worker(
    conn: Connection,
    model: str,
    layers: LayerRange,
    recipe: dict[str, Any],
    output_hidden: bool,
    runtime: BackendRuntime | None,
) -> None:
    try:
        if runtime is not None:
            runtime.activate()  # before the engine loads llama_cpp: this backend's build
        # Imported here: the engine loads llama.cpp, which only the worker needs. (The recipe
        # comes as a dict for this reason: unpickling a Recipe would import it first.)
        from noderuntime.engine.llama import EngineError, Recipe, Rows, ShardEngine

        engine = ShardEngine(model, Recipe(**recipe), layers, output_hidden=output_hidden)
    except RuntimeError as exc:  # EngineError, and a backend's typed errors, are RuntimeErrors
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    ready = {
        "memory": attrs.asdict(engine.memory()),
        "pid": os.getpid(),
        "n_vocab": engine.n_vocab,
        "recipe": engine.recipe_description(),
        "fingerprint": engine.recipe.fingerprint(engine.info.quant),
    }
    conn.send(("ready", ready))
    with engine:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            if message[0] == "stop":
                return
            if message[0] == "remove":
                engine.remove_sequence(message[1])
                conn.send(("ok", None))
                continue
            _, seq_ids, positions, outputs, tokens, hidden, into = message
            try:
                result = engine.run(Rows(seq_ids, positions, outputs, tokens=tokens, hidden=hidden), want_logits=True)
            except EngineError as exc:
                conn.send(("error", str(exc)))
                continue
            logits = result.logits
            if into is not None and logits is not None:
                path, offset = into
                try:
                    with open(path, "r+b") as file:
                        file.seek(offset)
                        np.ascontiguousarray(logits).tofile(file)
                except OSError as exc:  # a full disk, say: the driver's error, not this process's end
                    conn.send(("error", f"cannot write the logits to {path}: {exc}"))
                    continue
                logits = None
            conn.send(("ok", ShardOutput(result.hidden, logits, result.seconds)))


class ProcessChain:
    """Shard processes for consecutive ranges; use as a context manager."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        ranges: Sequence[LayerRange],
        recipe: Any,
        *,
        output_hidden: bool = False,
        models: Sequence[str | os.PathLike[str]] | None = None,
        runtime: BackendRuntime | None = None,
        recipes: Sequence[Any] | None = None,
        runtimes: Sequence[BackendRuntime | None] | None = None,
    ) -> None:
        """Start one process per range. ``models`` gives a file per range (sliced files).

        ``runtime`` makes every process load that backend's build of llama.cpp (see
        :mod:`noderuntime.engine.backends`); the default is the environment's own.
        ``recipes`` and ``runtimes`` give each range its own (a route that mixes devices:
        a Vulkan shard between CPU shards), in place of ``recipe`` and ``runtime``.
        """
        for a, b in itertools.pairwise(ranges):
            if a.end != b.start:
                raise ValueError(f"ranges {a} and {b} are not contiguous")
        self.ranges = list(ranges)
        self.seconds = [0.0] * len(ranges)
        self.info: list[dict[str, Any]] = []
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        paths = list(models) if models is not None else [model] * len(ranges)
        each_recipe = list(recipes) if recipes is not None else [recipe] * len(ranges)
        each_runtime = list(runtimes) if runtimes is not None else [runtime] * len(ranges)
        if not len(each_recipe) == len(each_runtime) == len(ranges):
            raise ValueError("give one recipe and one runtime per range")
        try:
            for path, layers, own_recipe, own_runtime in zip(paths, ranges, each_recipe, each_runtime, strict=True):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker,
                    args=(child, str(path), layers, attrs.asdict(own_recipe), output_hidden, own_runtime),
                    daemon=True,
                )
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            for conn, layers in zip(self._conns, ranges, strict=True):
                status, payload = self._recv(conn, layers)
                if status != "ready":
                    raise ChainError(f"shard {layers} failed to load: {payload}")
                self.info.append(payload)
        except BaseException:
            self.close()
            raise

    def _recv(self, conn: Connection, layers: LayerRange) -> tuple[str, Any]:
        try:
            message: tuple[str, Any] = conn.recv()
            return message
        except EOFError:
            raise ChainError(f"shard process {layers} exited") from None

    def step(
        self,
        seq_ids: np.ndarray,
        positions: np.ndarray,
        outputs: np.ndarray,
        tokens: np.ndarray,
        *,
        into: tuple[str, int] | None = None,
    ) -> ShardOutput:
        """Run one batch through every process; returns the tail's output.

        ``into`` (a file and a byte offset): the tail writes its logits there, and the
        output carries none.
        """
        hidden = None
        result: ShardOutput | None = None
        last = len(self._conns) - 1
        for i, (conn, layers) in enumerate(zip(self._conns, self.ranges, strict=True)):
            started = time.perf_counter()
            first, tail = i == 0, i == last
            conn.send(("run", seq_ids, positions, outputs, tokens if first else None, hidden, into if tail else None))
            status, payload = self._recv(conn, layers)
            if status != "ok":
                raise ChainError(f"shard {layers}: {payload}")
            self.seconds[i] += time.perf_counter() - started
            result = payload
            hidden = payload.hidden
        assert result is not None
        return result

    def teacher_forced(self, tokens: np.ndarray, chunk: int) -> np.ndarray:
        """The logits of every position of ``tokens`` (sequence 0, from position 0), ``chunk`` rows a step, read-only.

        The tail writes them into a file, in memory where the system has room for them
        there, and the driver maps it once at the end: 768 positions of a 262k vocabulary
        are 805 MB, which pickled through the pipe, unpickled and joined took the driver
        2.5 CPU-seconds and the tail about 0.5 more, on one core.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("no tokens to run")
        width = int(self.info[-1]["n_vocab"])
        row_bytes = width * np.dtype(np.float32).itemsize
        with tempfile.TemporaryDirectory(prefix="procchain-", dir=_shared_dir(n * row_bytes)) as tmp:
            path = os.path.join(tmp, "logits")
            open(path, "wb").close()
            for first in range(0, n, chunk):
                rows = np.arange(first, min(n, first + chunk), dtype=np.int32)
                seq_ids, outputs = np.zeros(len(rows), np.int32), np.ones(len(rows), bool)
                self.step(seq_ids, rows, outputs, tokens[rows], into=(path, first * row_bytes))
            with open(path, "rb") as file:
                # the page table filled in one call, not a fault a page later; the mapping
                # outlives the file's name. (Read into an array of the driver's own instead,
                # the copy took 1.6 s here on small pages.)
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                pages = mmap.mmap(file.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
        logits: np.ndarray = np.frombuffer(pages, dtype=np.float32)
        return logits.reshape(n, width)

    def remove_sequence(self, seq_id: int) -> None:
        """Drop a sequence's KV on every shard."""
        for conn, layers in zip(self._conns, self.ranges, strict=True):
            conn.send(("remove", seq_id))
            self._recv(conn, layers)

    def close(self) -> None:
        """Stop every process; idempotent."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop",))
            conn.close()
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._conns.clear()
        self._procs.clear()

    def __enter__(self) -> ProcessChain:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
