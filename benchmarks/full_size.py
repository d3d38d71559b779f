"""A top open model at full size, on machines none of which can hold it.

    python -m benchmarks.full_size [--quick] [--out PATH] [--cache DIR]

The model is Qwen3-30B-A3B's full shape with random weights (48 layers, 2048 wide, 32
heads and 4 KV heads of 128, 128 experts of which 8 are used, expert feed-forward 768,
vocabulary 151,936, untied), in Q4_0: 17.3 GB, written by ``noderuntime models synth``
(quantized blocks written directly) into a cache outside the clone (``--cache``; default
``~/.cache/noderuntime/benchmarks/full_size``) and kept there. As a model host would, the
lane signs its manifest (``noderuntime models manifest``) and serves the file from a real
HTTP server that answers Range requests, on loopback (:mod:`noderuntime.testing.rangeserver`).

1. **The swarm.** A tracker holding the manifest; three nodes, one after the other, each
   ``noderuntime up --model URL --memory-limit 7GiB`` with no ``--layers``, each in a
   memory cgroup of that limit (an overrun is an OOM kill): each sizes itself from the
   header, is placed by the tracker, fetches only its layers and serves. A gateway.
2. **The baselines.** The same file as one whole-model node (no limit; the machine holds
   it), then ``llama-server`` built from the same sources, one after another.
3. **Figures.** Per node: the range it was placed on, bytes fetched against its layers'
   share of the file, the time to be placed, to fetch, to load; peak RSS against its limit
   and against the memory planner's prediction for its range. The time from the first
   ``up`` to the first served token. Prefill tokens/s of a 512-token prompt (a completion
   of one token, timed to its end) and decode tokens/s at 1 and 4 clients, for the route,
   the whole model and llama-server. On paper, from the planner's dry run on header-only
   files of their shapes (the tensor data a hole, so nothing of their size is written):
   how many 8, 16 and 24 GiB machines Llama-3.1-70B and Qwen3-235B-A22B in Q4_0 need, and
   the ranges this tracker's placement gives such machines joining one at a time.

``--quick`` runs the same lane on a 12-layer cut of the shape (4.6 GB) with 2 GiB limits,
without llama-server and without the on-paper part. All processes share this machine's two
cores, one after another: the route's three nodes take turns on them as a pipeline does.
Goals: route decode >= 0.9x the whole model at 1 client and >= 0.95x at 4; each node's
peak RSS within its limit and within 10 % of the planner's prediction; bytes fetched <=
1.05x the node's share.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import numpy as np

from benchmarks import _common, fit, serving
from noderuntime.engine import memplan
from noderuntime.engine.llama import Recipe
from noderuntime.models import artifacts, manifest, synth
from noderuntime.models.artifacts import LayerRange
from noderuntime.services.cgroups import MemoryCap, available
from noderuntime.services.cluster import ManagedProcess, ProcessError, stop_all
from noderuntime.services.ready import GatewayReady, NodeReady, TrackerReady, expect
from noderuntime.testing.clusters import local_tracker_args
from noderuntime.testing.rangeserver import RangeServer

NAME = "full_size"
GiB = 1 << 30
SLOTS = 4
CTX = 1024  # per session: the 512-token prompt and what follows it
BATCH = 256
THREADS = 2
PROMPT_TOKENS = 512
DECODE_TOKENS = 32
MODEL_ID = "full"


@attrs.frozen
class Lane:
    """The model's cut and each node's memory limit."""

    label: str
    shape: synth.ModelShape
    limit: int
    nodes: int = 3
    decode_runs: int = 2
    llama_server: bool = True
    on_paper: bool = True


FULL = Lane("Qwen3-30B-A3B shape, all 48 layers (Q4_0)", synth.qwen3_30b_a3b_shape(48), 7 * GiB)
QUICK = Lane(
    "Qwen3-30B-A3B shape, 12 layers (Q4_0)",
    synth.qwen3_30b_a3b_shape(12),
    2 * GiB,
    decode_runs=1,
    llama_server=False,
    on_paper=False,
)

# the on-paper shapes: their published hyper-parameters, Q4_0
PAPER_SHAPES = {
    "Llama-3.1-70B": synth.ModelShape(
        n_layer=80,
        n_embd=8192,
        n_ff=28672,
        n_head=64,
        n_head_kv=8,
        n_vocab=128256,
        rope_freq_base=500000.0,
        tied_output=False,
    ),
    "Qwen3-235B-A22B": synth.ModelShape(
        arch="qwen3moe",
        n_layer=94,
        n_embd=4096,
        n_ff=12288,
        n_head=64,
        n_head_kv=4,
        head_dim=128,
        n_expert=128,
        n_expert_used=8,
        n_ff_expert=1536,
        n_vocab=151936,
        context_length=40960,
        tied_output=False,
    ),
}
PAPER_MACHINES_GIB = (8, 16, 24)


def recipe() -> Recipe:
    """What every node of the lane runs (a memory-limited node's recipe: weights read, not mapped)."""
    return memplan.capped(Recipe(n_threads=THREADS, n_ctx_per_seq=CTX, n_seq_max=SLOTS, n_batch=BATCH, n_ubatch=BATCH))


def _node_args(model: str, data: Path, tracker: str, extra: Sequence[str]) -> list[str]:
    return [
        *("up", "--model", model, "--listen", "127.0.0.1:0", "--data-dir", str(data), "--tracker", tracker),
        *("--slots", str(SLOTS), "--ctx", str(CTX), "--batch", str(BATCH), "--threads", str(THREADS), *extra),
    ]


def _gateway(root: Path, tracker: str, model: Path) -> ManagedProcess:
    return ManagedProcess(
        "gateway",
        [
            *("gateway", "--data-dir", str(root / "gateway"), "--tracker", tracker, "--listen", "127.0.0.1:0"),
            *("--model", f"{MODEL_ID}={model}", "--ctx", str(CTX)),
        ],
    )


# --- the model, as its host keeps it


def prepare(lane: Lane, cache: Path) -> dict[str, Any]:
    """The model file (written once, then reused), its publisher key and signed manifest: paths and times."""
    cache.mkdir(parents=True, exist_ok=True)
    model = cache / f"qwen3-30b-a3b-shape-{lane.shape.n_layer}l-q4_0.gguf"
    key, signed = cache / "publisher.key", model.with_suffix(".manifest.json")
    figures: dict[str, Any] = {"model": str(model), "synth_seconds": None, "manifest_seconds": None}
    if not model.exists():
        started = time.monotonic()
        synth.write_model(model, lane.shape, quant="Q4_0", name=f"qwen3-30b-a3b-shape-{lane.shape.n_layer}l")
        figures["synth_seconds"] = round(time.monotonic() - started, 1)
    if not signed.exists() or signed.stat().st_mtime < model.stat().st_mtime:
        started = time.monotonic()
        command = [sys.executable, "-m", "noderuntime", "models", "manifest", str(model)]
        subprocess.run([*command, "--key", str(key), "--out", str(signed), "--quiet"], check=True, env=_env())
        figures["manifest_seconds"] = round(time.monotonic() - started, 1)
    loaded = manifest.Manifest.loads(signed.read_bytes())
    figures |= {"model_bytes": model.stat().st_size, "manifest": str(signed), "publisher": loaded.publisher}
    return figures


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def share_bytes(signed: manifest.Manifest, layers: LayerRange) -> int:
    """The bytes of the file a node of ``layers`` needs: the header and its layers' tensors."""
    tied = artifacts.tied_output(signed.index())
    wanted = [t for t in signed.tensors if artifacts.tensor_belongs(t.name, layers, signed.n_layer, tied)]
    return signed.parts[0].data_offset + sum(t.n_bytes for t in wanted)


# --- the swarm


@attrs.define
class Joining:
    """When a joining node was placed, had fetched its shard, and served (watched from outside)."""

    process: ManagedProcess
    data: Path
    launched: float = 0.0
    placed: float | None = None
    fetched: float | None = None
    ready: float | None = None

    def watch(self, stop: threading.Event) -> None:
        """Poll its log (the placement line) and its shard folder (the finished file) until ``stop``."""
        while not stop.is_set():
            now = time.monotonic()
            if self.placed is None and any("placed this node on layers" in line for line in self.process.output):
                self.placed = now
            if self.fetched is None and any((self.data / "shards").glob("*.gguf")):
                self.fetched = now
            stop.wait(0.1)


@contextmanager
def swarm(lane: Lane, prepared: dict[str, Any], root: Path) -> Iterator[dict[str, Any]]:
    """The tracker, the lane's nodes joining one after another from the URL, the gateway; their figures."""
    model = Path(prepared["model"])
    signed = manifest.Manifest.loads(Path(prepared["manifest"]).read_bytes())
    processes: list[ManagedProcess] = []
    caps: list[MemoryCap] = []
    with RangeServer(model.parent) as server:
        try:
            tracker_process = ManagedProcess(
                "tracker", local_tracker_args(root / "tracker", "--manifest", prepared["manifest"])
            )
            processes.append(tracker_process)
            tracker = expect(tracker_process.start(120), TrackerReady).url
            began = time.monotonic()
            nodes: list[dict[str, Any]] = []
            for i in range(lane.nodes):
                cap = MemoryCap(lane.limit, f"full{i}")
                caps.append(cap)
                data = root / f"node{i}"
                extra = ["--memory-limit", str(lane.limit), "--publisher-key", prepared["publisher"]]
                process = ManagedProcess(
                    f"node{i}", _node_args(server.url(model.name), data, tracker, extra), cap=cap, keep_lines=None
                )
                processes.append(process)
                joining = Joining(process, data)
                server.reset()
                stop = threading.Event()
                watcher = threading.Thread(target=joining.watch, args=(stop,), daemon=True)
                joining.launched = time.monotonic()
                process.launch()
                watcher.start()
                try:
                    ready = expect(process.wait_ready(1800), NodeReady)
                finally:
                    stop.set()
                    watcher.join()
                joining.ready = time.monotonic()
                layers = LayerRange(*ready.layers)
                share = share_bytes(signed, layers)
                nodes.append(
                    {
                        "layers": str(layers),
                        "process": process,
                        "cap": cap,
                        "fetched_bytes": server.sent,
                        "share_bytes": share,
                        "fetched_over_share": round(server.sent / share, 4),
                        "placed_s": _since(joining.launched, joining.placed),
                        "fetch_s": _since(joining.placed, joining.fetched),
                        "load_s": _since(joining.fetched, joining.ready),
                        "up_to_ready_s": _since(joining.launched, joining.ready),
                        # the planner's dry run of the range: weights, KV, compute, runtime (what the
                        # engine holds); the node also budgets a prefix cache, filled only as prompts come
                        "planned_bytes": memplan.needs(model, layers, recipe()).total,
                        "prefix_cache_budget_bytes": memplan.prefix_cache_size(
                            model, layers, recipe(), memplan.Budget(host=lane.limit), None
                        ),
                    }
                )
                print(f"node{i}: layers {layers}, {server.sent / 1e9:.2f} GB fetched", flush=True)
            gateway, first_token_s = _serve(processes, root, tracker, model, began)
            yield {"gateway": gateway, "nodes": nodes, "first_up_to_first_token_s": first_token_s}
        finally:
            stop_all(processes)
            for cap in caps:
                cap.remove()


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 1)


