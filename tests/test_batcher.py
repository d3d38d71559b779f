"""The batcher's timing logic, with a fake engine on trio's autojump clock."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from noderuntime.engine.base import Rows, StepResult
from noderuntime.node.batcher import Batcher, StepFailed, StepRequest
from noderuntime.node.leases import Lease, LeaseManager, SlotState

RUN_SECONDS = 0.010  # each batch takes 10 ms of (virtual) time


class FakeEngine:
    """Echoes positions as hidden rows; samples ``1000 + position``; records every batch."""

    is_head = True
    is_tail = True

    def __init__(self) -> None:
        self.batches: list[list[tuple[int, int]]] = []  # (seq_id, rows) per step
        self.removed: list[int] = []
        self.fail_next = False

    def run(self, rows: Rows, *, samplers: dict[int, Any] | None = None, want_logits: bool = False) -> StepResult:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("decode failed")
        steps: list[tuple[int, int]] = []
        for seq in rows.seq_ids.tolist():
            if steps and steps[-1][0] == seq:
                steps[-1] = (seq, steps[-1][1] + 1)
            else:
                steps.append((seq, 1))
        self.batches.append(steps)
        hidden = np.repeat(rows.positions.astype(np.float32)[:, None], 4, axis=1)
        sampled = {row: 1000 + int(rows.positions[row]) for row in (samplers or {})}
        return StepResult(hidden, None, sampled, RUN_SECONDS)

    def remove_sequence(self, seq_id: int) -> None:
        self.removed.append(seq_id)


async def virtual_runner(call: Callable[[], StepResult]) -> StepResult:
    await trio.sleep(RUN_SECONDS)
    return call()


def make(slots: int = 8, budget: int = 64) -> tuple[Batcher, FakeEngine, LeaseManager]:
    engine = FakeEngine()
    leases = LeaseManager(slots, 1000)
    return Batcher(engine, leases, max_batch_tokens=budget, runner=virtual_runner), engine, leases


def two_leases(leases: LeaseManager) -> tuple[Lease, Lease]:
    """Two sessions' leases of 100 positions."""
    first, second = leases.acquire(100), leases.acquire(100)
    assert first is not None and second is not None
    return first, second


def request(seq: int, start: int, n: int, *, sampler: object = None) -> StepRequest:
    return StepRequest(seq, start, tokens=np.arange(n, dtype=np.int32), sampler=sampler, decode=n == 1)


async def test_an_idle_batcher_adds_no_latency(autojump_clock: trio.testing.MockClock) -> None:
    batcher, _, _ = make()
    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        await trio.sleep(5)  # idle for a while
        started = trio.current_time()
        out = await batcher.step(request(0, 7, 1, sampler=object()))
        assert trio.current_time() - started == pytest.approx(RUN_SECONDS)
        assert out.token == 1007 and out.batch_rows == 1
        assert out.hidden is not None and out.hidden[0, 0] == 7
        nursery.cancel_scope.cancel()


async def test_steps_arriving_during_a_run_are_taken_at_the_next_tick(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batcher, engine, _ = make()
    results: dict[int, float] = {}

    async def session(seq: int, delay: float) -> None:
        await trio.sleep(delay)
        await batcher.step(request(seq, 0, 1))
        results[seq] = trio.current_time()

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        t0 = trio.current_time()
        async with trio.open_nursery() as sessions:
            sessions.start_soon(session, 0, 0.0)
            sessions.start_soon(session, 1, 0.003)  # during the first run
            sessions.start_soon(session, 2, 0.004)  # also during it
        nursery.cancel_scope.cancel()
    assert engine.batches == [[(0, 1)], [(1, 1), (2, 1)]]
    assert results[0] - t0 == pytest.approx(0.010)
    assert results[1] - t0 == pytest.approx(0.020) and results[2] - t0 == pytest.approx(0.020)


async def test_a_tick_waits_briefly_for_leased_sessions_that_have_not_handed_in_a_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batcher, engine, leases = make()
    first, second = two_leases(leases)

    async def late(seq: int) -> None:
        for _ in range(2):  # runnable in the same instant, two scheduler passes later
            await trio.lowlevel.checkpoint()
        await batcher.step(request(seq, 0, 1))

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        async with trio.open_nursery() as sessions:
            sessions.start_soon(batcher.step, request(first.seq_id, 0, 1))
            sessions.start_soon(late, second.seq_id)
        # with every leased session's step in, nothing is waited for: the unleased step
        # that comes two passes later runs in a tick of its own
        async with trio.open_nursery() as sessions:
            sessions.start_soon(batcher.step, request(first.seq_id, 1, 1))
            sessions.start_soon(batcher.step, request(second.seq_id, 1, 1))
            sessions.start_soon(late, 5)
        nursery.cancel_scope.cancel()
    assert engine.batches[0] == [(first.seq_id, 1), (second.seq_id, 1)]
    assert engine.batches[1:] == [[(first.seq_id, 1), (second.seq_id, 1)], [(5, 1)]]


async def test_decode_steps_share_a_tick_and_prefill_chunks_run_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batcher, engine, _ = make(budget=64)
    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        async with trio.open_nursery() as sessions:
            sessions.start_soon(batcher.step, request(0, 0, 40))
            sessions.start_soon(batcher.step, request(1, 0, 40))
            sessions.start_soon(batcher.step, request(2, 5, 1))
            sessions.start_soon(batcher.step, request(3, 7, 1))
        nursery.cancel_scope.cancel()
    # the decode rows go together first; each prefill chunk then runs alone (batched with
    # other sequences, llama.cpp would compute it in other shapes, with other low bits)
    assert engine.batches[0] == [(2, 1), (3, 1)]
    assert sorted(engine.batches[1:]) == [[(0, 40)], [(1, 40)]]


async def test_a_cancelled_waiting_step_is_withdrawn(autojump_clock: trio.testing.MockClock) -> None:
    batcher, engine, _ = make(budget=8)
    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        async with trio.open_nursery() as sessions:
            sessions.start_soon(batcher.step, request(0, 0, 8))
            await trio.sleep(0.001)
            with trio.move_on_after(0.005):  # still waiting behind seq 0's batch
                await batcher.step(request(1, 0, 8))
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert engine.batches == [[(0, 8)]]
    assert batcher.statistics().waiting == 0


async def test_retire_waits_for_the_running_batch_then_frees_the_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batcher, engine, leases = make()
    lease = leases.acquire(10)
    assert lease is not None
    closed: list[bool] = []

    class Sampler:
        def close(self) -> None:
            closed.append(True)

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)

        async def cancelled_mid_run() -> None:
            with trio.move_on_after(0.005):
                await batcher.step(request(lease.seq_id, 0, 4))
            lease.release()
            batcher.retire(lease.seq_id, Sampler())
            # the batch is still running: nothing removed yet, the slot still draining
            assert engine.removed == [] and leases.statistics().slots_draining == 1

        await cancelled_mid_run()
        await trio.sleep(0.02)
        assert engine.removed == [lease.seq_id] and closed == [True]
        assert leases.statistics().slots_free == 8
        # idle batcher: retire applies at once
        other = leases.acquire(5)
        assert other is not None and other.release()
        batcher.retire(other.seq_id)
        assert engine.removed[-1] == other.seq_id and leases.statistics().slots_free == 8
        nursery.cancel_scope.cancel()


