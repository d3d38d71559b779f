"""Where a joining node should serve: plain synchronous code over the tracker's state, no I/O.

A node started without a layer range tells the tracker how many layers it can hold; the
tracker answers the window of that many layers around the layer with the least serving
capacity. A layer's capacity is the sum of the decode throughput (tokens/s, as
:meth:`NodeRecord.tokens_per_s` measures it) of the nodes that hold it: the registered
nodes that routes use or will use once probed, and the nodes still loading the range the
tracker gave them (their reservations). An uncovered layer has capacity 0, so it comes
first. Among the windows that hold a weakest layer, the one whose own layers are the
thinnest is taken: their capacities, sorted, compared smallest first.

A reservation lasts until its node registers (then its record counts instead, whatever
range it registered with), leaves, asks again, or :data:`RESERVATION_SECONDS` pass: so two
nodes that ask at once are given different gaps, and one that never comes does not hold
its gap for ever.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

import attrs
import numpy as np
import numpy.typing as npt

from noderuntime.tracker.state import NodeRecord, TrackerState, layer_count

RESERVATION_SECONDS = 600.0  # long enough to fetch and load a shard of a large model
MAX_RESERVATIONS = 4096  # reservations kept at once; beyond, the soonest to expire goes first
DEFAULT_TOKENS_PER_S = 100.0  # a joiner's throughput when neither it nor any peer measured one
KEPT = 16  # a window's thinnest layers compared (beyond these, its total decides)
CHUNK = 256  # windows sorted at once: bounds the memory of one answer on a model of many layers
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


def counted(record: NodeRecord) -> bool:
    """Whether a registered node's capacity counts: it serves routes, or will once its probe is answered.

    A node that failed its probe or an audit serves nothing, and its layers are as thin as if it had left.
    """
    return record.probe_passed is not False and not record.audit_failed


def best_window(capacity: Capacities | Iterable[float], size: int) -> tuple[int, int]:
    """The window of ``size`` layers (at most all of them) to serve: ``[start, end)``.

    It holds a weakest layer; among those that do, the one whose thinnest :data:`KEPT`
    layers, sorted, are smallest (compared in order), then the smallest total, then the first.
    """
    values = np.round(np.asarray(capacity, np.float64), DECIMALS)
    n = int(values.size)
    if n == 0 or size <= 0:
        raise ValueError("a window needs layers and a positive size")
    size = min(size, n)
    if size == n:
        return 0, n
    weak = values <= values.min()
    # a start whose window holds a weakest layer: a prefix count of them over each window
    seen = np.concatenate(([0], np.cumsum(weak)))
    starts = np.flatnonzero(seen[size:] - seen[: n - size + 1] > 0)
    windows = np.lib.stride_tricks.sliding_window_view(values, size)
    kept = min(KEPT, size)
    keys = np.empty((starts.size, kept))
    for at in range(0, starts.size, CHUNK):
        rows = windows[starts[at : at + CHUNK]]
        keys[at : at + CHUNK] = np.sort(np.partition(rows, kept - 1, axis=1)[:, :kept], axis=1)
    running = np.concatenate(([0.0], np.cumsum(values)))
    totals = np.round(running[starts + size] - running[starts], DECIMALS)
    # np.lexsort sorts by its last key first
    order = np.lexsort((starts, totals, *keys.T[::-1]))
    start = int(starts[order[0]])
    return start, start + size


class Placement:
    """The reservations of nodes still loading, and the answers to joiners, over ``state``."""

    def __init__(self, state: TrackerState, *, reservation_seconds: float = RESERVATION_SECONDS) -> None:
        self.state = state
        self.reservation_seconds = reservation_seconds
        self.reservations: dict[bytes, Reservation] = {}

    def capacity(self, artifact: str, n_layer: int, now: float, *, exclude: bytes | None = None) -> Capacities:
        """By layer, the tokens/s of the nodes that serve it or are loading it (``exclude`` not counted)."""
        self.expire(now)
        change = np.zeros(n_layer + 1)
        budget = self.state.step_budget_ms
        for record in self.state.nodes_of(artifact):
            if record.node_id != exclude and record.n_layer == n_layer and counted(record):
                _add(change, record.layers, record.tokens_per_s(budget))
        for held in self.reservations.values():
            if held.node_id != exclude and held.artifact == artifact and held.n_layer == n_layer:
                _add(change, held.layers, held.tokens_per_s)
        return np.maximum(np.round(np.cumsum(change[:n_layer]), DECIMALS), 0.0)

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
        """Give ``node_id`` the range it should load, and reserve it; :class:`PlacementError` when the
        request contradicts the swarm.

        ``max_layers``: how many layers it can hold (more than the model has: all of them);
        ``tokens_per_s``: its expected decode throughput, else its peers' median. A node that
        asks again gives up what it held or was given before: its answer is computed without it.
        """
        if n_layer <= 0 or max_layers <= 0:
            raise ValueError("a model has layers, and a node holds at least one")
        present = [r for r in self.state.nodes_of(artifact) if r.node_id != node_id]
        if present and layer_count(present) != n_layer:
            raise PlacementError(
                f"artifact {artifact[:16]}… has {layer_count(present)} layers by its nodes, not {n_layer}"
            )
        self.reservations.pop(node_id, None)
        capacity = self.capacity(artifact, n_layer, now, exclude=node_id)
        start, end = best_window(capacity, max_layers)
        weakest = start + int(capacity[start:end].argmin())
        if tokens_per_s is None or not tokens_per_s > 0:
            budget = self.state.step_budget_ms
            peers = [r.tokens_per_s(budget) for r in present if r.n_layer == n_layer and counted(r)]
            tokens_per_s = statistics.median(peers) if peers else DEFAULT_TOKENS_PER_S
        expires = now + self.reservation_seconds
        if len(self.reservations) >= MAX_RESERVATIONS:
            del self.reservations[min(self.reservations.values(), key=lambda r: r.expires).node_id]
        self.reservations[node_id] = Reservation(node_id, artifact, n_layer, (start, end), tokens_per_s, expires)
        return Assignment((start, end), weakest, float(capacity[weakest]), expires)

    def registered(self, node_id: bytes) -> None:
        """A node registered: its record counts now, in place of its reservation."""
        self.reservations.pop(node_id, None)

    def forget(self, node_id: bytes) -> None:
        """A node left (or never came): its reservation no longer holds its range."""
        self.reservations.pop(node_id, None)

    def expire(self, now: float) -> list[bytes]:
        """Drop the reservations that lapsed; their node ids."""
        gone = [r.node_id for r in self.reservations.values() if r.expires <= now]
        for node_id in gone:
            del self.reservations[node_id]
        return gone


def _add(change: Capacities, layers: tuple[int, int], tokens_per_s: float) -> None:
    start, end = layers
    if 0 <= start < end < change.size:
        change[start] += tokens_per_s
        change[end] -= tokens_per_s


__all__ = [
    "RESERVATION_SECONDS",
    "Assignment",
    "Placement",
    "PlacementError",
    "Reservation",
    "best_window",
    "counted",
]
