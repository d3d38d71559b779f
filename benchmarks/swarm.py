"""Placement at swarm scale: simulated nodes join through the tracker's placement, some leave, others join.

    python -m benchmarks.swarm [--quick] [--out PATH]

On the tracker's own state (``TrackerState`` and ``tracker.placement``, no I/O), N nodes
(50, 200 and 1,000; 50 with ``--quick``) of one 80-layer model join one at a time: each
holds a random number of layers (its memory: 4 to 24) and has a random speed (its layer
throughput ``r``, log-normal: a node serving ``k`` layers gives them ``r / k`` decode
tokens/s, as a node whose step time grows with its layers does). Each asks the placement
for a range, as a node started without ``--layers`` does, and registers with it at the
throughput that range gives it. Then a fifth of them, drawn at random, leave; the others
rebalance (each asks whether to move, ``Placement.reconsider``, in random order, round
after round until a round moves none: a node moves only when the least capacity grows by
1/0.75, so the rounds end); then as many new ones join.

Figures, after the joins, the leaves, the rebalancing and the new joins: coverage (the share of
layers that some complete route holds), the bottleneck (the least capacity of any layer,
in tokens/s, counting only nodes on complete routes), and the bottleneck against the best
any plan could reach for the same nodes: no assignment of contiguous ranges gives every
layer more than ``sum(r) / n_layer`` (each node adds ``r`` layer-tokens/s wherever it
sits): the best plan reaches at most this bound, so the ratio to it is a floor on the
ratio to the best. A hand plan that exists is compared too: the same nodes placed with all
of them known, in the best of a few join orders (most memory first, fastest first, eight
shuffles), which the best plan reaches at least. Also the time one placement takes (p50,
p99; timing only: nothing asserts it), and the rebalancing's moves and rounds (settled:
a last round moved none). Goal: at least 0.9 of the best plan.

And a real swarm (not with ``--quick``): a tracker and five nodes of the demo model
(SmolLM2-135M, 30 layers), real processes on loopback, each started without ``--layers``
and with a ``--memory-limit`` that holds between a third and four fifths of the model;
a gateway serves chat completions through them. Then the node that alone serves some
layers (where every layer is held twice: the first node) is killed; once the tracker drops
it, a newcomer of the same memory is started without ``--layers``, and the gateway serves
again. Figures: the ranges placed, the time
from start to a complete route, the requests served, the time from the kill to a
complete route again.
"""

from __future__ import annotations

import contextlib
import json
import random
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from benchmarks import _common
from noderuntime.testing.clusters import local_gateway_args, local_tracker_args
from noderuntime.tracker.placement import Placement
from noderuntime.tracker.records import NodeRecord
from noderuntime.tracker.registry import TrackerState

# the real swarm: shares of the way from what the last layer alone needs to the whole model
REAL_SHARES = (0.3, 0.4, 0.55, 0.7, 0.8)
REAL_SLOTS, REAL_CTX = 2, 512
REAL_REQUESTS = 8

NAME = "swarm"
N_LAYER = 80
SIZES = (50, 200, 1000)
QUICK_SIZES = (50,)
MEMORY_LAYERS = (4, 24)  # what a node can hold, uniform
SPEED_MEDIAN = 2000.0  # layer-tokens/s: a node of 20 layers at 100 tokens/s
SPEED_SIGMA = 0.6  # log-normal spread of node speeds
LEAVING = 0.2  # the share of nodes that leave, and of new ones that join after
SLOTS = 4
ARTIFACT = "ab" * 32
SEED = 7
MAX_ROUNDS = 50  # rounds of rebalancing before it counts as not settling
HAND_ORDERS = 8  # shuffled join orders the hand plan tries besides the two sorted ones