def _serve(processes: list[ManagedProcess], root: Path, tracker: str, model: Path, began: float) -> tuple[str, float]:
    """Start the gateway (kept in ``processes``); its URL, and the seconds from ``began`` to the first
    completion it served."""
    gateway_process = _gateway(root, tracker, model)
    processes.append(gateway_process)
    gateway = expect(gateway_process.start(600), GatewayReady).url
    return gateway, round(_first_served(gateway) - began, 1)


def _first_served(gateway: str, within: float = 600) -> float:
    """When a completion first came back whole through the gateway (it answers 503 until a route exists)."""
    deadline = time.monotonic() + within
    while True:
        answer = httpx.post(
            gateway + "/v1/completions", json={"model": MODEL_ID, "prompt": [1000], "max_tokens": 1}, timeout=600
        )
        if answer.status_code == 200:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise SystemExit(f"the route never served: {answer.text}")
        time.sleep(0.25)


@contextmanager
def whole(model: Path, root: Path) -> Iterator[dict[str, Any]]:
    """The same file as one whole-model node (no limit; weights mapped), with a tracker and a gateway."""
    processes: list[ManagedProcess] = []
    try:
        tracker_process = ManagedProcess("tracker", local_tracker_args(root / "tracker"))
        processes.append(tracker_process)
        tracker = expect(tracker_process.start(120), TrackerReady).url
        node = ManagedProcess("whole", _node_args(str(model), root / "whole", tracker, []))
        processes.append(node)
        began = time.monotonic()
        expect(node.start(1800), NodeReady)
        gateway, first = _serve(processes, root, tracker, model, began)
        yield {"gateway": gateway, "process": node, "up_to_first_token_s": first}
    finally:
        stop_all(processes)


