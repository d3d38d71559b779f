"""The tracker at swarm scale: route choice, and its HTTP API under thousands of nodes.

    python -m benchmarks.tracker_scale [--quick] [--out PATH] [--baseline-commit REV]

Simulated nodes of one 80-layer model serve random windows of 4-20 layers (random cuts
of the model, so that even 100 nodes cover it), each with a measured capability (a
random speed per layer), some sessions running, one in ten reachable only through a
relay. Two kinds of figures:

Route choice, on the tracker's own state (no I/O), at 100, 1,000 and 10,000 nodes
(``--quick``: 100 and 1,000): how long a choice takes (p50, p99) and how the chosen
route's cost compares with the cheapest route that exists, computed exactly by a
dynamic program written here apart from the tracker's (``cheapest_cost``), for the
shortest path the tracker runs now and for the enumeration it replaced (the baseline:
``baseline_choose``, today's code before the change, kept here as it was). Twice: with
the constant seam costs both know, and with measured seams, where each node reports the
round trips to up to 8 of its next hops, nodes in three regions (5 ms within one, 90-160
ms between them); the baseline knows no measured seam and is judged by them all the same.
Also: how many distinct routes a run of choices took (the spread), a choice with
affinity (8 ``near`` nodes), and a heartbeat's cost in the state.

The HTTP API, through the real tracker app in its own process on one core (the load on
the other): N simulated nodes (1,000 and 10,000; ``--quick``: 1,000) register with real
signed requests (an Ed25519 key each), then heartbeat at the interval the tracker gives
them (in its answer to each registration and heartbeat, as real nodes do: it grows with
the swarm, ``TrackerState.heartbeat_seconds``), signed and checked, with their round
trips, while route requests arrive at 100/s. Latency of each (p50, p99; from the moment it was due,
so a tracker that falls behind shows it), what was served of what was offered, the
tracker's CPU share (its process, over the window) and memory. The baseline lane runs
the tracker of ``--baseline-commit`` (from git history) under the same load.
"""

from __future__ import annotations

import argparse
import collections
import functools
import heapq
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import psutil
import trio

from benchmarks import _common
from noderuntime.access.identity import Identity
from noderuntime.access.signing import sign
from noderuntime.control.admission import Capability, capability_record
from noderuntime.tracker.columns import COST_CEILING_MS
from noderuntime.tracker.records import DIRECT_SEAM_MS, HEARTBEAT_SECONDS, RELAY_SEAM_MS, NodeRecord
from noderuntime.tracker.registry import TrackerState
from noderuntime.tracker.routechoice import NEAR_EQUAL, NoRoute, RouteChoice, layer_count

NAME = "tracker_scale"
N_LAYER = 80
WINDOWS = (4, 20)
ARTIFACT = "ab" * 32
RECIPE = "0123456789abcdef"
SLOTS = 8
TOKENS = 256
PEERS_REPORTED = 8  # round trips each node reports (its next hops)
REGION_MS = ((5.0, 90.0, 160.0), (90.0, 5.0, 120.0), (160.0, 120.0, 5.0))
ROUTES_PER_S = 100.0
EXPIRE_AFTER = 10.0  # the tracker's default: a node silent this long is dropped
HEARTBEAT_CONNECTIONS = 256  # each node has its own; a tracker that answers slowly must not wait on the client
SETTLE_SECONDS = 15.0
BASELINE_COMMIT = "3c83203"  # the tracker before route choice became a shortest path
ROOT = Path(__file__).resolve().parents[1]


# --- the simulated swarm


@attrs.frozen
class SimNode:
    """One simulated node: its layers, what it measured, how it is reached, where it is."""

    layers: tuple[int, int]
    capability: Capability
    relay: bool
    region: int
    active: int  # sessions it runs (its heartbeats say so)


