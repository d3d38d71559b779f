"""Placement: the range a node that starts without one is given (pure), and the tracker's signed API for it."""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import httpx
import pytest
import trio

from noderuntime.access.identity import Identity
from noderuntime.access.signing import sign
from noderuntime.control.admission import Capability, capability_record
from noderuntime.operations.httpserve import serve_http
from noderuntime.tracker import placement as placement_module
from noderuntime.tracker.app import Tracker
from noderuntime.tracker.client import TrackerError, request_placement, request_reconsider
from noderuntime.tracker.messages import PlacementRequest, RebalanceRequest
from noderuntime.tracker.placement import (
    RESERVATION_SECONDS,
    Piece,
    Placement,
    PlacementError,
    choose,
    route_capacity,
)
from noderuntime.tracker.records import NodeRecord
from noderuntime.tracker.registry import TrackerState

ARTIFACT = "ab" * 32


def node(name: str, layers: tuple[int, int], *, step: float = 10.0, n_layer: int = 30, **changes: Any) -> NodeRecord:
    """A node of 4 slots that measured nothing: it gives 4 * 1000 / ``step`` tokens/s to its layers."""
    return NodeRecord(
        node_id=name.encode().ljust(32, b"."),
        artifact=ARTIFACT,
        n_layer=n_layer,
        layers=layers,
        recipe="r" * 16,
        address=f"{name}:1",
        relay="",
        tls_cert_sha256=b"",
        slots=4,
        ctx_per_session=2048,
        step_ms=step,
        **changes,
    )