@contextmanager
def llama_server(model: Path) -> Iterator[str]:
    """llama-server from the same sources on the same file, as many slots and the same batch."""
    batch = ("--batch-size", str(BATCH), "--ubatch-size", str(BATCH))
    port = serving.LLAMA_SERVER_PORT
    proc = serving._start_llama_server(serving._llama_server(), model, port, SLOTS, CTX, *batch, within=1800)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


# --- what is measured


def stream(base: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion of token ids (:func:`benchmarks.fit.stream_completion`)."""
    return fit.stream_completion(base, MODEL_ID, prompt, max_tokens)


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1000, 100_000, n)]


def measure(base: str, lane: Lane) -> dict[str, Any]:
    """Prefill of a 512-token prompt (one token, to the completion's end), decode at 1 and 4 clients."""
    stream(base, _prompt(0, 8), 2)  # warm: first allocations, first graph
    prefill = stream(base, _prompt(1, PROMPT_TOKENS), 1)
    prefill_s = prefill["ended"] - prefill["began"]
    singles = []
    for run in range(lane.decode_runs):
        one = stream(base, _prompt(10 + run, 16), DECODE_TOKENS)
        times = one["times"]
        if len(times) > 1:
            singles.append((len(times) - 1) / (times[-1] - times[0]))
    results: list[dict[str, Any]] = [{} for _ in range(SLOTS)]

    def client(k: int) -> None:
        results[k] = stream(base, _prompt(20 + k, 16), DECODE_TOKENS)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(SLOTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = min(r["times"][0] for r in results if r["times"])
    last = max(r["times"][-1] for r in results if r["times"])
    after_first = sum(len(r["times"]) - 1 for r in results if r["times"])
    return {
        "prefill_tokens_per_s": round(PROMPT_TOKENS / prefill_s, 2),
        "prefill_s": round(prefill_s, 2),
        "decode_tokens_per_s_1_client": round(float(np.median(singles)), 3) if singles else None,
        "decode_tokens_per_s_4_clients": round(after_first / (last - first), 3) if last > first else None,
        "tokens_4_clients": [r["tokens"] for r in results],
    }


def node_memory(node: dict[str, Any]) -> dict[str, Any]:
    """A route node's peak memory against its limit and its planned needs (the figures kept in the JSON)."""
    process: ManagedProcess = node.pop("process")
    cap: MemoryCap = node.pop("cap")
    peak = _common.peak_rss(process.pid)
    return node | {
        "alive": process.alive(),
        "peak_rss_bytes": peak,
        "limit_bytes": cap.limit,
        "cgroup_peak_bytes": cap.peak(),
        "oom_kills": cap.oom_kills(),
        "peak_rss_over_planned": round(peak / node["planned_bytes"], 3),
        "within_limit": peak <= cap.limit and cap.oom_kills() == 0,
    }


# --- on paper


def on_paper(cache: Path) -> dict[str, Any]:
    """For each paper shape and machine size: layers a machine holds, machines a complete route needs,
    and the ranges the tracker's placement gives identical machines joining one at a time."""
    from noderuntime.services import joining

    out: dict[str, Any] = {}
    for name, shape in PAPER_SHAPES.items():
        path = cache / f"paper-{name}.gguf"
        if not path.exists():
            synth.write_model(path, shape, quant="Q4_0", name=name, weights=False)
        file_bytes = path.stat().st_size
        lanes: dict[str, Any] = {}
        for gib in PAPER_MACHINES_GIB:
            held = joining.holdable(path, recipe(), memplan.Budget(host=gib * GiB))
            ranges = placed_ranges(shape.n_layer, held) if held else []
            lanes[f"{gib}GiB"] = {"layers_a_machine_holds": held, "machines": len(ranges), "ranges": ranges}
        out[name] = {"n_layer": shape.n_layer, "file_bytes": file_bytes, "machines": lanes}
    return out


def placed_ranges(n_layer: int, held: int) -> list[str]:
    """The ranges the tracker's placement gives identical machines that each hold ``held`` layers,
    joining one at a time until every layer is served (``benchmarks.swarm``'s simulated swarm)."""
    from benchmarks.swarm import Swarm

    swarm = Swarm(random.Random(0), n_layer)
    ranges: list[str] = []
    covered = np.zeros(n_layer, dtype=bool)
    while not covered.all() and len(ranges) < 4 * n_layer:
        start, end = swarm.join(held, speed=10.0 * held)  # the same speed on every machine
        covered[start:end] = True
        ranges.append(f"{start}:{end}")
    return ranges


# --- the run


def plot_png(path: Path, figures: dict[str, Any]) -> None:
    """Each node's peak RSS against its limit and its plan; decode and prefill of route, whole, llama-server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = figures["route"]["nodes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    labels = [n["layers"] for n in nodes]
    x = np.arange(len(nodes))
    left.bar(x - 0.2, [n["peak_rss_bytes"] / GiB for n in nodes], 0.4, color="#4477aa", label="peak RSS")
    left.bar(x + 0.2, [n["planned_bytes"] / GiB for n in nodes], 0.4, color="#88ccee", label="planner's prediction")
    left.axhline(figures["limit_bytes"] / GiB, color="#cc3311", linestyle="--", label="limit per node")
    left.set_xticks(x, labels)
    left.set_ylabel("GiB")
    left.set_xlabel("node (layers placed)")
    left.set_title(f"{figures['model_bytes'] / 1e9:.1f} GB model over {len(nodes)} nodes")
    left.legend(loc="lower right", fontsize=8)
    setups = [s for s in ("route", "whole", "llama_server") if figures.get(s)]
    measures = ("decode_tokens_per_s_1_client", "decode_tokens_per_s_4_clients")
    width = 0.8 / len(setups)
    for k, setup in enumerate(setups):
        values = [figures[setup][m] or 0.0 for m in measures]
        right.bar(np.arange(len(measures)) + k * width, values, width, label=setup.replace("_", "-"))
    right.set_xticks(np.arange(len(measures)) + width * (len(setups) - 1) / 2, ["1 client", "4 clients"])
    right.set_ylabel("decode tokens/s")
    right.set_title("decode")
    right.legend(fontsize=8)
    fig.suptitle(figures["lane"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    """Run the lane and write its JSON and PNG."""
    parser = _common.parser(NAME, __doc__ or "")
    parser.add_argument(
        "--cache", type=Path, default=_common.cache_dir(NAME), help="where the model is written and kept"
    )
    args = parser.parse_args()
    lane = QUICK if args.quick else FULL
    out = _common.out_path(NAME, args)
    reason = available()
    if reason is not None:
        raise SystemExit(f"the full-size lane needs memory cgroups: {reason}")

    prepared = prepare(lane, args.cache)
    model = Path(prepared["model"])
    print(f"model: {lane.label}, {prepared['model_bytes'] / 1e9:.2f} GB", flush=True)
    with tempfile.TemporaryDirectory(prefix="full-size-") as tmp:
        root = Path(tmp)
        try:
            with swarm(lane, prepared, root / "route") as system:
                route = measure(system["gateway"], lane) | {
                    "nodes": [node_memory(n) for n in system["nodes"]],
                    "first_up_to_first_token_s": system["first_up_to_first_token_s"],
                }
            print(f"route: {json.dumps({k: v for k, v in route.items() if k != 'nodes'})}", flush=True)
            with whole(model, root / "whole") as system:
                reference = measure(system["gateway"], lane) | {
                    "peak_rss_bytes": _common.peak_rss(system["process"].pid),
                    "up_to_first_token_s": system["up_to_first_token_s"],
                }
            print(f"whole: {json.dumps(reference)}", flush=True)
        except ProcessError as exc:
            raise SystemExit(str(exc)) from None
    anchor = None
    if lane.llama_server:
        with llama_server(model) as base:
            anchor = measure(base, lane)
        print(f"llama-server: {json.dumps(anchor)}", flush=True)
    paper = on_paper(args.cache) if lane.on_paper else None

    nodes = route["nodes"]
    ratios = {
        against: {
            "decode_1_client": _ratio(route["decode_tokens_per_s_1_client"], ref["decode_tokens_per_s_1_client"]),
            "decode_4_clients": _ratio(route["decode_tokens_per_s_4_clients"], ref["decode_tokens_per_s_4_clients"]),
            "prefill": _ratio(route["prefill_tokens_per_s"], ref["prefill_tokens_per_s"]),
        }
        for against, ref in (("whole", reference), ("llama_server", anchor))
        if ref is not None
    }
    figures: dict[str, Any] = {
        "lane": lane.label,
        "shape": attrs.asdict(lane.shape),
        "model_bytes": prepared["model_bytes"],
        "synth_seconds": prepared["synth_seconds"],
        "manifest_seconds": prepared["manifest_seconds"],
        "limit_bytes": lane.limit,
        "model_over_limit": round(prepared["model_bytes"] / lane.limit, 2),
        "prompt_tokens": PROMPT_TOKENS,
        "decode_tokens": DECODE_TOKENS,
        "route": route,
        "whole": reference,
        "llama_server": anchor,
        "route_over": ratios,
        "on_paper": paper,
        "goals": {
            "decode_1_client_at_least_0_9x_whole": (ratios["whole"]["decode_1_client"] or 0) >= 0.9,
            "decode_4_clients_at_least_0_95x_whole": (ratios["whole"]["decode_4_clients"] or 0) >= 0.95,
            "every_node_within_its_limit": all(n["within_limit"] and n["alive"] for n in nodes),
            "every_node_within_10_percent_of_its_plan": all(abs(n["peak_rss_over_planned"] - 1) <= 0.10 for n in nodes),
            "fetched_at_most_1_05x_share": all(n["fetched_over_share"] <= 1.05 for n in nodes),
        },
    }
    doc_recipe = {
        "model": f"random-weight qwen3moe, {lane.label}, served over HTTP with Range on loopback",
        "nodes": f"{lane.nodes} x noderuntime up --model URL --memory-limit {memplan.human(lane.limit)} "
        "(no --layers), each in a memory cgroup of that limit",
        "whole": "one noderuntime up on the file, weights mapped, no limit",
        "llama_server": f"llama-server --parallel {SLOTS} --batch-size {BATCH} --ubatch-size {BATCH}"
        if lane.llama_server
        else None,
        "slots": SLOTS,
        "ctx_per_session": CTX,
        "batch": BATCH,
        **recipe().describe("Q4_0"),
    }
    _common.write(out, NAME, args, doc_recipe, figures)
    png = out.with_suffix(".png")
    plot_png(png, figures)
    print(
        _common.table(
            ["node", "fetched / share", "fetch s", "load s", "peak RSS GiB", "planned GiB", "limit GiB"],
            [
                [
                    n["layers"],
                    n["fetched_over_share"],
                    n["fetch_s"],
                    n["load_s"],
                    round(n["peak_rss_bytes"] / GiB, 2),
                    round(n["planned_bytes"] / GiB, 2),
                    round(n["limit_bytes"] / GiB, 2),
                ]
                for n in nodes
            ],
        )
    )
    rows = []
    for setup, result in (("route", route), ("whole", reference), ("llama-server", anchor)):
        if result is not None:
            rows.append(
                [
                    setup,
                    result["prefill_tokens_per_s"],
                    result["decode_tokens_per_s_1_client"],
                    result["decode_tokens_per_s_4_clients"],
                ]
            )
    print(_common.table(["setup", "prefill tok/s", "decode tok/s, 1", "decode tok/s, 4"], rows))
    print(json.dumps(figures["goals"]))
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
