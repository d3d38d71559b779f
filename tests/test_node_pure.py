"""Leases, the scheduler and a hop's decode windows: plain synchronous logic, no event loop."""

from __future__ import annotations

import pytest

from noderuntime.node.leases import LeaseManager, SlotState
from noderuntime.node.scheduler import ReadyStep, schedule
from noderuntime.node.windows import HopWindows
from protocol import RemoteProtocolError, Span, StatusCode


def test_leases_refuse_when_full_and_reuse_only_drained_slots() -> None:
    leases = LeaseManager(n_slots=2, max_tokens_per_sequence=100)
    a, b = leases.acquire(50), leases.acquire(60)
    assert a is not None and b is not None and {a.seq_id, b.seq_id} == {0, 1}
    assert leases.acquire(10) is None
    assert a.release() and not a.release()  # idempotent
    assert leases.state(a.seq_id) is SlotState.DRAINING
    assert leases.acquire(10) is None  # the KV of a is not removed yet
    leases.free(a.seq_id)
    leases.free(a.seq_id)
    c = leases.acquire(10)
    assert c is not None and c.seq_id == a.seq_id
    stats = leases.statistics()
    assert (stats.slots_leased, stats.slots_draining, stats.kv_reserved_tokens, stats.refused) == (2, 0, 70, 2)


def test_leases_respect_the_kv_budget_and_the_context_per_sequence() -> None:
    leases = LeaseManager(n_slots=4, max_tokens_per_sequence=100, kv_budget_tokens=150)
    assert leases.acquire(101) is None
    assert leases.acquire(0) is None
    first = leases.acquire(100)
    assert first is not None
    assert leases.acquire(60) is None
    assert leases.acquire(50) is not None
    assert leases.statistics().slots_free == 2


def test_a_tick_runs_all_decode_steps_or_prefill_chunks_never_both() -> None:
    ready = [ReadyStep(0, 128, False), ReadyStep(1, 1, True), ReadyStep(2, 64, False), ReadyStep(3, 1, True)]
    plans = [schedule(ready, budget=512, rotation=tick) for tick in range(4)]
    assert [[s.seq_id for s in plan.steps] for plan in plans] == [[1, 3], [0], [1, 3], [2]]
    assert [plan.n_decode for plan in plans] == [2, 0, 2, 0]


def test_with_only_one_kind_ready_every_tick_serves_it() -> None:
    prefills = [ReadyStep(i, 100, False) for i in range(4)]
    firsts = [schedule(prefills, budget=150, rotation=tick).steps[0].seq_id for tick in range(8)]
    assert sorted(set(firsts)) == [0, 1, 2, 3]  # every session's prefill gets its turn
    decodes = [ReadyStep(i, 1, True) for i in range(3)]
    assert all(schedule(decodes, budget=8, rotation=tick).n_decode == 3 for tick in range(4))


def test_a_step_larger_than_the_budget_runs_alone_rather_than_never() -> None:
    plan = schedule([ReadyStep(0, 300, False)], budget=256)
    assert [s.seq_id for s in plan.steps] == [0]
    assert not schedule([], budget=10)


def test_decode_rows_beyond_the_budget_wait() -> None:
    ready = [ReadyStep(i, 1, True) for i in range(10)]
    plan = schedule(ready, budget=4)
    assert [s.seq_id for s in plan.steps] == [0, 1, 2, 3]


def test_prefill_chunks_of_one_length_share_a_tick_within_the_group_rows() -> None:
    ready = [ReadyStep(0, 64, False), ReadyStep(1, 100, False), ReadyStep(2, 64, False), ReadyStep(3, 64, False)]
    assert [s.seq_id for s in schedule(ready, budget=512, rotation=0).steps] == [0, 2, 3]
    assert [s.seq_id for s in schedule(ready, budget=512, rotation=2).steps] == [1]  # no other chunk of 100
    assert [s.seq_id for s in schedule(ready, budget=512, rotation=0, group_rows=128).steps] == [0, 2]
    # with decode steps waiting, prefill ticks still alternate with decode ticks
    mixed = [*ready, ReadyStep(4, 1, True)]
    assert [[s.seq_id for s in schedule(mixed, budget=512, rotation=t).steps] for t in range(2)] == [[4], [0, 2, 3]]