async def test_an_engine_failure_fails_that_batch_only(autojump_clock: trio.testing.MockClock) -> None:
    batcher, engine, _ = make()
    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        engine.fail_next = True
        with pytest.raises(StepFailed, match="decode failed"):
            await batcher.step(request(0, 0, 3))
        out = await batcher.step(request(0, 0, 3))
        assert out.batch_rows == 3
        assert batcher.statistics().failed_batches == 1
        nursery.cancel_scope.cancel()


async def test_one_step_per_sequence(autojump_clock: trio.testing.MockClock) -> None:
    batcher, _, _ = make()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.step, request(0, 0, 1))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RuntimeError, match="already has a step waiting"):
            await batcher.step(request(0, 1, 1))
        with pytest.raises(ValueError, match="1 to 64 rows"):
            await batcher.step(request(1, 0, 65))
        nursery.cancel_scope.cancel()


async def _route_like(batcher: Batcher, seq: int, offset: float, round_trip: float, steps: int) -> list[float]:
    """A session whose decode steps come back ``round_trip`` after each result, as on a route."""
    await trio.sleep(offset)
    times = []
    for position in range(steps):
        await batcher.step(request(seq, position, 1))
        times.append(trio.current_time())
        await trio.sleep(round_trip)
    return times


async def test_decode_steps_that_are_due_join_the_tick_instead_of_splitting_into_groups(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two sessions a few ms apart would take turns forever; the one that is due is waited for."""
    batcher, engine, leases = make()
    a, b = two_leases(leases)
    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        async with trio.open_nursery() as sessions:
            sessions.start_soon(_route_like, batcher, a.seq_id, 0.0, 0.003, 12)
            sessions.start_soon(_route_like, batcher, b.seq_id, 0.002, 0.003, 12)
        nursery.cancel_scope.cancel()
    both = [(a.seq_id, 1), (b.seq_id, 1)]
    assert engine.batches[:2] == [[(a.seq_id, 1)], [(b.seq_id, 1)]]  # apart, until their cadence is known
    assert engine.batches[3:11] == [both] * 8  # then together, and they stay so
    assert len(engine.batches) < 2 * 12 - 8


async def test_a_step_that_is_not_due_is_not_waited_for(autojump_clock: trio.testing.MockClock) -> None:
    batcher, _, leases = make()
    a, b = two_leases(leases)
    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        async with trio.open_nursery() as sessions:
            sessions.start_soon(_route_like, batcher, b.seq_id, 0.0, 0.200, 3)
            times = await _route_like(batcher, a.seq_id, 0.001, 0.005, 10)
        nursery.cancel_scope.cancel()
    # b comes every 210 ms, far outside a tick's wait: a's ticks never wait for it
    gaps = [t1 - t0 for t0, t1 in itertools.pairwise(times)]
    assert max(gaps[2:]) == pytest.approx(0.005 + RUN_SECONDS)


async def test_a_session_that_took_its_last_step_is_not_waited_for(autojump_clock: trio.testing.MockClock) -> None:
    """Finished but still leased (its Release is on the way): the other sessions' ticks go on at once."""
    batcher, _, leases = make()
    a, b = two_leases(leases)

    async def finishes() -> None:
        await _route_like(batcher, b.seq_id, 0.0, 0.003, 4)
        batcher.last_step(b.seq_id)

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        async with trio.open_nursery() as sessions:
            sessions.start_soon(finishes)
            times = await _route_like(batcher, a.seq_id, 0.0, 0.003, 12)
        nursery.cancel_scope.cancel()
    assert leases.state(b.seq_id) is SlotState.LEASED
    # without the word, a's first tick after b's last step would wait a whole tick for b
    gaps = [t1 - t0 for t0, t1 in itertools.pairwise(times)]
    assert max(gaps) == pytest.approx(0.003 + RUN_SECONDS)