def swarm(count: int, seed: int) -> list[SimNode]:
    """``count`` nodes serving random windows of the model, each at its own speed.

    The windows are drawn as random cuts of the model's layers into pieces of 4-20 (each cut
    a route by itself), so that a small swarm covers the model too; a large one holds
    routes by the million, cuts crossing where their boundaries meet.
    """
    rng = random.Random(seed)
    nodes: list[SimNode] = []
    while len(nodes) < count:
        at = 0
        while at < N_LAYER and len(nodes) < count:
            left = N_LAYER - at
            width = rng.choice([w for w in range(WINDOWS[0], WINDOWS[1] + 1) if w == left or left - w >= WINDOWS[0]])
            one = width * rng.lognormvariate(0.0, 0.5)  # ms per decode step at one session: ~1 ms a layer
            capability = Capability(2.0, ((1, round(one, 3)), (8, round(one * 1.8, 3))), 1 << 30, 1 << 28, 1 << 26, 4)
            relay = rng.random() < 0.1
            nodes.append(SimNode((at, at + width), capability, relay, rng.randrange(3), rng.randint(0, 5)))
            at += width
    return nodes


def round_trips(nodes: Sequence[SimNode], seed: int) -> list[dict[int, float]]:
    """What each node reports: round trips to up to ``PEERS_REPORTED`` of its next hops (by index)."""
    rng = random.Random(seed)
    by_start: dict[int, list[int]] = collections.defaultdict(list)
    for i, node in enumerate(nodes):
        by_start[node.layers[0]].append(i)
    out = []
    for node in nodes:
        after = by_start.get(node.layers[1], [])
        peers = rng.sample(after, min(PEERS_REPORTED, len(after)))
        out.append({p: round(REGION_MS[node.region][nodes[p].region] * rng.uniform(0.8, 1.2), 2) for p in peers})
    return out


def node_id(i: int) -> bytes:
    """The simulated node id of the ``i``-th node (route choice alone needs no keys)."""
    return i.to_bytes(32, "big")


def record(i: int, node: SimNode) -> NodeRecord:
    """The registration of the ``i``-th node."""
    return NodeRecord(
        node_id=node_id(i),
        artifact=ARTIFACT,
        n_layer=N_LAYER,
        layers=node.layers,
        recipe=RECIPE,
        address="" if node.relay else f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:7000",
        relay="wss://relay.example:443/" if node.relay else "",
        tls_cert_sha256=b"",
        slots=SLOTS,
        ctx_per_session=4096,
        model_name="sim-80",
        measured=node.capability,
    )


def tracker_state(nodes: Sequence[SimNode], seams: Sequence[dict[int, float]] | None, seed: int) -> TrackerState:
    """A tracker's state holding ``nodes``, their load, and (when given) their round trips."""
    state = TrackerState(rng=random.Random(seed))
    for i, node in enumerate(nodes):
        state.register(record(i, node), 0.0)
    _beat_all(state, nodes, seams, 0.0)
    return state


def _beat_all(
    state: TrackerState, nodes: Sequence[SimNode], seams: Sequence[dict[int, float]] | None, now: float
) -> None:
    """Every node's heartbeat into the state: its load, and (when given) its round trips."""
    for i, node in enumerate(nodes):
        state.heartbeat(
            node_id(i),
            now,
            active_sessions=node.active,
            free_slots=SLOTS - node.active,
            queue_depth=0,
            step_ms=node.capability.step_ms(max(1, node.active)),
            round_trips=None if seams is None else {node_id(p): ms for p, ms in seams[i].items()},
        )


# --- the oracle: the cheapest route that exists, exactly


