"""Where a seam hop's time goes outside the engines: thread crossings, or a processor woken cold.

    python -m benchmarks.crossings [--quick] [--out PATH]

A gRPC seam's frame crosses threads twice in each node: grpclib runs on an asyncio loop in
a thread of its own (``noderuntime.transport.grpc.bridge.AsyncioThread``) and hands
frames to trio's thread through a pipe. This benchmark measures that design against the
candidate that removes both crossings, and what a crossing's cost is made of here:

1. **Round trips over a loopback gRPC seam between two processes** (a decode-size frame,
   2442 bytes, sent and echoed), for each design of the asyncio side:
   - ``thread``: the project's design, asyncio's loop in its own thread;
   - ``hosted``: asyncio's loop driven from a trio task on trio's own thread (the
     candidate; defined here, :class:`HostedLoop`): grpclib's callbacks and trio's
     tasks share one thread, and a frame handed between them wakes no other thread.
   Back to back, and with an idle gap of 3 ms before each (about a shard's decode tick,
   as in a route, where every thread sleeps between tokens). p50 µs, and CPU µs a round
   trip of each process. The two designs take turns over several rounds.
2. **Bursts**: 1, 8 and 16 seams on one connection, a frame sent on every one at once and
   echoed, after 3 ms idle (a batcher's tick answers all its sessions together): a round's
   p50, and both processes' CPU µs a frame. The pipes' wake-ups cross in one go for all
   that are ready (``bridge.Handover``).
3. **The hand-off to the engine thread**: a trio task's round trip to a thread that runs a
   no-op and hands the result back, the same thread with a ``queue.Queue`` (a condition
   variable: the woken thread then takes the queue's mutex again; the engine thread's
   hand-off before) and with a ``queue.SimpleQueue`` (one lock; the engine thread's now),
   and ``EngineThread`` itself (its turn lock and checks on top), back to back and after
   3 ms idle, in turns.
4. **Work after idling**: the same few dozen µs of plain Python (a dict filled and
   encoded as JSON), timed after the thread slept 0, 0.5, 3 and 10 ms. On a virtual
   machine whose idle processors halt, code that runs right after a wake-up runs slower,
   whatever thread it runs on; that is part of every stage of a hop.

The JSON says which design wins where; ``docs/performance.md`` ("What is left") reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import selectors
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import outcome
import trio

from benchmarks import _common
from noderuntime.transport.grpc import AsyncioThread

NAME = "crossings"
DECODE_FRAME = 2442  # a decode step's frame on the demo model's seam
GAPS = (0.0, 0.003)  # idle before each round trip: none, and about one shard's decode tick
IDLES = (0.0, 0.0005, 0.003, 0.010)
SEAMS = (1, 8, 16)  # seams with a frame at once, in a burst
DESIGNS = ("thread", "hosted")
ROUNDS = 4
MAX_PASSES = 64  # asyncio passes a hosted loop runs before it lets trio's other tasks run
_T = TypeVar("_T")


class _NonBlockingSelector(selectors.EpollSelector):
    """asyncio's selector for a hosted loop: it never blocks; where asyncio would wait, it stops the loop.

    ``wait`` then says for how long asyncio meant to wait (``math.inf``: until an fd is
    ready), which the driving trio task waits instead, on this selector's epoll fd.
    """

    def __init__(self) -> None:
        super().__init__()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wait = 0.0
        self.passes = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        self.passes += 1
        assert self.loop is not None
        if not ready and (timeout is None or timeout > 0):
            self.wait = math.inf if timeout is None else timeout
            self.loop.stop()  # this pass runs what is ready, then run_forever returns
        elif self.passes >= MAX_PASSES:
            self.wait = 0.0
            self.loop.stop()
        return ready


class HostedLoop:
    """The candidate: an asyncio loop run in passes by a trio task, on trio's thread.

    The same face as ``AsyncioThread`` (``loop``, ``call``), so grpclib's server, connector
    and the bridge's pipes run on it unchanged: a pipe's ``call_soon_threadsafe`` and
    ``run_sync_soon`` then write to a socket the same thread polls, and wake no thread.
    """

    def __init__(self) -> None:
        self._selector = _NonBlockingSelector()
        self.loop = asyncio.SelectorEventLoop(self._selector)
        self._selector.loop = self.loop
        self._handovers: dict[trio.lowlevel.TrioToken, Any] = {}
        self._handovers_lock = threading.Lock()

    async def drive(self) -> None:
        """Run the loop's passes until cancelled (in a nursery that outlives every use of the loop)."""
        fd = self._selector.fileno()
        while True:
            self._selector.passes = 0
            self.loop.run_forever()
            if self._selector.wait == 0:
                await trio.lowlevel.checkpoint()
                continue
            with trio.move_on_after(self._selector.wait):
                await trio.lowlevel.wait_readable(fd)

    # run ``factory()`` on the loop and wait for it, and hand wake-ups over, as the thread's runtime does
    call = AsyncioThread.call
    handover = AsyncioThread.handover

    def finish(self) -> None:
        """Cancel what still runs on the loop and close it (the driving task has ended)."""
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()


