"""Fit: a model about twice a node's memory cap, served by a route of capped nodes.

    python -m benchmarks.fit [--quick] [--moe] [--out PATH]

A random-weight Llama model is written straight in Q4_0 (``noderuntime models synth``):
an 8B-class shape (Llama-3-8B's: 32 layers, 4096 wide, 14336 FFN, 32/8 heads, 128256
vocabulary, 4.5 GB) with 2.5 GB caps, or with ``--quick`` a 3B-class shape
(1.5 GB) with 1 GB caps. ``--moe`` runs a Qwen3-MoE of Qwen3-30B-A3B's per-layer
shape instead (2048 wide, 128 experts of which 8 are used, expert FFN 768, 32/4 heads
of 128, 151936 vocabulary, untied): 12 layers (4.6 GB) with 2.75 GB caps (two nodes of six
layers; at 2.5 GB it takes three, one more than this machine's two cores serve well), or 5 layers
(2.1 GB) with 1.2 GB caps with ``--quick``. Every node process runs in its own cgroup with a hard
memory limit (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``), so an overrun is
an OOM kill, not a promise. The model is written once a machine and kept in the user
cache (``--keep-model PATH`` puts it elsewhere). The lane shows, in order:

1. admission: ``noderuntime up --memory-limit CAP`` for the whole model refuses to
   start, naming how many layers would fit;
2. the cap is real: the whole model forced into one capped process (``--no-mmap``,
   no ``--memory-limit``) is killed by the kernel;
3. the route: as few capped nodes as the admission plan needs (a dry run of each
   candidate range), even cuts, each ``noderuntime up --memory-limit CAP`` under its
   cap, tracker and gateway; completions streamed through the gateway: TTFT, decode
   tokens/s, every node's peak RSS against its cap;
4. for reference, the whole model uncapped in one process on this machine, measured
   the same way; the ratio route / whole.

The model is meaningless text; its speed and memory are real.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx

from benchmarks import _common
from noderuntime.engine import memplan
from noderuntime.engine.llama import Recipe
from noderuntime.models import synth
from noderuntime.models.artifacts import LayerRange
from noderuntime.services.cgroups import MemoryCap, available
from noderuntime.services.cluster import ManagedProcess, ProcessError, stop_all
from noderuntime.services.ready import GatewayReady, NodeReady, TrackerReady, expect
from noderuntime.testing.clusters import local_tracker_args

NAME = "fit"
SLOTS = 2
CTX = 512
BATCH = 64
THREADS = 2
PROMPT_WORDS = 32
NO_ISSUER = "00" * 32  # for a node that must refuse before it ever checks a ticket


@attrs.frozen
class Lane:
    """A model shape and the cap each node gets."""

    label: str
    shape: synth.ModelShape
    cap: int
    requests: int
    max_tokens: int
    prompt_words: int = PROMPT_WORDS

    @property
    def prompt(self) -> str:
        """The completion's prompt: ``t1 t2 ...``, as many words as the lane says."""
        return " ".join(f"t{i}" for i in range(1, self.prompt_words + 1))


QUICK = Lane(
    "3B-class (26 x 3072, Q4_0)",
    synth.ModelShape(n_layer=26, n_embd=3072, n_ff=8192, n_head=24, n_head_kv=8, n_vocab=32000),
    1_000_000_000,
    requests=1,  # make test's size: the capped route serves, its figures come from the full lane
    max_tokens=8,
    # a quarter of the full prompt: its prefill took 10 of the quick run's 58 s, twice (route
    # and whole); what the caps bound, weights, KV and compute buffers, is sized at load
    prompt_words=8,
)
FULL = Lane(
    "8B-class (Llama-3-8B shape, Q4_0)",
    synth.ModelShape(
        n_layer=32,
        n_embd=4096,
        n_ff=14336,
        n_head=32,
        n_head_kv=8,
        n_vocab=128256,
        rope_freq_base=500000.0,
        tied_output=False,
    ),
    2_500_000_000,
    requests=3,
    max_tokens=32,
)


MOE_QUICK = Lane(
    "Qwen3-30B-A3B shape, 5 layers (Q4_0)", synth.qwen3_30b_a3b_shape(5), 1_200_000_000, requests=2, max_tokens=16
)
MOE_FULL = Lane(
    "Qwen3-30B-A3B shape, 12 layers (Q4_0)", synth.qwen3_30b_a3b_shape(12), 2_750_000_000, requests=3, max_tokens=32
)


def recipe() -> Recipe:
    """What every node of the lane runs."""
    return memplan.capped(Recipe(n_threads=THREADS, n_ctx_per_seq=CTX, n_seq_max=SLOTS, n_batch=BATCH, n_ubatch=BATCH))