def cheapest_cost(state: TrackerState, artifact: str) -> float:
    """The cost of the cheapest route with room, by a plain dynamic program over every pair of neighbours.

    Written apart from the tracker's search: it walks the nodes in order of their first layer
    and costs each pair of consecutive hops with the state's own cost model (``seam_ms``,
    ``estimated_step_ms``), so it checks the search, not the model.
    """
    nodes = [
        n
        for n in state.nodes.values()
        if n.artifact == artifact and n.admitted and n.has_room(state.step_budget_ms) and n.free_slots > 0
    ]
    n_layer = layer_count(state.nodes_of(artifact))
    ending: dict[int, list[tuple[float, NodeRecord]]] = collections.defaultdict(list)
    for node in sorted((n for n in nodes if n.n_layer == n_layer), key=lambda n: n.layers[0]):
        start, end = node.layers
        if not 0 <= start < end <= n_layer:
            continue
        own = min(node.estimated_step_ms(), COST_CEILING_MS)
        if start == 0:
            cost = own + state.seam_ms(None, node)
        else:
            cost = min((c + state.seam_ms(p, node) for c, p in ending.get(start, ())), default=math.inf) + own
        if cost < math.inf:
            ending[end].append((cost, node))
    return min((c for c, _ in ending.get(n_layer, ())), default=math.inf)


# --- the baseline: route choice as it was (an enumeration of routes, capped)

BASELINE_MAX_ROUTES = 2000


def baseline_choose(
    state: TrackerState,
    artifact: str,
    tokens: int,
    *,
    exclude: Iterable[bytes] = (),
    start: int = 0,
    recipe: str | None = None,
    prefer: str | None = None,
    near: Collection[bytes] = (),
) -> RouteChoice:
    """``TrackerState.choose`` before the shortest path (commit ``BASELINE_COMMIT``), unchanged but for names."""
    excluded = set(exclude)
    candidates = [
        r
        for r in state.nodes.values()
        if r.artifact == artifact and r.node_id not in excluded and r.ctx_per_session >= tokens and r.admitted
    ]
    if recipe is not None:
        candidates = [c for c in candidates if c.recipe == recipe]
    if not candidates:
        raise NoRoute(f"no node serves artifact {artifact[:16]}… for {tokens} tokens", full=False)
    n_layer = layer_count([r for r in state.nodes.values() if r.artifact == artifact])
    routes = _baseline_routes(
        [c for c in candidates if c.n_layer == n_layer], n_layer, state.mixes.get(artifact, ()), start=start
    )
    if not routes:
        raise NoRoute(f"the nodes of artifact {artifact[:16]}… do not cover its layers", full=False)
    free = [r for r in routes if all(node.has_room(state.step_budget_ms) for node in r)]
    if not free:
        raise NoRoute("every route is at capacity", full=True)
    if prefer is not None:
        free = [r for r in free if {node.recipe for node in r} == {prefer}] or free
    if near:
        wanted = set(near)
        overlap = [sum(node.node_id in wanted for node in r) for r in free]
        if max(overlap) > 0:
            free = [r for r, o in zip(free, overlap, strict=True) if o == max(overlap)]
    costed = sorted(((_baseline_cost(r), r) for r in free), key=lambda pair: pair[0])
    best = costed[0][0]
    equals = [pair for pair in costed if pair[0] <= best * (1.0 + NEAR_EQUAL)]
    cost, route = state._rng.choice(equals)
    return RouteChoice(tuple(route), cost)


def _baseline_cost(route: Sequence[NodeRecord]) -> float:
    return sum(node.estimated_step_ms() + (DIRECT_SEAM_MS if node.address else RELAY_SEAM_MS) for node in route)


def _baseline_routes(
    nodes: Sequence[NodeRecord], n_layer: int, mixes: Collection[frozenset[str]] = (), *, start: int = 0
) -> list[list[NodeRecord]]:
    by_start: dict[int, list[NodeRecord]] = {}
    for node in nodes:
        if 0 <= node.layers[0] < node.layers[1] <= n_layer:
            by_start.setdefault(node.layers[0], []).append(node)
    recipes = {n.recipe for n in nodes}
    groups = [frozenset((r,)) for r in sorted(recipes)]
    groups += sorted({pair for pair in mixes if len(pair) == 2 and pair <= recipes}, key=sorted)
    routes: list[list[NodeRecord]] = []
    for group in groups:
        viable: set[int] = set()
        for boundary in sorted(by_start, reverse=True):
            if any(n.recipe in group and (n.layers[1] == n_layer or n.layers[1] in viable) for n in by_start[boundary]):
                viable.add(boundary)
        visits = 0

        def extend(path: list[NodeRecord], at: int, group: frozenset[str] = group, viable: set[int] = viable) -> None:
            nonlocal visits
            if len(routes) >= BASELINE_MAX_ROUTES or visits >= 2 * BASELINE_MAX_ROUTES:
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
    return routes


