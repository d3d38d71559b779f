"""The tracker's soft state and route selection: plain synchronous code, no I/O.

Nodes register (and re-register after a tracker restart) and send heartbeats with
their load; a node that misses heartbeats for ``expire_after`` seconds is dropped.
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

Step times come from the capability each node measured and signed at start (checked
against what its heartbeats show), and they also bound how many sessions a slow node
is sent. A node the tracker can probe is admitted to routes only once it has
answered its known-answer probe correctly.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import random
from collections.abc import Collection, Iterable, Mapping, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from noderuntime.control.admission import Capability
from noderuntime.tracker.messages import MAX_PEERS, MAX_ROUND_TRIP_MS

DIRECT_SEAM_MS = 1.0  # a seam nobody measured, into a node peers dial directly
RELAY_SEAM_MS = 2.5  # ... into a node reached through its relay
DEFAULT_STEP_MS = 10.0
NEAR_EQUAL = 0.10  # routes within 10 % of the cheapest are equally good
STEP_BUDGET_MS = 1000.0  # a node gets no more sessions than keep its decode step under this
MAX_ROUTES = 2000  # all_routes' cap (status pages list routes; route choice enumerates none)
DEPARTED_KEPT = 64  # departed nodes remembered, for status pages
SEAMS_KEPT = 8  # measured seams into one node that routes read: its slowest ones
COST_CEILING_MS = 1e9  # a node's cost is clipped here, so that sums over routes stay finite
LAYERS_CEILING = 1 << 15  # layer numbers route choice takes (int16)
ROUND_TRIP_SLACK = 0.1  # a reported round trip that moved less than this share (or 0.2 ms) is kept as it was
# Heartbeats: a small swarm's nodes beat every HEARTBEAT_SECONDS; a large one's less often, so
# that all of them together send about HEARTBEATS_PER_SECOND. A heartbeat costs the tracker
# about 1.4 ms of CPU through its HTTP stack (85 % of it the framework, 9 % the signature:
# benchmarks.tracker_scale), so 200 a second take under a third of a core and leave the
# rest to route requests. At 10,000 nodes that is a beat every 50 s (Petals announces every
# 60 s); past MAX_HEARTBEAT_SECONDS the interval stops growing and the budget is exceeded.
HEARTBEAT_SECONDS = 2.0
HEARTBEATS_PER_SECOND = 200.0
MAX_HEARTBEAT_SECONDS = 60.0
# a node is dropped after this many of its intervals without a word (and never sooner than expire_after)
EXPIRE_HEARTBEATS = 3.0


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
    beat_seconds: float = HEARTBEAT_SECONDS  # the heartbeat interval the tracker last told it
    # why audits excluded it (two auditors agreed against it: tracker/audits.py); "" when they did not
    audit_failed: str = ""

    @property
    def reachability(self) -> str:
        """``direct``, ``direct+relay`` or ``relay-only``."""
        if self.address and self.relay:
            return "direct+relay"
        return "direct" if self.address else "relay-only"

    @property
    def admitted(self) -> bool:
        """Whether routes may use this node: it passed its probe (or needs none) and no audit excluded it."""
        probed = self.probe_passed is True or (self.probe_passed is None and not self.probe_required)
        return probed and not self.audit_failed

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
        return _capacity(self.measured, self.slots, step_budget_ms)

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
        """Latency of the seam into this node, where neither end measured it."""
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


@functools.lru_cache(maxsize=1 << 14)
def _capacity(measured: Capability, slots: int, step_budget_ms: float) -> int:
    # every heartbeat asks it again, of figures fixed at registration
    fitting = sum(1 for batch in range(1, slots + 1) if measured.step_ms(batch) <= step_budget_ms)
    return max(1, fitting)


Rows = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]
Costs = npt.NDArray[np.float64]


class _Columns:
    """One artifact's nodes as columns, a row per node: what route choice reads.

    Kept current as registrations, heartbeats and departures arrive, so that a route
    request reads arrays instead of walking records; a departed node's row is reused.
    """

    def __init__(self, artifact: str) -> None:
        self.artifact = artifact
        self.rows: dict[bytes, int] = {}
        self.records: list[NodeRecord | None] = []
        self.vacant: list[int] = []
        self.layer_counts: collections.Counter[int] = collections.Counter()
        self.recipe_codes: dict[str, int] = {}
        self.size = 0  # rows ever used (present or vacant)
        self._layout: _Layout | None = None
        self._seams: _SeamLayout | None = None
        self._unmeasured: float | None = None
        self.present = np.zeros(0, np.bool_)
        self.admitted = np.zeros(0, np.bool_)
        self.room = np.zeros(0, np.bool_)
        # int16 (layers are at most messages.MAX_LAYERS): sorting them is a radix sort
        self.start = np.zeros(0, np.int16)
        self.end = np.zeros(0, np.int16)
        self.n_layer = np.zeros(0, np.int16)
        self.ctx = np.zeros(0, np.int64)
        self.recipe = np.zeros(0, np.int32)
        self.step = np.zeros(0, np.float64)  # estimated step time at one more session
        self.seam = np.zeros(0, np.float64)  # the seam into it where nobody measured one
        # measured seams into it: the previous hop's row (-1: none) and the round trip
        self.seams_from = np.zeros((0, SEAMS_KEPT), np.int64)
        self.seams_ms = np.zeros((0, SEAMS_KEPT), np.float64)
        self.seams_count = np.zeros(0, np.int32)
        self._grow(64)

    def _grow(self, capacity: int) -> None:
        def grown(old: npt.NDArray[np.generic], fill: object) -> npt.NDArray[np.generic]:
            new = np.full((capacity, *old.shape[1:]), fill, old.dtype)
            new[: len(old)] = old
            return new

        for name in ("present", "admitted", "room"):
            setattr(self, name, grown(getattr(self, name), False))
        for name in ("start", "end", "n_layer", "ctx", "recipe", "seams_count"):
            setattr(self, name, grown(getattr(self, name), 0))
        self.step = grown(self.step, 0.0)  # type: ignore[assignment]
        self.seam = grown(self.seam, 0.0)  # type: ignore[assignment]
        self.seams_from = grown(self.seams_from, -1)  # type: ignore[assignment]
        self.seams_ms = grown(self.seams_ms, 0.0)  # type: ignore[assignment]

    def put(self, record: NodeRecord, step_budget_ms: float) -> None:
        """Add a node or bring its row up to date."""
        row = self.rows.get(record.node_id)
        if row is None:
            if self.vacant:
                row = self.vacant.pop()
            else:
                if self.size == len(self.present):
                    self._grow(2 * self.size)
                row = self.size
                self.size += 1
            self.rows[record.node_id] = row
            self.records.extend([None] * (row + 1 - len(self.records)))
            old = None
        else:
            old = self.records[row]
        if old is None or old.layers != record.layers or old.n_layer != record.n_layer or old.recipe != record.recipe:
            if old is not None:
                self._uncount(old)
            self.layer_counts[record.n_layer] += 1
            code = self.recipe_codes.setdefault(record.recipe, len(self.recipe_codes))
            start, end = record.layers
            if 0 <= start < end <= record.n_layer < LAYERS_CEILING:
                self.start[row], self.end[row], self.n_layer[row] = start, end, record.n_layer
            else:  # no route can use it (a registration's layers are checked before this)
                self.start[row] = self.end[row] = self.n_layer[row] = 0
            self.recipe[row] = code
            self._layout = self._seams = None
            self._unmeasured = None
        self.records[row] = record
        self.present[row] = True
        self.admitted[row] = record.admitted and self.n_layer[row] > 0
        self.ctx[row] = record.ctx_per_session
        self.step[row] = min(record.estimated_step_ms(), COST_CEILING_MS)
        self.seam[row] = record.seam_ms()
        self.room[row] = record.has_room(step_budget_ms)

    def remove(self, node_id: bytes) -> None:
        """Forget a node; its row waits for the next one."""
        row = self.rows.pop(node_id, None)
        if row is None:
            return
        old = self.records[row]
        assert old is not None
        self._uncount(old)
        self.records[row] = None
        self.present[row] = self.admitted[row] = self.room[row] = False
        self.seams_from[row] = -1
        self.seams_count[row] = 0
        self.vacant.append(row)
        self._layout = self._seams = self._unmeasured = None

    def _uncount(self, record: NodeRecord) -> None:
        self.layer_counts[record.n_layer] -= 1
        if not self.layer_counts[record.n_layer]:
            del self.layer_counts[record.n_layer]

    def set_seams(self, row: int, seams: Sequence[tuple[int, float]]) -> None:
        """The measured seams into the node of ``row``: (the previous hop's row, round trip ms)."""
        kept = seams[:SEAMS_KEPT]
        self.seams_from[row] = -1
        self.seams_ms[row] = 0.0
        if kept:
            self.seams_from[row, : len(kept)] = [previous for previous, _ in kept]
            self.seams_ms[row, : len(kept)] = [ms for _, ms in kept]
        self.seams_count[row] = len(kept)
        self._seams = self._unmeasured = None

    def unmeasured_scale(self) -> float:
        """What the constants for seams nobody measured are scaled by: the median measured round
        trip of these nodes over ``DIRECT_SEAM_MS``, at most 1 (1 where none is measured yet).

        With the constants alone a swarm on one LAN (round trips of 0.1 ms) never routed a new
        node, whose seams cost the 1 ms constant until a session through it measured them. A
        seam nobody measured costs what a typical measured one does, or the constant where
        that is less: across continents a new node is tried (and so measured) rather than
        priced as the slowest link.
        """
        if self._unmeasured is None:
            used = np.flatnonzero(self.present[: self.size])
            counts = self.seams_count[used]
            kept = self.seams_ms[used][np.arange(SEAMS_KEPT)[None, :] < counts[:, None]]
            self._unmeasured = min(1.0, float(np.median(kept)) / DIRECT_SEAM_MS) if kept.size else 1.0
        return self._unmeasured

    def layer_count(self) -> int:
        """The layer count most of these nodes report (see :func:`layer_count`)."""
        return self.layer_counts.most_common(1)[0][0]

    def layout(self) -> _Layout:
        """The present rows in order of their first layer: rebuilt when nodes come, go or change layers."""
        if self._layout is None:
            used = np.flatnonzero(self.present[: self.size])
            rows = used[np.argsort(self.start[used], kind="stable")]
            position = np.full(self.size, -1, np.int64)
            position[rows] = np.arange(rows.size)
            end = self.end[rows]
            by_end = np.argsort(end, kind="stable")
            self._layout = _Layout(rows, position, self.start[rows], end, by_end, end[by_end])
        return self._layout

    def seam_layout(self) -> _SeamLayout:
        """The measured seams into each position: rebuilt when seams or the layout change."""
        if self._seams is None:
            layout = self.layout()
            named = self.seams_from[layout.rows]
            sources = np.where(named >= 0, layout.position[np.maximum(named, 0)], -1)
            # live: its previous hop ends where this node starts (one that registered again with
            # other layers leaves seams that lead nowhere until they are measured again)
            live = (sources >= 0) & (layout.end[np.maximum(sources, 0)] == layout.start[:, None])
            self._seams = _SeamLayout(
                np.where(live, sources, 0),
                np.where(live, sources, -1),
                np.where(live, self.seams_ms[layout.rows], np.inf),
                np.concatenate(([0], np.cumsum(live.any(axis=1)))),
            )
        return self._seams

    def shortest(self, usable: Mask, costs: EdgeCosts, start: int, n_layer: int) -> _Cheapest | None:
        """The cost of the cheapest chain of ``usable`` positions over ``[start, n_layer)``; None if there is none.

        Boundaries are settled in order: every node ending at a boundary starts before it,
        so its cost is final when the nodes starting there are costed. The chains
        themselves are drawn afterwards (:meth:`draw`), the cheapest one too.
        """
        layout, seams = self.layout(), self.seam_layout()
        start_at = np.searchsorted(layout.start, np.arange(n_layer + 2))
        end_at = np.searchsorted(layout.end_sorted, np.arange(n_layer + 2))
        # per boundary: whether a node starting there has a measured seam into it
        measured_at = (seams.counted[start_at[1:]] > seams.counted[start_at[:-1]]).tolist()
        starts, ends = start_at.tolist(), end_at.tolist()
        barred = np.where(usable, 0.0, np.inf)
        plain = costs.plain + barred
        measured = costs.measured + barred[:, None]
        best = np.full(layout.rows.size, np.inf)  # the cheapest chain from `start` through each position
        for boundary in range(start, n_layer):
            a, b = starts[boundary], starts[boundary + 1]
            if a == b:
                continue
            if boundary == start:
                best[a:b] = plain[a:b]
                continue
            before = layout.by_end[ends[boundary] : ends[boundary + 1]]
            if not before.size:
                continue
            reached = best[before]
            k = int(reached.argmin())
            if reached[k] == np.inf:
                continue
            if measured_at[boundary]:
                self._measured_seams(a, b, before, reached, k, best, plain, measured)
            else:
                best[a:b] = reached[k] + plain[a:b]
        last = layout.by_end[ends[n_layer] : ends[n_layer + 1]]
        cost = float(best[last].min()) if last.size else np.inf
        return None if cost == np.inf else _Cheapest(cost, best, end_at, start, n_layer)

    def _measured_seams(
        self,
        a: int,
        b: int,
        before: Rows,
        reached: Costs,
        k: int,
        best: Costs,
        plain: Costs,
        measured: npt.NDArray[np.float64],
    ) -> None:
        """Cost positions ``a:b`` (nodes starting where ``before`` end, the ``k``-th the cheapest) with their
        measured seams.

        A node's cheapest way in is a previous hop that measured its seam into it (at that
        round trip), or the cheapest previous hop that did not (at the constant): of the
        ``SEAMS_KEPT + 1`` cheapest previous hops, one at least measured none.
        """
        seams = self.seam_layout()
        via = (best[seams.sources[a:b]] + measured[a:b]).min(axis=1)  # a position never reached, or no seam: inf
        into = reached[k] + plain[a:b]
        named = seams.named[a:b]
        past = np.flatnonzero((named == before[k]).any(axis=1))  # the cheapest previous hop measured these
        if past.size:
            order = np.argsort(reached, kind="stable")[: SEAMS_KEPT + 1]
            named_by = (named[past][:, :, None] == before[order]).any(axis=1)  # (nodes, cheapest hops)
            first = named_by.argmin(axis=1)  # the first that measured no seam into the node
            none = named_by[np.arange(past.size), first]  # all of them did
            into[past] = np.where(none, np.inf, reached[order][first] + plain[a:b][past])
        best[a:b] = np.minimum(via, into)

    def record_at(self, position: int) -> NodeRecord:
        """The node at ``position`` of the layout."""
        record = self.records[int(self.layout().rows[position])]
        assert record is not None  # the layout holds present rows only
        return record

    def draw(self, found: _Cheapest, costs: EdgeCosts, budget: float, rng: random.Random) -> list[int]:
        """A route of ``found``'s nodes costing at most ``budget``, drawn at random (positions, first hop first).

        Walking back from the last layer, each hop is drawn among those through which the
        cheapest way back to the first layer keeps the whole route within ``budget``: every
        such route may be drawn, and no other.
        """
        layout, seams = self.layout(), self.seam_layout()
        best, end_at = found.best, found.end_at
        # a float sum in another order may miss the cheapest by a rounding error
        budget += 1e-9 * (1.0 + abs(budget))
        last = layout.by_end[end_at[found.n_layer] : end_at[found.n_layer + 1]]
        at = int(rng.choice(last[best[last] <= budget]))
        route, after = [at], 0.0
        while layout.start[at] != found.start:
            boundary = int(layout.start[at])
            before = layout.by_end[end_at[boundary] : end_at[boundary + 1]]
            into = np.full(before.size, costs.plain[at])
            for k in np.flatnonzero(seams.named[at] >= 0):
                into[before == seams.named[at, k]] = costs.measured[at, k]
            total = best[before] + into + after
            fits = np.flatnonzero(total <= budget)
            pick = int(rng.choice(fits)) if fits.size else int(total.argmin())
            after += float(into[pick])
            at = int(before[pick])
            route.append(at)
        return route[::-1]


@attrs.frozen
class _Cheapest:
    """A shortest path's outcome: the cheapest route's cost, and what a draw of routes reads."""

    cost: float
    best: Costs  # by position: the cheapest chain from `start` through it (inf: none)
    end_at: npt.NDArray[np.int64]  # by boundary: where the positions ending there begin in `by_end`
    start: int
    n_layer: int


@attrs.frozen
class _Layout:
    """The present rows in order of their first layer (a node's position), and the positions by end."""

    rows: Rows  # position -> row
    position: Rows  # row -> position (-1: vacant)
    start: npt.NDArray[np.int16]  # by position, ascending
    end: npt.NDArray[np.int16]  # by position
    by_end: Rows  # positions in order of their end
    end_sorted: npt.NDArray[np.int16]


@attrs.frozen
class _SeamLayout:
    """The measured seams into each position (``SEAMS_KEPT`` columns): previous hop and round trip."""

    sources: Rows  # previous hop's position; 0 where none (its round trip is inf there)
    named: Rows  # the same, -1 where none
    round_trip: npt.NDArray[np.float64]
    counted: Rows  # by position p: how many positions before p have a live measured seam (p + 1 entries)


@attrs.frozen
class EdgeCosts:
    """What entering each node costs on one request, with its discount.

    By position (see :meth:`_Columns.layout`). ``plain``: from the client, or from a
    previous hop that measured no seam into it; ``measured`` (positions x ``SEAMS_KEPT``):
    from the previous hops of :meth:`_Columns.seam_layout` (inf where there is none).
    """

    plain: Costs
    measured: npt.NDArray[np.float64]


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
        """``mixes``: by artifact, the pairs of recipes that may share a route (certified);
        ``expire_after``: seconds of silence after which a node is dropped, at the least (a
        large swarm's nodes beat less often, and are given ``EXPIRE_HEARTBEATS`` of their intervals)."""
        self.expire_after = expire_after
        self.step_budget_ms = step_budget_ms
        self.mixes: dict[str, frozenset[frozenset[str]]] = {a: frozenset(p) for a, p in (mixes or {}).items()}
        self.nodes: dict[bytes, NodeRecord] = {}
        # the nodes that left lately, newest last: (record, when, why: "left" or "expired")
        self.departed: collections.deque[tuple[NodeRecord, float, str]] = collections.deque(maxlen=DEPARTED_KEPT)
        self._rng = rng or random.Random()
        self._columns: dict[str, _Columns] = {}
        # round trips as their nodes last reported them (reporter -> peer -> ms), and who names whom
        self._round_trips: dict[bytes, dict[bytes, float]] = {}
        self._named_by: dict[bytes, set[bytes]] = {}
        # measured seams between registered neighbours: node -> previous hop -> ms, and back
        self._seams_into: dict[bytes, dict[bytes, float]] = {}
        self._seams_from: dict[bytes, set[bytes]] = {}
        self._seams_kept: dict[bytes, dict[bytes, float]] = {}  # what routes read: the slowest SEAMS_KEPT

    # --- the registry

    @property
    def heartbeat_seconds(self) -> float:
        """The interval nodes are told to heartbeat at now: longer as the swarm grows (see HEARTBEATS_PER_SECOND)."""
        return min(MAX_HEARTBEAT_SECONDS, max(HEARTBEAT_SECONDS, len(self.nodes) / HEARTBEATS_PER_SECOND))

    def expires_after(self, beat_seconds: float) -> float:
        """Seconds of silence after which a node told to beat every ``beat_seconds`` is dropped."""
        return max(self.expire_after, EXPIRE_HEARTBEATS * beat_seconds)

    def register(self, record: NodeRecord, now: float) -> None:
        """Add or replace a node; a re-registration starts afresh (it may run other weights now).

        Its ``beat_seconds`` is the interval to tell it (:attr:`heartbeat_seconds`).
        """
        self._forget_seams(record.node_id)
        beat = self.heartbeat_seconds
        self._store(attrs.evolve(record, last_seen=now, free_slots=record.slots, beat_seconds=beat))
        # what its neighbours measured of it still holds: it is the same host
        touched: set[bytes] = set()
        for reporter in self._named_by.get(record.node_id, ()):
            self._relink(reporter, record.node_id, touched)
        self._write_seams(touched)

    def heartbeat(
        self,
        node_id: bytes,
        now: float,
        *,
        active_sessions: int,
        free_slots: int,
        queue_depth: int,
        step_ms: float,
        round_trips: Mapping[bytes, float] | None = None,
    ) -> bool:
        """Update a node's load; False if the node is unknown (it must register again).

        Its ``beat_seconds`` becomes the interval to tell it now (:attr:`heartbeat_seconds`).
        ``round_trips``: by peer node id, the smoothed round trip in ms to the peers it talks to;
        they replace what it reported before (None: leave those as they are).
        """
        record = self.nodes.get(node_id)
        if record is None:
            return False
        self._store(
            attrs.evolve(
                record,
                active_sessions=active_sessions,
                free_slots=free_slots,
                queue_depth=queue_depth,
                step_ms=step_ms,
                last_seen=now,
                beat_seconds=self.heartbeat_seconds,
            )
        )
        if round_trips is not None:
            self._report(node_id, round_trips)
        return True

    def update(self, node_id: bytes, **changes: object) -> None:
        """Set fields of a registered node (capability, probe result)."""
        record = self.nodes.get(node_id)
        if record is not None:
            self._store(attrs.evolve(record, **changes))  # type: ignore[arg-type]

    def expire(self, now: float) -> list[bytes]:
        """Drop nodes silent for longer than their interval allows (:meth:`expires_after`); returns their ids."""
        gone = [nid for nid, r in self.nodes.items() if now - r.last_seen > self.expires_after(r.beat_seconds)]
        for nid in gone:
            self.departed.append((self._drop(nid), now, "expired"))
        return gone

    def leave(self, node_id: bytes, now: float) -> bool:
        """Forget a node that says it leaves; False if it was not registered."""
        if node_id not in self.nodes:
            return False
        self.departed.append((self._drop(node_id), now, "left"))
        return True

    def note_session(self, node_ids: Iterable[bytes]) -> None:
        """Count a routed session in its nodes' load until their next heartbeat reports the truth.

        The cost sees it, and so does the capacity of a node whose measured step time allows
        fewer sessions than its slots (see :meth:`NodeRecord.has_room`). Its free slots
        lose one each: left at what the last heartbeat said, every route asked for between
        two heartbeats went to the same "free" slots, and a burst of twice a node's slots
        met refusals at the node (a third of 48 streams, with 16 clients on 8 slots). Slots
        freed before the next heartbeat are not seen until it comes, and a node counted
        full heartbeats as soon as one frees (``TrackerLink.slot_freed``).
        """
        for nid in node_ids:
            record = self.nodes.get(nid)
            if record is not None:
                self._store(
                    attrs.evolve(
                        record,
                        active_sessions=record.active_sessions + 1,
                        free_slots=max(0, record.free_slots - 1),
                    )
                )

    def _store(self, record: NodeRecord) -> None:
        old = self.nodes.get(record.node_id)
        if old is not None and old.artifact != record.artifact:
            self._columns[old.artifact].remove(record.node_id)
        self.nodes[record.node_id] = record
        columns = self._columns.get(record.artifact)
        if columns is None:
            columns = self._columns[record.artifact] = _Columns(record.artifact)
        columns.put(record, self.step_budget_ms)

    def _drop(self, node_id: bytes) -> NodeRecord:
        self._forget_seams(node_id)  # before its row can go to another node
        record = self.nodes.pop(node_id)
        columns = self._columns[record.artifact]
        columns.remove(node_id)
        if not columns.rows:
            del self._columns[record.artifact]
        return record

    # --- measured seams

    def seam_ms(self, previous: NodeRecord | None, node: NodeRecord) -> float:
        """The seam into ``node`` from ``previous`` (None: from the route's client).

        The round trip the two measured, where either reported one (the larger, where both
        did: neither end can make its seams look faster than the other saw them); else the
        constant for the node's reachability.
        """
        if previous is not None:
            measured = self._seams_kept.get(node.node_id, {}).get(previous.node_id)
            if measured is not None:
                return measured
        # scaled to what the artifact's nodes measure (_Columns.unmeasured_scale)
        columns = self._columns.get(node.artifact)
        return node.seam_ms() * (columns.unmeasured_scale() if columns is not None else 1.0)

    def route_cost(self, route: Sequence[NodeRecord]) -> float:
        """Estimated milliseconds per decode step along ``route``, its measured seams counted."""
        return sum(
            min(node.estimated_step_ms(), COST_CEILING_MS) + self.seam_ms(before, node)
            for before, node in zip((None, *route[:-1]), route, strict=True)
        )

    def _report(self, reporter: bytes, round_trips: Mapping[bytes, float]) -> None:
        """Take a node's round trips to its peers in place of those it reported before."""
        fresh: dict[bytes, float] = {}
        # bounded again here: the message type bounds what arrives over HTTP, not every caller
        for peer, ms in itertools.islice(round_trips.items(), MAX_PEERS):
            if peer != reporter and isinstance(ms, int | float) and math.isfinite(ms) and ms >= 0:
                fresh[peer] = min(float(ms), MAX_ROUND_TRIP_MS)
        old = self._round_trips.get(reporter, {})
        for peer, ms in fresh.items():
            # jitter is no news: the seams keep their costs and route choice its arrays
            was = old.get(peer)
            if was is not None and abs(ms - was) <= max(0.2, ROUND_TRIP_SLACK * was):
                fresh[peer] = was
        if fresh == old:
            return
        if fresh:
            self._round_trips[reporter] = fresh
        else:
            self._round_trips.pop(reporter, None)
        touched: set[bytes] = set()
        for peer in old.keys() | fresh.keys():
            if peer not in fresh:
                self._unname(reporter, peer)
            elif peer not in old:
                self._named_by.setdefault(peer, set()).add(reporter)
            if old.get(peer) != fresh.get(peer):
                self._relink(reporter, peer, touched)
        self._write_seams(touched)

    def _unname(self, reporter: bytes, peer: bytes) -> None:
        naming = self._named_by.get(peer)
        if naming is not None:
            naming.discard(reporter)
            if not naming:
                del self._named_by[peer]

    def _forget_seams(self, node_id: bytes) -> None:
        """Drop what a node reported and every seam it is an end of (it leaves, or starts afresh)."""
        for peer in self._round_trips.pop(node_id, {}):
            self._unname(node_id, peer)
        touched: set[bytes] = set()
        for after in list(self._seams_from.get(node_id, ())):
            self._unlink(node_id, after, touched)
        for before in list(self._seams_into.get(node_id, ())):
            self._unlink(before, node_id, touched)
        self._write_seams(touched)

    def _relink(self, a: bytes, b: bytes, touched: set[bytes]) -> None:
        """Cost the seam between two nodes again from what both reported (a seam runs one way: layers say which)."""
        self._unlink(a, b, touched)
        self._unlink(b, a, touched)
        first, second = self.nodes.get(a), self.nodes.get(b)
        if first is None or second is None or first.artifact != second.artifact:
            return
        if first.layers[1] == second.layers[0]:
            before, after = a, b
        elif second.layers[1] == first.layers[0]:
            before, after = b, a
        else:
            return  # not neighbours on any route
        reports = [
            r for r in (self._round_trips.get(a, {}).get(b), self._round_trips.get(b, {}).get(a)) if r is not None
        ]
        if reports:
            self._seams_into.setdefault(after, {})[before] = max(reports)
            self._seams_from.setdefault(before, set()).add(after)
            touched.add(after)

    def _unlink(self, before: bytes, after: bytes, touched: set[bytes]) -> None:
        into = self._seams_into.get(after)
        if into is None or before not in into:
            return
        del into[before]
        if not into:
            del self._seams_into[after]
        following = self._seams_from[before]
        following.discard(after)
        if not following:
            del self._seams_from[before]
        touched.add(after)

    def _write_seams(self, nodes: Iterable[bytes]) -> None:
        """Put the measured seams into ``nodes`` where route choice reads them."""
        for node_id in nodes:
            record = self.nodes.get(node_id)
            into = self._seams_into.get(node_id, {})
            # the slowest: a slow seam taken for a fast constant would send routes across it
            kept = dict(sorted(into.items(), key=lambda item: -item[1])[:SEAMS_KEPT])
            if kept:
                self._seams_kept[node_id] = kept
            else:
                self._seams_kept.pop(node_id, None)
            if record is None:
                continue
            columns = self._columns[record.artifact]
            columns.set_seams(columns.rows[node_id], [(columns.rows[b], ms) for b, ms in kept.items()])

    # --- what routes there are

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
        columns = self._columns.get(artifact)
        if columns is None:
            return False
        usable = self._usable(columns, 1, (), None)
        if usable is None:
            return False
        costs = self._costs(columns, None)
        return bool(self._cheapest(columns, usable, None, 0, columns.layer_count(), costs))

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

        The cheapest route with room is found as a shortest path; the route taken is drawn
        at random among those costing at most ``NEAR_EQUAL`` more (see :meth:`_Columns.draw`).
        Affinity is a discount on ``near`` nodes larger than any route's whole cost: the
        count of them on a route comes first, its cost second.
        """
        columns = self._columns.get(artifact)
        usable = self._usable(columns, tokens, exclude, recipe) if columns is not None else None
        if columns is None or usable is None or not usable.any():
            raise NoRoute(f"no node serves artifact {artifact[:16]}… for {tokens} tokens", full=False)
        # counted over every node of the artifact, as /v1/artifacts shows it: not over the
        # candidates left after exclusions and full nodes, where a few could outvote the rest
        n_layer = columns.layer_count()
        rows = columns.layout().rows
        costs = self._costs(columns, self._bonus(columns, usable, near) if near else None)
        room = usable & columns.room[rows]
        found: list[_Cheapest] = []
        if prefer is not None and prefer in columns.recipe_codes:
            alone = room & (columns.recipe[rows] == columns.recipe_codes[prefer])
            found = [c for c in (columns.shortest(alone, costs, start, n_layer),) if c is not None]
        if not found:
            found = self._cheapest(columns, room, recipe, start, n_layer, costs)
        if not found:
            if self._cheapest(columns, usable, recipe, start, n_layer, costs):
                raise NoRoute("every route is at capacity", full=True)
            what = f"layers {start}:{n_layer}" if start else f"{n_layer} layers"
            raise NoRoute(f"the nodes of artifact {artifact[:16]}… do not cover its {what}", full=False)
        cheapest = min(found, key=lambda c: c.cost)
        # within NEAR_EQUAL of the cheapest route's own cost (its discount aside)
        route = self._records(columns, columns.draw(cheapest, costs, cheapest.cost, self._rng))
        budget = cheapest.cost + NEAR_EQUAL * self.route_cost(route)
        # recipes that cannot share a route are searched apart: one of those with a route in the budget
        group = self._rng.choice([c for c in found if c.cost <= budget])
        route = self._records(columns, columns.draw(group, costs, budget, self._rng))
        return RouteChoice(route, self.route_cost(route))

    @staticmethod
    def _records(columns: _Columns, positions: Sequence[int]) -> tuple[NodeRecord, ...]:
        return tuple(columns.record_at(p) for p in positions)

    def _usable(self, columns: _Columns, tokens: int, exclude: Iterable[bytes], recipe: str | None) -> Mask | None:
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

    @staticmethod
    def _bonus(columns: _Columns, usable: Mask, near: Collection[bytes]) -> Costs:
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

    @staticmethod
    def _costs(columns: _Columns, bonus: Costs | None) -> EdgeCosts:
        """By position, what entering each node costs: its step time and the seam into it, less its bonus."""
        rows = columns.layout().rows
        own = columns.step[rows]
        if bonus is not None:
            own = own - bonus
        measured = columns.seam_layout().round_trip + own[:, None]
        return EdgeCosts(own + columns.seam[rows] * columns.unmeasured_scale(), measured)

    def _cheapest(
        self, columns: _Columns, usable: Mask, recipe: str | None, start: int, n_layer: int, costs: EdgeCosts
    ) -> list[_Cheapest]:
        """The cheapest route over ``usable`` positions of each group of recipes that may share a route:
        one recipe, or a certified pair of them ([] when there is none)."""
        recipes = columns.recipe[columns.layout().rows]
        codes = {int(c) for c in np.unique(recipes[usable])}
        if recipe is not None or len(codes) <= 1:
            groups = [usable]
        else:
            names = {code: name for name, code in columns.recipe_codes.items()}
            present = {names[c] for c in codes}
            pairs = [pair for pair in self.mixes.get(columns.artifact, ()) if len(pair) == 2 and pair <= present]
            alone = [r for r in present if not any(r in pair for pair in pairs)]
            groups = [
                usable & np.isin(recipes, [columns.recipe_codes[r] for r in group])
                for group in [*pairs, *(frozenset((r,)) for r in alone)]
            ]
        found = (columns.shortest(allowed, costs, start, n_layer) for allowed in groups)
        return [c for c in found if c is not None]

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
