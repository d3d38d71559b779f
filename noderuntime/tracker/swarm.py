"""What the swarm map shows, computed from the tracker's state: plain synchronous code, no I/O.

A page asks for two things. :func:`swarm_status` is the swarm at a glance, aggregated so
that its size does not grow with the number of nodes: per model, its layers as segments
that the same nodes serve (how many, and the decode throughput they measured; the least
served marked thin), its layer ranges as bands, the routes the tracker would pick now,
and counts of its nodes by device, drift class, reachability and probe result; then the
nodes that left lately. :func:`node_page` is one page of the nodes a query selects,
filtered and ordered here, so that a page never holds more rows than it shows.
"""

from __future__ import annotations

import collections
import itertools
import statistics
from collections.abc import Callable, Iterable, Sequence

from noderuntime.tracker.messages import (
    DepartedView,
    LayerSegment,
    ModelView,
    NodePage,
    NodeQuery,
    NodeView,
    ProbeState,
    RangeBand,
    RouteHopView,
    RouteView,
    SwarmStatus,
)
from noderuntime.tracker.records import NodeRecord
from noderuntime.tracker.registry import TrackerState
from noderuntime.tracker.routechoice import MAX_ROUTES, NEAR_EQUAL, layer_count

SLOW_FACTOR = 2.0  # slower per layer than this many times the median of its peers: slow
STALE_HEARTBEATS = 2.0  # silent for longer than this many heartbeat intervals: stale
ROUTES_SHOWN = 5
BANDS_SHOWN = 40
CLASSES_SHOWN = 6  # drift classes are the nodes' own words: the most common few, then "other"


def probe_state(record: NodeRecord) -> ProbeState:
    """Whether the node passed its known-answer probe, failed it, owes one, or is asked none."""
    if record.probe_passed is True:
        return "passed"
    if record.probe_passed is False:
        return "failed"
    return "pending" if record.probe_required else "none"


def _ms_per_layer(record: NodeRecord) -> float:
    return record.estimated_step_ms() / max(1, record.layers[1] - record.layers[0])


def _peers(record: NodeRecord) -> tuple[str, bool]:
    # a tail also computes the logits, a fixed cost its layers do not share: tails are compared with tails
    return record.artifact, record.layers[1] == record.n_layer


def _slow_limits(records: Iterable[NodeRecord]) -> dict[tuple[str, bool], float]:
    """Per group of peers (:func:`_peers`), the step time per layer beyond which a node counts as slow."""
    per_layer: dict[tuple[str, bool], list[float]] = collections.defaultdict(list)
    for record in records:
        per_layer[_peers(record)].append(_ms_per_layer(record))
    # the lower median: of two nodes, the slow one is measured against the fast one
    return {group: SLOW_FACTOR * statistics.median_low(times) for group, times in per_layer.items()}


def is_stale(record: NodeRecord, now: float) -> bool:
    """Silent for longer than ``STALE_HEARTBEATS`` of the intervals it was told (a large swarm's are longer)."""
    return now - record.last_seen > STALE_HEARTBEATS * record.beat_seconds


def swarm_status(state: TrackerState, now: float, *, routes_issued: int) -> SwarmStatus:
    """The swarm at a glance: every model's coverage, and the nodes that left lately (newest first)."""
    by_artifact: dict[str, list[NodeRecord]] = collections.defaultdict(list)
    for record in state.nodes.values():
        by_artifact[record.artifact].append(record)
    limits = _slow_limits(state.nodes.values())
    models = [_model(state, artifact, nodes, limits, now) for artifact, nodes in by_artifact.items()]
    models.sort(key=lambda m: (m.name.casefold(), m.artifact))
    departed = [
        DepartedView(
            node_id=record.node_id.hex(),
            model_name=record.model_name,
            artifact=record.artifact,
            layers=record.layers,
            why=why,
            seconds_ago=round(max(0.0, now - when), 1),
        )
        for record, when, why in reversed(state.departed)
    ]
    return SwarmStatus(
        generated_unix=round(now, 3),
        heartbeat_seconds=state.heartbeat_seconds,
        expire_after_seconds=state.expires_after(state.heartbeat_seconds),
        nodes=len(state.nodes),
        routes_issued=routes_issued,
        models=models,
        departed=departed,
    )