def plan(model: Path, n_layer: int, cap: int) -> list[LayerRange]:
    """As few ranges as fit ``cap`` each (greedy by dry run), then cut evenly when even cuts fit too."""
    r = recipe()
    greedy: list[LayerRange] = []
    start = 0
    while start < n_layer:
        fit = memplan.widest_fit(model, start, n_layer, r, cap)
        if fit is None:
            raise SystemExit(f"layer {start} alone does not fit a {memplan.human(cap)} cap")
        greedy.append(fit)
        start = fit.end
    count = len(greedy)
    cuts = [round(i * n_layer / count) for i in range(count + 1)]
    even = [LayerRange(a, b) for a, b in itertools.pairwise(cuts)]
    if all(memplan.needs(model, rng, r).total <= cap for rng in even):
        return even
    return greedy


def _node_args(model: Path, data: Path, extra: Sequence[str]) -> list[str]:
    return [
        "up",
        "--model",
        str(model),
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        str(data),
        "--slots",
        str(SLOTS),
        "--ctx",
        str(CTX),
        "--batch",
        str(BATCH),
        "--threads",
        str(THREADS),
        *extra,
    ]


def _model_file(shape: synth.ModelShape) -> str:
    """The model's file name in the user cache, by its shape: written once a machine (5 s for
    the quick lane's 1.5 GB on one core), as the other benchmarks keep their large models."""
    digest = hashlib.sha256(repr(shape).encode()).hexdigest()[:12]
    return f"fit-{shape.n_layer}x{shape.n_embd}-q4_0-{digest}.gguf"