def test_a_windows_drafted_rows_enter_the_commitments_only_as_far_as_they_were_kept() -> None:
    windows = HopWindows.open(8, 8, audit=False, head_of_route=False)
    committed: list[tuple[int, list[int]]] = []
    windows.commit(lambda start, rows: committed.append((start, list(rows))), 10, [1, 2, 3, 4], window=True)
    windows.stepped(10, 4, (2, 3, 4), follows=False, sent_on=True)
    assert committed == [(10, [1])] and (windows.engine_end, windows.kept_end) == (14, 11)
    windows.keep(12)  # the tail kept one draft: rows 10 and 11
    assert committed == [(10, [1]), (11, [2])] and windows.kept_end == 12
    windows.keep(14)  # nothing held is committed twice
    assert committed == [(10, [1]), (11, [2])]


def test_an_audit_takes_no_windows_and_a_head_waits_for_the_tail_to_say() -> None:
    assert HopWindows.open(8, 8, audit=True, head_of_route=False).window == 0
    head = HopWindows.open(8, 4, audit=False, head_of_route=True)
    assert (head.takes, head.window) == (4, 0)
    head.answered(64)
    assert head.window == 4 and head.lowered(2) == 2


def test_a_window_leaves_room_for_the_reservation_and_the_reply() -> None:
    windows = HopWindows.open(8, 8, audit=False, head_of_route=False)
    assert windows.room(100, left=50, reserved=1000) == 8
    assert windows.room(100, left=3, reserved=1000) == 2
    assert windows.room(100, left=50, reserved=103) == 2
    assert windows.room(100, left=1, reserved=1000) == 0
    assert windows.room(999, left=50, reserved=1000) == 0


@pytest.mark.parametrize(
    ("positions", "drafts", "decode", "message"),
    [
        (Span(5, 7), (1,), False, "decode steps only"),
        (Span(5, 6), (1,), True, "positions with 1 drafted"),
        (Span(5, 15), tuple(range(1, 10)), True, "9 drafted tokens where this session takes 8"),
        (Span(5, 7), (99,), True, "outside the vocabulary"),
    ],
)
def test_a_peers_window_must_fit_its_rows_this_hops_bound_and_the_vocabulary(
    positions: Span, drafts: tuple[int, ...], decode: bool, message: str
) -> None:
    windows = HopWindows.open(8, 8, audit=False, head_of_route=False)
    with pytest.raises(RemoteProtocolError, match=message):
        windows.check_drafts(positions, drafts, decode=decode, n_vocab=50)


def test_a_windows_answer_must_follow_its_drafts_once() -> None:
    def sent() -> HopWindows:
        windows = HopWindows.open(8, 8, audit=False, head_of_route=False)
        windows.stepped(10, 4, (7, 8, 9), follows=False, sent_on=True)
        return windows

    for tokens, span, problem in [
        ((7, 5, 1), Span(11, 14), "do not follow"),
        ((7, 1), Span(12, 14), "not 11:13"),
        ((7, 8, 9, 1, 2), Span(11, 16), "do not follow"),
    ]:
        with pytest.raises(RemoteProtocolError, match=problem):
            sent().answer(tokens, span, finished=False)
    windows = sent()
    windows.answer((7, 8, 1), Span(11, 14), finished=False)
    assert not windows.flight and (windows.kept_end, windows.last) == (13, 1)
    windows.answer((3,), Span(40, 41), finished=False)  # the window is answered: nothing in flight to check


def test_windows_that_follow_live_while_each_before_them_is_kept_whole() -> None:
    """A hop with a window in flight (rows 10..13) and one following it (13..15, its guess 4):
    the answer that keeps the first whole and draws 4 keeps the second in flight; one that
    keeps less, or draws another token, makes it stale, and a window arriving after is judged
    against what was kept."""

    def two_in_flight() -> HopWindows:
        windows = HopWindows.open(8, 8, audit=False, head_of_route=False, max_ahead=2)
        windows.stepped(10, 3, (7, 8), follows=False, sent_on=True)
        assert windows.live(13, (4, 5))  # it continues the one in flight
        windows.stepped(13, 2, (4, 5), follows=True, sent_on=True)
        return windows

    kept = two_in_flight()
    kept.answer((7, 8, 4), Span(11, 14), finished=False)
    assert [step.start for step in kept.flight] == [13] and kept.kept_end == 13
    kept.answer((5, 6), Span(14, 16), finished=False)  # the guess ran first: its drafts are 5
    assert not kept.flight and (kept.kept_end, kept.last) == (15, 6)
    assert kept.live(15, (6,)) and kept.live(15, [6]) and not kept.live(15, (2,)) and not kept.live(16, (6,))
    for tokens, span in [((7, 1), Span(11, 13)), ((7, 8, 9), Span(11, 14))]:
        stale = two_in_flight()
        stale.answer(tokens, span, finished=False)
        assert not stale.flight and not stale.live(13, (4, 5))
    ended = two_in_flight()
    ended.answer((7, 8, 4), Span(11, 14), finished=True)
    assert not ended.flight


