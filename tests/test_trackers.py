"""Several trackers: the order a client asks them in, their back-off, and a node linked to each.

The order and the back-off are plain bookkeeping, tested with a clock the test moves. The
links and the fail-over run against real trackers served in this process on loopback, one
of them down when the node starts and one stopped while it serves.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import pytest
import trio

from noderuntime.access.identity import Identity
from noderuntime.access.known_trackers import KnownTrackers
from noderuntime.access.tickets import TicketVerifier
from noderuntime.operations.httpserve import serve_http
from noderuntime.tracker.app import Tracker
from noderuntime.tracker.client import NodeLoad, RouteGrant, TrackerError, request_route
from noderuntime.tracker.messages import Registration
from noderuntime.tracker.trackers import (
    MAX_BACKOFF_SECONDS,
    TrackerLinks,
    Trackers,
    first_issuer_keys,
    tracker_urls,
    unanswered,
)

from .test_faults import _free_port
from .test_tracker import ARTIFACT, _registration

A, B, C = "http://a", "http://b", "http://c"


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def answering(answers: dict[str, int], asked: list[str]) -> Callable[[str], Awaitable[str]]:
    """A call that each tracker answers with the status ``answers`` gives it (200: its URL; 0: no answer)."""

    async def call(url: str) -> str:
        asked.append(url)
        status = answers.get(url, 200)
        if status != 200:
            raise TrackerError(f"{url} says {status}", status)
        return url

    return call


def test_urls_keep_their_order_without_repeats_and_there_is_one_at_least() -> None:
    assert tracker_urls(["http://a/", "http://b", "http://a"]) == ("http://a", "http://b")
    assert tracker_urls("http://a/") == ("http://a",)
    with pytest.raises(ValueError, match="at least one"):
        Trackers([])
    with pytest.raises(ValueError, match="at least one"):
        tracker_urls(["http://a", ""])


def test_what_counts_as_no_answer() -> None:
    assert unanswered(TrackerError("refused connection"))
    assert unanswered(TrackerError("malformed route", 200))
    assert unanswered(TrackerError("bad gateway", 502))
    assert unanswered(TrackerError("internal", 500))
    for refusal in (503, 429, 403, 401, 400, 404):
        assert not unanswered(TrackerError("refused", refusal))


async def test_a_tracker_that_does_not_answer_rests_and_the_next_answers() -> None:
    clock = Clock()
    trackers = Trackers([A, B, C], clock=clock)
    asked: list[str] = []
    answers = {A: 0}
    assert await trackers.ask(answering(answers, asked)) == B
    assert asked == [A, B]
    # while it rests, requests go to the next at once
    asked.clear()
    assert await trackers.ask(answering(answers, asked)) == B
    assert asked == [B]
    assert trackers.order() == [B, C, A]
    # its rest over, it is asked first again; failing, it rests twice as long
    clock.now += 1.0
    assert trackers.order() == [A, B, C]
    asked.clear()
    assert await trackers.ask(answering(answers, asked)) == B
    assert asked == [A, B]
    clock.now += 1.5
    assert trackers.order() == [B, C, A]
    clock.now += 0.5
    assert trackers.order() == [A, B, C]
    # the rest doubles up to a bound
    for _ in range(10):
        trackers.failed(A)
    standing = {s.url: s for s in trackers.statistics()}
    assert standing[A].resting_seconds == MAX_BACKOFF_SECONDS
    assert standing[A].failures == 12 and standing[A].failed == 12 and standing[B].answered == 3
    # back, it is the first again, and its failures are forgotten
    clock.now += MAX_BACKOFF_SECONDS
    del answers[A]
    asked.clear()
    assert await trackers.ask(answering(answers, asked)) == A
    assert asked == [A]
    assert {s.url: s.failures for s in trackers.statistics()} == {A: 0, B: 0, C: 0}


async def test_one_request_alone_tries_a_rested_tracker_while_the_others_pass_it_over() -> None:
    clock = Clock()
    trackers = Trackers([A, B], clock=clock)
    trackers.failed(A)
    clock.now += 1.0
    trying = trio.Event()
    release = trio.Event()
    asked: list[str] = []

    async def slow_a(url: str) -> str:
        asked.append(url)
        if url == A:
            trying.set()
            await release.wait()  # a tracker that takes its time to time out
            raise TrackerError("timed out")
        return url

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trackers.ask, slow_a)
        await trying.wait()
        assert trackers.order() == [B, A]
        assert await trackers.ask(slow_a) == B
        release.set()
    assert asked == [A, B, B]
    assert trackers.order() == [B, A]  # it failed again: it rests


async def test_refusals_are_answers_and_no_route_is_asked_of_the_next() -> None:
    trackers = Trackers([A, B])
    asked: list[str] = []
    # every route full: the others count the same slots
    with pytest.raises(TrackerError) as full:
        await trackers.ask(answering({A: 429}, asked))
    assert full.value.status == 429 and asked == [A]
    # no route: the next may know nodes the first does not (it restarted); neither rests
    asked.clear()
    assert await trackers.ask(answering({A: 503}, asked)) == B
    assert asked == [A, B] and trackers.order() == [A, B]
    # none has one: the first's refusal is the answer, not a failure of the last
    asked.clear()
    with pytest.raises(TrackerError, match="http://a says 503"):
        await trackers.ask(answering({A: 503, B: 0}, asked))
    # unless the caller wants that tracker's answer alone
    asked.clear()
    with pytest.raises(TrackerError, match="http://a says 503"):
        await trackers.ask(answering({A: 503}, asked), past_no_route=False)
    assert asked == [A]
    # none answers: the last failure
    with pytest.raises(TrackerError, match="http://b says 0"):
        await trackers.ask(answering({A: 0, B: 0}, []))
    # asked of some only
    asked.clear()
    assert await trackers.ask(answering({}, asked), among=[B]) == B
    assert asked == [B]


def _check(verifier: TicketVerifier, grant: RouteGrant, node: bytes) -> None:
    verifier.check(
        grant.ticket,
        session_id=grant.session_id,
        epoch=grant.epoch,
        artifact=bytes.fromhex(ARTIFACT),
        hops=grant.hops,
        node_id=node,
        index=0,
    )


async def test_a_node_links_to_each_tracker_trusts_each_and_a_client_fails_over() -> None:
    """One tracker is down when the node starts: it starts with the other, and once the second comes
    up it trusts its key and registers there too. A client then gets routes from the first until it
    stops, then from the second, and the node accepts the tickets of both."""
    me = Identity.generate()
    first, second = (Tracker(Identity.generate(), expire_after=5.0, local_swarm=True) for _ in range(2))
    second_url = f"http://127.0.0.1:{_free_port()}"

    def load() -> NodeLoad:
        return NodeLoad(active_sessions=0, free_slots=2, queue_depth=0, step_ms=1.0)

    async def serve(tracker: Tracker, listen: str, scope: trio.CancelScope, task_status: trio.TaskStatus[str]) -> None:
        with scope:
            await serve_http(tracker.app, listen, task_status=task_status)

    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        first_scope, links_scope = trio.CancelScope(), trio.CancelScope()

        first_url = await nursery.start(serve, first, "127.0.0.1:0", first_scope)
        with trio.fail_after(10):
            keys = await first_issuer_keys([first_url, second_url], KnownTrackers(None))  # the second: not waited for
        assert keys == {first_url: first.identity.node_id}
        verifier = TicketVerifier(keys.values())
        links = TrackerLinks(
            [first_url, second_url], me, Registration(**_registration(me)), load, verifier=verifier, trusted=keys
        )

        async def run_links(task_status: trio.TaskStatus[None]) -> None:
            with links_scope:
                await links.run(task_status=task_status)

        with trio.fail_after(10):
            await nursery.start(run_links)
        assert me.node_id in first.state.nodes and me.node_id not in second.state.nodes
        assert verifier.trusted == {first.identity.node_id}

        await nursery.start(serve, second, second_url.removeprefix("http://"), trio.CancelScope())
        with trio.fail_after(10):
            while me.node_id not in second.state.nodes:
                await trio.sleep(0.05)
        assert verifier.trusted == {first.identity.node_id, second.identity.node_id}

        trackers = Trackers([first_url, second_url])

        async def route(url: str) -> RouteGrant:
            return await request_route(client, url, ARTIFACT, 100)

        grant = await trackers.ask(route)
        assert grant.tracker == first_url
        _check(verifier, grant, me.node_id)
        first_scope.cancel()  # the first tracker dies
        await trio.sleep(0.1)
        grant = await trackers.ask(route)
        assert grant.tracker == second_url
        _check(verifier, grant, me.node_id)
        assert [s.failures for s in trackers.statistics()] == [1, 0]

        # the node stops: the tracker that answers hears it leave, the dead one does not hold it up
        links_scope.cancel()
        with trio.fail_after(5):
            while me.node_id in second.state.nodes:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