# --- route choice, timed


def _summary(ms: Sequence[float]) -> dict[str, float]:
    return {"p50_ms": _common.percentile(ms, 50), "p99_ms": _common.percentile(ms, 99), "count": len(ms)}


def _choices(
    state: TrackerState, choose: Callable[..., RouteChoice], count: int, optimum: float, **options: Any
) -> dict[str, Any]:
    """``count`` choices: their times, the chosen routes' costs over ``optimum``, and the spread."""
    times, ratios, routes = [], [], collections.Counter[tuple[bytes, ...]]()
    for _ in range(count):
        began = time.perf_counter()
        choice = choose(state, ARTIFACT, TOKENS, **{k: v() if callable(v) else v for k, v in options.items()})
        times.append((time.perf_counter() - began) * 1e3)
        ratios.append(state.route_cost(choice.nodes) / optimum)
        routes[tuple(n.node_id for n in choice.nodes)] += 1
    return {
        **_summary(times),
        "cost_over_cheapest": {
            "p50": _common.percentile(ratios, 50),
            "mean": sum(ratios) / len(ratios),
            "max": max(ratios),
        },
        "distinct_routes": len(routes),
        "most_taken_share": routes.most_common(1)[0][1] / count,
    }


def _heartbeat_us(state: TrackerState, nodes: Sequence[SimNode], seams: Sequence[dict[int, float]] | None) -> float:
    """Microseconds per heartbeat into the state (steady: the same load and round trips again)."""
    began = time.perf_counter()
    _beat_all(state, nodes, seams, 1.0)
    return (time.perf_counter() - began) / len(nodes) * 1e6


def route_choice(sizes: Sequence[int], quick: bool) -> dict[str, Any]:
    """Route choice at each swarm size, shortest path and baseline, constant and measured seams."""
    out: dict[str, Any] = {}
    for size in sizes:
        nodes = swarm(size, seed=size)
        seams = round_trips(nodes, seed=size + 1)
        lanes: dict[str, Any] = {}
        for seam_kind, reported in (("constant_seams", None), ("measured_seams", seams)):
            state = tracker_state(nodes, reported, seed=7)
            began = time.perf_counter()
            optimum = cheapest_cost(state, ARTIFACT)
            oracle_s = time.perf_counter() - began
            count = 100 if quick else (400 if size <= 1000 else 200)
            baseline_count = 20 if quick or size > 1000 else 50 if size == 1000 else 200
            rng = random.Random(size)
            ids = list(state.nodes)
            lane: dict[str, Any] = {
                "cheapest_ms": optimum,
                "oracle_seconds": oracle_s,
                "shortest_path": _choices(state, TrackerState.choose, count, optimum),
                "shortest_path_affinity": _choices(
                    state, TrackerState.choose, count, optimum, near=functools.partial(rng.sample, ids, 8)
                ),
                "baseline": _choices(state, baseline_choose, baseline_count, optimum),
                "heartbeat_us": _heartbeat_us(state, nodes, reported),
            }
            # the affinity lane's routes run through the near nodes first: its costs are not comparable
            del lane["shortest_path_affinity"]["cost_over_cheapest"]
            lanes[seam_kind] = lane
        out[str(size)] = lanes
    return out


# --- the HTTP API under load