class Swarm:
    """Simulated nodes on a tracker's state, joining through its placement."""

    def __init__(self, rng: random.Random, n_layer: int = N_LAYER) -> None:
        self.rng = rng
        self.n_layer = n_layer
        self.state = TrackerState(expire_after=1e12)
        self.placement = Placement(self.state)
        self.speed: dict[bytes, float] = {}  # layer-tokens/s of each present node
        self.memory: dict[bytes, int] = {}  # the layers it can hold
        self.placed_ms: list[float] = []
        self.now = 0.0
        self.count = 0

    def draw(self) -> tuple[int, float]:
        """A new node's memory (layers it can hold) and speed (layer-tokens/s), at random."""
        return self.rng.randint(*MEMORY_LAYERS), SPEED_MEDIAN * float(np.exp(self.rng.gauss(0.0, SPEED_SIGMA)))

    def join(self, memory: int, speed: float) -> tuple[int, int]:
        """One new node: placed, loaded, registered; the layers it was given."""
        self.count += 1
        node_id = self.count.to_bytes(32, "big")
        self.now += 1.0
        began = time.perf_counter()
        given = self.placement.assign(node_id, ARTIFACT, self.n_layer, memory, self.now, tokens_per_s=speed / memory)
        self.placed_ms.append((time.perf_counter() - began) * 1e3)
        start, end = given.layers
        tokens_per_s = speed / (end - start)
        record = NodeRecord(
            node_id=node_id,
            artifact=ARTIFACT,
            n_layer=self.n_layer,
            layers=(start, end),
            recipe="0" * 16,
            address=f"10.0.0.1:{self.count}",
            relay="",
            tls_cert_sha256=b"",
            slots=SLOTS,
            ctx_per_session=2048,
            step_ms=SLOTS * 1000.0 / tokens_per_s,  # a node that measured nothing gives slots * 1000 / step
        )
        self.state.register(record, self.now)
        self.placement.registered(node_id)
        self.speed[node_id] = speed
        self.memory[node_id] = memory
        return start, end

    def rebalance(self) -> dict[str, Any]:
        """Every node asks whether to move, in random order, round after round, until a round moves none."""
        moves, rounds, moved_nodes = 0, 0, set()
        while rounds < MAX_ROUNDS:
            rounds += 1
            moved = 0
            for node_id in self.rng.sample(sorted(self.speed), len(self.speed)):
                self.now += 1.0
                move = self.placement.reconsider(node_id, self.memory[node_id], self.now)
                if move is None:
                    continue
                old = self.state.nodes[node_id]
                start, end = move.layers
                # loaded, registered with its new range; its old one drained
                step = SLOTS * 1000.0 / (self.speed[node_id] / (end - start))
                self.state.register(attrs.evolve(old, layers=(start, end), step_ms=step), self.now)
                self.placement.registered(node_id)
                moved += 1
                moved_nodes.add(node_id)
            moves += moved
            if not moved:
                break
        return {"moves": moves, "rounds": rounds, "nodes_moved": len(moved_nodes), "settled": rounds < MAX_ROUNDS}

    def leave(self, share: float) -> int:
        """A random ``share`` of the nodes leave; how many."""
        gone = self.rng.sample(sorted(self.speed), int(share * len(self.speed)))
        for node_id in gone:
            self.state.leave(node_id, self.now)
            self.placement.forget(node_id)
            del self.speed[node_id]
            del self.memory[node_id]
        return len(gone)

    def figures(self) -> dict[str, Any]:
        """Coverage, bottleneck and bound now."""
        capacity = self.placement.capacity(ARTIFACT, self.n_layer, self.now)
        bound = sum(self.speed.values()) / self.n_layer
        bottleneck = float(capacity.min())
        return {
            "nodes": len(self.speed),
            "coverage": round(float((capacity > 0).mean()), 4),
            "bottleneck_tokens_per_s": round(bottleneck, 2),
            "bound_tokens_per_s": round(bound, 2),
            "ratio": round(bottleneck / bound, 4) if bound else None,
            "distinct_ranges": len({r.layers for r in self.state.nodes.values()}),
        }


def hand_plan(nodes: list[tuple[int, float]], seed: int) -> dict[str, Any]:
    """The best bottleneck the same placement reaches for ``nodes`` joining in an order chosen with all of them
    known: largest first, fastest first, or one of ``HAND_ORDERS`` shuffles."""
    rng = random.Random(seed)
    orders = {
        "most_memory_first": sorted(nodes, key=lambda node: -node[0]),
        "fastest_first": sorted(nodes, key=lambda node: -node[1]),
        **{f"shuffle{k}": rng.sample(nodes, len(nodes)) for k in range(HAND_ORDERS)},
    }
    best_name, best = "", -1.0
    for name, order in orders.items():
        swarm = Swarm(random.Random(seed))
        for memory, speed in order:
            swarm.join(memory, speed)
        bottleneck = float(swarm.placement.capacity(ARTIFACT, swarm.n_layer, swarm.now).min())
        if bottleneck > best:
            best_name, best = name, bottleneck
    return {"order": best_name, "bottleneck_tokens_per_s": round(best, 2)}


