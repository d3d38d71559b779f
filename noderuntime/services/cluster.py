"""Starting and stopping noderuntime processes (nodes, relays, trackers, gateways).

Used by the multi-process tests, the benchmarks and ``noderuntime up`` with no
arguments. Each process prints its ready line on stdout when it serves
(:mod:`noderuntime.services.ready`); :class:`ManagedProcess` waits for it, keeps the
rest of the output (for error messages) in a bounded buffer, and keeps apart every defect
the process printed (:data:`DEFECT_MARKS`), which a node serving on after one would
otherwise hide from whoever only reads its answers.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from noderuntime.services import ready
from noderuntime.services.cgroups import MemoryCap
from noderuntime.services.ready import Ready

ROOT = Path(__file__).resolve().parents[2]  # the checkout: noderuntime/services/cluster.py


class ProcessError(RuntimeError):
    """A process did not become ready, or exited."""


# What a process prints on a defect of ours: a node's line for a session it failed on one
# (node/core.py; the node serves on), and the traceback of any exception nobody handled
DEFECT_MARKS = ("failed on a defect", "Traceback (most recent call last):")
_TRACEBACK_GOES_ON = ("Traceback", "During handling", "The above exception")
_DEFECT_LINES = 60  # of one defect's traceback, kept


class Defects:
    """Reads a process's output line by line and keeps each defect it printed, with its traceback."""

    def __init__(self) -> None:
        self.found: list[list[str]] = []  # each defect's lines, the one that marked it first
        self._open: list[str] | None = None  # the defect whose traceback is being read

    def feed(self, line: str) -> None:
        """The next line of output."""
        block = self._open
        if block is not None:
            goes_on = not line or line[:1].isspace() or line.startswith(_TRACEBACK_GOES_ON)
            raised = len(block) > 1 and block[-1][:1].isspace()  # the exception itself, after its frames
            if goes_on or raised:
                if len(block) < _DEFECT_LINES:
                    block.append(line)
                return
            self._open = None
        if any(mark in line for mark in DEFECT_MARKS):
            self._open = [line]
            self.found.append(self._open)


def defects_in(lines: Iterable[str]) -> list[list[str]]:
    """The defects in a process's output (see :data:`DEFECT_MARKS`), each with its traceback."""
    reader = Defects()
    for line in lines:
        reader.feed(line.rstrip("\n"))
    return reader.found


# A harness that watches every managed process (the tests' check for defects and repairs)
# hears of each when it is launched, and of each about to be stopped while it still runs
on_launch: list[Callable[[ManagedProcess], None]] = []
on_stop: list[Callable[[ManagedProcess], None]] = []


class ManagedProcess:
    """One child process running ``python -m noderuntime ...`` (or another module that prints a ready line)."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
        cwd: Path | None = None,
        cap: MemoryCap | None = None,
        module: str = "noderuntime",
        keep_lines: int | None = 400,
    ) -> None:
        """``prefix`` goes before the interpreter (e.g. ``ip netns exec HOST``); ``cap`` is a
        memory cgroup the process runs in from its first allocation; ``module`` is what runs;
        ``keep_lines``: the last lines of its output kept in :attr:`output` (None: all of them)."""
        self.name = name
        self.argv = [*prefix, sys.executable, "-m", module, *args]
        self._env = {**os.environ, **(env or {})}
        self._env.setdefault("PYTHONPATH", str(ROOT))
        self._env["PYTHONUNBUFFERED"] = "1"
        self._cwd = cwd
        self.cap = cap
        self.proc: subprocess.Popen[str] | None = None
        self._info: Ready | None = None
        self._malformed = ""  # why a ready line could not be read
        self.output: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._defects = Defects()
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self, timeout: float = 60.0) -> Ready:
        """Start and wait for the ready line; returns it."""
        self.launch()
        return self.wait_ready(timeout)

    def restart(self, timeout: float = 60.0) -> Ready:
        """Start it again, as it was started (after it exited or was killed); its new ready line."""
        if self.alive():
            raise ProcessError(f"{self.name} still runs")
        self._ready.clear()
        self._info = None
        self._malformed = ""
        return self.start(timeout)

    def launch(self) -> None:
        """Start the process without waiting (see :meth:`wait_ready`)."""
        self.proc = _SPAWNER.submit(
            lambda: subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=self._env,
                cwd=self._cwd,
                start_new_session=True,
                preexec_fn=self._before_exec,
            )
        ).result()
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-output", daemon=True)
        self._reader.start()
        for hook in on_launch:
            hook(self)

    def _before_exec(self) -> None:
        _die_with_parent()
        if self.cap is not None:
            self.cap.join()

    def wait_ready(self, timeout: float = 60.0) -> Ready:
        """Wait for the ready line; returns it."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                raise ProcessError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise ProcessError(f"{self.name} was not ready within {timeout:.0f} s:\n{self.tail()}")
        return self.info

    @property
    def info(self) -> Ready:
        """The process's ready line; :class:`ProcessError` before it came, or when malformed."""
        if self._info is None:
            raise ProcessError(f"{self.name} has not said it is ready{self._malformed}")
        return self._info

    @property
    def defects(self) -> list[list[str]]:
        """Each defect the process printed so far (every run of it), with its traceback's lines."""
        return self._defects.found

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip("\n"))
            self._defects.feed(line.rstrip("\n"))
            if not self._ready.is_set() and line.startswith(ready.PREFIX):
                try:
                    self._info = ready.parse(line)
                except ready.ReadyError as exc:
                    self._malformed = f": its ready line is malformed ({exc})"
                self._ready.set()

    def tail(self, lines: int = 40) -> str:
        """The last lines the process printed."""
        return "\n".join(list(self.output)[-lines:])

    @property
    def pid(self) -> int:
        """The child's pid."""
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        """Send a signal (SIGSTOP, SIGCONT, SIGKILL...)."""
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signum)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (a clean drain), then SIGKILL after ``timeout``; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with _suppress():
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot drain
            for hook in on_stop:
                hook(self)
            with _suppress():
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._read_to_the_end()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group."""
        if self.proc is not None and self.proc.poll() is None:
            with _suppress():
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._read_to_the_end()

    def _read_to_the_end(self) -> None:
        # an exited process's last lines (a defect met while draining) are read before stop returns
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5.0)


# Every child is forked from this one long-lived thread. The kernel sends a child its
# death signal when the *thread* that forked it exits, not the process: a node restarted
# from a short-lived thread (a benchmark's chaos thread) would be stopped when that
# thread ends. One worker, never shut down before the interpreter exits.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")


def _die_with_parent() -> None:
    # children must not outlive a parent that was killed without running its cleanup
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _suppress:  # a tiny contextlib.suppress for ProcessLookupError only
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError | PermissionError)


def start_all(processes: Sequence[ManagedProcess], timeout: float = 90.0) -> list[Ready]:
    """Launch every one of ``processes``, then wait for each one's ready line; the lines, in order."""
    for process in processes:
        process.launch()
    return [process.wait_ready(timeout) for process in processes]


def stop_all(processes: list[ManagedProcess]) -> None:
    """Stop the nodes and gateways of ``processes`` at once (each drains on its own), then the rest, last first.

    The rest are the processes named ``tracker*`` or ``relay*``: the others may still speak
    to them while they drain.
    """
    serving = [p for p in processes if not p.name.startswith(("tracker", "relay"))]
    with ThreadPoolExecutor(max(1, len(serving))) as pool:
        list(pool.map(ManagedProcess.stop, serving))
    for process in reversed(processes):
        process.stop()
