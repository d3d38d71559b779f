"""The tracker: route selection (pure), and its API's authentication (in process, over HTTP)."""

from __future__ import annotations

import collections
import functools
import itertools
import json
import random
import time
from collections.abc import Collection, Sequence
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from pydantic import ValidationError

from noderuntime.access.identity import Identity
from noderuntime.access.signing import sign
from noderuntime.access.tickets import TicketVerifier
from noderuntime.control.admission import Capability, capability_record
from noderuntime.node.leases import LeaseManager
from noderuntime.operations.httpserve import serve_http
from noderuntime.tracker import registry, routechoice
from noderuntime.tracker.app import Tracker
from noderuntime.tracker.client import NodeLoad, TrackerError, TrackerLink, request_route
from noderuntime.tracker.messages import MAX_PEERS, MAX_ROUND_TRIP_MS, Heartbeat, Registration
from noderuntime.tracker.records import DIRECT_SEAM_MS, NodeRecord
from noderuntime.tracker.registry import TrackerState
from noderuntime.tracker.roundtrips import RoundTrips, connect_ms, measure_round_trips
from noderuntime.tracker.routechoice import MAX_ROUTES, NEAR_EQUAL, NoRoute, all_routes, unmixed
from noderuntime.verify.certificates import CoveredPair
from protocol import Hop, Span, route_recipe

ARTIFACT = "ab" * 32


def node(
    name: str,
    layers: tuple[int, int],
    *,
    slots: int = 4,
    free: int | None = None,
    step: float = 10.0,
    relay: bool = False,
    recipe: str = "r" * 16,
) -> NodeRecord:
    return NodeRecord(
        node_id=name.encode().ljust(32, b"."),
        artifact=ARTIFACT,
        n_layer=30,
        layers=layers,
        recipe=recipe,
        address="" if relay else f"{name}:1",
        relay="ws://relay" if relay else "",
        tls_cert_sha256=b"",
        slots=slots,
        ctx_per_session=2048,
        free_slots=slots if free is None else free,
        step_ms=step,
    )


def state_with(*records: NodeRecord, seed: int = 0) -> TrackerState:
    state = TrackerState(rng=random.Random(seed))
    for record in records:
        state.register(record, 0.0)
        if record.free_slots != record.slots:
            state.heartbeat(
                record.node_id,
                0.0,
                active_sessions=record.slots - record.free_slots,
                free_slots=record.free_slots,
                queue_depth=0,
                step_ms=record.step_ms,
            )
    return state


def test_routes_are_contiguous_covers_of_one_recipe() -> None:
    records = [
        node("a", (0, 10)),
        node("b", (10, 30)),
        node("c", (0, 20)),
        node("d", (20, 30)),
        node("e", (10, 20)),
        node("x", (10, 30), recipe="other" * 3 + "o"),
    ]
    routes = {tuple(r.node_id[:1].decode() for r in route) for route in all_routes(records, 30)}
    assert routes == {("a", "b"), ("c", "d"), ("a", "e", "d")}


def test_a_maze_of_dead_ends_is_not_searched_and_a_layer_count_in_the_minority_joins_no_route() -> None:
    # two nodes per boundary up to layer 29 and none serving the last: 2**29 partial paths
    maze = [node(f"m{i}{k}", (i, i + 1)) for i in range(29) for k in "ab"]
    with pytest.raises(NoRoute):
        state_with(*maze).choose(ARTIFACT, 10)
    # finished by one node, the maze holds 2**29 routes: the search stops at the cap
    assert len(all_routes([*maze, node("z", (29, 30))], 30)) == MAX_ROUTES
    # a node that claims the artifact has 20 layers would be a whole route by itself
    liar = attrs.evolve(node("l", (0, 20)), n_layer=20)
    state = state_with(liar, node("a", (0, 10)), node("b", (10, 30)))
    assert {tuple(n.node_id[:1] for n in state.choose(ARTIFACT, 10).nodes) for _ in range(10)} == {(b"a", b"b")}
    assert state.artifacts()[ARTIFACT]["n_layer"] == 30


def test_status_says_why_recipes_of_one_artifact_share_no_route() -> None:
    cpu = node("a", (0, 15), recipe="c" * 16)
    gpu = attrs.evolve(node("b", (15, 30), recipe="g" * 16), device="vulkan:0")
    other = node("c", (15, 30), recipe="f" * 16)
    assert not all_routes([cpu, gpu], 30)  # a CPU head and a Vulkan tail form no route
    lines = unmixed([cpu, gpu, other])
    assert len(lines) == 3
    across = next(line for line in lines if "cccccccc (cpu) and gggggggg (vulkan)" in line)
    assert "tolerance" in across and "benchmarks.backends" in across
    alike = next(line for line in lines if "cccccccc (cpu) and ffffffff (cpu)" in line)
    assert "kernels or settings differ" in alike
    assert unmixed([cpu, attrs.evolve(cpu, node_id=b"x" * 32, layers=(15, 30))]) == []


