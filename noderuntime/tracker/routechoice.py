"""Route choice: a shortest path over layer boundaries, and a random draw among near-equal routes.

A route is a chain of nodes of one artifact and recipe whose layer ranges cover
``[0, n_layer)`` contiguously, or of two recipes that a mixed-route certificate covers
(a route across devices, held to the tolerance the certificate measured). Its cost
is the sum, per hop, of the node's estimated step time under its current load, plus
the seam into it: the round trip the two hops measured between them, when one of them
reported it in its heartbeats, else a constant by the node's reachability.

Route choice is a shortest path over layer boundaries: each node is an edge from its
first layer to the one past its last, weighted by its cost, and every edge runs
forward, so one pass over the boundaries in order settles the cheapest route (the
work grows with the nodes, not with the routes they form). Each request scales every
node's weight by its own random factor in ``[1, 1 + NEAR_EQUAL]``: independent
requests spread over routes of about the same cost instead of piling onto one, and
the route taken never costs more than ``NEAR_EQUAL`` above the cheapest there is.

:func:`choose` reads one artifact's :class:`~noderuntime.tracker.columns.Columns`;
:func:`all_routes` enumerates routes of records (capped), for status pages.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import attrs
import numpy as np

from noderuntime.tracker.columns import COST_CEILING_MS, Cheapest, Columns, Costs, EdgeCosts, Mask
from noderuntime.tracker.records import NodeRecord

NEAR_EQUAL = 0.10  # routes within 10 % of the cheapest are equally good
MAX_ROUTES = 2000  # all_routes' cap (status pages list routes; route choice enumerates none)


@attrs.frozen
class RouteChoice:
    """A chosen route and its estimated cost."""

    nodes: tuple[NodeRecord, ...]
    cost_ms: float


@attrs.frozen
class Seen:
    """A node as the requesting client sees it, where that is not what the columns hold: its own route
    grants through it that the node has not yet confirmed count in full (``TrackerState.seen``)."""

    record: NodeRecord
    room: bool  # whether it has room for one more session of this client's


class NoRoute(Exception):
    """No route can serve the request; ``full`` says whether routes exist but are at capacity."""

    def __init__(self, message: str, *, full: bool) -> None:
        super().__init__(message)
        self.full = full


def choose(
    columns: Columns | None,
    artifact: str,
    tokens: int,
    *,
    exclude: Iterable[bytes],
    start: int,
    recipe: str | None,
    prefer: str | None,
    near: Collection[bytes],
    mixes: Collection[frozenset[str]],
    rng: random.Random,
    route_cost: Callable[[Sequence[NodeRecord]], float],
    seen: Mapping[bytes, Seen] | None = None,
) -> RouteChoice:
    """Pick a route over ``columns`` (``artifact``'s) for a session of ``tokens`` positions; raises :class:`NoRoute`.

    ``start``: the route covers ``[start, n_layer)`` only (the rest of a route under
    repair, whose first hops stay); ``recipe``: only nodes of that recipe (a repair's
    replacement must compute what the lost hops did, bit for bit); ``prefer``: routes of
    that one recipe first, any other only when none has room; ``near``: nodes that hold
    the session's prefix (affinity): a route with room through most of them is taken,
    whatever it costs, and only when none has room do the others spread the load.
    ``mixes``: the pairs of recipes that may share a route; ``route_cost``: what a route
    of records costs, its measured seams counted; ``seen``: by node id, the nodes the requesting client
    sees otherwise than the columns hold them (its own grants there counted in full).

    The cheapest route with room is found as a shortest path; the route taken is drawn
    at random among those costing at most ``NEAR_EQUAL`` more (see :meth:`Columns.draw`).
    Affinity is a discount on ``near`` nodes larger than any route's whole cost: the
    count of them on a route comes first, its cost second.
    """
    usable = _usable(columns, tokens, exclude, recipe) if columns is not None else None
    if columns is None or usable is None or not usable.any():
        raise NoRoute(f"no node serves artifact {artifact[:16]}… for {tokens} tokens", full=False)
    # the manifest's, or counted over every admitted node of the artifact, as /v1/artifacts shows
    # it: not over the candidates left after exclusions and full nodes, where a few could outvote the rest
    n_layer = columns.layer_count()
    rows = columns.layout().rows
    seen = seen or {}
    has_room, step = _seen_by(columns, seen)
    costs = _costs(columns, _bonus(columns, usable, near) if near else None, step)
    room = usable & has_room
    found: list[Cheapest] = []
    if prefer is not None and prefer in columns.recipe_codes:
        alone = room & (columns.recipe[rows] == columns.recipe_codes[prefer])
        found = [c for c in (columns.shortest(alone, costs, start, n_layer),) if c is not None]
    if not found:
        found = _cheapest(columns, room, recipe, start, n_layer, costs, mixes)
    if not found:
        if _cheapest(columns, usable, recipe, start, n_layer, costs, mixes):
            raise NoRoute("every route is at capacity", full=True)
        what = f"layers {start}:{n_layer}" if start else f"{n_layer} layers"
        raise NoRoute(f"the nodes of artifact {artifact[:16]}… do not cover its {what}", full=False)
    cheapest = min(found, key=lambda c: c.cost)
    # within NEAR_EQUAL of the cheapest route's own cost (its discount aside)
    route = _records(columns, columns.draw(cheapest, costs, cheapest.cost, rng), seen)
    budget = cheapest.cost + NEAR_EQUAL * route_cost(route)
    # recipes that cannot share a route are searched apart: one of those with a route in the budget
    group = rng.choice([c for c in found if c.cost <= budget])
    route = _records(columns, columns.draw(group, costs, budget, rng), seen)
    return RouteChoice(route, route_cost(route))


def routable(columns: Columns | None, mixes: Collection[frozenset[str]]) -> bool:
    """Whether the nodes routes may use in ``columns`` chain into a complete route, full or not."""
    if columns is None:
        return False
    usable = _usable(columns, 1, (), None)
    if usable is None:
        return False
    costs = _costs(columns, None, columns.step[columns.layout().rows])
    return bool(_cheapest(columns, usable, None, 0, columns.layer_count(), costs, mixes))


def _records(columns: Columns, positions: Sequence[int], seen: Mapping[bytes, Seen]) -> tuple[NodeRecord, ...]:
    records = (columns.record_at(p) for p in positions)
    return tuple(seen[r.node_id].record if r.node_id in seen else r for r in records)


def _seen_by(columns: Columns, seen: Mapping[bytes, Seen]) -> tuple[Mask, Costs]:
    """By position, room and step time as the requesting client sees them: the columns', but for ``seen``."""
    layout = columns.layout()
    room, step = columns.room[layout.rows], columns.step[layout.rows]  # copies: rows is an index array
    for node_id, view in seen.items():
        row = columns.rows.get(node_id)
        if row is not None:
            at = layout.position[row]
            room[at] = view.room
            step[at] = min(view.record.estimated_step_ms(), COST_CEILING_MS)
    return room, step


def _usable(columns: Columns, tokens: int, exclude: Iterable[bytes], recipe: str | None) -> Mask | None:
    """By position, the nodes a route may use: admitted, with context for ``tokens``, of the artifact's
    layer count (and of ``recipe``, when given), not excluded."""
    layout = columns.layout()
    rows = layout.rows
    usable: Mask = (
        columns.admitted[rows] & (columns.ctx[rows] >= tokens) & (columns.n_layer[rows] == columns.layer_count())
    )
    if recipe is not None:
        if recipe not in columns.recipe_codes:
            return None
        usable &= columns.recipe[rows] == columns.recipe_codes[recipe]
    for node_id in exclude:
        row = columns.rows.get(node_id)
        if row is not None:
            usable[layout.position[row]] = False
    return usable


def _bonus(columns: Columns, usable: Mask, near: Collection[bytes]) -> Costs:
    """By position, a discount on the ``near`` nodes larger than any route's whole (noisy) cost."""
    layout = columns.layout()
    bonus = np.zeros(usable.size)
    at = [layout.position[row] for row in (columns.rows.get(n) for n in near) if row is not None]
    if at:
        rows = layout.rows
        slowest_seam = np.maximum(columns.seam[rows], columns.seams_ms[rows].max(axis=1))
        whole = float((columns.step[rows] + slowest_seam)[usable].sum())
        bonus[at] = (1.0 + NEAR_EQUAL) * whole + 1.0
    return bonus


def _costs(columns: Columns, bonus: Costs | None, step: Costs) -> EdgeCosts:
    """By position, what entering each node costs: its step time (``step``) and the seam into it, less its bonus."""
    rows = columns.layout().rows
    own = step
    if bonus is not None:
        own = own - bonus
    measured = columns.seam_layout().round_trip + own[:, None]
    return EdgeCosts(own + columns.seam[rows] * columns.unmeasured_scale(), measured)


def _cheapest(
    columns: Columns,
    usable: Mask,
    recipe: str | None,
    start: int,
    n_layer: int,
    costs: EdgeCosts,
    mixes: Collection[frozenset[str]],
) -> list[Cheapest]:
    """The cheapest route over ``usable`` positions of each group of recipes that may share a route:
    one recipe, or a certified pair of them ([] when there is none)."""
    recipes = columns.recipe[columns.layout().rows]
    codes = {int(c) for c in np.unique(recipes[usable])}
    if recipe is not None or len(codes) <= 1:
        groups = [usable]
    else:
        names = {code: name for name, code in columns.recipe_codes.items()}
        present = {names[c] for c in codes}
        pairs = [pair for pair in mixes if len(pair) == 2 and pair <= present]
        alone = [r for r in present if not any(r in pair for pair in pairs)]
        groups = [
            usable & np.isin(recipes, [columns.recipe_codes[r] for r in group])
            for group in [*pairs, *(frozenset((r,)) for r in alone)]
        ]
    found = (columns.shortest(allowed, costs, start, n_layer) for allowed in groups)
    return [c for c in found if c is not None]


def free_routes(
    nodes: Sequence[NodeRecord], mixes: Collection[frozenset[str]], step_budget_ms: float
) -> list[list[NodeRecord]]:
    """The complete routes of one artifact's ``nodes`` (enumerated, capped) with room on every hop for a short
    session: those :func:`choose` picks from; [] when there are none."""
    candidates = [r for r in nodes if r.ctx_per_session >= 1 and r.admitted]
    if not candidates:
        return []
    # counted over every admitted node of the artifact: not over the candidates left after
    # exclusions and full nodes, where a few could outvote the rest
    n_layer = layer_count(nodes)
    routes = all_routes([c for c in candidates if c.n_layer == n_layer], n_layer, mixes)
    return [r for r in routes if all(node.has_room(step_budget_ms) for node in r)]


def layer_count(nodes: Sequence[NodeRecord]) -> int:
    """The layer count of the artifact ``nodes`` serve: the one most of the admitted ones report
    (most of all of them, where none is admitted yet: then no route is offered anyway).

    An artifact has one; a node that claims another (its word against theirs) joins no
    route, so it cannot offer a route that stops short of the last layer. Unadmitted nodes
    have no vote while any is admitted: anyone can register them.
    """
    admitted = [node.n_layer for node in nodes if node.admitted]
    return collections.Counter(admitted or [node.n_layer for node in nodes]).most_common(1)[0][0]


def route_cost(route: Sequence[NodeRecord]) -> float:
    """Estimated milliseconds per decode step along ``route``."""
    return sum(node.estimated_step_ms() + node.seam_ms() for node in route)


def all_routes(
    nodes: Sequence[NodeRecord], n_layer: int, mixes: Collection[frozenset[str]] = (), *, start: int = 0
) -> list[list[NodeRecord]]:
    """Every chain of nodes covering ``[start, n_layer)`` contiguously (capped): of one recipe, or
    of a pair of recipes in ``mixes`` (pairs a mixed-route certificate covers) using both.

    Only boundaries from which the allowed recipes' nodes still reach ``n_layer`` are
    followed, so the work is bounded by the routes found: a registered maze of dead ends (two
    nodes per boundary, the last layer never served) would otherwise cost 2**boundaries.
    """
    by_start: dict[int, list[NodeRecord]] = {}
    for node in nodes:
        if 0 <= node.layers[0] < node.layers[1] <= n_layer:
            by_start.setdefault(node.layers[0], []).append(node)
    recipes = {n.recipe for n in nodes}
    groups = [frozenset((r,)) for r in sorted(recipes)]
    groups += sorted({pair for pair in mixes if len(pair) == 2 and pair <= recipes}, key=sorted)
    routes: list[list[NodeRecord]] = []
    for group in groups:
        _walk(by_start, n_layer, group, routes, start)
    return routes


def _walk(
    by_start: dict[int, list[NodeRecord]],
    n_layer: int,
    group: frozenset[str],
    routes: list[list[NodeRecord]],
    start: int = 0,
) -> None:
    """Add to ``routes`` the chains whose hops run the recipes of ``group``, each of them."""
    # boundaries from which the group's nodes reach n_layer; a node's end lies above its
    # start, so walking the starts downwards settles each boundary once
    viable: set[int] = set()
    for boundary in sorted(by_start, reverse=True):
        if any(n.recipe in group and (n.layers[1] == n_layer or n.layers[1] in viable) for n in by_start[boundary]):
            viable.add(boundary)
    # a pair's chains that run only one of its recipes are that recipe's own routes, found
    # on their own; they count as visits, so enumerating a pair stays bounded too
    visits = 0

    def extend(path: list[NodeRecord], at: int) -> None:
        nonlocal visits
        if len(routes) >= MAX_ROUTES or visits >= 2 * MAX_ROUTES:
            return
        if at == n_layer:
            visits += 1
            if len({node.recipe for node in path}) == len(group):
                routes.append(list(path))
            return
        for node in by_start.get(at, []):
            if node.recipe in group and (node.layers[1] == n_layer or node.layers[1] in viable):
                path.append(node)
                extend(path, node.layers[1])
                path.pop()

    if start in viable:
        extend([], start)


def unmixed(nodes: Sequence[NodeRecord], mixes: Mapping[str, Collection[frozenset[str]]] | None = None) -> list[str]:
    """Why nodes of one artifact with different recipes form no route together: a line per pair.

    Every hop of a route runs one recipe, and nodes refuse another, unless the route's two
    recipes are a pair ``mixes`` holds for the artifact: a mixed-route certificate from
    ``benchmarks.backends`` covers it (a route across devices is held to the tolerance the
    certificate measured, not to bit-exactness).
    """
    lines = []
    for artifact in sorted({n.artifact for n in nodes}):
        certified = (mixes or {}).get(artifact, ())
        devices: dict[str, set[str]] = {}
        classes: dict[str, set[str]] = {}
        for node in nodes:
            if node.artifact == artifact:
                devices.setdefault(node.recipe, set()).add(node.device.partition(":")[0])
                classes.setdefault(node.recipe, set()).add(node.kernel_class)
        recipes = sorted(devices)
        for i, a in enumerate(recipes):
            for b in recipes[i + 1 :]:
                if frozenset((a, b)) in certified:
                    continue
                where = f"{artifact[:12]}: recipes {a[:8]} ({'/'.join(sorted(devices[a]))}) and {b[:8]} "
                where += f"({'/'.join(sorted(devices[b]))}) share no route: "
                if devices[a] != devices[b]:
                    lines.append(
                        where + "their devices agree only within a tolerance, and no certificate covers this "
                        "pair (benchmarks.backends certifies one; the tracker takes it with --certificate)"
                    )
                elif classes[a] != classes[b]:
                    lines.append(
                        where + "they run other CPU kernels (drift classes "
                        f"{' / '.join(sorted(classes[a]))} and {' / '.join(sorted(classes[b]))}): their bits differ, "
                        "and no certificate covers this pair"
                    )
                else:
                    lines.append(where + "their kernels or settings differ (quant, ubatch, flash attention, KV)")
    return lines