def refusal(model: Path, cap: int, root: Path) -> dict[str, Any]:
    """The whole model on one node with ``--memory-limit``: it must refuse and say what fits."""
    started = time.monotonic()
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "noderuntime",
            *_node_args(model, root / "refuse", ["--issuer-key", NO_ISSUER, "--memory-limit", str(cap)]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    message = next((line for line in process.stderr.splitlines() if line.startswith("noderuntime: error:")), "")
    return {
        "exit_status": process.returncode,
        "message": message.removeprefix("noderuntime: error: "),
        "seconds": round(time.monotonic() - started, 1),
    }


def forced(model: Path, cap: int, root: Path) -> dict[str, Any]:
    """The whole model read into one capped process with no admission: the kernel must kill it."""
    limit = MemoryCap(cap, "forced")
    process = ManagedProcess(
        "forced", _node_args(model, root / "forced", ["--issuer-key", NO_ISSUER, "--no-mmap"]), cap=limit
    )
    started = time.monotonic()
    try:
        process.launch()
        assert process.proc is not None
        try:
            status = process.proc.wait(600)
        except subprocess.TimeoutExpired:
            status = None
        return {
            "exit_status": status,
            "killed_by_signal": -status if status is not None and status < 0 else None,
            "oom_kills": limit.oom_kills(),
            "cgroup_peak_bytes": limit.peak(),
            "seconds": round(time.monotonic() - started, 1),
        }
    finally:
        process.stop()
        limit.remove()


@contextmanager
def serving(model: Path, ranges: Sequence[LayerRange | None], cap: int | None, root: Path) -> Iterator[dict[str, Any]]:
    """Tracker, one node per range (capped when ``cap``), gateway; yields their handles."""
    processes: list[ManagedProcess] = []
    caps: list[MemoryCap] = []

    try:
        processes.append(ManagedProcess("tracker", local_tracker_args(root / "tracker")))
        tracker = expect(processes[0].start(120), TrackerReady)
        nodes = []
        for i, layers in enumerate(ranges):
            extra = ["--tracker", tracker.url]
            if layers is not None:
                extra += ["--layers", str(layers)]
            limit = None
            if cap is not None:
                limit = MemoryCap(cap, f"node{i}")
                caps.append(limit)
                extra += ["--memory-limit", str(cap)]
            else:
                extra += ["--no-mmap"]  # like for like: the capped nodes read their weights too
            nodes.append(
                (ManagedProcess(f"node{i}", _node_args(model, root / f"node{i}", extra), cap=limit), limit, layers)
            )
        gateway = ManagedProcess(
            "gateway",
            [
                "gateway",
                "--data-dir",
                str(root / "gateway"),
                "--tracker",
                tracker.url,
                "--listen",
                "127.0.0.1:0",
                "--model",
                f"fit={model}",
                "--ctx",
                str(CTX),
                "--ledger",
                str(root / "ledger.sqlite"),
            ],
        )
        # the nodes and the gateway start together, each in its own cgroup: one after the
        # other they took 12 s of a quick run, together about half of that
        starting = [node for node, _, _ in nodes] + [gateway]
        processes.extend(starting)
        for process in starting:
            process.launch()
        for node, _, _ in nodes:
            expect(node.wait_ready(600), NodeReady)
        ready = expect(gateway.wait_ready(120), GatewayReady)
        yield {"gateway": ready.url, "nodes": nodes}
    finally:
        stop_all(processes)
        for limit in caps:
            limit.remove()


def _wait_routable(gateway: str, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while True:
        response = httpx.post(
            gateway + "/v1/completions", json={"model": "fit", "prompt": "t1", "max_tokens": 1}, timeout=600
        )
        if response.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the route never served: {response.text}")
        time.sleep(0.25)


def stream_completion(base: str, model: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion (text or token ids) of an OpenAI API at ``base``: when it
    began and ended, the times its text chunks came, its tokens (the usage's, else the chunks')."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    began = time.perf_counter()
    times: list[float] = []
    tokens = 0
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=1800) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"the completion failed: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0].get("text"):
                times.append(time.perf_counter())
    return {"began": began, "ended": time.perf_counter(), "times": times, "tokens": tokens or len(times)}


def generate(gateway: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One streamed greedy completion: TTFT, decode tokens/s, tokens."""
    run = stream_completion(gateway, "fit", prompt, max_tokens)
    times, tokens = run["times"], run["tokens"]
    if not times:
        raise SystemExit("no token came back")
    decode = (tokens - 1) / (times[-1] - times[0]) if tokens > 1 and times[-1] > times[0] else float("nan")
    return {"ttft_s": times[0] - run["began"], "decode_tokens_per_s": decode, "tokens": tokens}


def measure(system: dict[str, Any], lane: Lane) -> dict[str, Any]:
    """Warm the route once, then the lane's requests; medians, and each node's memory."""
    _wait_routable(system["gateway"])
    runs = [generate(system["gateway"], lane.prompt, lane.max_tokens) for _ in range(lane.requests)]
    nodes = []
    for node, limit, layers in system["nodes"]:
        status = httpx.get(expect(node.info, NodeReady).http + "/status", timeout=10).json()
        nodes.append(
            {
                "layers": str(layers) if layers is not None else "all",
                "alive": node.alive(),
                "peak_rss_bytes": _common.peak_rss(node.pid),
                "cap_bytes": limit.limit if limit is not None else None,
                "cgroup_peak_bytes": limit.peak() if limit is not None else None,
                "oom_kills": limit.oom_kills() if limit is not None else None,
                "llama_memory_bytes": (status.get("capability") or {}).get("memory_bytes"),
            }
        )
    return {
        "ttft_s": _median([r["ttft_s"] for r in runs]),
        "decode_tokens_per_s": _median([r["decode_tokens_per_s"] for r in runs]),
        "runs": runs,
        "nodes": nodes,
    }


def _median(values: list[float]) -> float:
    return round(_common.percentile(values, 50), 3)


def plot_png(path: Path, figures: dict[str, Any]) -> None:
    """Peak RSS of each capped node against its cap, and decode speed route vs whole."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = figures["route"]["nodes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4), dpi=110, gridspec_kw={"width_ratios": [2, 1]})
    labels = [n["layers"] for n in nodes]
    left.bar(labels, [n["peak_rss_bytes"] / 2**30 for n in nodes], color="#4477aa", label="peak RSS")
    left.axhline(figures["cap_bytes"] / 2**30, color="#cc3311", linestyle="--", label="cap per node")
    left.axhline(figures["model_bytes"] / 2**30, color="#777777", linestyle=":", label="whole model file")
    left.set_ylabel("GiB")
    left.set_xlabel("node (layers)")
    left.set_title("capped nodes of the route")
    left.legend(loc="upper left", fontsize=8)
    speeds = [figures["route"]["decode_tokens_per_s"], figures["whole"]["decode_tokens_per_s"]]
    right.bar(["route", "whole, 1 process"], speeds, color=["#4477aa", "#999999"])
    right.set_ylabel("decode tokens/s")
    right.set_title(f"ratio {figures['ratio_route_to_whole']['decode']:.2f}")
    fig.suptitle(figures["lane"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    """Run the fit lane and write its JSON and PNG."""
    parser = _common.parser(NAME, __doc__ or "")
    parser.add_argument("--keep-model", type=Path, help="write (or reuse) the model here instead of the user cache")
    parser.add_argument("--moe", action="store_true", help="the Qwen3-30B-A3B-shape mixture of experts")
    args = parser.parse_args()
    lanes = {(False, False): FULL, (False, True): QUICK, (True, False): MOE_FULL, (True, True): MOE_QUICK}
    lane = lanes[args.moe, args.quick]
    out = _common.out_path(NAME, args)
    if args.moe and args.out is None:
        out = out.with_name(out.name.replace("fit", "fit-moe", 1))
    reason = available()
    if reason is not None:
        raise SystemExit(f"the fit lane needs memory cgroups: {reason}")

    with tempfile.TemporaryDirectory(prefix="fit-") as tmp:
        root = Path(tmp)
        model = args.keep_model or _common.cache_dir(NAME) / _model_file(lane.shape)
        started = time.monotonic()
        cached = model.exists()
        if not cached:
            model.parent.mkdir(parents=True, exist_ok=True)
            synth.write_model(model, lane.shape, quant="Q4_0", name=f"fit-{lane.shape.n_layer}x{lane.shape.n_embd}")
        synth_seconds = time.monotonic() - started
        model_bytes = model.stat().st_size
        how = "kept from an earlier run" if cached else f"written in {synth_seconds:.0f} s"
        print(f"model: {lane.label}, {model_bytes / 1e9:.2f} GB, {how}", flush=True)

        whole = memplan.needs(model, LayerRange(0, lane.shape.n_layer), recipe())
        ranges = plan(model, lane.shape.n_layer, lane.cap)
        planned = [memplan.needs(model, r, recipe()) for r in ranges]
        print("plan: " + ", ".join(f"{n.layers} {memplan.human(n.total)}" for n in planned), flush=True)

        refused = refusal(model, lane.cap, root)
        print(f"admission: exit {refused['exit_status']}: {refused['message']}", flush=True)
        killed = forced(model, lane.cap, root)
        print(f"forced: exit {killed['exit_status']}, OOM kills {killed['oom_kills']}", flush=True)

        try:
            with serving(model, ranges, lane.cap, root / "route") as system:
                route = measure(system, lane)
            with serving(model, [None], None, root / "whole") as system:
                reference = measure(system, lane)
        except ProcessError as exc:
            raise SystemExit(str(exc)) from None

    figures: dict[str, Any] = {
        "lane": lane.label,
        "shape": attrs.asdict(lane.shape),
        "prompt_words": lane.prompt_words,
        "model_bytes": model_bytes,
        "synth_seconds": round(synth_seconds, 1),
        "model_cached": cached,
        "cap_bytes": lane.cap,
        "model_to_cap": round(model_bytes / lane.cap, 2),
        "whole_needs_bytes": whole.total,
        "plan": [
            {"layers": str(n.layers), "needs_bytes": n.total, "weights": n.weights, "kv": n.kv, "compute": n.compute}
            for n in planned
        ],
        "admission_refused": refused,
        "forced_whole_capped": killed,
        "route": route,
        "whole": reference,
        "ratio_route_to_whole": {
            "decode": round(route["decode_tokens_per_s"] / reference["decode_tokens_per_s"], 3),
            "ttft": round(route["ttft_s"] / reference["ttft_s"], 3),
        },
        "every_node_under_cap": all(
            n["alive"] and n["oom_kills"] == 0 and n["peak_rss_bytes"] < lane.cap for n in route["nodes"]
        ),
    }
    doc_recipe = {
        "model": f"random-weight {lane.shape.arch}, {lane.label}",
        "quant": "Q4_0",
        "slots": SLOTS,
        "ctx": CTX,
        "batch": BATCH,
        "mmap": False,
        **recipe().describe("Q4_0"),
    }
    _common.write(out, NAME, args, doc_recipe, figures)
    png = out.with_suffix(".png")
    plot_png(png, figures)
    print(
        _common.table(
            ["node", "peak RSS GiB", "cap GiB", "OOM kills"],
            [
                [n["layers"], round(n["peak_rss_bytes"] / 2**30, 2), round(lane.cap / 2**30, 2), n["oom_kills"]]
                for n in route["nodes"]
            ],
        )
    )
    print(
        _common.table(
            ["setup", "TTFT s", "decode tok/s"],
            [
                ["route (capped)", route["ttft_s"], route["decode_tokens_per_s"]],
                ["whole (1 process)", reference["ttft_s"], reference["decode_tokens_per_s"]],
                [
                    "ratio route/whole",
                    figures["ratio_route_to_whole"]["ttft"],
                    figures["ratio_route_to_whole"]["decode"],
                ],
            ],
        )
    )
    print(f"wrote {out} and {png}")
    if not math.isfinite(route["decode_tokens_per_s"]) or not figures["every_node_under_cap"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