@contextlib.asynccontextmanager
async def runtime(design: str) -> AsyncIterator[Any]:
    """The asyncio side of ``design``, open for the block."""
    if design == "thread":
        thread = AsyncioThread()
        try:
            yield thread
        finally:
            thread.close()
        return
    hosted = HostedLoop()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hosted.drive)
            yield hosted
            nursery.cancel_scope.cancel()
    finally:
        hosted.finish()


async def _echo_server(design: str) -> None:
    """Serve an echoing gRPC seam on loopback; print the port; stop at end of stdin."""
    from noderuntime.transport import TransportError
    from noderuntime.transport.grpc import GrpcServer

    async def echo(stream: Any) -> None:
        with contextlib.suppress(TransportError):
            while True:
                await stream.send(await stream.receive())

    async with runtime(design) as rt, trio.open_nursery() as nursery:
        server = GrpcServer(rt, lambda stream: nursery.start_soon(echo, stream), max_frame_bytes=1 << 20)
        port = await server.start("127.0.0.1", 0, None)
        print(port, flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)
        await server.close()
        nursery.cancel_scope.cancel()


async def _round_trips(design: str, port: int, count: int, gap: float) -> tuple[list[float], float]:
    """``count`` round trips to the echo at ``port``: their times, and this process's CPU seconds in them."""
    from noderuntime.transport.grpc import GrpcConnector

    payload = os.urandom(DECODE_FRAME)
    times = []
    async with runtime(design) as rt:
        connector = GrpcConnector(rt, max_frame_bytes=1 << 20)
        try:
            stream = await connector.open(f"127.0.0.1:{port}")
            for _ in range(5):  # warm-up
                await stream.send(payload)
                await stream.receive()
            cpu = time.process_time()
            for _ in range(count):
                if gap:
                    await trio.sleep(gap)
                started = time.perf_counter()
                await stream.send(payload)
                await stream.receive()
                times.append(time.perf_counter() - started)
            cpu = time.process_time() - cpu
            await stream.aclose()
        finally:
            await connector.close()
    return times, cpu


async def _bursts(port: int, seams: int, rounds: int) -> tuple[list[float], float]:
    """``rounds`` rounds of a frame on each of ``seams`` seams at once, after 3 ms idle each."""
    from noderuntime.transport.grpc import GrpcConnector

    payload = os.urandom(DECODE_FRAME)
    times = []

    async def one(stream: Any) -> None:
        await stream.send(payload)
        await stream.receive()

    async with runtime("thread") as rt:
        connector = GrpcConnector(rt, max_frame_bytes=1 << 20)
        try:
            streams = [await connector.open(f"127.0.0.1:{port}") for _ in range(seams)]
            for r in range(rounds + 5):
                await trio.sleep(0.003)
                if r == 5:
                    cpu = time.process_time()
                started = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for stream in streams:
                        nursery.start_soon(one, stream)
                if r >= 5:  # warm-up
                    times.append(time.perf_counter() - started)
            cpu = time.process_time() - cpu
            for stream in streams:
                await stream.aclose()
        finally:
            await connector.close()
    return times, cpu