def _model(
    state: TrackerState,
    artifact: str,
    nodes: Sequence[NodeRecord],
    slow_limits: dict[tuple[str, bool], float],
    now: float,
) -> ModelView:
    n_layer = layer_count(nodes)
    budget = state.step_budget_ms
    # a node that claims another layer count joins no route (routechoice.layer_count): not on the strip either
    fitting = [r for r in nodes if r.n_layer == n_layer and 0 <= r.layers[0] < r.layers[1] <= n_layer]
    choices = state.routes_now(artifact)
    best = choices[0].cost_ms if choices else 0.0
    routes = [
        RouteView(
            hops=[
                RouteHopView(node_id=n.node_id.hex(), layers=n.layers, device=n.device, reachability=n.reachability)
                for n in choice.nodes
            ],
            cost_ms=round(choice.cost_ms, 2),
            near_equal=choice.cost_ms <= best * (1.0 + NEAR_EQUAL),
        )
        for choice in choices[:ROUTES_SHOWN]
    ]
    bands, hidden = _bands(fitting, budget)
    classes = collections.Counter(r.kernel_class or "unnamed" for r in nodes).most_common()
    drift = dict(classes[:CLASSES_SHOWN])
    if len(classes) > CLASSES_SHOWN:
        drift["other"] = sum(count for _, count in classes[CLASSES_SHOWN:])
    return ModelView(
        artifact=artifact,
        name=collections.Counter(r.model_name for r in nodes).most_common(1)[0][0],
        n_layer=n_layer,
        nodes=len(nodes),
        admitted=sum(r.admitted for r in nodes),
        # full routes are routes too: with none free, ask whether any exists at all
        routable=bool(choices) or state.routable(artifact),
        segments=_segments(fitting, n_layer, budget),
        bands=bands,
        bands_not_shown=hidden,
        routes=routes,
        route_count=len(choices),
        routes_capped=len(choices) >= MAX_ROUTES,
        active_sessions=sum(r.active_sessions for r in nodes),
        devices=dict(collections.Counter(r.device.partition(":")[0] for r in nodes).most_common()),
        drift_classes=drift,
        reachability=dict(collections.Counter(r.reachability for r in nodes).most_common()),
        probes=dict(collections.Counter(probe_state(r) for r in nodes).most_common()),
        slow=sum(_ms_per_layer(r) > slow_limits[_peers(r)] for r in nodes),
        stale=sum(is_stale(r, now) for r in nodes),
    )


def _segments(nodes: Sequence[NodeRecord], n_layer: int, budget: float) -> list[LayerSegment]:
    """The layers cut wherever a node's range starts or ends, each stretch with what serves it.

    Sums over the nodes by their changes at each boundary: the work grows with the nodes
    and the boundaries, not with nodes times layers. Throughput is summed in tenths of a
    token per second, as integers, so that a stretch nobody serves sums to exactly zero.
    """
    changes: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0, 0])
    for r in nodes:
        tenths = round(r.tokens_per_s(budget) * 10) if r.admitted else 0
        for boundary, sign in ((r.layers[0], 1), (r.layers[1], -1)):
            change = changes[boundary]
            for i, value in enumerate((1, int(r.admitted), tenths, r.active_sessions, r.slots)):
                change[i] += sign * value
    boundaries = sorted({0, n_layer, *changes})
    running = [0, 0, 0, 0, 0]
    stretches = []
    for start, end in itertools.pairwise(boundaries):
        running = [total + change for total, change in zip(running, changes.get(start, [0] * 5), strict=True)]
        stretches.append((start, end, tuple(running)))
    levels = [tenths for _, _, (_, _, tenths, _, _) in stretches]
    lowest, uneven = min(levels), min(levels) < max(levels)
    return [
        LayerSegment(
            start=start,
            end=end,
            nodes=count,
            admitted=admitted,
            tokens_per_s=tenths / 10,
            active_sessions=active,
            slots=slots,
            thin=uneven and tenths == lowest,
        )
        for start, end, (count, admitted, tenths, active, slots) in stretches
    ]