def test_a_certified_pair_of_recipes_mixes_in_routes_and_no_other_does() -> None:
    cpu_a, cpu_b = node("a", (0, 13), recipe="c" * 16), node("c", (17, 30), recipe="c" * 16)
    gpu = attrs.evolve(node("g", (13, 17), recipe="g" * 16), device="vulkan:0")
    cpu_whole = node("w", (0, 30), recipe="c" * 16)
    other = attrs.evolve(node("o", (13, 17), recipe="f" * 16), device="cuda:0")
    nodes = [cpu_a, gpu, cpu_b, cpu_whole, other]
    pair = frozenset(("c" * 16, "g" * 16))
    names = lambda routes: {"".join(n.node_id[:1].decode() for n in r) for r in routes}  # noqa: E731
    assert names(all_routes(nodes, 30)) == {"w"}
    # the pair's routes use both recipes; the CPU's own route is found once, on its own
    assert names(all_routes(nodes, 30, [pair])) == {"w", "agc"}
    assert names(all_routes(nodes, 30, [pair, frozenset(("x" * 16, "c" * 16))])) == {"w", "agc"}
    # status stops saying why the certified pair shares no route, and says it of the others
    apart = unmixed(nodes, {ARTIFACT: [pair]})
    assert len(apart) == len(unmixed(nodes)) - 1 == 2
    assert not any("cccccccc (cpu) and gggggggg" in line for line in apart)
    assert all("no certificate covers this pair" in line for line in apart)

    state = TrackerState(rng=random.Random(0), mixes={ARTIFACT: [pair]})
    for record in (cpu_a, gpu, cpu_b, other):
        state.register(record, 0.0)
    assert [n.node_id[:1] for n in state.choose(ARTIFACT, 10).nodes] == [b"a", b"g", b"c"]
    assert state.artifacts()[ARTIFACT]["routable"]
    # a certificate is for one artifact: another's nodes do not mix on it
    elsewhere = TrackerState(mixes={"f" * 64: [pair]})
    for record in (cpu_a, gpu, cpu_b):
        elsewhere.register(record, 0.0)
    with pytest.raises(NoRoute):
        elsewhere.choose(ARTIFACT, 10)


def test_full_nodes_are_avoided_and_all_full_is_told_apart_from_no_route() -> None:
    state = state_with(node("a", (0, 15), free=0), node("b", (15, 30)), node("c", (0, 15)))
    for _ in range(10):
        assert [n.node_id[:1] for n in state.choose(ARTIFACT, 100).nodes] == [b"c", b"b"]
        state.heartbeat(b"c".ljust(32, b"."), 0.0, active_sessions=0, free_slots=4, queue_depth=0, step_ms=10.0)
    full = state_with(node("a", (0, 15), free=0), node("b", (15, 30)))
    with pytest.raises(NoRoute) as info:
        full.choose(ARTIFACT, 100)
    assert info.value.full
    with pytest.raises(NoRoute) as gap:
        state_with(node("a", (0, 10)), node("b", (15, 30))).choose(ARTIFACT, 100)
    assert not gap.value.full
    with pytest.raises(NoRoute):
        state.choose(ARTIFACT, 100_000)  # no node holds that much context


def test_equivalent_routes_share_the_load_and_disjoint_routes_serve_at_once() -> None:
    state = state_with(node("a", (0, 15)), node("b", (15, 30)), node("c", (0, 15)), node("d", (15, 30)), seed=3)
    heads: collections.Counter[bytes] = collections.Counter()
    for _ in range(8):
        choice = state.choose(ARTIFACT, 100)
        state.note_session(n.node_id for n in choice.nodes)
        heads[choice.nodes[0].node_id[:1]] += 1
    # the sessions routed so far weigh on the cost: 8 sessions spread over both heads
    assert heads[b"a"] >= 3 and heads[b"c"] >= 3


def test_costs_prefer_fast_unloaded_direct_nodes() -> None:
    fast = state_with(node("a", (0, 30), step=5), node("b", (0, 30), step=50))
    assert {fast.choose(ARTIFACT, 10).nodes[0].node_id[:1] for _ in range(20)} == {b"a"}
    relayed = state_with(node("a", (0, 30), relay=True), node("b", (0, 30)))
    assert relayed.choose(ARTIFACT, 10).nodes[0].node_id[:1] == b"b"


def test_silent_nodes_expire_and_come_back_by_registering() -> None:
    state = state_with(node("a", (0, 30)))
    state.heartbeat(b"a".ljust(32, b"."), 5.0, active_sessions=0, free_slots=4, queue_depth=0, step_ms=9)
    assert state.expire(14.0) == []
    assert state.expire(16.0) == [b"a".ljust(32, b".")]
    assert not state.heartbeat(b"a".ljust(32, b"."), 16.5, active_sessions=0, free_slots=4, queue_depth=0, step_ms=9)


# --- route choice as a shortest path, against the brute force on small swarms


