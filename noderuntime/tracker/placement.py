"""Where a joining node should serve: plain synchronous code over the tracker's state, no I/O.

A node started without a layer range tells the tracker how many layers it can hold; the
tracker answers a window of at most that many layers where it adds the most serving
capacity. A layer's capacity is the sum of the decode throughput (tokens/s, as
:meth:`NodeRecord.tokens_per_s` measures it) of the nodes that hold it on a complete
route: a route's hops meet exactly at their boundaries, so a node whose range no chain
reaches from the first layer, or that leads to none reaching the last, serves nothing
however thin its layers are. Counted are the registered nodes that routes use (admitted:
a node whose probe is still owed counts for nothing), and the nodes still loading the
range the tracker gave them (their reservations).

The window taken (:func:`choose`) starts where a chain from layer 0 ends and ends where
other pieces start (or at the model's end, or as far as the node reaches): first a window
that completes a route, then the one that raises the least capacity most (the window
around the weakest layer; uncovered layers, at 0, come first) and leaves the fewest layers
at it, then progress towards a route for pieces that no route holds yet (a bridge over a
stretch too long for one node, which the next joiners finish), then the longest.

A reservation lasts until its node registers (then its record counts instead, whatever
range it registered with), leaves, asks again, or :data:`RESERVATION_SECONDS` pass: so two
nodes that ask at once are given different gaps, and one that never comes does not hold
its gap for ever.

Rebalancing (:meth:`Placement.reconsider`): a serving node that was placed asks now and
then whether it should move. It moves only when the least capacity of the routes grows by
more than :data:`MOVE_MARGIN` with it moved, never where a layer would be left uncovered,
and a node that was told to move is not told again for :data:`HOLD_DOWN_SECONDS`: measured
step times drift, and a swarm whose nodes chased every drift would flap.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from noderuntime.operations.memory import compacted
from noderuntime.tracker.records import NodeRecord
from noderuntime.tracker.registry import TrackerState

RESERVATION_SECONDS = 600.0  # long enough to fetch and load a shard of a large model
MAX_RESERVATIONS = 4096  # reservations kept at once; beyond, the soonest to expire goes first
# a serving node moves only when the swarm's least capacity grows by more than this factor
# (and by 1/MOVE_MARGIN at once: each move raises it that much, so moves cannot cycle)
MOVE_MARGIN = 1 / 0.75
# after a move, the node is not moved again this long: it has its new range's weights to
# fetch and load, and its step times need a while to be measured on the new range
HOLD_DOWN_SECONDS = 600.0
DEFAULT_TOKENS_PER_S = 100.0  # a joiner's throughput when neither it nor any peer measured one
# windows weighed for one answer (the nearest the weakest layer, where there are more): each costs
# work in proportion to the distinct ranges served, so this bounds an answer in a swarm of many
MAX_CANDIDATES = 512
CHUNK = 256  # windows weighed at once: bounds the memory of one answer on a model of many layers
DECIMALS = 6  # capacities are rounded here: sums of floats must see an uncovered layer as exactly 0

Capacities = npt.NDArray[np.float64]


class PlacementError(ValueError):
    """The request contradicts what the tracker knows (another layer count for the artifact)."""


@attrs.frozen
class Reservation:
    """A range given to a node that is still loading it, counted as if it served it already."""

    node_id: bytes
    artifact: str
    n_layer: int
    layers: tuple[int, int]
    tokens_per_s: float
    expires: float


@attrs.frozen
class Assignment:
    """The tracker's answer to a joiner: its range, the layer it was placed around, and that layer's capacity."""

    layers: tuple[int, int]
    weakest: int
    weakest_capacity: float  # tokens/s before this node: 0 for a layer nobody served
    expires: float  # when the reservation lapses unless the node registers first


@attrs.frozen
class Move:
    """A serving node's better range, and the least capacity of the routes before and after it moves."""

    layers: tuple[int, int]
    least_before: float
    least_after: float