def test_a_windows_rows_that_follow_enter_the_commitments_only_once_kept() -> None:
    windows = HopWindows.open(8, 8, audit=False, head_of_route=False, max_ahead=2)
    committed: list[tuple[int, list[int]]] = []

    def add(start: int, rows: list[int]) -> None:
        committed.append((start, list(rows)))

    windows.commit(add, 10, [1, 2, 3], window=True)
    windows.stepped(10, 3, (7, 8), follows=False, sent_on=True)
    windows.commit(add, 13, [4, 5], window=True, follows=True)
    windows.stepped(13, 2, (4, 5), follows=True, sent_on=True)
    assert committed == [(10, [1])]
    windows.answer((7, 8, 4), Span(11, 14), finished=False)
    assert committed == [(10, [1]), (11, [2, 3])]  # the second window's rows still held
    windows.answer((5, 1), Span(14, 16), finished=False)
    assert committed == [(10, [1]), (11, [2, 3]), (13, [4, 5])]
    # a stale window's rows never enter: the next step goes back and drops them
    stale = HopWindows.open(8, 8, audit=False, head_of_route=False, max_ahead=2)
    committed.clear()
    stale.commit(add, 10, [1, 2, 3], window=True)
    stale.stepped(10, 3, (7, 8), follows=False, sent_on=True)
    stale.commit(add, 13, [4, 5], window=True, follows=True)
    stale.stepped(13, 2, (4, 5), follows=True, sent_on=True)
    stale.answer((7, 9), Span(11, 13), finished=False)
    stale.drop_from(12)
    stale.commit(add, 12, [6], window=False)
    stale.keep(13, 2)
    assert committed == [(10, [1]), (11, [2]), (12, [6])]


def test_a_window_that_follows_is_taken_only_where_the_route_takes_them() -> None:
    single = HopWindows.open(8, 8, audit=False, head_of_route=False)
    with pytest.raises(RemoteProtocolError, match="takes 0 ahead"):
        single.check_drafts(Span(5, 7), (1, 2), decode=True, n_vocab=50, follows=True)
    ahead = HopWindows.open(8, 8, audit=False, head_of_route=False, max_ahead=2)
    ahead.check_drafts(Span(5, 7), (1, 2), decode=True, n_vocab=50, follows=True)  # the guess listed first
    with pytest.raises(RemoteProtocolError, match="2 positions with 1 drafted"):
        ahead.check_drafts(Span(5, 7), (1,), decode=True, n_vocab=50, follows=True)
    with pytest.raises(RemoteProtocolError, match="decode steps only"):
        ahead.check_drafts(Span(5, 7), (1, 2), decode=False, n_vocab=50, follows=True)
    assert HopWindows.open(8, 8, audit=True, head_of_route=False, max_ahead=2).takes_ahead == 0


def test_a_peer_may_not_run_ahead_of_its_answers_nor_leave_a_gap() -> None:
    """Behind a step in flight only windows that follow it, up to the bound; never a step past
    the KV this hop holds (a stale window passed over leaves none)."""
    windows = HopWindows.open(8, 8, audit=False, head_of_route=False, max_ahead=1)
    windows.restored(10)
    windows.check_step(10, decode=True, follows=False)
    with pytest.raises(RemoteProtocolError, match="past the 10") as gap:
        windows.check_step(12, decode=True, follows=False)
    assert gap.value.code == StatusCode.FAILED_PRECONDITION
    windows.stepped(10, 3, (7, 8), follows=False, sent_on=True)
    with pytest.raises(RemoteProtocolError, match="unanswered"):
        windows.check_step(13, decode=True, follows=False)
    windows.check_step(13, decode=True, follows=True)
    windows.stepped(13, 2, (4, 5), follows=True, sent_on=True)
    with pytest.raises(RemoteProtocolError, match="follows 2 in flight") as beyond:
        windows.check_step(15, decode=True, follows=True)
    assert beyond.value.code == StatusCode.OUT_OF_RANGE
