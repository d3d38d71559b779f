"""Gate E: a 2-shard GGUF route vs a 2-shard safetensors route on this machine.

    python -m benchmarks.gate_e [--quick] [--out PATH]

Each route is two real ``noderuntime up`` processes (layers 0:15 and 15:30 of the demo
model, one thread each on this 2-core machine, a gRPC seam on loopback): llama.cpp on
the GGUF files (the original Q4_1 and the Q8_0 lane) and the Transformers backend on
the BF16 and F32 safetensors lanes, all made from the same weights by
``noderuntime.verify.lanes``. Routes run one after another, never two at once.

The same client loop drives each route with the Gate A prompts: concurrency 1 (each
prompt alone: TTFT, decode tok/s) and 8 (eight sessions at once: TTFT p50/max and
aggregate tok/s), greedy. Per shard: peak RSS (VmHWM). Quality drift: how many greedy
tokens each route's output shares with the whole F32 Transformers model's before the
first difference (the teacher-forced KL of the same weights and engines is Gate A's).
JSON and a PNG beside it. ``--quick`` runs one route of each backend (Q4_1, F32) on
short prompts.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from benchmarks import _common

NAME = "gate_e"
ROUTES = {  # name -> (lane, backend flag)
    "gguf-q4_1": ("gguf-q4_1", "llama.cpp"),
    "gguf-q8_0": ("gguf-q8_0", "llama.cpp"),
    "hf-bf16": ("hf-bf16", "transformers"),
    "hf-f32": ("hf-f32", "transformers"),
}
CUTS = (0, 15, 30)


def _settings(quick: bool) -> dict[str, Any]:
    if quick:  # one route of each backend
        return {
            "routes": ["gguf-q4_1", "hf-f32"],
            "prompts": ["short", "128"],
            "new_tokens": 12,
            "c8_prompt": "short",
            "c8_tokens": 12,
        }
    return {
        "routes": list(ROUTES),
        "prompts": ["short", "128", "512", "1024"],
        "new_tokens": 48,
        "c8_prompt": "128",
        "c8_tokens": 48,
    }


async def _generation(cluster: Any, dialer: Any, prompt: list[int], n: int) -> dict[str, Any]:
    from noderuntime.seams.client import GenerationRequest

    started = time.perf_counter()
    arrivals: list[float] = []
    async with cluster.open(dialer, GenerationRequest(tuple(prompt), n)) as gen:
        while await gen.next() is not None:
            arrivals.append(time.perf_counter())
    tokens = list(gen.tokens)
    return {"started": started, "arrivals": arrivals, "tokens": tokens}


async def _measure(cluster: Any, prompts: dict[str, list[int]], settings: dict[str, Any]) -> dict[str, Any]:
    from noderuntime.seams.dialer import open_dialer

    out: dict[str, Any] = {"c1": {"prompts": {}}, "outputs": {}}
    async with open_dialer() as dialer:
        await _generation(cluster, dialer, prompts[settings["prompts"][0]], 4)  # connections, caches
        for name in settings["prompts"]:
            g = await _generation(cluster, dialer, prompts[name], settings["new_tokens"])
            arrivals = g["arrivals"]
            gaps = [b - a for a, b in itertools.pairwise(arrivals)]
            out["c1"]["prompts"][name] = {
                "prompt_tokens": len(prompts[name]),
                "ttft_ms": (arrivals[0] - g["started"]) * 1e3,
                "decode_tok_s": len(gaps) / sum(gaps),
                "token_ms_p50": _common.percentile(gaps, 50) * 1e3,
                "token_ms_p95": _common.percentile(gaps, 95) * 1e3,
            }
            out["outputs"][name] = g["tokens"]
        by_prompt = out["c1"]["prompts"].values()
        for key in ("decode_tok_s", "token_ms_p50", "token_ms_p95"):
            out["c1"][key] = statistics.median(x[key] for x in by_prompt)
        results: list[dict[str, Any]] = []
        prompt = prompts[settings["c8_prompt"]]
        t0 = time.perf_counter()

        async def one() -> None:
            results.append(await _generation(cluster, dialer, prompt, settings["c8_tokens"]))

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(one)
        wall = time.perf_counter() - t0
        ttfts = [r["arrivals"][0] - r["started"] for r in results]
        gaps = [b - a for r in results for a, b in itertools.pairwise(r["arrivals"])]
        out["c8"] = {
            "prompt_tokens": len(prompt),
            "ttft_ms_p50": _common.percentile(ttfts, 50) * 1e3,
            "ttft_ms_max": max(ttfts) * 1e3,
            "tok_s": sum(len(r["tokens"]) for r in results) / wall,
            "token_ms_p50": _common.percentile(gaps, 50) * 1e3,
            "token_ms_p95": _common.percentile(gaps, 95) * 1e3,
            "wall_s": wall,
        }
        out["c8_outputs"] = [r["tokens"] for r in results]
    return out


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    routes = doc["figures"]["routes"]
    names = list(routes)
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(12, 4), dpi=110)
    axes[0].bar(x - 0.2, [routes[n]["c1"]["decode_tok_s"] for n in names], 0.4, label="c1 decode tok/s")
    axes[0].bar(x + 0.2, [routes[n]["c8"]["tok_s"] for n in names], 0.4, label="c8 tok/s (all sessions)")
    axes[0].set_title("2-shard route throughput (higher is better)")
    axes[0].legend()
    axes[1].bar(x, [routes[n]["c1"]["prompts"][doc["recipe"]["settings"]["prompts"][-1]]["ttft_ms"] for n in names])
    axes[1].set_title(f"TTFT ms, {doc['recipe']['settings']['prompts'][-1]}-token prompt, c1")
    width = 0.4
    for i, offset in ((0, -width / 2), (1, width / 2)):
        axes[2].bar(x + offset, [routes[n]["peak_rss_bytes"][i] / 2**20 for n in names], width, label=f"shard {i}")
    axes[2].set_title("peak RSS per shard, MiB")
    axes[2].legend()
    for ax in axes:
        ax.set_xticks(x, names, rotation=25, ha="right")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    from benchmarks.gate_a import load_prompts
    from noderuntime.engine.base import transformers_versions
    from noderuntime.engine.llama import Vocab, build_info
    from noderuntime.engine.torch_backend import whole_model_greedy
    from noderuntime.models import catalogue as models
    from noderuntime.testing.clusters import running_cluster
    from noderuntime.verify import lanes

    args = _common.parser(NAME, __doc__.split("\n\n")[0]).parse_args(argv)
    settings = _settings(args.quick)
    source = models.pull(progress=False)
    built = lanes.build(source)
    vocab = Vocab(source)
    prompts = load_prompts(vocab, settings["prompts"])
    print("gate_e: reference greedy outputs from the whole F32 Transformers model", flush=True)
    reference = dict(
        zip(
            prompts,
            whole_model_greedy(built["hf-f32"].path, list(prompts.values()), settings["new_tokens"]),
            strict=True,
        )
    )
    figures: dict[str, Any] = {"routes": {}}
    for name in settings["routes"]:
        lane, backend = ROUTES[name]
        print(f"gate_e: route {name} ({backend}, layers {CUTS[0]}:{CUTS[1]} | {CUTS[1]}:{CUTS[2]})", flush=True)
        with (
            tempfile.TemporaryDirectory() as tmp,
            running_cluster(
                built[lane].path,
                list(CUTS),
                Path(tmp),
                extra=["--backend", backend],
                slots=8,
                ctx=2048,
                threads=1,
            ) as cluster,
        ):
            figs = trio.run(_measure, cluster, prompts, settings)
            figs["peak_rss_bytes"] = [_common.peak_rss(p.pid) for p in cluster.nodes]
        figs["backend"] = backend
        figs["lane"] = lane
        figs["size_bytes"] = built[lane].size_bytes()
        figs["greedy_prefix_match"] = {
            k: next((i for i, (a, b) in enumerate(zip(v, reference[k], strict=False)) if a != b), len(v))
            for k, v in figs["outputs"].items()
        }
        c8_ref = reference.get(settings["c8_prompt"])
        figs["c8_outputs_equal"] = all(out == figs["c8_outputs"][0] for out in figs["c8_outputs"])
        if c8_ref is not None:
            figs["c8_outputs_equal_c1"] = figs["c8_outputs"][0] == figs["outputs"][settings["c8_prompt"]]
        del figs["c8_outputs"]
        figures["routes"][name] = figs
    best_hf = max(
        (n for n in settings["routes"] if ROUTES[n][1] == "transformers"),
        key=lambda n: figures["routes"][n]["c1"]["decode_tok_s"],
    )
    gguf = "gguf-q4_1"
    figures["gguf_vs_best_safetensors"] = {
        "safetensors_route": best_hf,
        "c1_decode_ratio": figures["routes"][gguf]["c1"]["decode_tok_s"]
        / figures["routes"][best_hf]["c1"]["decode_tok_s"],
        "c8_tok_s_ratio": figures["routes"][gguf]["c8"]["tok_s"] / figures["routes"][best_hf]["c8"]["tok_s"],
    }
    recipe = {
        "llama_cpp": {**build_info(), "threads_per_shard": 1},
        "transformers": {**transformers_versions(), "threads_per_shard": 1},
        "cuts": list(CUTS),
        "seam": "gRPC on loopback",
        "sampling": "greedy",
        "settings": settings,
    }
    out = _common.out_path(NAME, args)
    doc = _common.write(out, NAME, args, recipe, figures)
    _plot(doc, out.with_suffix(".png"))
    rows = []
    for name, f in figures["routes"].items():
        longest = settings["prompts"][-1]
        rows.append(
            [
                name,
                f["c1"]["decode_tok_s"],
                f["c1"]["prompts"][longest]["ttft_ms"],
                f["c8"]["tok_s"],
                f["c8"]["ttft_ms_p50"],
                "/".join(f"{r / 2**20:.0f}" for r in f["peak_rss_bytes"]),
                min(f["greedy_prefix_match"].values()),
            ]
        )
    print(
        _common.table(
            ["route", "c1 tok/s", f"TTFT ms ({longest})", "c8 tok/s", "c8 TTFT p50", "RSS MiB", "min match"], rows
        )
    )
    print(f"wrote {out}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