def counted(record: NodeRecord) -> bool:
    """Whether a registered node's capacity counts: it is admitted to routes.

    A node that failed its probe or an audit serves nothing, and its layers are as thin as if it had left.
    Nor does one whose probe is still owed: a registrant has measured nothing the tracker checked, and
    sybils that never answer their probes must not make a range look served (its reservation counted
    while it loaded; its record counts once it is admitted).
    """
    return record.admitted


@attrs.frozen
class Piece:
    """A layer range that a node serves or is loading, and the decode throughput it gives it."""

    start: int
    end: int
    tokens_per_s: float


@attrs.frozen
class Choice:
    """Where a joiner should serve, and the layer of that window that routes served least before it."""

    layers: tuple[int, int]
    weakest: int
    weakest_capacity: float


def _merged(pieces: Sequence[Piece], n_layer: int) -> list[Piece]:
    """``pieces`` within ``[0, n_layer)``, those of one range as one: what the search weighs grows with the
    distinct ranges, not with the nodes."""
    speeds: dict[tuple[int, int], float] = {}
    for p in pieces:
        if 0 <= p.start < p.end <= n_layer:
            speeds[p.start, p.end] = speeds.get((p.start, p.end), 0.0) + p.tokens_per_s
    return [Piece(start, end, speed) for (start, end), speed in speeds.items()]


def _closure(pieces: Sequence[Piece], n_layer: int) -> npt.NDArray[np.bool_]:
    """``reach[a, b]``: a chain of ``pieces`` runs from boundary ``a`` to boundary ``b`` (``a`` to itself too)."""
    reach = np.eye(n_layer + 1, dtype=np.bool_)
    ends_from: dict[int, set[int]] = {}
    for piece in pieces:
        ends_from.setdefault(piece.start, set()).add(piece.end)
    # every piece runs forward: a boundary's row is final once the rows after it are
    for boundary in sorted(ends_from, reverse=True):
        for end in ends_from[boundary]:
            reach[boundary] |= reach[end]
    return reach


def _capacity(pieces: Sequence[Piece], on_route: npt.NDArray[np.bool_], n_layer: int) -> Capacities:
    change = np.zeros(n_layer + 1)
    for piece, counts in zip(pieces, on_route, strict=True):
        if counts:
            change[piece.start] += piece.tokens_per_s
            change[piece.end] -= piece.tokens_per_s
    return np.maximum(np.round(np.cumsum(change[:n_layer]), DECIMALS), 0.0)


def route_capacity(pieces: Sequence[Piece], n_layer: int) -> Capacities:
    """By layer, the tokens/s of the pieces that lie on a complete route (a chain from 0 to ``n_layer``).

    A route's hops meet at their boundaries: a piece that no chain reaches from the first
    layer, or that leads to none reaching the last, serves no route, whatever it holds.
    """
    pieces = _merged(pieces, n_layer)
    reach = _closure(pieces, n_layer)
    on_route = np.array([reach[0, p.start] and reach[p.end, n_layer] for p in pieces], np.bool_)
    return _capacity(pieces, on_route, n_layer)


def _least(capacity: npt.NDArray[np.float64]) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """By row: the least capacity, and how many layers have it."""
    least = capacity.min(axis=1)
    return least, (capacity <= least[:, None]).sum(axis=1)


