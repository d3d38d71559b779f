"""One artifact's nodes as columns, and the shortest path over layer boundaries that route choice runs on them.

A route request at 10,000 nodes cannot walk records: :class:`Columns` keeps, a row per
node, the arrays route choice reads (layers, context, recipe, admission, room, estimated
step time, the seams into it), current as registrations, heartbeats and departures
arrive. :meth:`Columns.shortest` settles the cheapest chain through each node boundary by
boundary, and :meth:`Columns.draw` walks back from the last layer to draw a route within
a budget of that cost (see :mod:`noderuntime.tracker.routechoice`).
"""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from noderuntime.tracker.records import DIRECT_SEAM_MS, NodeRecord

SEAMS_KEPT = 8  # measured seams into one node that routes read: its slowest ones
COST_CEILING_MS = 1e9  # a node's cost is clipped here, so that sums over routes stay finite
LAYERS_CEILING = 1 << 15  # layer numbers route choice takes (int16)
MIN_CAPACITY = 64  # rows an artifact's arrays start with, and never shrink below

Rows = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]
Costs = npt.NDArray[np.float64]


class Columns:
    """One artifact's nodes as columns, a row per node: what route choice reads.

    Kept current as registrations, heartbeats and departures arrive, so that a route
    request reads arrays instead of walking records; a departed node's row is reused.
    """

    def __init__(self, artifact: str, shape: int | None = None) -> None:
        """``shape``: the artifact's layer count where its manifest says it (else its admitted nodes do)."""
        self.artifact = artifact
        self.shape = shape
        self.rows: dict[bytes, int] = {}
        self.records: list[NodeRecord | None] = []
        self.vacant: list[int] = []
        self.layer_counts: collections.Counter[int] = collections.Counter()
        self.recipe_codes: dict[str, int] = {}
        self.size = 0  # rows ever used (present or vacant)
        self._layout: Layout | None = None
        self._seams: SeamLayout | None = None
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
        self._grow(MIN_CAPACITY)

    # each array and what its vacant rows hold
    _FILLS = (
        ("present", False),
        ("admitted", False),
        ("room", False),
        ("start", 0),
        ("end", 0),
        ("n_layer", 0),
        ("ctx", 0),
        ("recipe", 0),
        ("seams_count", 0),
        ("step", 0.0),
        ("seam", 0.0),
        ("seams_from", -1),
        ("seams_ms", 0.0),
    )

    @property
    def capacity(self) -> int:
        """Rows the arrays have room for."""
        return len(self.present)

    def _grow(self, capacity: int, keep: Rows | None = None) -> None:
        """Arrays of ``capacity`` rows holding the rows ``keep`` (all of them: None) first, in order."""
        for name, fill in self._FILLS:
            old = getattr(self, name)
            kept = old if keep is None else old[keep]
            new = np.full((capacity, *old.shape[1:]), fill, old.dtype)
            new[: len(kept)] = kept
            setattr(self, name, new)

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
        # Fewer than a quarter of the rows in use are present: renumbered and shrunk. A flood of
        # throwaway nodes on an artifact honest nodes serve left its arrays, row map and record
        # list at the flood's size after it expired.
        if self.capacity > MIN_CAPACITY and 4 * len(self.rows) < self.size:
            self._compact()

    def _compact(self) -> None:
        """Renumber the present rows 0..n-1 in their order, and shrink the arrays, the row map, the
        record list and the recipe codes to them (with room for as many again).

        Paid for by the three quarters of the rows that went since the last compaction.
        Nothing outside keeps a row number from one call to the next (the registry asks
        :attr:`rows` each time); seams name their previous hop by row, so they are renumbered too.
        """
        used = np.flatnonzero(self.present[: self.size])
        renumbered = np.full(self.size, -1, np.int64)
        renumbered[used] = np.arange(used.size)
        self._grow(max(MIN_CAPACITY, 2 * used.size), keep=used)
        named = self.seams_from[: used.size]
        # a seam from a row no longer present leads nowhere (the registry forgets those first)
        named[:] = np.where(named >= 0, renumbered[np.maximum(named, 0)], -1)
        records = [self.records[row] for row in used.tolist()]
        self.records = records
        self.rows = {record.node_id: row for row, record in enumerate(records) if record is not None}
        self.vacant = []
        self.size = used.size
        # recipe codes strangers named and no present node uses any longer go too
        codes: dict[str, int] = {}
        for row, record in enumerate(records):
            if record is not None:
                self.recipe[row] = codes.setdefault(record.recipe, len(codes))
        self.recipe_codes = codes
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
        """The artifact's layer count: its manifest's, else the one most of the admitted nodes report
        (see :func:`noderuntime.tracker.routechoice.layer_count`)."""
        if self.shape is not None:
            return self.shape
        votes = np.bincount(self.n_layer[: self.size][self.admitted[: self.size]])
        if votes.size and votes.max() > 0:
            return int(votes.argmax())
        return self.layer_counts.most_common(1)[0][0]

    def layout(self) -> Layout:
        """The present rows in order of their first layer: rebuilt when nodes come, go or change layers."""
        if self._layout is None:
            used = np.flatnonzero(self.present[: self.size])
            rows = used[np.argsort(self.start[used], kind="stable")]
            position = np.full(self.size, -1, np.int64)
            position[rows] = np.arange(rows.size)
            end = self.end[rows]
            by_end = np.argsort(end, kind="stable")
            self._layout = Layout(rows, position, self.start[rows], end, by_end, end[by_end])
        return self._layout

    def seam_layout(self) -> SeamLayout:
        """The measured seams into each position: rebuilt when seams or the layout change."""
        if self._seams is None:
            layout = self.layout()
            named = self.seams_from[layout.rows]
            sources = np.where(named >= 0, layout.position[np.maximum(named, 0)], -1)
            # live: its previous hop ends where this node starts (one that registered again with
            # other layers leaves seams that lead nowhere until they are measured again)
            live = (sources >= 0) & (layout.end[np.maximum(sources, 0)] == layout.start[:, None])
            self._seams = SeamLayout(
                np.where(live, sources, 0),
                np.where(live, sources, -1),
                np.where(live, self.seams_ms[layout.rows], np.inf),
                np.concatenate(([0], np.cumsum(live.any(axis=1)))),
            )
        return self._seams

    def shortest(self, usable: Mask, costs: EdgeCosts, start: int, n_layer: int) -> Cheapest | None:
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
        return None if cost == np.inf else Cheapest(cost, best, end_at, start, n_layer)

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

    def draw(self, found: Cheapest, costs: EdgeCosts, budget: float, rng: random.Random) -> list[int]:
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
class Cheapest:
    """A shortest path's outcome: the cheapest route's cost, and what a draw of routes reads."""

    cost: float
    best: Costs  # by position: the cheapest chain from `start` through it (inf: none)
    end_at: npt.NDArray[np.int64]  # by boundary: where the positions ending there begin in `by_end`
    start: int
    n_layer: int


@attrs.frozen
class Layout:
    """The present rows in order of their first layer (a node's position), and the positions by end."""

    rows: Rows  # position -> row
    position: Rows  # row -> position (-1: vacant)
    start: npt.NDArray[np.int16]  # by position, ascending
    end: npt.NDArray[np.int16]  # by position
    by_end: Rows  # positions in order of their end
    end_sorted: npt.NDArray[np.int16]


@attrs.frozen
class SeamLayout:
    """The measured seams into each position (``SEAMS_KEPT`` columns): previous hop and round trip."""

    sources: Rows  # previous hop's position; 0 where none (its round trip is inf there)
    named: Rows  # the same, -1 where none
    round_trip: npt.NDArray[np.float64]
    counted: Rows  # by position p: how many positions before p have a live measured seam (p + 1 entries)


@attrs.frozen
class EdgeCosts:
    """What entering each node costs on one request, with its discount.

    By position (see :meth:`Columns.layout`). ``plain``: from the client, or from a
    previous hop that measured no seam into it; ``measured`` (positions x ``SEAMS_KEPT``):
    from the previous hops of :meth:`Columns.seam_layout` (inf where there is none).
    """

    plain: Costs
    measured: npt.NDArray[np.float64]
