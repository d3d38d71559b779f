"""The tracker's soft state and route selection: plain synchronous code, no I/O.

Nodes register (and re-register after a tracker restart) and send heartbeats with
their load; a node that misses heartbeats for ``expire_after`` seconds is dropped.
A route is a chain of nodes of one artifact and recipe whose layer ranges cover
``[0, n_layer)`` contiguously, or of two recipes that a mixed-route certificate covers
(a route across devices, held to the tolerance the certificate measured). Its cost
is the sum, per hop, of the node's estimated step time under its current load, plus
a latency per seam; among routes within a few percent of the cheapest one is picked
at random, so independent requests spread over equivalent routes instead of piling
onto one.

Step times come from the capability each node measured and signed at start (checked
against what its heartbeats show), and they also bound how many sessions a slow node
is sent. A node the tracker can probe is admitted to routes only once it has
answered its known-answer probe correctly.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Collection, Iterable, Mapping, Sequence

import attrs

from noderuntime.control.admission import Capability

DIRECT_SEAM_MS = 1.0
RELAY_SEAM_MS = 2.5
DEFAULT_STEP_MS = 10.0
NEAR_EQUAL = 0.10  # routes within 10 % of the cheapest are equally good
STEP_BUDGET_MS = 1000.0  # a node gets no more sessions than keep its decode step under this
MAX_ROUTES = 2000  # enumeration cap: a tracker of a few hundred nodes stays well under it
DEPARTED_KEPT = 64  # departed nodes remembered, for status pages


@attrs.frozen
class NodeRecord:
    """What a node told the tracker about itself (registration) and its load (heartbeats)."""

    node_id: bytes
    artifact: str
    n_layer: int
    layers: tuple[int, int]
    recipe: str
    address: str  # "" for a relay-only node
    relay: str
    tls_cert_sha256: bytes
    slots: int
    ctx_per_session: int
    model_name: str = ""
    device: str = "cpu"  # where its layers and KV live ("vulkan:0"): shown, not routed on
    kernel_class: str = ""  # its drift class, as the node names it (the recipe fingerprint covers it)
    # load, from heartbeats
    active_sessions: int = 0
    free_slots: int = 0
    queue_depth: int = 0
    step_ms: float = 0.0  # recent engine time per batch
    last_seen: float = 0.0
    # what the node measured of itself (signed, checked at registration)
    measured: Capability | None = None
    # known-answer probe: required when the tracker holds references for this shard
    probe_required: bool = False
    probe_passed: bool | None = None
    probe_detail: str = ""

    @property
    def reachability(self) -> str:
        """``direct``, ``direct+relay`` or ``relay-only``."""
        if self.address and self.relay:
            return "direct+relay"
        return "direct" if self.address else "relay-only"

    @property
    def admitted(self) -> bool:
        """Whether routes may use this node: it passed its probe, or none is required of it."""
        return self.probe_passed is True or (self.probe_passed is None and not self.probe_required)

    def estimated_step_ms(self) -> float:
        """Decode step time with one more session.

        From the measured step time at that batch size; a node running slower than it
        measured (heartbeats report its recent step time) is costed at what it shows.
        """
        if self.measured is None:
            base = self.step_ms or DEFAULT_STEP_MS
            busy = self.active_sessions / max(1, self.slots)
            return base * (1.0 + busy) + 0.1 * self.queue_depth * base
        single = self.measured.step_ms(1)
        at_load = max(self.measured.step_ms(self.active_sessions + 1), self.step_ms)
        return at_load + 0.1 * self.queue_depth * single

    def capacity(self, step_budget_ms: float) -> int:
        """Sessions this node should get: as many as keep its measured step time within budget."""
        if self.measured is None:
            return self.slots
        fitting = sum(1 for batch in range(1, self.slots + 1) if self.measured.step_ms(batch) <= step_budget_ms)
        return max(1, fitting)

    def tokens_per_s(self, step_budget_ms: float) -> float:
        """Decode tokens per second this node gives its layers at the sessions routes may send it.

        Its capacity in sessions, each advancing one token per measured step at that batch;
        a node that measured nothing is taken at its reported step time (or the default).
        """
        sessions = self.capacity(step_budget_ms)
        step = self.measured.step_ms(sessions) if self.measured is not None else (self.step_ms or DEFAULT_STEP_MS)
        return sessions * 1000.0 / max(step, 1e-3)

    def has_room(self, step_budget_ms: float) -> bool:
        """Whether one more session may be routed here now."""
        if self.free_slots <= 0:
            return False
        capacity = self.capacity(step_budget_ms)
        # below its slot count the measured capacity binds (counting sessions routed since
        # the last heartbeat); at it, the free slots the node reports do
        return capacity >= self.slots or self.active_sessions < capacity

    def seam_ms(self) -> float:
        """Latency of the seam into this node."""
        return DIRECT_SEAM_MS if self.address else RELAY_SEAM_MS


@attrs.frozen
class RouteChoice:
    """A chosen route and its estimated cost."""

    nodes: tuple[NodeRecord, ...]
    cost_ms: float


class NoRoute(Exception):
    """No route can serve the request; ``full`` says whether routes exist but are at capacity."""

    def __init__(self, message: str, *, full: bool) -> None:
        super().__init__(message)
        self.full = full


class TrackerState:
    """Registered nodes and their load."""

    def __init__(
        self,
        *,
        expire_after: float = 10.0,
        step_budget_ms: float = STEP_BUDGET_MS,
        rng: random.Random | None = None,
        mixes: Mapping[str, Collection[frozenset[str]]] | None = None,
    ) -> None:
        """``mixes``: by artifact, the pairs of recipes that may share a route (certified)."""
        self.expire_after = expire_after
        self.step_budget_ms = step_budget_ms
        self.mixes: dict[str, frozenset[frozenset[str]]] = {a: frozenset(p) for a, p in (mixes or {}).items()}
        self.nodes: dict[bytes, NodeRecord] = {}
        # the nodes that left lately, newest last: (record, when, why: "left" or "expired")
        self.departed: collections.deque[tuple[NodeRecord, float, str]] = collections.deque(maxlen=DEPARTED_KEPT)
        self._rng = rng or random.Random()

    def register(self, record: NodeRecord, now: float) -> None:
        """Add or replace a node; a re-registration starts afresh (it may run other weights now)."""
        self.nodes[record.node_id] = attrs.evolve(record, last_seen=now, free_slots=record.slots)

    def heartbeat(
        self, node_id: bytes, now: float, *, active_sessions: int, free_slots: int, queue_depth: int, step_ms: float
    ) -> bool:
        """Update a node's load; False if the node is unknown (it must register again)."""
        record = self.nodes.get(node_id)
        if record is None:
            return False
        self.nodes[node_id] = attrs.evolve(
            record,
            active_sessions=active_sessions,
            free_slots=free_slots,
            queue_depth=queue_depth,
            step_ms=step_ms,
            last_seen=now,
        )
        return True

    def update(self, node_id: bytes, **changes: object) -> None:
        """Set fields of a registered node (capability, probe result)."""
        record = self.nodes.get(node_id)
        if record is not None:
            self.nodes[node_id] = attrs.evolve(record, **changes)  # type: ignore[arg-type]

    def expire(self, now: float) -> list[bytes]:
        """Drop nodes silent for too long; returns their ids."""
        gone = [nid for nid, r in self.nodes.items() if now - r.last_seen > self.expire_after]
        for nid in gone:
            self.departed.append((self.nodes.pop(nid), now, "expired"))
        return gone

    def leave(self, node_id: bytes, now: float) -> bool:
        """Forget a node that says it leaves; False if it was not registered."""
        record = self.nodes.pop(node_id, None)
        if record is None:
            return False
        self.departed.append((record, now, "left"))
        return True

    def note_session(self, node_ids: Iterable[bytes]) -> None:
        """Count a routed session in its nodes' load until their next heartbeat reports the truth.

        The cost sees it, and so does the capacity of a node whose measured step time allows
        fewer sessions than its slots (see :meth:`NodeRecord.has_room`). The free slots stay
        those the node reports: most sessions end between two heartbeats, and a node that is
        really full refuses at once (the gateway then asks for another route).
        """
        for nid in node_ids:
            record = self.nodes.get(nid)
            if record is not None:
                self.nodes[nid] = attrs.evolve(record, active_sessions=record.active_sessions + 1)

    def artifacts(self) -> dict[str, dict[str, object]]:
        """Known artifacts: name, layers, nodes, and whether some route covers them."""
        out: dict[str, dict[str, object]] = {}
        for artifact in {r.artifact for r in self.nodes.values()}:
            nodes = self.nodes_of(artifact)
            out[artifact] = {
                "name": nodes[0].model_name,
                "n_layer": layer_count(nodes),
                "nodes": len(nodes),
                "routable": self.routable(artifact),
            }
        return out

    def routable(self, artifact: str) -> bool:
        """Whether the nodes routes may use chain into a complete route of ``artifact``, full or not."""
        nodes = self.nodes_of(artifact)
        if not nodes:
            return False
        n_layer = layer_count(nodes)
        eligible = [r for r in self._eligible(artifact, 1, exclude=()) if r.n_layer == n_layer]
        return bool(all_routes(eligible, n_layer, self.mixes.get(artifact, ())))

    def nodes_of(self, artifact: str) -> list[NodeRecord]:
        """Registered nodes of one artifact."""
        return [r for r in self.nodes.values() if r.artifact == artifact]

    def _eligible(self, artifact: str, tokens: int, exclude: Iterable[bytes]) -> list[NodeRecord]:
        excluded = set(exclude)
        return [
            r
            for r in self.nodes.values()
            if r.artifact == artifact and r.node_id not in excluded and r.ctx_per_session >= tokens and r.admitted
        ]

    def choose(
        self,
        artifact: str,
        tokens: int,
        *,
        exclude: Iterable[bytes] = (),
        start: int = 0,
        recipe: str | None = None,
        prefer: str | None = None,
        near: Collection[bytes] = (),
    ) -> RouteChoice:
        """Pick a route for a session of ``tokens`` positions; raises :class:`NoRoute`.

        ``start``: the route covers ``[start, n_layer)`` only (the rest of a route under
        repair, whose first hops stay); ``recipe``: only nodes of that recipe (a repair's
        replacement must compute what the lost hops did, bit for bit); ``prefer``: routes of
        that one recipe first, any other only when none has room; ``near``: nodes that hold
        the session's prefix (affinity): a route with room through most of them is taken,
        whatever it costs, and only when none has room do the others spread the load.
        """
        free = self._free_routes(artifact, tokens, exclude, start, recipe)
        if prefer is not None:
            free = [r for r in free if {node.recipe for node in r} == {prefer}] or free
        if near:
            wanted = set(near)
            overlap = [sum(node.node_id in wanted for node in r) for r in free]
            if max(overlap) > 0:
                free = [r for r, o in zip(free, overlap, strict=True) if o == max(overlap)]
        costed = sorted(((route_cost(r), r) for r in free), key=lambda pair: pair[0])
        best = costed[0][0]
        equals = [pair for pair in costed if pair[0] <= best * (1.0 + NEAR_EQUAL)]
        cost, route = self._rng.choice(equals)
        return RouteChoice(tuple(route), cost)

    def routes_now(self, artifact: str) -> list[RouteChoice]:
        """The routes :meth:`choose` would pick from for a short session of ``artifact`` now, cheapest
        first; [] when it would find none. Those within ``NEAR_EQUAL`` of the first are equally likely.
        """
        try:
            free = self._free_routes(artifact, 1, (), 0, None)
        except NoRoute:
            return []
        return sorted((RouteChoice(tuple(r), route_cost(r)) for r in free), key=lambda choice: choice.cost_ms)

    def _free_routes(
        self, artifact: str, tokens: int, exclude: Iterable[bytes], start: int, recipe: str | None
    ) -> list[list[NodeRecord]]:
        """The complete routes with room on every hop; raises :class:`NoRoute` when there are none."""
        candidates = self._eligible(artifact, tokens, exclude)
        if recipe is not None:
            candidates = [c for c in candidates if c.recipe == recipe]
        if not candidates:
            raise NoRoute(f"no node serves artifact {artifact[:16]}… for {tokens} tokens", full=False)
        # counted over every node of the artifact, as /v1/artifacts shows it: not over the
        # candidates left after exclusions and full nodes, where a few could outvote the rest
        n_layer = layer_count(self.nodes_of(artifact))
        routes = all_routes(
            [c for c in candidates if c.n_layer == n_layer], n_layer, self.mixes.get(artifact, ()), start=start
        )
        if not routes:
            what = f"layers {start}:{n_layer}" if start else f"{n_layer} layers"
            raise NoRoute(f"the nodes of artifact {artifact[:16]}… do not cover its {what}", full=False)
        free = [r for r in routes if all(node.has_room(self.step_budget_ms) for node in r)]
        if not free:
            raise NoRoute("every route is at capacity", full=True)
        return free


def layer_count(nodes: Sequence[NodeRecord]) -> int:
    """The layer count of the artifact ``nodes`` serve: the one most of them report.

    An artifact has one; a node that claims another (its word against theirs) joins no
    route, so it cannot offer a route that stops short of the last layer.
    """
    return collections.Counter(node.n_layer for node in nodes).most_common(1)[0][0]


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
