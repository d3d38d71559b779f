"""The engine thread: one thread for every call, in order, errors and cancellation passed back."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from noderuntime.engine.thread import EngineThread


async def test_every_call_runs_on_the_same_thread_in_order() -> None:
    thread = EngineThread("test-engine")
    seen: list[tuple[int, str]] = []

    def call(i: int) -> int:
        seen.append((threading.get_ident(), threading.current_thread().name))
        return i * 2

    try:
        results: dict[int, int] = {}

        async def one(i: int) -> None:
            results[i] = await thread.run(lambda: call(i))

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, i)
        assert results == {i: i * 2 for i in range(20)}
        assert len({ident for ident, _ in seen}) == 1
        assert seen[0][0] != threading.get_ident() and seen[0][1] == "test-engine"
    finally:
        thread.close()


async def test_an_error_in_the_call_is_raised_to_the_caller_and_the_thread_lives_on() -> None:
    thread = EngineThread()

    def fail() -> None:
        raise ValueError("bad batch")

    try:
        with pytest.raises(ValueError, match="bad batch"):
            await thread.run(fail)
        assert await thread.run(lambda: 7) == 7
    finally:
        thread.close()


async def test_a_cancelled_caller_waits_for_its_call_to_finish() -> None:
    thread = EngineThread()
    finished = threading.Event()

    def slow() -> str:
        time.sleep(0.3)
        finished.set()
        return "rows"

    try:
        got = []
        started = trio.current_time()
        with trio.move_on_after(0.05) as scope:
            got.append(await thread.run(slow))  # the call cannot be abandoned: its result comes back
            await trio.lowlevel.checkpoint()  # and the cancellation meets the caller after it
            got.append("not reached")
        assert scope.cancelled_caught and got == ["rows"]
        assert finished.is_set() and trio.current_time() - started >= 0.29
        with trio.move_on_after(0) as already:  # cancelled before queueing: nothing runs
            await thread.run(lambda: pytest.fail("ran"))
        assert already.cancelled_caught
        assert await thread.run(lambda: "still serving") == "still serving"
    finally:
        thread.close()


async def test_close_is_idempotent_and_refuses_later_calls() -> None:
    thread = EngineThread()
    assert await thread.run(lambda: 1) == 1
    worker = thread._thread
    thread.close()
    thread.close()
    assert worker is not None
    worker.join(5)
    assert not worker.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        await thread.run(lambda: 2)