def run(n: int, seed: int) -> dict[str, Any]:
    """N nodes join, a fifth leave, as many join: the figures at each stage."""
    swarm = Swarm(random.Random(seed))
    nodes = [swarm.draw() for _ in range(n)]
    for memory, speed in nodes:
        swarm.join(memory, speed)
    joined = swarm.figures()
    hand = hand_plan(nodes, seed)
    joined["hand_plan"] = hand
    joined["ratio_to_hand_plan"] = round(joined["bottleneck_tokens_per_s"] / hand["bottleneck_tokens_per_s"], 4)
    left = swarm.leave(LEAVING)
    after_leaves = swarm.figures()
    rebalancing = swarm.rebalance()
    rebalanced = {**swarm.figures(), **rebalancing}
    for _ in range(left):
        swarm.join(*swarm.draw())
    rejoined = swarm.figures()
    placed = swarm.placed_ms
    return {
        "after_joins": joined,
        "after_leaves": after_leaves,
        "after_rebalancing": rebalanced,
        "after_new_joins": rejoined,
        "left": left,
        "placement_ms_p50": round(_common.percentile(placed, 50), 3),
        "placement_ms_p99": round(_common.percentile(placed, 99), 3),
    }


def real_swarm(root: Path) -> dict[str, Any]:
    """Five real nodes without ``--layers`` cover the demo model; one dies and a newcomer covers its hole."""
    from noderuntime.engine import memplan
    from noderuntime.engine.llama import Recipe
    from noderuntime.models import catalogue as models
    from noderuntime.models.artifacts import LayerRange
    from noderuntime.services.cluster import ManagedProcess, start_all, stop_all
    from noderuntime.services.localsystem import _wait_routable
    from noderuntime.services.ready import GatewayReady, NodeReady, TrackerReady, expect

    model = models.pull(models.DEMO_MODEL, progress=False)
    recipe = memplan.capped(Recipe(n_threads=1, n_ctx_per_seq=REAL_CTX, n_seq_max=REAL_SLOTS))
    tail = memplan.needs(model, LayerRange(29, 30), recipe).host
    whole = memplan.needs(model, LayerRange(0, 30), recipe).host
    limits = [int(tail + (whole - tail) * share) for share in REAL_SHARES]
    processes: list[ManagedProcess] = []

    def node(name: str, limit: int) -> ManagedProcess:
        flags = ["--memory-limit", str(limit), "--slots", str(REAL_SLOTS), "--ctx", str(REAL_CTX), "--threads", "1"]
        argv = ["up", "--model", str(model), "--listen", "127.0.0.1:0", "--tracker", tracker_url, *flags]
        process = ManagedProcess(name, [*argv, "--data-dir", str(root / name)])
        processes.append(process)
        return process

    def routable() -> bool:
        with urllib.request.urlopen(tracker_url + "/v1/artifacts", timeout=10) as response:
            return bool(json.loads(response.read())["artifacts"].get(artifact, {}).get("routable"))

    def listed() -> set[str]:
        with urllib.request.urlopen(tracker_url + "/v1/nodes", timeout=10) as response:
            return {n["node_id"] for n in json.loads(response.read())["nodes"]}

    def serve(count: int) -> int:
        body = {"model": "smol", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 16}
        served = 0
        for _ in range(count):
            request = urllib.request.Request(
                gateway_url + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
            )
            with contextlib.suppress(urllib.error.HTTPError), urllib.request.urlopen(request, timeout=120) as answer:
                served += bool(json.loads(answer.read())["choices"][0]["message"]["content"])
        return served

    try:
        tracker = ManagedProcess(
            "tracker",
            local_tracker_args(root / "t", "--expire-after", "2"),
        )
        processes.append(tracker)
        tracker_url = expect(tracker.start(), TrackerReady).url
        nodes = [node(f"node{i}", limit) for i, limit in enumerate(limits)]
        started = time.monotonic()
        ready = [expect(info, NodeReady) for info in start_all(nodes, timeout=120)]
        artifact = ready[0].artifact
        _wait_routable(tracker_url, artifact)
        to_route = time.monotonic() - started
        ranges = [tuple(r.layers) for r in ready]
        covered = set().union(*(range(a, b) for a, b in ranges))
        gateway = ManagedProcess(
            "gateway",
            local_gateway_args(root / "gateway", tracker_url, f"smol={model}"),
        )
        processes.append(gateway)
        gateway_url = expect(gateway.start(), GatewayReady).url
        served_before = serve(REAL_REQUESTS)
        only = {
            k: set(range(a, b)) - set().union(*(range(c, d) for j, (c, d) in enumerate(ranges) if j != k))
            for k, (a, b) in enumerate(ranges)
        }
        # the one that alone serves some layers, if any; else (every layer held twice) the first
        lost = next((k for k, layers in only.items() if layers), 0)
        killed = time.monotonic()
        nodes[lost].kill()
        while ready[lost].node_id in listed():
            time.sleep(0.1)
        dropped = time.monotonic() - killed
        routable_without_it = routable()
        newcomer = expect(node("newcomer", limits[lost]).start(120), NodeReady)
        _wait_routable(tracker_url, artifact)
        recovered = time.monotonic() - killed
        return {
            "model": models.DEMO_MODEL,
            "n_layer": 30,
            "memory_limits_bytes": limits,
            "whole_model_needs_bytes": whole,
            "ranges": [list(r) for r in ranges],
            "largest_range": max(b - a for a, b in ranges),
            "coverage": len(covered) / 30,
            "seconds_from_start_to_a_route": to_route,
            "requests": REAL_REQUESTS,
            "served_before": served_before,
            "killed": {"range": list(ranges[lost]), "layers_only_it_served": sorted(only[lost])},
            "seconds_until_the_tracker_dropped_it": dropped,
            "routable_without_it": routable_without_it,
            "newcomer_range": list(newcomer.layers),
            "newcomer_covers_the_hole": only[lost] <= set(range(*newcomer.layers)),
            "seconds_from_the_kill_to_a_route_again": recovered,
            "served_after": serve(REAL_REQUESTS),
        }
    finally:
        stop_all(processes)


