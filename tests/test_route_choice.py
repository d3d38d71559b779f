"""Route choice (pure): contiguous covers of one recipe, the shortest path against the brute force on
small swarms, measured seams, and what a node may report of its peers."""

from __future__ import annotations

import collections
import json
import random
from collections.abc import Collection, Sequence

import attrs
import pytest
from pydantic import ValidationError

from noderuntime.control.admission import Capability
from noderuntime.tracker import registry, routechoice
from noderuntime.tracker.messages import MAX_PEERS, MAX_ROUND_TRIP_MS, Heartbeat
from noderuntime.tracker.records import DIRECT_SEAM_MS, NodeRecord
from noderuntime.tracker.registry import TrackerState
from noderuntime.tracker.routechoice import MAX_ROUTES, NEAR_EQUAL, NoRoute, all_routes, unmixed
from tests.swarm_records import ARTIFACT, node, node_id, state_with


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


# --- route grants a node has not confirmed (TrackerState.note_session)


def _grant(state: TrackerState, client: str) -> bytes:
    """A route for ``client``, counted as its grant; the head's node id."""
    nodes = state.choose(ARTIFACT, 100, client=client).nodes
    state.note_session((n.node_id for n in nodes), client)
    return nodes[0].node_id


def _grants_until_full(state: TrackerState, client: str, most: int = 64) -> int:
    for granted in range(most):
        try:
            _grant(state, client)
        except NoRoute as exc:
            assert exc.full
            return granted
    return most


def test_a_crowd_of_names_holding_unconfirmed_grants_leaves_every_other_client_half_the_free_slots() -> None:
    """Grants not yet confirmed by a heartbeat count in full for the client that holds them, and all
    other clients' together weigh at most half the room the node last reported: 100 names that each
    took a grant on a node of 8 free slots leave an honest client 4 (every grant counted for everyone,
    the first 8 names left it none). A heartbeat ends every count."""
    state = state_with(node("a", (0, 30), slots=8))
    for k in range(100):
        _grant(state, f"sybil {k}")
    assert _grants_until_full(state, "honest") == 4
    # the node list and status pages still count every grant
    assert state.nodes[node_id("a")].free_slots == 0 and state.nodes[node_id("a")].active_sessions == 104
    state.heartbeat(node_id("a"), 1.0, active_sessions=0, free_slots=8, queue_depth=0, step_ms=10.0)
    assert _grants_until_full(state, "honest") == 8  # alone now: its own grants count in full
    # the next heartbeat says 5 of those 8 sessions opened: 3 free, of which others' grants weigh at most 1
    state.heartbeat(node_id("a"), 2.0, active_sessions=5, free_slots=3, queue_depth=0, step_ms=10.0)
    for k in range(10):
        _grant(state, f"sybil {k}")
    assert _grants_until_full(state, "honest") == 2


def test_one_clients_burst_counts_its_own_unconfirmed_grants_in_full() -> None:
    """A gateway's burst of 16 on two nodes of 8 slots goes 8 to each, then finds them full: its own
    grants weigh in full, and the half that others' may weigh does not let it overbook a node."""
    state = state_with(node("a", (0, 30), slots=8), node("b", (0, 30), slots=8))
    heads = collections.Counter(_grant(state, "gateway") for _ in range(16))
    assert heads == {node_id("a"): 8, node_id("b"): 8}
    with pytest.raises(NoRoute) as full:
        state.choose(ARTIFACT, 100, client="gateway")
    assert full.value.full
    assert _grants_until_full(state, "another") == 8  # half of each node's 8, whatever the gateway holds


def test_others_unconfirmed_grants_weigh_at_most_half_a_measured_capacity_below_the_slots() -> None:
    """A node whose measured step time admits 2 sessions of its 8 slots: others' grants weigh at most
    one of those 2, whatever they number."""
    slow = Capability(2.0, ((1, 400.0), (2, 800.0)), 1, 1, 1, 2)  # 1000 ms per step admits 2 sessions
    state = state_with(attrs.evolve(node("a", (0, 30), slots=8), measured=slow))
    for k in range(20):
        _grant(state, f"sybil {k}")
    assert _grants_until_full(state, "honest") == 1


def test_a_node_counts_unconfirmed_grants_of_a_bounded_number_of_names() -> None:
    """Past CLIENTS_COUNTED names on one node, a newcomer's grants count as others' for everyone, itself
    included: what the node keeps is bounded, and the newcomer is only ever let take more (its grants
    weigh at most half the room). Registering again starts afresh."""
    state = state_with(node("a", (0, 30), slots=8))
    for k in range(registry.CLIENTS_COUNTED):
        _grant(state, f"sybil {k}")
    assert _grants_until_full(state, "late", most=12) == 12  # 8 free, 4 of them others' at most, itself no more
    state.register(node("a", (0, 30), slots=8), 3.0)
    assert _grants_until_full(state, "late") == 8


# --- route choice as a shortest path, against the brute force on small swarms


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
    assert _names(state.choose(ARTIFACT, 10, near={node_id("a")}).nodes) == "a b"
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
        node_id(name),
        0.0,
        active_sessions=0,
        free_slots=4,
        queue_depth=0,
        step_ms=step_ms,
        round_trips={node_id(peer): ms for peer, ms in round_trips.items()},
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
    assert state.seam_ms(state.nodes[node_id("a")], state.nodes[node_id("b")]) == 150.0
    # soft state: gone with the node that reported it, and with a re-registration
    state.leave(node_id("b"), 1.0)
    assert state.seam_ms(state.nodes[node_id("a")], state.nodes[node_id("c")]) == 1.0
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
    assert state.seam_ms(state.nodes[node_id("a")], state.nodes[node_id("c")]) == pytest.approx(0.1)
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
    flood = {node_id("b"): float("nan"), node_id("a"): 5.0} | {bytes([i]) * 32: 1.0 for i in range(200)}
    state.heartbeat(node_id("a"), 0.0, active_sessions=0, free_slots=4, queue_depth=0, step_ms=1.0, round_trips=flood)
    assert len(state._round_trips[node_id("a")]) <= MAX_PEERS
    assert state.seam_ms(state.nodes[node_id("a")], state.nodes[node_id("b")]) == DIRECT_SEAM_MS
    state.heartbeat(
        node_id("a"), 0.0, active_sessions=0, free_slots=4, queue_depth=0, step_ms=1.0, round_trips={node_id("b"): 1e12}
    )
    assert state.seam_ms(state.nodes[node_id("a")], state.nodes[node_id("b")]) == MAX_ROUND_TRIP_MS