# The tracker process: the app of whichever tree PYTHONPATH names, on one core, as
# `noderuntime tracker` serves it (the app, its expiry loop, hypercorn on trio).
TRACKER_RUNNER = """
import os, sys, trio
os.sched_setaffinity(0, {int(sys.argv[1])})
from noderuntime.access.identity import Identity
from noderuntime.operations.httpserve import serve_http
from noderuntime.tracker.app import Tracker
tracker = Tracker(Identity.generate(), expire_after=float(sys.argv[2]))
async def main():
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tracker.expire_loop)
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        print(url, flush=True)
trio.run(main)
"""


@attrs.define
class _Load:
    """The simulated nodes' keys, bodies, and what came back."""

    identities: list[Identity]
    heartbeats: list[bytes]  # each node's heartbeat body (its load and round trips: the same every beat)
    latencies: dict[str, list[float]] = attrs.Factory(lambda: collections.defaultdict(list))  # ms from due
    service: dict[str, list[float]] = attrs.Factory(lambda: collections.defaultdict(list))  # ms from sent
    statuses: dict[str, collections.Counter[int]] = attrs.Factory(lambda: collections.defaultdict(collections.Counter))
    offered: collections.Counter[str] = attrs.Factory(collections.Counter)
    # each node's heartbeat interval, as the tracker's last answer to it gave it
    intervals: list[float] = attrs.Factory(list)
    window: tuple[float, float] = (math.inf, math.inf)  # trio clock: the measured stretch
    backlog_at_start: int = 0  # heartbeats due and not yet sent when the window began


def _signed_request(path: str, body: bytes, identity: Identity) -> bytes:
    """A POST signed as a node signs it (``access.signing.sign``), signed when it is sent."""
    headers = sign(identity, "POST", path, body, int(time.time() * 1000))
    head = f"POST {path} HTTP/1.1\r\nhost: tracker\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(body)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode() + body


def _plain_request(path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: tracker\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(body)}\r\n\r\n"
    return head.encode() + body


class _Connection:
    """One keep-alive HTTP/1.1 connection, a request at a time (what a node's or a gateway's pool does)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        """Send ``request``; the status and body of its answer."""
        await self.stream.send_all(request)
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += await self._more()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next((int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:")), 0)
        while len(self.buffer) < length:
            self.buffer += await self._more()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return status, body

    async def _more(self) -> bytes:
        data = await self.stream.receive_some(1 << 16)
        if not data:
            raise ConnectionError("the tracker closed the connection")
        return data


def _told_interval(body: bytes, current: float) -> float:
    """The heartbeat interval in a tracker's answer (the baseline's heartbeat answers give none)."""
    try:
        interval = json.loads(body).get("heartbeat_seconds", current)
    except (ValueError, AttributeError):
        return current
    return float(interval)


Request = tuple[str, float, int, Callable[[], bytes]]  # kind, when due, the node it is from (-1: none), build it


async def _serve_requests(url: str, requests: trio.MemoryReceiveChannel[Request], load: _Load) -> None:
    """Take due requests off ``requests`` and send them, one at a time, on one connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = _Connection(await trio.open_tcp_stream(host, int(port)))
    async for kind, due, node, build in requests:
        sent = trio.current_time()
        try:
            status, body = await connection.exchange(build())
        except (ConnectionError, trio.BrokenResourceError):
            # a connection idle past the server's keep-alive (the route connections wait out the
            # registrations) is closed under it: sent again on a new one, as HTTP clients do
            connection = _Connection(await trio.open_tcp_stream(host, int(port)))
            try:
                status, body = await connection.exchange(build())
            except (ConnectionError, trio.BrokenResourceError):
                status, body = 0, b""
                connection = _Connection(await trio.open_tcp_stream(host, int(port)))
        if status == 200 and node >= 0:
            load.intervals[node] = _told_interval(body, load.intervals[node])
        done = trio.current_time()
        if load.window[0] <= due < load.window[1]:
            load.statuses[kind][status] += 1
            if status == 200:
                load.latencies[kind].append((done - due) * 1e3)
                load.service[kind].append((done - sent) * 1e3)