def bursts(rounds: int) -> dict[str, Any]:
    """A frame on each of 1, 8 and 16 seams at once: a round's p50 and CPU µs a frame (client + echo)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.crossings", "--echo", "thread"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    out: dict[str, Any] = {}
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        for seams in SEAMS:
            before = _cpu_of(server.pid)
            times, client_cpu = trio.run(_bursts, port, seams, rounds)
            frames = seams * rounds
            out[f"{seams}_seams"] = {
                "round_p50_us": statistics.median(times) * 1e6,
                "cpu_us_per_frame": (client_cpu + _cpu_of(server.pid) - before) / frames * 1e6,
                "rounds": rounds,
            }
    finally:
        with contextlib.suppress(OSError):
            server.communicate("", timeout=30)
        if server.poll() is None:
            server.kill()
    return out


def _cpu_of(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def seam_round_trips(count: int) -> dict[str, Any]:
    """Each design (client and echo alike) at each gap: round trip p50 and CPU per round trip."""
    times: dict[tuple[str, float], list[float]] = {(d, g): [] for d in DESIGNS for g in GAPS}
    cpu: dict[tuple[str, float], list[float]] = {(d, g): [] for d in DESIGNS for g in GAPS}
    for _ in range(ROUNDS):
        for design in DESIGNS:
            server = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.crossings", "--echo", design],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert server.stdout is not None
                port = int(server.stdout.readline())
                for gap in GAPS:
                    before = _cpu_of(server.pid)
                    rtts, client_cpu = trio.run(_round_trips, design, port, count // ROUNDS, gap)
                    server_cpu = _cpu_of(server.pid) - before
                    times[design, gap] += rtts
                    cpu[design, gap].append((client_cpu + server_cpu) / len(rtts))
            finally:
                with contextlib.suppress(OSError):
                    server.communicate("", timeout=30)
                if server.poll() is None:
                    server.kill()
    out: dict[str, Any] = {}
    for design in DESIGNS:
        for gap in GAPS:
            key = f"{design}_gap_{gap * 1e3:g}ms"
            out[key] = {
                "round_trip_p50_us": statistics.median(times[design, gap]) * 1e6,
                "round_trip_p90_us": _common.percentile(times[design, gap], 90) * 1e6,
                # both processes' CPU, the client's idle gap included (a timer's wake-up)
                "cpu_us_per_round_trip": statistics.median(cpu[design, gap]) * 1e6,
                "round_trips": len(times[design, gap]),
            }
    for gap in GAPS:
        g = f"gap_{gap * 1e3:g}ms"
        hosted, thread = out[f"hosted_{g}"], out[f"thread_{g}"]
        out[f"hosted_over_thread_{g}"] = hosted["round_trip_p50_us"] / thread["round_trip_p50_us"]
    return out


class _HandOffThread:
    """A thread that runs one job at a time from ``jobs`` and hands each result back to trio.

    Timed with a ``queue.Queue`` (a condition variable, the engine thread's hand-off before)
    and with a ``queue.SimpleQueue`` (one lock, as ``EngineThread`` has now); nothing else differs.
    """

    def __init__(self, jobs: Any) -> None:
        self._jobs = jobs
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, deliver = job
            deliver(outcome.capture(fn))

    async def run(self, fn: Callable[[], _T]) -> _T:
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()
        self._jobs.put_nowait((fn, lambda result: token.run_sync_soon(trio.lowlevel.reschedule, task, result)))
        value: _T = await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        return value

    def close(self) -> None:
        self._jobs.put_nowait(None)


async def _hand_offs(count: int) -> dict[str, Any]:
    import queue

    from noderuntime.engine.thread import EngineThread

    threads: dict[str, Any] = {
        "condition": _HandOffThread(queue.Queue(maxsize=2)),
        "simple_queue": _HandOffThread(queue.SimpleQueue()),
        "engine_thread": EngineThread(),
    }
    times: dict[tuple[str, float], list[float]] = {(k, g): [] for k in threads for g in GAPS}
    try:
        for i in range(count):
            order = list(threads.items())
            if i % 2:
                order.reverse()  # neither goes first every time
            for gap in GAPS:
                for kind, thread in order:
                    await trio.sleep(gap)
                    started = time.perf_counter()
                    await thread.run(int)
                    times[kind, gap].append(time.perf_counter() - started)
    finally:
        for thread in threads.values():
            thread.close()
    return {
        f"{kind}_gap_{gap * 1e3:g}ms_p50_us": statistics.median(times[kind, gap]) * 1e6
        for kind in threads
        for gap in GAPS
    }


def engine_hand_offs(count: int) -> dict[str, Any]:
    """A trio task's no-op round trip: a condition variable against one lock, and the engine thread itself."""
    return trio.run(_hand_offs, count)


def _work() -> str:
    d = {i: str(i) for i in range(300)}
    return json.dumps(d)


def work_after_idle(count: int) -> dict[str, Any]:
    """The same Python work timed after each idle gap: p50 µs, and against no gap."""
    times: dict[float, list[float]] = {idle: [] for idle in IDLES}
    for _ in range(count):
        for idle in IDLES:
            if idle:
                time.sleep(idle)
            started = time.perf_counter()
            _work()
            times[idle].append(time.perf_counter() - started)
    base = statistics.median(times[0.0])
    return {
        f"after_{idle * 1e3:g}ms": {
            "work_p50_us": statistics.median(times[idle]) * 1e6,
            "over_no_idle": statistics.median(times[idle]) / base,
        }
        for idle in IDLES
    }


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(NAME, __doc__ or "")
    p.add_argument("--echo", choices=DESIGNS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.echo is not None:
        trio.run(_echo_server, args.echo)
        return 0
    count = 200 if args.quick else 2000
    seams = seam_round_trips(count)
    burst = bursts(50 if args.quick else 400)
    hand_offs = engine_hand_offs(100 if args.quick else 1000)
    idle = work_after_idle(50 if args.quick else 400)
    figures = {"seam_round_trips": seams, "bursts": burst, "engine_hand_offs": hand_offs, "work_after_idle": idle}
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        {},
        figures,
        settings={
            "frame_bytes": DECODE_FRAME,
            "round_trips_per_design_and_gap": count,
            "rounds": ROUNDS,
            "gaps_s": GAPS,
            "idles_s": IDLES,
            "burst_seams": SEAMS,
            "processes": "client and echo server, one each, on loopback",
        },
    )
    png = _common.plot(
        path.with_suffix(".png"),
        f"After idling, × the design it replaces back to back ({_common.machine().get('cpu', '')})",
        "idle before, ms",
        "time, × back to back",
        {
            "Python work": ([i * 1e3 for i in IDLES], [v["over_no_idle"] for v in idle.values()]),
            **{
                f"seam round trip, asyncio {design}": (
                    [g * 1e3 for g in GAPS],
                    [
                        seams[f"{design}_gap_{g * 1e3:g}ms"]["round_trip_p50_us"]
                        / seams["thread_gap_0ms"]["round_trip_p50_us"]
                        for g in GAPS
                    ],
                )
                for design in DESIGNS
            },
            **{
                f"engine hand-off, {kind}": (
                    [g * 1e3 for g in GAPS],
                    [
                        hand_offs[f"{kind}_gap_{g * 1e3:g}ms_p50_us"] / hand_offs["condition_gap_0ms_p50_us"]
                        for g in GAPS
                    ],
                )
                for kind in ("condition", "simple_queue")
            },
        },
    )
    rows = [
        [design, f"{gap * 1e3:g}", v["round_trip_p50_us"], v["round_trip_p90_us"], v["cpu_us_per_round_trip"]]
        for design in DESIGNS
        for gap in GAPS
        for v in [seams[f"{design}_gap_{gap * 1e3:g}ms"]]
    ]
    print(_common.table(["asyncio side", "gap ms", "RTT p50 µs", "p90 µs", "CPU µs / RTT"], rows))
    print()
    print(
        _common.table(
            ["seams at once", "round p50 µs", "CPU µs / frame"],
            [[n, burst[f"{n}_seams"]["round_p50_us"], burst[f"{n}_seams"]["cpu_us_per_frame"]] for n in SEAMS],
        )
    )
    print()
    print(
        _common.table(
            ["hand-off", "gap ms", "round trip p50 µs"],
            [
                [kind, f"{gap * 1e3:g}", hand_offs[f"{kind}_gap_{gap * 1e3:g}ms_p50_us"]]
                for kind in ("condition", "simple_queue", "engine_thread")
                for gap in GAPS
            ],
        )
    )
    print()
    print(
        _common.table(
            ["idle before, ms", "work p50 µs", "× no idle"],
            [[k.removeprefix("after_"), v["work_p50_us"], v["over_no_idle"]] for k, v in idle.items()],
        )
    )
    print(f"\nwrote {path} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