def choose(pieces: Sequence[Piece], n_layer: int, size: int, tokens_per_s: float) -> Choice:
    """The range a node of ``size`` layers and ``tokens_per_s`` should take among ``pieces``.

    Every window that starts where a chain from layer 0 ends (it can be a route's next hop)
    and ends at a boundary within ``size`` layers (where other pieces start, or the end of
    the model), or ``size`` layers on, is tried; the one taken leaves, in order:
    the largest least capacity over the layers of complete routes (so a window around the
    weakest layer, uncovered ones first, and one that completes a first route above all),
    the fewest layers at that least capacity, then the same two over the pieces that a
    chain from layer 0 reaches (progress towards a route, or a bridge others will finish),
    then the longest window, then the first.
    """
    if n_layer <= 0 or size <= 0:
        raise ValueError("a model has layers, and a node holds at least one")
    pieces = _merged(pieces, n_layer)
    size = min(size, n_layer)
    reach = _closure(pieces, n_layer)
    to_end = reach[:, n_layer]
    before = route_capacity(pieces, n_layer)
    boundaries = sorted({0, n_layer, *(p.start for p in pieces), *(p.end for p in pieces)})
    candidates: set[tuple[int, int]] = set()
    for start in np.flatnonzero(reach[0, :n_layer]).tolist():
        furthest = min(start + size, n_layer)
        candidates.add((start, furthest))
        inside = boundaries[bisect.bisect_right(boundaries, start) : bisect.bisect_left(boundaries, furthest)]
        candidates.update((start, b) for b in inside)
    ranked = _nearest(sorted(candidates), before)
    starts = np.array([p.start for p in pieces], np.int64)
    ends = np.array([p.end for p in pieces], np.int64)
    speeds = np.array([p.tokens_per_s for p in pieces])
    keys = []
    for at in range(0, len(ranked), CHUNK):
        chunk = np.array(ranked[at : at + CHUNK], np.int64).reshape(-1, 2)
        s, e = chunk[:, 0], chunk[:, 1]
        # with the window s -> e: what a chain from 0 reaches, and which boundaries lead to the end
        reached = reach[0][None, :] | reach[e]
        leads = to_end[None, :] | (reach[:, s].T & to_end[e][:, None])
        on_route = reached[:, starts] & leads[:, ends] if pieces else np.zeros((len(chunk), 0), np.bool_)
        usable = reached[:, starts] if pieces else on_route
        layer = np.arange(n_layer)
        window = (layer[None, :] >= s[:, None]) & (layer[None, :] < e[:, None])
        # the window counts on routes only where it leads to the end
        own = np.where(to_end[e], tokens_per_s, 0.0)
        route = _sum(on_route, starts, ends, speeds, n_layer) + np.where(window, own[:, None], 0.0)
        prefix = _sum(usable, starts, ends, speeds, n_layer) + np.where(window, tokens_per_s, 0.0)
        route_least, route_count = _least(np.round(route, DECIMALS))
        prefix_least, prefix_count = _least(np.round(prefix, DECIMALS))
        keys.append(np.stack([route_least, -route_count, prefix_least, -prefix_count, e - s, -s], axis=1))
    table = np.concatenate(keys)
    # np.lexsort sorts ascending by its last key first: the best window comes last
    best = int(np.lexsort(table.T[::-1])[-1])
    start, end = ranked[best]
    weakest = start + int(before[start:end].argmin())
    return Choice((start, end), weakest, float(before[weakest]))


def _nearest(windows: list[tuple[int, int]], capacity: Capacities) -> list[tuple[int, int]]:
    """At most :data:`MAX_CANDIDATES` of ``windows``, those nearest a weakest layer of ``capacity`` (a swarm of
    many distinct ranges has many windows: weighing them all would cost every answer dearly)."""
    if len(windows) <= MAX_CANDIDATES:
        return windows
    weak = np.flatnonzero(capacity <= capacity.min())
    spans = np.array(windows, np.int64)
    start, end = spans[:, 0], spans[:, 1]
    below = np.searchsorted(weak, start)  # the weak layers before each window's start
    inside = np.searchsorted(weak, end) > below
    far = 1 << 30
    gap_below = np.where(below > 0, start - weak[np.maximum(below - 1, 0)], far)
    after = np.searchsorted(weak, end)
    gap_above = np.where(after < weak.size, weak[np.minimum(after, weak.size - 1)] - end + 1, far)
    distance = np.where(inside, 0, np.minimum(gap_below, gap_above))
    keep = np.lexsort((end, start, distance))[:MAX_CANDIDATES]
    return [windows[k] for k in keep.tolist()]