def _id(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def placement_with(*records: NodeRecord) -> Placement:
    state = TrackerState()
    for record in records:
        state.register(record, 0.0)
    return Placement(state)


def test_the_window_completes_a_route_first_then_goes_around_the_weakest_layer_uncovered_ones_first() -> None:
    assert choose([], 30, 10, 100.0).layers == (0, 10)
    assert choose([], 30, 40, 100.0).layers == (0, 30)  # more than the model: all of it
    # no route yet: the chain from layer 0 grows, and the window that completes one wins
    assert choose([Piece(0, 10, 100.0)], 30, 17, 100.0).layers == (10, 27)
    assert choose([Piece(0, 10, 100.0), Piece(10, 27, 100.0)], 30, 24, 100.0).layers == (10, 30)
    # a piece that starts where no chain from layer 0 ends serves no route: the joiner bridges to it
    assert choose([Piece(20, 30, 100.0)], 30, 25, 100.0).layers == (0, 20)
    # one route: the window around its slowest stretch, ending where another piece starts
    slow_middle = [Piece(0, 10, 500.0), Piece(10, 20, 50.0), Piece(20, 30, 500.0)]
    given = choose(slow_middle, 30, 12, 100.0)
    assert given.layers == (10, 20) and given.weakest == 10 and given.weakest_capacity == 50.0
    # by throughput, not by count: two slow nodes are thinner than one fast one
    by_speed = [Piece(0, 15, 40.0), Piece(0, 15, 40.0), Piece(15, 30, 800.0)]
    assert choose(by_speed, 30, 15, 100.0).layers == (0, 15)
    with pytest.raises(ValueError):
        choose([], 0, 3, 1.0)


def test_joiners_too_small_for_a_stretch_build_a_bridge_that_the_next_ones_finish() -> None:
    pieces = [Piece(0, 30, 40.0)]
    for expected in [(0, 10), (10, 20), (20, 30)]:
        given = choose(pieces, 30, 10, 100.0)
        assert given.layers == expected
        pieces.append(Piece(*given.layers, 100.0))
    assert route_capacity(pieces, 30).tolist() == [140.0] * 30


def test_route_capacity_counts_only_pieces_on_a_chain_from_the_first_layer_to_the_last() -> None:
    pieces = [Piece(0, 10, 1.0), Piece(10, 30, 2.0), Piece(5, 12, 50.0), Piece(0, 12, 7.0)]
    assert route_capacity(pieces, 30).tolist() == [1.0] * 10 + [2.0] * 20
    assert route_capacity([Piece(0, 29, 5.0)], 30).tolist() == [0.0] * 30
    # sums of floats that cancel leave an uncovered layer at exactly 0
    assert route_capacity([Piece(0, 30, 0.1), Piece(0, 30, 0.2)], 30).min() == 0.3


def test_capacity_counts_measured_throughput_of_admitted_nodes_and_not_the_excluded() -> None:
    placement = placement_with(
        node("a", (0, 10), step=10.0),  # 400 tokens/s
        node("b", (10, 30), step=40.0),  # 100 tokens/s
        node("failed", (10, 30), probe_passed=False),
        node("audited", (10, 30), audit_failed="wrong bits"),
        node("probing", (10, 30), probe_required=True),  # its probe still owed: unadmitted, it counts for nothing
        node("other", (0, 30), n_layer=31),  # another layer count: it serves no route
        node("stray", (5, 12)),  # on no route
    )
    capacity = placement.capacity(ARTIFACT, 30, 0.0)
    assert capacity.tolist() == [400.0] * 10 + [100.0] * 20
    # a node that asks is counted without what it serves now
    assert placement.capacity(ARTIFACT, 30, 0.0, exclude=_id("a")).max() == 0.0
    # 10:30 is the weakest without the node still owing its probe
    assert placement.assign(_id("new"), ARTIFACT, 30, 10, 0.0).layers == (10, 20)


def test_two_joiners_asking_at_once_take_different_gaps_and_form_a_route() -> None:
    placement = placement_with()
    first = placement.assign(_id("one"), ARTIFACT, 30, 12, 0.0)
    second = placement.assign(_id("two"), ARTIFACT, 30, 12, 1.0)
    third = placement.assign(_id("three"), ARTIFACT, 30, 12, 2.0)
    assert first.layers == (0, 12) and first.weakest_capacity == 0.0
    assert second.layers == (12, 24) and second.weakest_capacity == 0.0
    assert third.layers == (24, 30) and third.weakest_capacity == 0.0
    assert placement.capacity(ARTIFACT, 30, 3.0).min() > 0
    # a fourth doubles a stretch, even before any of them registered
    fourth = placement.assign(_id("four"), ARTIFACT, 30, 12, 3.0)
    assert fourth.layers == (0, 12) and fourth.weakest_capacity > 0
    # asking again gives up the old reservation: the same answer, not a second window
    again = placement.assign(_id("four"), ARTIFACT, 30, 12, 4.0)
    assert again.layers == fourth.layers
    assert len(placement.reservations) == 4


def test_reservations_lapse_and_a_node_that_registers_or_leaves_clears_its_own() -> None:
    placement = placement_with()
    given = placement.assign(_id("one"), ARTIFACT, 30, 10, 0.0)
    assert given.expires == RESERVATION_SECONDS
    assert placement.assign(_id("two"), ARTIFACT, 30, 10, 1.0).layers == (10, 20)
    # one never came: after its reservation lapses, its gap is given again
    assert placement.assign(_id("late"), ARTIFACT, 30, 10, RESERVATION_SECONDS + 0.5).layers == (0, 10)
    assert set(placement.reservations) == {_id("two"), _id("late")}
    # one registered (with the range it was given): its record counts, its reservation is gone
    placement.state.register(node("two", (10, 20)), 2.0)
    placement.registered(_id("two"))
    assert set(placement.reservations) == {_id("late")}
    pieces = placement.pieces(ARTIFACT, 30, RESERVATION_SECONDS + 1)
    assert sorted(pieces, key=lambda p: p.start) == [Piece(0, 10, 100.0), Piece(10, 20, 400.0)]  # counted once
    placement.forget(_id("late"))
    assert not placement.reservations
    assert placement.assign(_id("new"), ARTIFACT, 30, 10, RESERVATION_SECONDS + 2).layers == (0, 10)


def test_reservations_are_bounded_and_a_request_against_the_swarms_layer_count_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(placement_module, "MAX_RESERVATIONS", 64)
    placement = placement_with(node("a", (0, 30)))
    with pytest.raises(PlacementError, match="30 layers"):
        placement.assign(_id("new"), ARTIFACT, 32, 10, 0.0)
    with pytest.raises(ValueError):
        placement.assign(_id("new"), ARTIFACT, 30, 0, 0.0)
    for k in range(64 + 10):
        placement.assign(k.to_bytes(32, "big"), ARTIFACT, 30, 3, k * 1e-3)
    assert len(placement.reservations) == 64
    assert (0).to_bytes(32, "big") not in placement.reservations  # the soonest to lapse went first


def test_joiners_one_by_one_cover_a_model_none_of_them_can_hold() -> None:
    placement = placement_with()
    for k, size in enumerate([7, 9, 5, 11, 6, 8]):
        placement.assign(_id(f"n{k}"), ARTIFACT, 40, size, float(k))
    assert placement.capacity(ARTIFACT, 40, 10.0).min() > 0


def _registration(me: Identity, layers: tuple[int, int], decode_ms: float = 10.0) -> dict[str, Any]:
    return {
        "node_id": me.node_id.hex(),
        "artifact": ARTIFACT,
        "n_layer": 30,
        "layers": list(layers),
        "recipe": "0123456789abcdef",
        "address": "127.0.0.1:1",
        "slots": 2,
        "ctx_per_session": 512,
        "capability": capability_record(
            me,
            artifact=ARTIFACT,
            layers=layers,
            recipe="0123456789abcdef",
            capability=Capability(2.0, ((1, decode_ms), (2, decode_ms * 1.2)), 1, 1, 1, 2),
        ),
    }


def _signed_poster(
    client: httpx.AsyncClient, url: str
) -> Callable[[str, dict[str, Any], Identity], Awaitable[httpx.Response]]:
    """POST a JSON body to the tracker at ``url`` as ``signer`` signs it, each with a timestamp of its own."""
    stamps = iter(range(int(time.time() * 1000), 1 << 62))

    async def post(path: str, body: dict[str, Any], signer: Identity) -> httpx.Response:
        data = json.dumps(body).encode()
        headers = {**sign(signer, "POST", path, data, next(stamps)), "content-type": "application/json"}
        return await client.post(url + path, content=data, headers=headers)

    return post


async def test_the_tracker_places_signed_joiners_apart_and_refuses_bad_requests_with_a_4xx() -> None:
    tracker = Tracker(Identity.generate(), local_swarm=True)
    one, two, other = Identity.generate(), Identity.generate(), Identity.generate()
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        post = _signed_poster(client, url)

        def asked(me: Identity, **changes: Any) -> dict[str, Any]:
            return {"node_id": me.node_id.hex(), "artifact": ARTIFACT, "n_layer": 30, "max_layers": 20, **changes}

        first = await request_placement(client, url, one, PlacementRequest(**asked(one)))
        second = await request_placement(client, url, two, PlacementRequest(**asked(two, tokens_per_s=50.0)))
        assert first.layers == (0, 20) and first.weakest_capacity == 0.0
        assert second.layers == (20, 30) and second.weakest_capacity == 0.0
        assert first.reserved_seconds == RESERVATION_SECONDS
        # unsigned, signed by another, or malformed: refused, and the tracker serves on
        assert (await client.post(url + "/v1/placement", json=asked(one))).status_code == 401
        assert (await post("/v1/placement", asked(one), other)).status_code == 403
        for bad in (
            asked(one, max_layers=0),
            asked(one, max_layers=True),
            asked(one, n_layer="30"),
            asked(one, n_layer=1 << 20),
            asked(one, tokens_per_s=-1.0),
            asked(one, artifact="zz"),
            asked(one, spare="field"),
            {"node_id": one.node_id.hex()},
        ):
            response = await post("/v1/placement", bad, one)
            assert response.status_code == 422, bad
        bad_json = b"{not json"
        headers = {
            **sign(one, "POST", "/v1/placement", bad_json, int(time.time() * 1000) + 1000),
            "content-type": "application/json",
        }
        assert (await client.post(url + "/v1/placement", content=bad_json, headers=headers)).status_code == 422
        # once a node of the artifact registered, another layer count is a conflict
        assert (await post("/v1/nodes/register", _registration(one, (0, 20)), one)).status_code == 200
        assert one.node_id not in tracker.placement.reservations
        assert two.node_id in tracker.placement.reservations
        with pytest.raises(TrackerError) as conflict:
            await request_placement(client, url, other, PlacementRequest(**asked(other, n_layer=32)))
        assert conflict.value.status == 409 and "30 layers" in str(conflict.value)
        # leaving clears a reservation too
        assert (await post("/v1/nodes/leave", {"node_id": two.node_id.hex()}, two)).status_code == 200
        assert not tracker.placement.reservations
        third = await request_placement(client, url, other, PlacementRequest(**asked(other, max_layers=10)))
        assert third.layers == (20, 30)
        nursery.cancel_scope.cancel()


async def test_a_placement_the_node_cannot_serve_is_a_tracker_error() -> None:
    me = Identity.generate()

    async def lying(request: httpx.Request) -> httpx.Response:
        body = {"layers": [0, 25], "n_layer": 30, "weakest": 0, "weakest_capacity": 0.0, "reserved_seconds": 60}
        return httpx.Response(200, json=body)

    async def garbled(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"\xff\x00")

    asked = PlacementRequest(node_id=me.node_id.hex(), artifact=ARTIFACT, n_layer=30, max_layers=20)
    for handler, message in ((lying, "cannot serve"), (garbled, "malformed")):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            with pytest.raises(TrackerError, match=message):
                await request_placement(client, "http://tracker", me, asked)


def _move(placement: Placement, name: str, layers: tuple[int, int], now: float) -> None:
    """What a node that moved does: it registers with its new range (its old one drains)."""
    old = placement.state.nodes[_id(name)]
    held = old.layers[1] - old.layers[0]
    step = old.step_ms * (layers[1] - layers[0]) / held  # its step time grows with its layers
    placement.state.register(attrs.evolve(old, layers=layers, step_ms=step), now)
    placement.registered(_id(name))


def test_a_serving_node_moves_to_the_weakest_stretch_only_when_the_least_capacity_grows_by_the_margin() -> None:
    # two nodes on the fast half, one slow one on the other: one of the first pair should move
    placement = placement_with(
        node("a", (0, 15), step=10.0), node("c", (0, 15), step=10.0), node("b", (15, 30), step=100.0)
    )
    assert placement.capacity(ARTIFACT, 30, 0.0).min() == 40.0
    moved = placement.reconsider(_id("c"), 15, 1.0)
    assert moved is not None and moved.layers == (15, 30)
    assert moved.least_before == 40.0 and moved.least_after == 400.0  # a alone on 0:15 now
    # make before break: its new range counts while it loads, its old one while it drains
    assert placement.capacity(ARTIFACT, 30, 1.0).tolist() == [800.0] * 15 + [440.0] * 15
    _move(placement, "c", moved.layers, 2.0)
    assert placement.capacity(ARTIFACT, 30, 2.0).tolist() == [400.0] * 15 + [440.0] * 15
    assert not placement.reservations
    # now neither may move: each is the only fast node of its half, and a move would uncover it
    for name in ("a", "b", "c"):
        assert placement.reconsider(_id(name), 15, 3.0) is None
    # a gain under the margin is no reason to move
    close = placement_with(node("a", (0, 15), step=10.0), node("c", (0, 15), step=80.0), node("b", (15, 30), step=20.0))
    assert close.reconsider(_id("c"), 15, 0.0) is None
    assert close.reconsider(_id("c"), 15, 0.0, margin=1.0) is not None
    # an unknown node, or one the swarm does not count, is not moved
    assert placement.reconsider(_id("nobody"), 15, 0.0) is None


def test_rebalancing_a_random_swarm_converges_raises_the_least_capacity_and_never_uncovers() -> None:
    rng = random.Random(5)
    placement = placement_with()
    sizes: dict[str, int] = {}
    for k in range(40):
        name = f"n{k}"
        sizes[name] = rng.randint(4, 20)
        given = placement.assign(_id(name), ARTIFACT, 60, sizes[name], float(k), tokens_per_s=rng.uniform(20, 400))
        placement.state.register(node(name, given.layers, n_layer=60, step=rng.uniform(5, 100)), float(k))
        placement.registered(_id(name))
    for name in rng.sample(sorted(sizes), 12):  # a third leave
        placement.state.leave(_id(name), 50.0)
        del sizes[name]
    least = placement.capacity(ARTIFACT, 60, 50.0).min()
    assert least > 0
    moves, rounds = 0, 0
    while True:
        rounds += 1
        assert rounds <= 20, "rebalancing does not settle"
        moved_now = 0
        for name in rng.sample(sorted(sizes), len(sizes)):
            move = placement.reconsider(_id(name), sizes[name], 60.0 + rounds)
            if move is not None:
                assert move.least_after > move.least_before * 1.33 and move.least_after > 0
                _move(placement, name, move.layers, 60.0 + rounds)
                now = placement.capacity(ARTIFACT, 60, 60.0 + rounds).min()
                assert now >= least  # every move keeps every layer on a route, and raises the least
                least, moved_now = now, moved_now + 1
        moves += moved_now
        if not moved_now:
            break
    assert moves > 0  # the leaves left a stretch thin enough to move for


def test_of_many_windows_those_nearest_the_weakest_layer_are_weighed(monkeypatch: pytest.MonkeyPatch) -> None:
    # one-layer pieces chain over the model: every layer a boundary, a window from each
    pieces = [Piece(k, k + 1, 100.0) for k in range(40)] + [Piece(0, 40, 100.0)]
    pieces[31] = Piece(31, 32, 10.0)  # the weakest layer
    expected = choose(pieces, 40, 3, 50.0)
    assert expected.weakest == 31
    monkeypatch.setattr(placement_module, "MAX_CANDIDATES", 4)
    narrowed = choose(pieces, 40, 3, 50.0)
    assert narrowed == expected


def _drift(placement: Placement, steps: dict[str, float], now: float) -> None:
    """The nodes' measured step times change (another load on their hosts, a thermal limit)."""
    for name, step in steps.items():
        placement.state.register(attrs.evolve(placement.state.nodes[_id(name)], step_ms=step), now)


def test_a_node_told_to_move_is_not_told_again_within_the_hold_down_however_the_swarm_drifts() -> None:
    def moves(hold_down: float) -> list[tuple[float, tuple[int, int]]]:
        """Where c went, asking every minute for an hour while the halves' speeds swap every minute."""
        placement = placement_with(node("a", (0, 15)), node("c", (0, 15)), node("b", (15, 30), step=100.0))
        placement.hold_down_seconds = hold_down
        went = []
        for minute in range(60):
            now = 60.0 * minute
            # a and b swap speeds: whichever half c does not serve is, by turns, the thin one
            slow, fast = ("b", "a") if minute % 2 == 0 else ("a", "b")
            _drift(placement, {slow: 100.0, fast: 10.0}, now)
            move = placement.reconsider(_id("c"), 15, now)
            if move is not None:
                went.append((now, move.layers))
                _move(placement, "c", move.layers, now)
        return went

    # without a hold-down this swarm flaps: c crosses over at every swap
    assert len(moves(0.0)) == 60
    held = moves(600.0)
    # with one, c moves at most once in each hold-down, and never sooner than it allows
    assert 1 < len(held) <= 6
    assert all(later - earlier >= 600.0 for (earlier, _), (later, _) in itertools.pairwise(held))


def test_the_hold_down_ends_and_is_forgotten_with_it() -> None:
    placement = placement_with(node("a", (0, 15)), node("c", (0, 15)), node("b", (15, 30), step=100.0))
    assert placement.held_down(_id("c"), 0.0) == 0.0
    move = placement.reconsider(_id("c"), 15, 0.0)
    assert move is not None
    assert placement.held_down(_id("c"), 100.0) == placement.hold_down_seconds - 100.0
    placement.expire(placement.hold_down_seconds)
    assert not placement.moved


async def test_the_tracker_tells_a_signed_serving_node_to_stay_or_move_and_holds_it_down() -> None:
    tracker = Tracker(Identity.generate(), move_hold_down=300.0, local_swarm=True)
    a, b, c, other = (Identity.generate() for _ in range(4))
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        post = _signed_poster(client, url)

        def asked(me: Identity, max_layers: int = 15) -> RebalanceRequest:
            return RebalanceRequest(node_id=me.node_id.hex(), max_layers=max_layers)

        # only a registered node may ask
        with pytest.raises(TrackerError) as unknown:
            await request_reconsider(client, url, a, asked(a))
        assert unknown.value.status == 404
        for me, layers, decode_ms in ((a, (0, 15), 10.0), (c, (0, 15), 10.0), (b, (15, 30), 100.0)):
            assert (await post("/v1/nodes/register", _registration(me, layers, decode_ms), me)).status_code == 200
        # a and c fast on the first half, b slow and alone on the second
        stay = await request_reconsider(client, url, b, asked(b))
        assert stay.layers is None and stay.hold_seconds == 0.0
        move = await request_reconsider(client, url, c, asked(c))
        assert move.layers == (15, 30) and move.least_after > move.least_before * 1.33
        assert move.hold_seconds == 300.0 and move.reserved_seconds == RESERVATION_SECONDS
        assert tracker.placement.reservations[c.node_id].layers == (15, 30)
        # asked again at once it is held down, even where the swarm would gain
        again = await request_reconsider(client, url, c, asked(c))
        assert again.layers is None and 0 < again.hold_seconds <= 300.0
        # it leaves its old range to load the new one: the new one stays reserved for it
        left = await post("/v1/nodes/leave", {"node_id": c.node_id.hex(), "moving": True}, c)
        assert left.status_code == 200 and c.node_id in tracker.placement.reservations
        # unsigned, signed by another, or malformed: refused, and the tracker serves on
        body = {"node_id": a.node_id.hex(), "max_layers": 15}
        assert (await client.post(url + "/v1/placement/reconsider", json=body)).status_code == 401
        assert (await post("/v1/placement/reconsider", body, other)).status_code == 403
        for bad in ({**body, "max_layers": 0}, {**body, "max_layers": "15"}, {**body, "spare": 1}, {}):
            assert (await post("/v1/placement/reconsider", bad, a)).status_code == 422, bad
        nursery.cancel_scope.cancel()


async def test_a_move_the_node_cannot_hold_is_a_tracker_error() -> None:
    me = Identity.generate()

    async def too_wide(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"layers": [0, 25], "least_before": 1.0, "least_after": 2.0})

    async def garbled(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"\xff\x00")

    asked = RebalanceRequest(node_id=me.node_id.hex(), max_layers=20)
    for handler, message in ((too_wide, "more than the 20"), (garbled, "malformed")):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            with pytest.raises(TrackerError, match=message):
                await request_reconsider(client, "http://tracker", me, asked)
