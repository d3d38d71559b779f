"""Gate F: Qwen3, Qwen3-MoE and Gemma 3 certified, at tiny and real per-layer shapes.

    python -m benchmarks.gate_f [--quick] [--out PATH]

For each architecture, in one run on this machine:

- parity (Gate B): shards in separate processes against the whole model, bit for bit,
  with a one-layer shard at each end, prefill of two prompts and 32 batched decode
  steps: tiny random Qwen3 and Qwen3-MoE, Gemma 3 270M on its real weights, and random
  files of Qwen3-8B's per-layer shape (4096 wide, 12288 FFN, 32/8 heads of 128, 151936
  vocabulary) and Qwen3-30B-A3B's (2048 wide, 128 experts of which 8 used, expert FFN
  768, 32/4 heads of 128) with as many layers as the lanes below fit in this machine's
  memory (8 and 12 here; 2 and 3 with ``--quick``);
- cross-implementation: a float32 route (float32 KV) against Transformers' own
  ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``Gemma3ForCausalLM`` on the same
  weights, teacher-forced: top-1 agreement and KL over 600 (tiny) and 768 (Gemma 3,
  real text past its 512-token window) tokens;
- Gemma 3 perplexity on ``benchmarks/data/public_domain.txt``: the Q4_K_M route, the
  whole Q4_K_M model, and Transformers on the same weights dequantized;
- mixture of experts, batching: decode tok/s at 1, 2, 4, 8 concurrent sessions for the
  raw engine and for one node (real protocol frames, the node's batcher), on the
  30B-A3B-shape and the 8B-shape files, so MoE scaling is read beside dense scaling;
- fit: ``python -m benchmarks.fit --moe`` (capped nodes, cgroups) is its own run; its
  JSON is read in if present.

Writes ``benchmarks/results/gate_f.json`` and a PNG of the batching scaling.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _common, concurrency

NAME = "gate_f"
TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
LEVELS = (1, 2, 4, 8)


def _shapes(quick: bool) -> dict[str, Any]:
    from noderuntime.models import synth

    return {
        "qwen3-8b-shape": synth.qwen3_8b_shape(2 if quick else 8),
        "qwen3-30b-a3b-shape": synth.qwen3_30b_a3b_shape(3 if quick else 12),
    }


def _end_cuts(n_layer: int) -> list[int]:
    """One-layer shards at both ends (and a middle one where there is room)."""
    if n_layer <= 2:
        return [0, 1, n_layer]
    return [0, 1, n_layer - 1, n_layer] if n_layer < 4 else [0, 1, n_layer // 2, n_layer - 1, n_layer]


def _parity(model: Path, n_layer: int) -> dict[str, Any]:
    from noderuntime.verify.parity import check_parity

    started = time.monotonic()
    report = check_parity(model, _end_cuts(n_layer), n_tokens=32, prompt_lengths=(23, 41))
    keep = ("cuts", "max_abs_diff_logits", "max_abs_diff_hidden", "greedy_tokens_equal", "parity", "shard_memory")
    return {**{k: report[k] for k in keep}, "seconds": round(time.monotonic() - started, 1)}


def _batching(model: Path, n_layer: int, new_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for lane in ("engine", "node"):
        out[lane] = {}
        for n in LEVELS:
            result = _common.in_fresh_process(concurrency._lane_main, lane, str(model), n_layer, n, new_tokens)
            out[lane][str(n)] = {k: round(v, 2) for k, v in result.items()}
    base = {lane: out[lane]["1"]["decode_tok_s"] for lane in out}
    out["gain_over_1_session"] = {
        lane: {str(n): round(out[lane][str(n)]["decode_tok_s"] / base[lane], 2) for n in LEVELS} for lane in base
    }
    out["node_over_engine"] = {
        str(n): round(out["node"][str(n)]["decode_tok_s"] / out["engine"][str(n)]["decode_tok_s"], 3) for n in LEVELS
    }
    return out


def plot_png(path: Path, batching: dict[str, Any]) -> None:
    """Decode gain over one session, MoE against dense, engine and node."""
    series: dict[str, tuple[Sequence[float], Sequence[float]]] = {
        f"{model} {lane}": (list(LEVELS), [batching[model]["gain_over_1_session"][lane][str(n)] for n in LEVELS])
        for model in batching
        for lane in ("engine", "node")
    }
    _common.plot(
        path,
        "Decode gain from batching: Qwen3-MoE (30B-A3B shape) vs dense (8B shape)",
        "concurrent sessions",
        "aggregate decode tok/s / 1 session",
        series,
        logx=True,
    )


def main() -> None:
    """Run every Gate F lane and write the JSON and PNG."""
    args = _common.parser(NAME, __doc__ or "").parse_args()
    from noderuntime.engine.cores import machine_cores
    from noderuntime.engine.llama import Recipe, Vocab
    from noderuntime.models import artifacts, synth
    from noderuntime.models import catalogue as models
    from noderuntime.verify import agreement

    out = _common.out_path(NAME, args)
    figures: dict[str, Any] = {"parity": {}, "agreement": {}, "batching": {}}
    gemma3 = models.pull("gemma3-270m", progress=False)
    with tempfile.TemporaryDirectory(prefix="gate-f-") as tmp:
        files: dict[str, tuple[Path, int]] = {}
        for name, shape in synth.TINY_SHAPES.items():
            files[f"tiny-{name}"] = (synth.write_model(Path(tmp) / f"{name}.gguf", shape, quant="Q8_0", seed=5), 4)
        for name, shape in _shapes(args.quick).items():
            started = time.monotonic()
            path = synth.write_model(Path(tmp) / f"{name}.gguf", shape, quant="Q4_0", embedding_quant="Q8_0")
            print(f"{name}: {path.stat().st_size / 1e9:.2f} GB in {time.monotonic() - started:.0f} s", flush=True)
            files[name] = (path, shape.n_layer)
        files["gemma3-270m"] = (gemma3, 18)

        for name, (path, n_layer) in files.items():
            figures["parity"][name] = _parity(path, n_layer)
            print(f"parity {name}: {figures['parity'][name]['parity']}", flush=True)

        tokens = [int(t) for t in np.random.default_rng(1).integers(0, 480, 600)]
        for name in ("tiny-qwen3", "tiny-qwen3moe"):
            path, _ = files[name]
            figures["agreement"][name] = agreement.check_agreement(path, [0, 1, 3, 4], tokens)
        text_tokens = Vocab(gemma3).tokenize(TEXT.read_text())[:768]
        figures["agreement"]["gemma3-270m"] = agreement.check_agreement(gemma3, [0, 1, 9, 18], text_tokens)
        for name, report in figures["agreement"].items():
            print(
                f"agreement {name}: top-1 {report['top1_agreement']:.4f}, mean KL {report['mean_kl']:.2e}", flush=True
            )

        ppl_tokens = Vocab(gemma3).tokenize(TEXT.read_text())[: 256 if args.quick else 1024]
        figures["gemma3_perplexity"] = agreement.check_perplexity(gemma3, [0, 9, 18], ppl_tokens)
        print(f"gemma3 perplexity: {figures['gemma3_perplexity']}", flush=True)

        new_tokens = 16 if args.quick else 32
        for name in ("qwen3-30b-a3b-shape", "qwen3-8b-shape"):
            path, n_layer = files[name]
            figures["batching"][name] = _batching(path, n_layer, new_tokens)
            print(f"batching {name}: {figures['batching'][name]['gain_over_1_session']}", flush=True)

        figures["files"] = {
            name: {"bytes": path.stat().st_size, "layers": n_layer, "fingerprint": artifacts.inspect(path).fingerprint}
            for name, (path, n_layer) in files.items()
        }
    fit = _common.RESULTS / ("fit-moe.quick.json" if args.quick else "fit-moe.json")
    if fit.exists():
        fitted = json.loads(fit.read_text())["figures"]
        figures["fit_moe"] = {
            "source": fit.name,
            "lane": fitted["lane"],
            "model_to_cap": fitted["model_to_cap"],
            "every_node_under_cap": fitted["every_node_under_cap"],
            "ratio_route_to_whole": fitted["ratio_route_to_whole"],
        }
    figures["certified"] = {
        "parity_all": all(r["parity"] for r in figures["parity"].values()),
        "agreement_all": all(
            r["top1_agreement"] >= 0.99 and r["mean_kl"] <= 1e-3 for r in figures["agreement"].values()
        ),
        "gemma3_route_within_2pct_of_transformers": abs(figures["gemma3_perplexity"]["route_over_transformers"] - 1)
        <= 0.02,
        "moe_gain_at_8_over_dense_gain_at_8": round(
            figures["batching"]["qwen3-30b-a3b-shape"]["gain_over_1_session"]["engine"]["8"]
            / figures["batching"]["qwen3-8b-shape"]["gain_over_1_session"]["engine"]["8"],
            3,
        ),
    }
    recipe = concurrency._recipe().describe("Q4_0/Q8_0/Q4_K_M")
    parity = Recipe(n_threads=len(machine_cores())).describe("as the file")  # check_parity's own recipe
    _common.write(out, NAME, args, {**recipe, "parity_recipe": parity}, figures)
    plot_png(out.with_suffix(".png"), figures["batching"])
    print(json.dumps(figures["certified"], indent=2))


if __name__ == "__main__":
    main()