def _sum(
    counted: npt.NDArray[np.bool_],
    starts: npt.NDArray[np.int64],
    ends: npt.NDArray[np.int64],
    speeds: Capacities,
    n_layer: int,
) -> npt.NDArray[np.float64]:
    """By row of ``counted`` (which pieces count), the capacity of each layer.

    What the pieces add where they start and take where they end, summed per boundary
    (``reduceat`` over the pieces in order), then run over the layers. A layer no piece
    covers is exactly 0 (counted apart, in integers: a float running sum need not return to 0).
    """

    def run(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
        change = np.zeros((values.shape[0], n_layer + 1), values.dtype)
        for points, sign in ((starts, 1), (ends, -1)):
            order = np.argsort(points, kind="stable")
            at, first = np.unique(points[order], return_index=True)
            if at.size:
                change[:, at] += sign * np.add.reduceat(values[:, order], first, axis=1)
        return np.cumsum(change[:, :n_layer], axis=1)

    covering = run(counted.astype(np.int64))
    return np.where(covering > 0, run(counted * speeds[None, :]), 0.0)


class Placement:
    """The reservations of nodes still loading, and the answers to joiners, over ``state``."""

    def __init__(
        self,
        state: TrackerState,
        *,
        reservation_seconds: float = RESERVATION_SECONDS,
        hold_down_seconds: float = HOLD_DOWN_SECONDS,
    ) -> None:
        """``hold_down_seconds``: how long a node told to move is not told again (see :meth:`reconsider`)."""
        self.state = state
        self.reservation_seconds = reservation_seconds
        self.hold_down_seconds = hold_down_seconds
        self.reservations: dict[bytes, Reservation] = {}
        self.moved: dict[bytes, float] = {}  # node id -> when it was last told to move

    def pieces(self, artifact: str, n_layer: int, now: float, *, exclude: bytes | None = None) -> list[Piece]:
        """What the nodes of ``artifact`` serve or are loading (``exclude`` not counted)."""
        self.expire(now)
        budget = self.state.step_budget_ms
        served = [
            Piece(*r.layers, r.tokens_per_s(budget))
            for r in self.state.nodes_of(artifact)
            if r.node_id != exclude and r.n_layer == n_layer and counted(r)
        ]
        loading = [
            Piece(*held.layers, held.tokens_per_s)
            for held in self.reservations.values()
            if held.node_id != exclude and held.artifact == artifact and held.n_layer == n_layer
        ]
        return served + loading

    def capacity(self, artifact: str, n_layer: int, now: float, *, exclude: bytes | None = None) -> Capacities:
        """By layer, the tokens/s of the routes its nodes (and those loading) form (see :func:`route_capacity`)."""
        return route_capacity(self.pieces(artifact, n_layer, now, exclude=exclude), n_layer)

    def assign(
        self,
        node_id: bytes,
        artifact: str,
        n_layer: int,
        max_layers: int,
        now: float,
        *,
        tokens_per_s: float | None = None,
    ) -> Assignment:
        """Give ``node_id`` the range it should load (see :func:`choose`), and reserve it;
        :class:`PlacementError` when the request contradicts the swarm.

        ``max_layers``: how many layers it can hold (more than the model has: all of them);
        ``tokens_per_s``: its expected decode throughput, at most its peers' median. A node that
        asks again gives up what it held or was given before: its answer is computed without it.
        """
        if n_layer <= 0 or max_layers <= 0:
            raise ValueError("a model has layers, and a node holds at least one")
        present = [r for r in self.state.nodes_of(artifact) if r.node_id != node_id]
        shape = self.state.shape(artifact)
        if shape is not None and shape != n_layer:
            raise PlacementError(f"artifact {artifact[:16]}… has {shape} layers, not {n_layer}")
        self.reservations.pop(node_id, None)
        budget = self.state.step_budget_ms
        peers = [r.tokens_per_s(budget) for r in present if r.n_layer == n_layer and counted(r)]
        typical = statistics.median(peers) if peers else DEFAULT_TOKENS_PER_S
        # a node that has not loaded has measured nothing: its claim may lower what its
        # reservation weighs, never raise it past its peers' (once registered, its record counts)
        tokens_per_s = typical if tokens_per_s is None or not tokens_per_s > 0 else min(tokens_per_s, typical)
        choice = choose(self.pieces(artifact, n_layer, now, exclude=node_id), n_layer, max_layers, tokens_per_s)
        expires = now + self.reservation_seconds
        if len(self.reservations) >= MAX_RESERVATIONS:
            del self.reservations[min(self.reservations.values(), key=lambda r: r.expires).node_id]
        self.reservations[node_id] = Reservation(node_id, artifact, n_layer, choice.layers, tokens_per_s, expires)
        return Assignment(choice.layers, choice.weakest, choice.weakest_capacity, expires)

    def reconsider(self, node_id: bytes, max_layers: int, now: float, *, margin: float = MOVE_MARGIN) -> Move | None:
        """Whether a serving node should move, and where: None when it should stay.

        It moves only where the least capacity of the routes (:func:`route_capacity`) grows
        by more than ``margin`` times, counted with it moved: where it leaves, the others
        still serve what they did, so a move that uncovered a layer would leave the least
        at 0 and is never taken. Its throughput on the new range is its measured one scaled
        by the layers (a step's time grows with the layers a node runs). The node loads the
        new range before it leaves the old one: its reservation counts the new range meanwhile.
        A node told to move is not told again for :attr:`hold_down_seconds` (whatever it did).
        """
        record = self.state.nodes.get(node_id)
        if record is None or not counted(record) or max_layers <= 0:
            return None
        if now - self.moved.get(node_id, -math.inf) < self.hold_down_seconds:
            return None
        n_layer = record.n_layer
        served = record.tokens_per_s(self.state.step_budget_ms)
        others = self.pieces(record.artifact, n_layer, now, exclude=node_id)
        before = float(route_capacity([*others, Piece(*record.layers, served)], n_layer).min())
        held = record.layers[1] - record.layers[0]
        choice = choose(others, n_layer, max_layers, served)
        start, end = choice.layers
        if (start, end) == record.layers:
            return None
        speed = served * held / (end - start)
        after = float(route_capacity([*others, Piece(start, end, speed)], n_layer).min())
        if not (after > margin * before if before > 0 else after > 0):
            return None
        reservation = Reservation(
            node_id, record.artifact, n_layer, (start, end), speed, now + self.reservation_seconds
        )
        self.reservations[node_id] = reservation
        # one entry per registered node at most, dropped when its hold-down ends (expire)
        self.moved[node_id] = now
        return Move((start, end), before, after)

    def held_down(self, node_id: bytes, now: float) -> float:
        """Seconds until ``node_id`` may be told to move again (0: it may now)."""
        return max(0.0, self.moved.get(node_id, -math.inf) + self.hold_down_seconds - now)

    def registered(self, node_id: bytes) -> None:
        """A node registered: its record counts now, in place of its reservation."""
        self.reservations.pop(node_id, None)

    def forget(self, node_id: bytes) -> None:
        """A node left (or never came): its reservation no longer holds its range."""
        self.reservations.pop(node_id, None)

    def expire(self, now: float) -> list[bytes]:
        """Drop the reservations that lapsed, and the hold-downs that ended; the reservations' node ids."""
        gone = [r.node_id for r in self.reservations.values() if r.expires <= now]
        for node_id in gone:
            del self.reservations[node_id]
        for node_id in [n for n, at in self.moved.items() if at + self.hold_down_seconds <= now]:
            del self.moved[node_id]
        self.reservations = compacted(self.reservations)
        self.moved = compacted(self.moved)
        return gone


__all__ = [
    "HOLD_DOWN_SECONDS",
    "MOVE_MARGIN",
    "RESERVATION_SECONDS",
    "Assignment",
    "Choice",
    "Move",
    "Piece",
    "Placement",
    "PlacementError",
    "Reservation",
    "choose",
    "counted",
    "route_capacity",
]