def _prepare(nodes: Sequence[SimNode], seams: Sequence[dict[int, float]]) -> _Load:
    """Keys for every node, and each one's heartbeat body naming its peers by their real ids."""
    identities = [Identity.generate() for _ in nodes]
    ids = [me.node_id.hex() for me in identities]
    bodies = []
    for i, node in enumerate(nodes):
        beat = {
            "node_id": ids[i],
            "active_sessions": node.active,
            "free_slots": SLOTS - node.active,
            "queue_depth": 0,
            "step_ms": node.capability.step_ms(max(1, node.active)),
            "round_trips": {ids[p]: ms for p, ms in seams[i].items()},
        }
        bodies.append(json.dumps(beat).encode())
    return _Load(identities, bodies, intervals=[HEARTBEAT_SECONDS] * len(nodes))


def _registration(i: int, node: SimNode, me: Identity) -> bytes:
    sim = record(i, node)
    body = {
        "node_id": me.node_id.hex(),
        "artifact": ARTIFACT,
        "model_name": sim.model_name,
        "n_layer": N_LAYER,
        "layers": list(node.layers),
        "recipe": RECIPE,
        "address": sim.address,
        "relay": sim.relay,
        "slots": SLOTS,
        "ctx_per_session": sim.ctx_per_session,
        "capability": capability_record(
            me, artifact=ARTIFACT, layers=node.layers, recipe=RECIPE, capability=node.capability
        ),
    }
    return json.dumps(body).encode()


async def _drive(
    url: str, nodes: Sequence[SimNode], load: _Load, window_s: float, connections: int, windowed: trio.Event
) -> float:
    """Register every node (each starts to heartbeat once registered), then measure ``window_s`` seconds.

    Returns the seconds registration took; ``windowed`` is set once ``load.window`` is.
    """
    count = len(nodes)
    heartbeat_send, heartbeat_receive = trio.open_memory_channel[Request](math.inf)
    route_send, route_receive = trio.open_memory_channel[Request](math.inf)
    beats: list[tuple[float, int]] = []  # a heap: (due, node)
    route_body = json.dumps({"artifact": ARTIFACT, "tokens": TOKENS}).encode()

    def heartbeat(i: int) -> Callable[[], bytes]:
        return lambda: _signed_request("/v1/nodes/heartbeat", load.heartbeats[i], load.identities[i])

    async def register(indices: Sequence[int]) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        connection = _Connection(await trio.open_tcp_stream(host, int(port)))
        for i in indices:
            body = _registration(i, nodes[i], load.identities[i])
            status, answer = await connection.exchange(_signed_request("/v1/nodes/register", body, load.identities[i]))
            load.statuses["register"][status] += 1
            load.intervals[i] = _told_interval(answer, load.intervals[i])
            # its beats start once it is known, at a random phase, as a node's would
            heapq.heappush(beats, (trio.current_time() + random.uniform(0, load.intervals[i]), i))

    async def beat_clock() -> None:
        while True:
            if not beats:
                await trio.sleep(0.01)
                continue
            due, i = beats[0]
            if due > trio.current_time():
                await trio.sleep_until(min(due, trio.current_time() + 0.01))
                continue
            heapq.heappop(beats)
            # at the interval its last answer gave, with a node's jitter (TrackerLink)
            heapq.heappush(beats, (due + load.intervals[i] * random.uniform(0.9, 1.1), i))
            if due < load.window[1]:
                load.offered["heartbeat"] += load.window[0] <= due
                heartbeat_send.send_nowait(("heartbeat", due, i, heartbeat(i)))

    async def route_clock() -> None:
        await windowed.wait()
        due = load.window[0]
        while due < load.window[1]:
            await trio.sleep_until(due)
            load.offered["route"] += 1
            route_send.send_nowait(("route", due, -1, lambda: _plain_request("/v1/routes", route_body)))
            due += 1.0 / ROUTES_PER_S

    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(connections):
            nursery.start_soon(_serve_requests, url, heartbeat_receive.clone(), load)
        for _ in range(8):
            nursery.start_soon(_serve_requests, url, route_receive.clone(), load)
        nursery.start_soon(beat_clock)
        async with trio.open_nursery() as registering:
            for k in range(16):
                registering.start_soon(register, range(k, count, 16))
        registration_s = trio.current_time() - began
        # a beat interval for the last registered to settle into their rhythm, and the beats
        # that queued up behind the registrations to be answered (a while at most), then the window
        await trio.sleep(max(load.intervals))
        with trio.move_on_after(SETTLE_SECONDS):
            # a memory channel has no event for its buffer running low: look now and then
            while heartbeat_send.statistics().current_buffer_used > connections:  # noqa: ASYNC110
                await trio.sleep(0.05)
        load.backlog_at_start = heartbeat_send.statistics().current_buffer_used
        load.window = (trio.current_time(), trio.current_time() + window_s)
        windowed.set()
        nursery.start_soon(route_clock)
        await trio.sleep_until(load.window[1] + 2.0)  # what was due in the window has 2 s to come back
        nursery.cancel_scope.cancel()
    return registration_s