def _bands(nodes: Sequence[NodeRecord], budget: float) -> tuple[list[RangeBand], int]:
    """The layer ranges nodes hold, in layer order: the ``BANDS_SHOWN`` most held, and how many more."""
    held: dict[tuple[int, int], list[NodeRecord]] = collections.defaultdict(list)
    for r in nodes:
        held[r.layers].append(r)
    shown = sorted(sorted(held, key=lambda span: -len(held[span]))[:BANDS_SHOWN])
    bands = [
        RangeBand(
            start=start,
            end=end,
            nodes=len(held[(start, end)]),
            admitted=sum(r.admitted for r in held[(start, end)]),
            tokens_per_s=round(sum(r.tokens_per_s(budget) for r in held[(start, end)] if r.admitted), 1),
        )
        for start, end in shown
    ]
    return bands, len(held) - len(shown)


_FILTERS: dict[str, Callable[[NodeRecord, bool, bool], bool]] = {
    "all": lambda r, slow, stale: True,
    "admitted": lambda r, slow, stale: r.admitted,
    "pending": lambda r, slow, stale: probe_state(r) == "pending",
    "failed": lambda r, slow, stale: probe_state(r) == "failed",
    "direct": lambda r, slow, stale: bool(r.address),
    "relay": lambda r, slow, stale: not r.address,
    "slow": lambda r, slow, stale: slow,
    "stale": lambda r, slow, stale: stale,
}


def node_page(state: TrackerState, query: NodeQuery, now: float) -> NodePage:
    """The nodes ``query`` selects, in its order: the page it asks for, and how many there are in all."""
    limits = _slow_limits(state.nodes.values())
    wanted = _FILTERS[query.state]
    needle = query.q.strip().casefold()
    selected: list[tuple[NodeRecord, bool, bool]] = []
    for r in state.nodes.values():
        if query.artifact and r.artifact != query.artifact:
            continue
        if query.layer is not None and not r.layers[0] <= query.layer < r.layers[1]:
            continue
        if needle and not any(needle in text.casefold() for text in _searched(r)):
            continue
        slow, stale = _ms_per_layer(r) > limits[_peers(r)], is_stale(r, now)
        if wanted(r, slow, stale):
            selected.append((r, slow, stale))
    orders: dict[str, Callable[[tuple[NodeRecord, bool, bool]], tuple[object, ...]]] = {
        "layers": lambda item: (item[0].artifact, item[0].layers, item[0].node_id),
        "step": lambda item: (-_ms_per_layer(item[0]), item[0].node_id),
        "load": lambda item: (-item[0].active_sessions / max(1, item[0].slots), -item[0].queue_depth, item[0].node_id),
        "seen": lambda item: (item[0].last_seen, item[0].node_id),
    }
    selected.sort(key=orders[query.sort])
    page = selected[query.offset : query.offset + query.limit]
    return NodePage(
        total=len(selected),
        offset=query.offset,
        limit=query.limit,
        nodes=[_view(r, slow, stale, now, state.step_budget_ms) for r, slow, stale in page],
    )


def _searched(record: NodeRecord) -> tuple[str, ...]:
    return (record.node_id.hex(), record.model_name, record.device, record.kernel_class)


def _view(record: NodeRecord, slow: bool, stale: bool, now: float, budget: float) -> NodeView:
    return NodeView(
        node_id=record.node_id.hex(),
        model_name=record.model_name,
        artifact=record.artifact,
        n_layer=record.n_layer,
        layers=record.layers,
        device=record.device,
        drift_class=record.kernel_class,
        reachability=record.reachability,
        active_sessions=record.active_sessions,
        slots=record.slots,
        queue_depth=record.queue_depth,
        step_ms=round(record.step_ms, 2),
        estimated_step_ms=round(record.estimated_step_ms(), 2),
        tokens_per_s=round(record.tokens_per_s(budget), 1),
        probe=probe_state(record),
        probe_detail=record.probe_detail,
        audit_failed=record.audit_failed,
        admitted=record.admitted,
        slow=slow,
        stale=stale,
        seconds_since_heartbeat=round(max(0.0, now - record.last_seen), 1),
    )