def _id(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def _names(route: Sequence[NodeRecord]) -> str:
    return " ".join(n.node_id.rstrip(b".").decode() for n in route)


def _random_swarm(
    seed: int, *, recipes: Sequence[str] = ("r" * 16,), seams: float = 0.5, full: float = 0.0
) -> TrackerState:
    """Up to 16 nodes with random windows of 30 layers (on a grid of 5, so that they often meet), step
    times, reachability, room and measured seams."""
    rng = random.Random(seed)
    state = TrackerState(rng=random.Random(seed))
    for i in range(rng.randint(2, 16)):
        start = rng.randrange(0, 30, 5)
        end = rng.choice([end for end in range(5, 31, 5) if start < end <= start + 15])
        record = node(
            f"n{i}",
            (start, end),
            step=rng.uniform(1.0, 20.0),
            relay=rng.random() < 0.2,
            recipe=rng.choice(recipes),
            free=0 if rng.random() < full else None,
        )
        state.register(record, 0.0)
        state.heartbeat(
            record.node_id, 0.0, active_sessions=0, free_slots=record.free_slots, queue_depth=0, step_ms=record.step_ms
        )
    for record in list(state.nodes.values()):
        # the peers it talks to: nodes starting where it ends (some report, some do not)
        peers = {p.node_id: rng.uniform(0.0, 40.0) for p in state.nodes.values() if p.layers[0] == record.layers[1]}
        reported = {p: ms for p, ms in peers.items() if rng.random() < seams}
        state.heartbeat(
            record.node_id,
            0.0,
            active_sessions=0,
            free_slots=record.free_slots,
            queue_depth=0,
            step_ms=record.step_ms,
            round_trips=reported,
        )
    return state


def _oracle(state: TrackerState, routes: list[list[NodeRecord]], near: Collection[bytes] = ()) -> float:
    """The cheapest of ``routes`` with room, by brute force: through the most ``near`` nodes first."""
    free = [r for r in routes if all(n.has_room(state.step_budget_ms) for n in r)]
    most = max(sum(n.node_id in near for n in r) for r in free)
    return min(state.route_cost(r) for r in free if sum(n.node_id in near for n in r) == most)


def test_the_shortest_path_is_the_cheapest_route_of_random_swarms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its noise route choice takes the cheapest route there is; with it, one within NEAR_EQUAL."""
    checked = 0
    for seed in range(300):
        state = _random_swarm(seed, full=0.15)
        nodes = list(state.nodes.values())
        routes = all_routes(nodes, 30)
        assert len(routes) < MAX_ROUTES  # so the brute force saw every route
        if not any(all(n.has_room(state.step_budget_ms) for n in r) for r in routes):
            with pytest.raises(NoRoute) as refused:
                state.choose(ARTIFACT, 10)
            assert refused.value.full == bool(routes)
            continue
        best = _oracle(state, routes)
        monkeypatch.setattr(routechoice, "NEAR_EQUAL", 0.0)
        exact = state.choose(ARTIFACT, 10)
        assert exact.cost_ms == pytest.approx(best), seed
        assert exact.cost_ms == pytest.approx(state.route_cost(exact.nodes))
        monkeypatch.undo()
        for _ in range(5):
            chosen = state.choose(ARTIFACT, 10)
            assert best - 1e-9 <= chosen.cost_ms <= best * (1 + NEAR_EQUAL) + 1e-9, seed
            assert chosen.nodes[0].layers[0] == 0 and chosen.nodes[-1].layers[1] == 30
        checked += 1
    assert checked > 100


def test_repairs_recipes_certificates_and_exclusions_hold_on_random_swarms(monkeypatch: pytest.MonkeyPatch) -> None:
    """``start``, ``recipe``, a certified pair and excluded nodes, each against the brute force."""
    monkeypatch.setattr(routechoice, "NEAR_EQUAL", 0.0)
    cpu, gpu, other = "c" * 16, "g" * 16, "o" * 16
    pair = frozenset((cpu, gpu))
    for seed in range(200):
        state = _random_swarm(seed, recipes=(cpu, gpu, other))
        state.mixes = {ARTIFACT: frozenset((pair,))}
        nodes = list(state.nodes.values())
        rng = random.Random(seed)
        excluded = {n.node_id for n in nodes if rng.random() < 0.2}
        start = rng.choice([0, *(n.layers[0] for n in nodes)])
        allowed = [n for n in nodes if n.node_id not in excluded]
        for recipe in (None, cpu, other):
            mine = [n for n in allowed if recipe is None or n.recipe == recipe]
            routes = all_routes(mine, 30, [pair] if recipe is None else (), start=start)
            if not routes:
                with pytest.raises(NoRoute) as refused:
                    state.choose(ARTIFACT, 10, exclude=excluded, start=start, recipe=recipe)
                assert not refused.value.full
                continue
            chosen = state.choose(ARTIFACT, 10, exclude=excluded, start=start, recipe=recipe)
            assert chosen.cost_ms == pytest.approx(_oracle(state, routes)), (seed, recipe)
            assert chosen.nodes[0].layers[0] == start and not excluded & {n.node_id for n in chosen.nodes}
            used = {n.recipe for n in chosen.nodes}
            assert used == {recipe} if recipe else (len(used) == 1 or used == pair)


def test_affinity_takes_the_route_through_most_near_nodes_then_the_cheapest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A discount on ``near`` nodes larger than any route's cost: their count first, the cost second."""
    monkeypatch.setattr(routechoice, "NEAR_EQUAL", 0.0)
    for seed in range(200):
        state = _random_swarm(seed, full=0.1)
        nodes = list(state.nodes.values())
        routes = all_routes(nodes, 30)
        if not any(all(n.has_room(state.step_budget_ms) for n in r) for r in routes):
            continue
        near = {n.node_id for n in random.Random(seed).sample(nodes, min(3, len(nodes)))}
        chosen = state.choose(ARTIFACT, 10, near=near)
        free = [r for r in routes if all(n.has_room(state.step_budget_ms) for n in r)]
        most = max(sum(n.node_id in near for n in r) for r in free)
        assert sum(n.node_id in near for n in chosen.nodes) == most, seed
        assert chosen.cost_ms == pytest.approx(_oracle(state, routes, near)), seed
    # an expensive route through the prefix's holders wins over a cheap one elsewhere
    state = state_with(node("a", (0, 15), step=90), node("b", (15, 30)), node("c", (0, 15), step=1))
    assert _names(state.choose(ARTIFACT, 10, near={_id("a")}).nodes) == "a b"
    assert _names(state.choose(ARTIFACT, 10).nodes) == "c b"


def test_near_equal_routes_are_all_taken_and_a_dearer_one_never() -> None:
    """Random noise on each node's cost spreads requests over routes within NEAR_EQUAL of the cheapest."""
    heads = [node(f"h{i}", (0, 15), step=10.0 + 0.1 * i) for i in range(4)]  # within 1.5 % of each other
    dear = node("x", (0, 15), step=13.0)  # 20 % dearer than the cheapest route
    tails = [node(f"t{i}", (15, 30), step=10.0) for i in range(2)]
    state = state_with(*heads, dear, *tails, seed=5)
    taken = collections.Counter(_names(state.choose(ARTIFACT, 10).nodes) for _ in range(400))
    assert set(taken) == {f"h{i} t{j}" for i in range(4) for j in range(2)}, taken
    assert min(taken.values()) >= 10


def _report(state: TrackerState, name: str, round_trips: dict[str, float], *, step_ms: float) -> None:
    """An idle node's heartbeat with the round trips it measured to its peers (by name)."""
    state.heartbeat(
        _id(name),
        0.0,
        active_sessions=0,
        free_slots=4,
        queue_depth=0,
        step_ms=step_ms,
        round_trips={_id(peer): ms for peer, ms in round_trips.items()},
    )


def test_a_seam_across_a_slow_link_is_avoided_when_an_equal_route_is_not() -> None:
    """Heartbeats report round trips to peers; the seam between two nodes costs what either end measured."""
    state = state_with(node("a", (0, 15)), node("b", (15, 30)), node("c", (15, 30)), seed=1)

    def report(name: str, round_trips: dict[str, float]) -> None:
        _report(state, name, round_trips, step_ms=10.0)

    def tails() -> set[str]:
        return {_names(state.choose(ARTIFACT, 10).nodes) for _ in range(50)}

    assert tails() == {"a b", "a c"}  # nothing measured: the constants, and the spread
    report("a", {"b": 150.0, "c": 0.8})  # b is across an ocean from a
    assert tails() == {"a c"}
    assert state.choose(ARTIFACT, 10).cost_ms == pytest.approx(10 + 1.0 + 10 + 0.8)
    report("a", {"b": 150.0, "c": 151.0})
    assert tails() == {"a b", "a c"}
    # either end's word counts, and where both speak the slower: no node makes its seams look faster
    report("a", {})
    report("b", {"a": 150.0})
    assert tails() == {"a c"}
    report("a", {"b": 1.0})
    assert tails() == {"a c"}
    assert state.seam_ms(state.nodes[_id("a")], state.nodes[_id("b")]) == 150.0
    # soft state: gone with the node that reported it, and with a re-registration
    state.leave(_id("b"), 1.0)
    assert state.seam_ms(state.nodes[_id("a")], state.nodes[_id("c")]) == 1.0
    state.register(node("b", (15, 30)), 2.0)
    report("a", {"b": 150.0})
    state.register(node("a", (0, 15)), 3.0)
    assert tails() == {"a b", "a c"}


def test_a_new_node_among_fast_measured_seams_is_routed() -> None:
    """On one LAN (round trips of 0.1 ms) a seam nobody measured yet costs what the measured ones do,
    so a node that just joined gets sessions (and so its seams measured) instead of none."""
    state = state_with(node("a", (0, 15)), node("b", (15, 30)), seed=2)

    def beat(name: str, round_trips: dict[str, float]) -> None:
        _report(state, name, round_trips, step_ms=0.05)

    beat("a", {"b": 0.1})
    beat("b", {"a": 0.1})
    state.register(node("c", (15, 30)), 0.0)
    beat("c", {})
    assert state.seam_ms(state.nodes[_id("a")], state.nodes[_id("c")]) == pytest.approx(0.1)
    assert {_names(state.choose(ARTIFACT, 10).nodes) for _ in range(50)} == {"a b", "a c"}


def test_what_a_node_reports_of_its_peers_is_bounded() -> None:
    """The message refuses a huge map, negative, infinite or NaN round trips and malformed ids; the state
    ignores them from any other caller too."""
    beat = {"node_id": "ab" * 32, "active_sessions": 0, "free_slots": 1, "queue_depth": 0, "step_ms": 1.0}
    assert Heartbeat.model_validate({**beat, "round_trips": {"cd" * 32: 3.5}}).round_trips == {"cd" * 32: 3.5}
    for bad in (
        {f"{i:064x}": 1.0 for i in range(MAX_PEERS + 1)},
        {"cd" * 32: -1.0},
        {"cd" * 32: float("nan")},
        {"cd" * 32: float("inf")},
        {"cd" * 32: 1e9},
        {"not hex": 1.0},
    ):
        with pytest.raises(ValidationError):
            Heartbeat.model_validate({**beat, "round_trips": bad})
    with pytest.raises(ValidationError):
        Heartbeat.model_validate_json(json.dumps({**beat, "round_trips": {"cd" * 32: 1}}).replace("1}", "NaN}"))
    state = state_with(node("a", (0, 15)), node("b", (15, 30)))
    flood = {_id("b"): float("nan"), _id("a"): 5.0} | {bytes([i]) * 32: 1.0 for i in range(200)}
    state.heartbeat(_id("a"), 0.0, active_sessions=0, free_slots=4, queue_depth=0, step_ms=1.0, round_trips=flood)
    assert len(state._round_trips[_id("a")]) <= MAX_PEERS
    assert state.seam_ms(state.nodes[_id("a")], state.nodes[_id("b")]) == DIRECT_SEAM_MS
    state.heartbeat(
        _id("a"), 0.0, active_sessions=0, free_slots=4, queue_depth=0, step_ms=1.0, round_trips={_id("b"): 1e12}
    )
    assert state.seam_ms(state.nodes[_id("a")], state.nodes[_id("b")]) == MAX_ROUND_TRIP_MS


async def test_a_node_measures_its_next_hops_and_its_heartbeat_carries_them() -> None:
    """TCP connects to the next hops' addresses, smoothed and bounded; a node's heartbeat names them by id."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    began = time.perf_counter()
    ms = await connect_ms(f"127.0.0.1:{port}")
    took = (time.perf_counter() - began) * 1e3
    assert ms is not None and 0 <= ms <= took  # milliseconds, of the connect alone: within the call
    assert await connect_ms("not an address") is None
    now = [0.0]
    trips = RoundTrips(clock=lambda: now[0])
    hop = Hop(_id("b"), Span(15, 30), f"127.0.0.1:{port}")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(measure_round_trips, trips, lambda: [hop], every=0.05, look_every=0.01))
        with trio.fail_after(5):
            while not trips.snapshot():
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    listener.socket.close()
    assert set(trips.snapshot()) == {_id("b")}
    trips.note(_id("b"), 100.0)
    smoothed = trips.snapshot()[_id("b")]
    assert 0 < smoothed < 100.0
    for i in range(MAX_PEERS + 5):
        trips.note(bytes([i]) * 32, 1.0)
    assert len(trips.snapshot()) == MAX_PEERS
    now[0] = 1e6  # not measured for long: no longer reported
    assert trips.snapshot() == {}
    load = NodeLoad(active_sessions=1, free_slots=2, queue_depth=0, step_ms=3.0, round_trips={_id("b"): 4.5})
    assert load.heartbeat(_id("a")).round_trips == {_id("b").hex(): 4.5}


def _registration(me: Identity, **changes: Any) -> dict[str, Any]:
    body = {
        "node_id": me.node_id.hex(),
        "artifact": ARTIFACT,
        "model_name": "m",
        "n_layer": 30,
        "layers": [0, 30],
        "recipe": "0123456789abcdef",
        "address": "127.0.0.1:1",
        "relay": "",
        "tls_cert_sha256": "",
        "slots": 2,
        "ctx_per_session": 512,
    }
    body.update(changes)
    if "capability" not in changes:
        layers = body["layers"]
        body["capability"] = capability_record(
            me,
            artifact=body["artifact"],
            layers=(layers[0], layers[1]),
            recipe=body["recipe"],
            capability=Capability(2.0, ((1, 10.0), (2, 12.0)), 1, 1, 1, 2),
        )
    return body


def test_a_registration_speaks_the_node_description_and_the_record_keeps_all_of_it() -> None:
    """The JSON a node registers with keeps its keys; the tracker's record holds every field of its
    description (the hex ids as bytes), with what the tracker adds."""
    me = Identity.generate()
    body = _registration(me, tls_cert_sha256="ab" * 32, device="vulkan:0", kernel_class="vulkan:gpu")
    registration = Registration(**body)
    assert set(registration.model_dump(mode="json")) == {
        "node_id",
        "artifact",
        "model_name",
        "n_layer",
        "layers",
        "recipe",
        "address",
        "relay",
        "tls_cert_sha256",
        "slots",
        "ctx_per_session",
        "device",
        "kernel_class",
        "capability",
        "join_proof",
    }
    record = NodeRecord.of(registration, probe_required=True)
    assert record.node_id == me.node_id and record.tls_cert_sha256 == b"\xab" * 32 and record.probe_required
    for name, value in registration.description().model_dump().items():
        held = getattr(record, name)
        assert (held.hex() if isinstance(held, bytes) else held) == value, name


async def test_api_authenticates_nodes_and_issues_verifiable_tickets() -> None:
    tracker = Tracker(Identity.generate(), expire_after=2.0, api_key="gw-secret")
    me, other = Identity.generate(), Identity.generate()
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")

        async def post(path: str, body: dict[str, Any], signer: Identity, ts: int | None = None) -> httpx.Response:
            data = json.dumps(body).encode()
            headers = sign(signer, "POST", path, data, ts or int(time.time() * 1000))
            return await client.post(url + path, content=data, headers={**headers, "content-type": "application/json"})

        assert (await post("/v1/nodes/register", _registration(me), me)).status_code == 200
        # a node cannot register under another node's id, nor with a bad signature
        assert (await post("/v1/nodes/register", _registration(me), other)).status_code == 403
        unsigned = await client.post(url + "/v1/nodes/register", json=_registration(me))
        assert unsigned.status_code == 401
        # a replayed request is refused
        stamp = int(time.time() * 1000) + 5
        beat = {"node_id": me.node_id.hex(), "active_sessions": 0, "free_slots": 2, "queue_depth": 0, "step_ms": 3.0}
        assert (await post("/v1/nodes/heartbeat", beat, me, stamp)).status_code == 200
        assert (await post("/v1/nodes/heartbeat", beat, me, stamp)).status_code == 401
        assert (await post("/v1/nodes/register", _registration(me, layers=[5, 40]), me, stamp + 1)).status_code == 400
        # a node must send the capability it measured, signed by itself, for this very shard
        assert (await post("/v1/nodes/register", _registration(me, capability={}), me, stamp + 2)).status_code == 400
        theirs = _registration(other)["capability"]
        assert (
            await post("/v1/nodes/register", _registration(me, capability=theirs), me, stamp + 3)
        ).status_code == 400
        elsewhere = _registration(me, layers=[0, 15])["capability"]
        assert (
            await post("/v1/nodes/register", _registration(me, capability=elsewhere), me, stamp + 4)
        ).status_code == 400
        assert tracker.state.nodes[me.node_id].layers == (0, 30)

        with pytest.raises(TrackerError) as unauthorized:
            await request_route(client, url, ARTIFACT, 100)
        assert unauthorized.value.status == 401
        grant = await request_route(client, url, ARTIFACT, 100, api_key="gw-secret")
        assert [h.node_id for h in grant.hops] == [me.node_id]
        ticket = TicketVerifier([tracker.identity.node_id]).check(
            grant.ticket,
            session_id=grant.session_id,
            epoch=grant.epoch,
            artifact=bytes.fromhex(ARTIFACT),
            hops=grant.hops,
            node_id=me.node_id,
            index=0,
        )
        assert ticket.issuer == tracker.identity.node_id
        with pytest.raises(TrackerError) as none:
            await request_route(client, url, "cd" * 32, 100, api_key="gw-secret")
        assert none.value.status == 503
        nursery.cancel_scope.cancel()


async def test_a_mixed_grant_names_each_hops_recipe_and_the_session_names_them_together() -> None:
    cpu, gpu = "c" * 16, "9" * 16
    tracker = Tracker(Identity.generate(), mixes=[CoveredPair(ARTIFACT, cpu, gpu)])
    head, tail = Identity.generate(), Identity.generate()
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        for me, layers, recipe, device in ((head, [0, 13], cpu, "cpu"), (tail, [13, 30], gpu, "vulkan:0")):
            body = _registration(me, layers=layers, recipe=recipe, device=device)
            data = json.dumps(body).encode()
            headers = {**sign(me, "POST", "/v1/nodes/register", data, int(time.time() * 1000))}
            registered = await client.post(
                url + "/v1/nodes/register", content=data, headers={**headers, "content-type": "application/json"}
            )
            assert registered.status_code == 200, registered.text
        grant = await request_route(client, url, ARTIFACT, 100)
        assert [h.recipe_fingerprint.hex() for h in grant.hops] == [cpu, gpu]
        assert grant.recipe == route_recipe([bytes.fromhex(cpu), bytes.fromhex(gpu)])
        listed = (await client.get(url + "/v1/nodes")).json()
        assert listed["mixes"] == [{"artifact": ARTIFACT, "recipes": sorted([cpu, gpu])}]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "change",
    [
        {"address": "no-port"},
        {"address": "host:0"},
        {"address": "host:70000"},
        {"address": ":7000"},
        {"address": "a" * 64 + ":7000"},
        {"address": "a..b:7000"},
        {"address": "[not-v6]:7000"},
        {"relay": "http://relay:1"},
        {"relay": "ws://"},
        {"relay": "ws://relay:99999"},
        {"capability": {"body": "[" * 20_000, "signature": "00"}},
    ],
    ids=lambda c: next(iter(c)),
)
async def test_a_registration_that_peers_could_not_use_is_refused_and_the_tracker_serves_on(
    change: dict[str, Any],
) -> None:
    """What routes hand to peers must be dialable; JSON that breaks parsers is a 4xx, not a crash."""
    tracker = Tracker(Identity.generate(), expire_after=2.0)
    me = Identity.generate()
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")

        async def register(body: dict[str, Any]) -> int:
            data = json.dumps(body).encode()
            headers = sign(me, "POST", "/v1/nodes/register", data, int(time.time() * 1000))
            response = await client.post(
                url + "/v1/nodes/register", content=data, headers={**headers, "content-type": "application/json"}
            )
            return response.status_code

        assert await register(_registration(me, **change)) in (400, 422)
        assert me.node_id not in tracker.state.nodes
        assert await register(_registration(me, address="[::1]:7000", relay="wss://relay.example:443/")) == 200
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 5000,
        b'{"epoch": 1e999}',
        b"[]",
        b'{"session_id": "00", "epoch": 0, "ticket": "00", "recipe": "00", "hops": []}',
        b'{"error": "route granted"}',
    ],
)
async def test_a_malformed_route_grant_is_a_tracker_error(body: bytes) -> None:
    """A gateway reads the tracker's route with the tracker's own message type; nonsense is a TrackerError."""
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(TrackerError, match="malformed route") as refused:
            await request_route(client, "http://tracker", ARTIFACT, 100)
    assert refused.value.status == 200


async def test_nodes_register_again_after_a_tracker_restart() -> None:
    me = Identity.generate()
    first = Tracker(Identity.generate(), expire_after=2.0)
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()
        gone = trio.Event()

        async def serve(tracker: Tracker, port: int, task_status: trio.TaskStatus[str]) -> None:
            try:
                with scope:
                    await serve_http(tracker.app, f"127.0.0.1:{port}", task_status=task_status)
            finally:
                gone.set()

        url = await nursery.start(serve, first, 0)
        port = int(url.rsplit(":", 1)[1])
        link = TrackerLink(
            url,
            me,
            Registration(**_registration(me)),
            lambda: NodeLoad(active_sessions=0, free_slots=2, queue_depth=0, step_ms=1.0),
            retry_seconds=0.2,
        )
        await nursery.start(link.run)
        assert me.node_id in first.state.nodes
        scope.cancel()  # the tracker goes away...
        await gone.wait()  # (its port free again)
        second = Tracker(Identity.generate(), expire_after=2.0)
        scope, gone = trio.CancelScope(), trio.Event()
        await nursery.start(serve, second, port)  # ...and comes back empty
        # the tracker stores the node before the link has read the answer: wait for both
        with trio.fail_after(15):
            while me.node_id not in second.state.nodes or link.registrations < 2:
                await trio.sleep(0.1)
        assert link.registrations == 2
        nursery.cancel_scope.cancel()


async def test_a_node_the_tracker_counts_full_heartbeats_as_soon_as_a_slot_frees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TrackerLink.slot_freed: the tracker takes a slot off per route it grants, so a node it may count
    full (one route on its way allowed for) says at once when one frees; one with room waits."""
    me = Identity.generate()
    tracker = Tracker(Identity.generate())
    load = {"free_slots": 4, "sessions_opened": 0}
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        link = TrackerLink(
            url,
            me,
            Registration(**{**_registration(me), "slots": 4}),
            lambda: NodeLoad(active_sessions=4 - load["free_slots"], queue_depth=0, step_ms=1.0, **load),
        )
        await nursery.start(link.run)
        _beats_a_minute_apart_after_the_first(monkeypatch)
        with trio.fail_after(10):
            while link.heartbeats < 1:  # the tracker heard "4 free"
                await trio.sleep(0.02)
        link.slot_freed()  # nothing routed here since: the tracker counts 4 free, no hurry
        load.update(free_slots=3, sessions_opened=2)  # two routed since, one of them over
        link.slot_freed()  # the tracker counts 2 free: still no hurry
        await trio.testing.wait_all_tasks_blocked()  # a link told to beat would have woken, and counted it
        assert link.early_heartbeats == 0 and link.heartbeats == 1
        for _ in range(4):  # four routes granted (a slot off each time); three sessions opened, one on its way
            tracker.state.note_session([me.node_id])
        load.update(free_slots=1, sessions_opened=3)
        assert tracker.state.nodes[me.node_id].free_slots == 0
        load.update(free_slots=2)  # one more ends
        link.slot_freed()
        with trio.fail_after(10):  # the next beat at the interval is a minute away
            while tracker.state.nodes[me.node_id].free_slots != 2:
                await trio.sleep(0.01)
        assert link.early_heartbeats == 1 and link.heartbeats == 2
        nursery.cancel_scope.cancel()


def test_the_heartbeat_interval_grows_with_the_swarm_and_expiry_with_each_nodes_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A swarm of N nodes beats every N / HEARTBEATS_PER_SECOND seconds (within its bounds); a node is
    dropped after EXPIRE_HEARTBEATS of the interval it was told, and never sooner than expire_after."""
    monkeypatch.setattr(registry, "HEARTBEATS_PER_SECOND", 2.0)  # 10 nodes: 5 s
    state = TrackerState(expire_after=10.0)
    assert state.heartbeat_seconds == registry.HEARTBEAT_SECONDS
    state.register(node("first", (0, 30)), 0.0)
    assert state.nodes[_id("first")].beat_seconds == registry.HEARTBEAT_SECONDS
    for i in range(9):
        state.register(node(f"n{i}", (0, 30)), 0.0)
    assert state.heartbeat_seconds == 5.0
    for i in range(9):  # each heartbeat's answer tells the interval of the swarm now
        state.heartbeat(_id(f"n{i}"), 1.0, active_sessions=0, free_slots=4, queue_depth=0, step_ms=9)
        assert state.nodes[_id(f"n{i}")].beat_seconds == 5.0
    # the first, told 2 s, goes once silent past expire_after; those told 5 s once silent 3 beats
    assert state.expire(10.5) == [_id("first")]
    assert state.expire(15.9) == []
    assert len(state.expire(16.1)) == 9
    for i in range(400):
        state.register(node(f"m{i}", (0, 30)), 20.0)
    # 200 s at 2 a second: bounded, or a vanished node would linger ten minutes
    assert state.heartbeat_seconds == registry.MAX_HEARTBEAT_SECONDS
    state.heartbeat(_id("m0"), 21.0, active_sessions=0, free_slots=4, queue_depth=0, step_ms=9)
    assert state.nodes[_id("m0")].beat_seconds == registry.MAX_HEARTBEAT_SECONDS
    assert _id("m0") not in state.expire(21.0 + 3 * 60.0 - 1)
    assert _id("m0") in state.expire(21.0 + 3 * 60.0 + 1)


async def test_a_node_beats_at_the_interval_the_trackers_latest_answer_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interval is in every heartbeat's answer: a node registered in a small swarm slows its beats
    when the swarm grows, and the tracker expires it by the interval it told it."""
    monkeypatch.setattr(registry, "HEARTBEAT_SECONDS", 0.2)
    monkeypatch.setattr(registry, "HEARTBEATS_PER_SECOND", 10.0)
    tracker = Tracker(Identity.generate(), expire_after=0.5)
    me = Identity.generate()
    beats: list[float] = []  # when each heartbeat left
    kept: list[bool] = []  # whether the tracker's sweep kept the node then, the longest it had been silent

    def load() -> NodeLoad:
        beats.append(trio.current_time())
        tracker.expire(time.time())
        kept.append(me.node_id in tracker.state.nodes)
        return NodeLoad(active_sessions=0, free_slots=2, queue_depth=0, step_ms=1.0)

    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        link = TrackerLink(url, me, Registration(**_registration(me)), load)
        await nursery.start(link.run)
        assert link.interval == 0.2
        for i in range(14):  # others join: 15 nodes at 10 beats a second is a beat every 1.5 s
            tracker.state.register(node(f"n{i}", (0, 30)), time.time() + 3600)
        with trio.fail_after(10):
            while link.interval != 1.5:
                await trio.sleep(0.05)
        told = len(beats)  # the answer to one of these said 1.5 s, and so did every one since
        with trio.fail_after(10):
            while len(beats) < told + 2:
                await trio.sleep(0.05)
        # each beat after it waited the interval, give or take its tenth of jitter (at 0.2 s: 0.18 s apart)
        gaps = [b - a for a, b in itertools.pairwise(beats[told - 1 :])]
        assert min(gaps) >= 0.9 * 1.5, gaps
        # silent that long, beyond expire_after, the node was kept: told 1.5 s, it is expired by that
        assert all(kept), kept
        nursery.cancel_scope.cancel()


async def test_a_node_that_refuses_for_want_of_a_slot_tells_the_tracker_at_once_and_only_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TrackerLink.slot_refused: slots another tracker's routes took are news to this one; a node whose
    last heartbeat said it was full sends no more for each refusal."""
    me = Identity.generate()
    tracker = Tracker(Identity.generate())
    load = {"free_slots": 4, "sessions_opened": 0}
    leases = LeaseManager(4, 64)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        link = TrackerLink(
            url,
            me,
            Registration(**{**_registration(me), "slots": 4}),
            lambda: NodeLoad(active_sessions=4 - load["free_slots"], queue_depth=0, step_ms=1.0, **load),
        )
        leases.on_refused.append(link.slot_refused)
        await nursery.start(link.run)
        _beats_a_minute_apart_after_the_first(monkeypatch)
        with trio.fail_after(10):
            while link.heartbeats < 1:  # the tracker heard "4 free"
                await trio.sleep(0.02)
        held = [leases.acquire(16) for _ in range(4)]  # another tracker's sessions fill the node
        load.update(free_slots=0, sessions_opened=4)
        assert all(held) and tracker.state.nodes[me.node_id].free_slots == 4
        assert leases.acquire(16) is None  # refused: this tracker's count is 4 too many
        with trio.fail_after(10):  # the next beat at the interval is a minute away
            while tracker.state.nodes[me.node_id].free_slots != 0:
                await trio.sleep(0.01)
        assert link.early_heartbeats == 1 and link.heartbeats == 2
        for _ in range(20):  # a flood of refusals: the tracker already knows
            assert leases.acquire(16) is None
        await trio.testing.wait_all_tasks_blocked()  # a link told to beat would have woken, and counted it
        assert link.early_heartbeats == 1
        nursery.cancel_scope.cancel()


def _beats_a_minute_apart_after_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """From the answer to its first heartbeat on, a node registered now beats a minute apart (the longest
    interval): within a test, every heartbeat but the first is an early one."""
    monkeypatch.setattr(registry, "HEARTBEAT_SECONDS", registry.MAX_HEARTBEAT_SECONDS)