def http_lane(count: int, window_s: float, tree: Path | None, seed: int) -> dict[str, Any]:
    """``count`` nodes against one tracker process (``tree``: the source tree it runs; None: this one)."""
    nodes = swarm(count, seed=seed)
    load = _prepare(nodes, round_trips(nodes, seed=seed + 1))
    cores = sorted(os.sched_getaffinity(0))
    tracker_core, load_cores = cores[0], set(cores[1:]) or {cores[0]}
    env = dict(os.environ, PYTHONPATH=str(tree or ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", TRACKER_RUNNER, str(tracker_core), str(EXPIRE_AFTER)],
        stdout=subprocess.PIPE,
        cwd=tree or ROOT,
        env=env,
        text=True,
    )
    previous_affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, load_cores)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        tracker = psutil.Process(proc.pid)
        samples: list[tuple[float, float, float]] = []  # (wall, tracker CPU s, this process's CPU s)

        def sample() -> None:
            cpu, me = tracker.cpu_times(), psutil.Process().cpu_times()
            samples.append((time.monotonic(), cpu.user + cpu.system, me.user + me.system))

        async def run() -> float:
            windowed = trio.Event()

            async def sample_the_window() -> None:
                await windowed.wait()
                for edge in load.window:
                    await trio.sleep_until(edge)
                    sample()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample_the_window)
                return await _drive(url, nodes, load, window_s, HEARTBEAT_CONNECTIONS, windowed)

        registration_s = trio.run(run)
        load_average = os.getloadavg()[0]
        rss, peak = tracker.memory_info().rss, _common.peak_rss(proc.pid)
    finally:
        os.sched_setaffinity(0, previous_affinity)
        proc.terminate()
        proc.wait(10)
    (began, tracker_began, me_began), (ended, tracker_ended, me_ended) = samples
    elapsed = ended - began
    figures: dict[str, Any] = {
        "nodes": count,
        "registration_seconds": registration_s,
        "registrations": dict(load.statuses["register"]),
        "window_seconds": window_s,
        "tracker_cpu_share": (tracker_ended - tracker_began) / elapsed,
        "load_generator_cpu_share": (me_ended - me_began) / elapsed,
        "tracker_rss_bytes": rss,
        "tracker_peak_rss_bytes": peak,
        "heartbeats_queued_at_window_start": load.backlog_at_start,
        # what the tracker told the nodes last (the baseline: a fixed HEARTBEAT_SECONDS)
        "heartbeat_interval_seconds": {
            "min": min(load.intervals),
            "median": statistics.median(load.intervals),
            "max": max(load.intervals),
        },
        # other work on this machine takes cores from both sides
        "load_average_1min": load_average,
    }
    for kind in ("heartbeat", "route"):
        served = load.statuses[kind][200]
        figures[kind] = {
            "offered_per_s": load.offered[kind] / window_s,
            "served_per_s": served / window_s,
            "served_share": served / max(1, load.offered[kind]),
            "statuses": {str(k): v for k, v in sorted(load.statuses[kind].items())},
            "from_due": _summary(load.latencies[kind]),
            "service": _summary(load.service[kind]),
        }
    heartbeats = figures["heartbeat"]
    figures["keeps_up"] = (
        heartbeats["served_share"] >= 0.99
        and figures["route"]["served_share"] >= 0.99
        # however long the interval, a beat answered a small swarm's interval late is a tracker behind
        and heartbeats["from_due"]["p99_ms"] < 1000 * HEARTBEAT_SECONDS
    )
    return figures


