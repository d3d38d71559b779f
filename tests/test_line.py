"""The gateway's line of requests waiting for a slot (runner/line.py): bounds, turns, back-off."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from noderuntime.runner.line import FIRST_BACKOFF_SECONDS, MAX_BACKOFF_SECONDS, LineFull, Waiter, WaitLine


def test_the_line_is_bounded_in_all_and_per_key_and_refuses_at_once() -> None:
    line = WaitLine(limit=3, per_key=2)
    a1 = line.join_nowait("a")
    line.join_nowait("a")
    with pytest.raises(LineFull):
        line.join_nowait("a")  # its key's share is taken; another key still gets in
    line.join_nowait("b")
    with pytest.raises(LineFull):
        line.join_nowait("c")  # the whole line is full
    line.leave(a1, served=False)
    line.leave(a1, served=False)  # idempotent: a second leave frees nothing more
    assert line.waiting == 2
    line.join_nowait("c")
    stats = line.statistics()
    assert (stats.waiting, stats.keys, stats.joined, stats.refused, stats.served) == (3, 3, 4, 2, 0)
    with pytest.raises(LineFull):
        WaitLine(limit=0, per_key=5).join_nowait("a")  # a line of 0: nobody waits


def test_turns_go_round_the_keys_and_in_order_within_a_key() -> None:
    line = WaitLine(limit=10, per_key=10)
    waiters = {name: line.join_nowait(name[0]) for name in ("a1", "a2", "a3", "b1", "c1", "b2")}
    served = []
    while line.waiting:
        head = line.head()
        assert head is not None
        served.append(next(name for name, w in waiters.items() if w is head))
        line.leave(head, served=True)
    assert served == ["a1", "b1", "c1", "a2", "b2", "a3"]
    # one that leaves unserved (timed out) does not send its key to the back
    line = WaitLine(limit=10, per_key=10)
    a1, a2, b1 = line.join_nowait("a"), line.join_nowait("a"), line.join_nowait("b")
    line.leave(a1, served=False)
    assert line.head() is a2
    line.leave(a2, served=True)
    assert line.head() is b1


async def _serve(line: WaitLine, waiter: Waiter, free: list[int], order: list[str], name: str) -> None:
    """A request in line: on each turn it takes a free slot if there is one, else waits again."""
    while True:
        await line.wait_turn(waiter)
        if free[0] > 0:
            free[0] -= 1
            order.append(name)
            line.leave(waiter, served=True)
            return


async def test_a_freed_slot_goes_to_the_head_and_keys_take_turns(autojump_clock: trio.testing.MockClock) -> None:
    """Slots freed one at a time go round the keys: a key's burst does not starve another's one request."""
    line = WaitLine(limit=10, per_key=10)
    free = [0]
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        for name in ("a1", "a2", "a3", "a4", "b1", "b2"):
            nursery.start_soon(_serve, line, line.join_nowait(name[0]), free, order, name)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(6):
            free[0] += 1
            line.slot_freed()
            await trio.testing.wait_all_tasks_blocked()
    assert order == ["a1", "b1", "a2", "b2", "a3", "a4"]
    assert line.statistics().served == 6


async def test_several_slots_freed_at_once_are_taken_one_after_another_without_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A served request hands the turn on at once: slots freed elsewhere are not left for the back-off."""
    line = WaitLine(limit=10, per_key=10)
    free = [0]
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        for name in ("a1", "a2", "a3"):
            nursery.start_soon(_serve, line, line.join_nowait(name[0]), free, order, name)
        await trio.testing.wait_all_tasks_blocked()
        started = trio.current_time()
        free[0] = 3
        line.slot_freed()
    assert order == ["a1", "a2", "a3"]
    assert trio.current_time() - started < 1e-6


async def test_only_the_head_polls_and_its_back_off_is_bounded(autojump_clock: trio.testing.MockClock) -> None:
    """Slots freed by other gateways are found by the head alone, trying at growing intervals up to a bound."""
    line = WaitLine(limit=10, per_key=10)
    tries: dict[str, list[float]] = {"head": [], "behind": []}

    async def count(waiter: Waiter, name: str) -> None:
        while True:
            await line.wait_turn(waiter)
            tries[name].append(trio.current_time())

    with trio.move_on_after(20.0):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(count, line.join_nowait("a"), "head")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(count, line.join_nowait("b"), "behind")
    gaps = [round(b - a, 6) for a, b in zip(tries["head"], tries["head"][1:], strict=False)]
    assert tries["head"][0] == pytest.approx(FIRST_BACKOFF_SECONDS)
    assert gaps == sorted(gaps) and max(gaps) == pytest.approx(MAX_BACKOFF_SECONDS)
    assert 15 < len(tries["head"]) < 25  # about 20 s at one a second, after a few quicker ones
    assert tries["behind"] == []


async def test_a_head_that_leaves_hands_the_turn_on_at_once(autojump_clock: trio.testing.MockClock) -> None:
    """A request that gives up (its client left, its time ran out) is out of the line at once, the next one up."""
    line = WaitLine(limit=10, per_key=10)
    free = [0]
    order: list[str] = []
    head = line.join_nowait("a")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve, line, line.join_nowait("b"), free, order, "b1")
        await trio.testing.wait_all_tasks_blocked()
        free[0] = 1
        await trio.sleep(5.0)
        assert order == []  # not its turn: it does not look
        line.leave(head, served=False)  # what the gateway does when the head's wait ends
    assert order == ["b1"]
    assert line.statistics().waiting == 0
    with pytest.raises(ValueError):
        await line.wait_turn(head)  # out of the line: it cannot wait there again