def main(argv: list[str] | None = None) -> int:
    parser = _common.parser(NAME, __doc__ or "")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    figures: dict[str, Any] = {str(n): run(n, SEED + n) for n in sizes}
    if not args.quick:
        with tempfile.TemporaryDirectory(prefix="swarm-") as tmp:
            figures["real"] = real_swarm(Path(tmp))
    recipe = {
        "n_layer": N_LAYER,
        "sizes": list(sizes),
        "memory_layers": list(MEMORY_LAYERS),
        "speed": f"layer-tokens/s log-normal, median {SPEED_MEDIAN}, sigma {SPEED_SIGMA}; r / k tokens/s on k layers",
        "leaving_share": LEAVING,
        "seed": SEED,
        "bound": "sum of layer throughputs / n_layer: no plan of contiguous ranges gives every layer more",
    }
    out = _common.out_path(NAME, args)
    _common.write(out, NAME, args, recipe, figures)
    rows = [
        [
            n,
            stage,
            f["nodes"],
            f["coverage"],
            f["bottleneck_tokens_per_s"],
            f["bound_tokens_per_s"],
            f["ratio"],
            f["hand_plan"]["bottleneck_tokens_per_s"] if "hand_plan" in f else "",
            f.get("ratio_to_hand_plan", ""),
        ]
        for n, result in figures.items()
        if n != "real"
        for stage in ("after_joins", "after_leaves", "after_rebalancing", "after_new_joins")
        for f in (result[stage],)
    ]
    headers = ["N", "stage", "nodes", "coverage", "bottleneck", "bound", "ratio", "hand plan", "ratio to it"]
    print(_common.table(headers, rows))
    times = [
        [n, r["placement_ms_p50"], r["placement_ms_p99"], *(r["after_rebalancing"][k] for k in ("moves", "rounds"))]
        for n, r in figures.items()
        if n != "real"
    ]
    print(_common.table(["N", "placement p50 ms", "p99 ms", "moves", "rounds"], times))
    if "real" in figures:
        real = figures["real"]
        print(
            f"real swarm: ranges {real['ranges']} (coverage {real['coverage']:.2f}), a route after "
            f"{real['seconds_from_start_to_a_route']:.1f} s, {real['served_before']}/{real['requests']} served; "
            f"killed {real['killed']['range']}, newcomer {real['newcomer_range']}, a route again after "
            f"{real['seconds_from_the_kill_to_a_route_again']:.1f} s, {real['served_after']}/{real['requests']} served"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