def _baseline_tree(commit: str, into: Path) -> Path | None:
    """The source tree of ``commit`` (its packages), or None where git history is not at hand."""
    try:
        archive = subprocess.run(
            ["git", "archive", commit, "noderuntime", "protocol"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main(argv: list[str] | None = None) -> int:
    parser = _common.parser(NAME, __doc__ or "")
    parser.add_argument("--baseline-commit", default=BASELINE_COMMIT, help="the tracker the baseline lane runs")
    args: argparse.Namespace = parser.parse_args(argv)
    sizes = (100, 1000) if args.quick else (100, 1000, 10_000)
    http_sizes = (1000,) if args.quick else (1000, 10_000)
    window = 4.0 if args.quick else 30.0
    figures: dict[str, Any] = {"route_choice": route_choice(sizes, args.quick), "http": {}}
    scratch = Path(tempfile.mkdtemp(prefix="tracker-baseline-"))
    try:
        baseline = _baseline_tree(args.baseline_commit, scratch)
        for count in http_sizes:
            lanes = {"shortest_path": http_lane(count, window, None, seed=count)}
            if baseline is not None:
                lanes["baseline"] = http_lane(count, window, baseline, seed=count)
            else:
                lanes["baseline"] = {"skipped": f"no git history here to take commit {args.baseline_commit} from"}
            figures["http"][str(count)] = lanes
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        {"model_layers": N_LAYER, "windows": list(WINDOWS), "slots": SLOTS, "tokens": TOKENS},
        figures,
        settings={
            "heartbeat_seconds": HEARTBEAT_SECONDS,
            "routes_per_s": ROUTES_PER_S,
            "peers_reported": PEERS_REPORTED,
            "region_round_trips_ms": REGION_MS,
            "near_equal": NEAR_EQUAL,
            "baseline_commit": args.baseline_commit,
            "http_window_seconds": window,
        },
    )
    rows = []
    for size, lanes in figures["route_choice"].items():
        for seams, lane in lanes.items():
            for name in ("shortest_path", "baseline"):
                s = lane[name]
                rows.append(
                    [size, seams, name, s["p50_ms"], s["p99_ms"], s["cost_over_cheapest"]["max"], s["distinct_routes"]]
                )
    print(_common.table(["nodes", "seams", "choice", "p50 ms", "p99 ms", "worst cost/cheapest", "routes"], rows))
    rows = []
    for size, lanes in figures["http"].items():
        for name, lane in lanes.items():
            if "skipped" in lane:
                rows.append([size, name, "skipped", "", "", "", "", ""])
                continue
            rows.append(
                [
                    size,
                    name,
                    lane["heartbeat"]["served_share"],
                    lane["heartbeat"]["from_due"]["p99_ms"],
                    lane["route"]["served_share"],
                    lane["route"]["from_due"]["p99_ms"],
                    lane["tracker_cpu_share"],
                    lane["tracker_peak_rss_bytes"] >> 20,
                ]
            )
    print()
    headers = ["nodes", "tracker", "beats served", "beat p99 ms", "routes served", "route p99 ms", "CPU", "peak MiB"]
    print(_common.table(headers, rows))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
