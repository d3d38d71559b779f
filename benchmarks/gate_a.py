"""Gate A: Transformers/safetensors vs llama.cpp/GGUF on the same weights, speed and quality.

    python -m benchmarks.gate_a [--quick] [--out PATH] [--lanes NAME,...]

The lanes (``noderuntime.verify.lanes``) all come from the demo model's weights: float32 and
bfloat16 safetensors run by Transformers (``noderuntime.engine.torch_backend``), and GGUF F32, F16,
Q8_0, Q4_K_M (llama.cpp's quantizer) and the original Q4_1 run by the patched llama.cpp.
Both engines are driven through the same interface by the same loop: the committed
prompts (``benchmarks/data/gate_a_prompts.json``, 32 to 1024 tokens) tokenized once,
prefilled in chunks of at most 512, then greedy decoding of a fixed number of tokens;
two threads pinned to the same two cores; concurrency 1 (each prompt alone) and 8 (eight sessions prefilled one at a
time, then decoded in one batch per step, as a node's scheduler runs them).

Per lane: TTFT, prefill tok/s, decode tok/s, p50/p95 per-token latency, peak RSS (each
lane runs in its own process; RSS is read before the quality pass), weights on disk,
and quality against the F32 Transformers lane: top-1 agreement and mean KL divergence
over teacher-forced positions of ``benchmarks/data/public_domain.txt``, and perplexity.

The result is a contract (``noderuntime.verify.contract``): the sha256 of every input, the
recipes, library versions, the machine, the figures and the thresholds this run locks
(each measured figure with a stated margin for noise), signed with Ed25519.
``noderuntime bench verify FILE [--rerun]`` checks it. A Markdown summary and a PNG go
beside the JSON.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _common
from noderuntime.engine.cores import machine_cores

NAME = "gate_a"
DATA = Path(__file__).resolve().parent / "data"
PROMPTS = DATA / "gate_a_prompts.json"
TEXT = DATA / "public_domain.txt"
# two, or one per core this process may run on where that is fewer: make test runs the quick
# form on a worker pinned to one core, where two threads wait for each other at every barrier
# (there it took 59 s with two threads, 53 s with one)
THREADS = min(2, len(machine_cores()))
CHUNK = 512  # prefill chunk (llama.cpp n_batch)
REFERENCE = "hf-f32"
BASELINE = "hf-bf16"  # the Transformers lane the GGUF lanes are held against

# how the run locks its thresholds from what it measured: a speed ratio may fall to this
# share of the measured one, a quality figure may move by these margins
SPEED_MARGIN = 0.7
TOP1_MARGIN = 0.03
KL_FACTOR = 1.5
PPL_FACTOR = 1.05


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "prompts": ["short", "128"],
            "new_tokens": 12,
            "c8_prompt": "short",
            "c8_tokens": 12,
            "text_tokens": 256,
        }
    return {
        "prompts": ["short", "128", "512", "1024"],
        "new_tokens": 64,
        "c8_prompt": "128",
        "c8_tokens": 64,
        "text_tokens": 1024,
    }


def load_prompts(vocab: Any, names: list[str]) -> dict[str, list[int]]:
    """The committed prompts named ``names``, as token ids of the demo model's tokenizer."""
    doc = json.loads(PROMPTS.read_text())
    return {
        p["id"]: vocab.tokenize(p["text"], add_special=vocab.add_bos, parse_special=True)
        for p in doc["prompts"]
        if p["id"] in names
    }


def _engine(backend: str, path: str, output_hidden: bool = False) -> Any:
    if backend == "transformers":
        from noderuntime.engine.torch_backend import TorchEngine, TorchRecipe

        return TorchEngine(path, TorchRecipe(n_threads=THREADS, n_ctx_per_seq=2048, n_seq_max=8, n_batch=CHUNK))
    from noderuntime.engine.llama import Recipe, ShardEngine

    recipe = Recipe(n_threads=THREADS, n_ctx_per_seq=2048, n_seq_max=8, n_batch=CHUNK, n_ubatch=CHUNK)
    return ShardEngine(path, recipe)


def _rows(seq: int, start: int, tokens: list[int], *, all_outputs: bool = False) -> Any:
    from noderuntime.engine.base import Rows

    n = len(tokens)
    outputs = np.ones(n, dtype=bool) if all_outputs else np.arange(n) == n - 1
    return Rows(
        np.full(n, seq, dtype=np.int32),
        np.arange(start, start + n, dtype=np.int32),
        outputs,
        tokens=np.asarray(tokens, dtype=np.int32),
    )


def _prefill(engine: Any, seq: int, prompt: list[int], sampler: Any) -> int:
    """Prefill ``prompt`` into ``seq`` and sample the first token."""
    token = -1
    for start in range(0, len(prompt), CHUNK):
        chunk = prompt[start : start + CHUNK]
        last = start + len(chunk) == len(prompt)
        result = engine.run(_rows(seq, start, chunk), samplers={len(chunk) - 1: sampler} if last else None)
        if last:
            token = result.sampled[len(chunk) - 1]
    return token


def _decode(engine: Any, seqs: list[int], positions: list[int], tokens: list[int], samplers: list[Any]) -> list[int]:
    from noderuntime.engine.base import Rows

    n = len(seqs)
    rows = Rows(
        np.asarray(seqs, dtype=np.int32),
        np.asarray(positions, dtype=np.int32),
        np.ones(n, dtype=bool),
        tokens=np.asarray(tokens, dtype=np.int32),
    )
    result = engine.run(rows, samplers=dict(enumerate(samplers)))
    return [result.sampled[i] for i in range(n)]


def _speed(engine: Any, prompts: dict[str, list[int]], settings: dict[str, Any]) -> dict[str, Any]:
    from protocol import Sampling

    greedy = Sampling()
    out: dict[str, Any] = {"c1": {"prompts": {}}, "outputs": {}}
    # one untimed pass warms caches and allocators (both engines grow buffers on first use)
    warm = engine.new_sampler(greedy)
    _prefill(engine, 0, prompts[settings["prompts"][0]][:16], warm)
    engine.remove_sequence(0)
    for name in settings["prompts"]:
        prompt = prompts[name]
        sampler = engine.new_sampler(greedy, prompt)
        t0 = time.perf_counter()
        token = _prefill(engine, 0, prompt, sampler)
        ttft = time.perf_counter() - t0
        generated = [token]
        steps = []
        for i in range(settings["new_tokens"] - 1):
            t = time.perf_counter()
            token = _decode(engine, [0], [len(prompt) + i], [token], [sampler])[0]
            steps.append(time.perf_counter() - t)
            generated.append(token)
        engine.remove_sequence(0)
        out["c1"]["prompts"][name] = {
            "prompt_tokens": len(prompt),
            "ttft_ms": ttft * 1e3,
            "prefill_tok_s": len(prompt) / ttft,
            "decode_tok_s": len(steps) / sum(steps),
            "token_ms_p50": _common.percentile(steps, 50) * 1e3,
            "token_ms_p95": _common.percentile(steps, 95) * 1e3,
        }
        out["outputs"][name] = generated
    # concurrency 8: prefills one at a time, then every session decoded in one batch per step
    prompt = prompts[settings["c8_prompt"]]
    samplers = [engine.new_sampler(greedy, prompt) for _ in range(8)]
    t0 = time.perf_counter()
    firsts, ttfts = [], []
    for seq in range(8):
        firsts.append(_prefill(engine, seq, prompt, samplers[seq]))
        ttfts.append(time.perf_counter() - t0)
    tokens, steps = firsts, []
    for i in range(settings["c8_tokens"] - 1):
        t = time.perf_counter()
        tokens = _decode(engine, list(range(8)), [len(prompt) + i] * 8, tokens, samplers)
        steps.append(time.perf_counter() - t)
    for seq in range(8):
        engine.remove_sequence(seq)
    out["c8"] = {
        "prompt_tokens": len(prompt),
        "ttft_ms_p50": _common.percentile(ttfts, 50) * 1e3,
        "ttft_ms_max": max(ttfts) * 1e3,
        "prefill_tok_s": 8 * len(prompt) / ttfts[-1],
        "decode_tok_s": 8 * len(steps) / sum(steps),
        "token_ms_p50": _common.percentile(steps, 50) * 1e3,
        "token_ms_p95": _common.percentile(steps, 95) * 1e3,
    }
    return out


def _teacher_forced(engine: Any, tokens: list[int]) -> np.ndarray:
    """Logits of every position of ``tokens`` (float32 [n, n_vocab])."""
    parts = []
    for start in range(0, len(tokens), CHUNK):
        chunk = tokens[start : start + CHUNK]
        parts.append(engine.run(_rows(0, start, chunk, all_outputs=True), want_logits=True).logits)
    engine.remove_sequence(0)
    return np.concatenate(parts)


def _lane_cores() -> list[int]:
    """The cores every lane runs on: the first THREADS of those this process may use."""
    return list(machine_cores()[:THREADS])


def _lane(
    conn: Any,
    backend: str,
    path: str,
    prompts: dict[str, list[int]],
    text: list[int],
    settings: dict[str, Any],
    logits_out: str,
) -> None:
    try:
        # pin the lane to the same cores, whichever engine starts its threads
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(_lane_cores()))
        t0 = time.perf_counter()
        engine = _engine(backend, path)
        figures: dict[str, Any] = {"load_s": time.perf_counter() - t0}
        figures.update(_speed(engine, prompts, settings))
        figures["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        np.save(logits_out, _teacher_forced(engine, text))
        engine.close()
        conn.send(("ok", figures))
    except BaseException as exc:  # reported to the parent, which fails the run; re-raised
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _run_lane(
    backend: str, path: Path, prompts: dict[str, list[int]], text: list[int], settings: dict[str, Any], logits_out: Path
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_lane, args=(child, backend, str(path), prompts, text, settings, str(logits_out)))
    proc.start()
    status, payload = parent.recv()
    proc.join()
    if status != "ok":
        raise SystemExit(f"lane {path}: {payload}")
    result: dict[str, Any] = payload
    return result


def _quality(ref_lp: np.ndarray, lane: np.ndarray, text: list[int]) -> dict[str, float]:
    """Top-1 agreement, mean KL(reference || lane) and perplexity of the next tokens.

    ``ref_lp`` is the reference's log-softmax, made once for every lane.
    """
    from noderuntime.verify.agreement import log_softmax

    lane_lp = log_softmax(lane)
    kl = (np.exp(ref_lp) * (ref_lp - lane_lp)).sum(axis=1)
    targets = np.asarray(text[1:])
    nll = -lane_lp[np.arange(len(targets)), targets]
    return {
        "top1_agreement": float(np.mean(ref_lp.argmax(axis=1) == lane_lp.argmax(axis=1))),
        "kl_mean": float(kl.mean()),
        "kl_p95": float(np.percentile(kl, 95)),
        "perplexity": float(math.exp(nll.mean())),
        "positions": len(text),
    }


def _floor(value: float, digits: int = 2) -> float:
    scale = 10.0**digits
    return math.floor(value * scale) / scale


def _ceil(value: float, digits: int = 4) -> float:
    scale = 10.0**digits
    return math.ceil(value * scale) / scale


def _thresholds(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """The claims this run locks, each from its measured figure with the stated margin."""
    from noderuntime.verify import contract

    lanes = figures["lanes"]
    out: list[dict[str, Any]] = []
    for lane in ("gguf-q4_k_m", "gguf-q8_0", "gguf-q4_1"):
        if lane not in lanes or BASELINE not in lanes:
            continue
        for c in ("c1", "c8"):
            left, right = f"lanes.{lane}.{c}.decode_tok_s", f"lanes.{BASELINE}.{c}.decode_tok_s"
            ratio = contract.figure(figures, left) / contract.figure(figures, right)
            factor = _floor(ratio * SPEED_MARGIN)
            out.append(
                {
                    "id": f"{lane}-decode-{c}",
                    "left": left,
                    "op": ">=",
                    "right": right,
                    "factor": factor,
                    "text": f"{lane} decodes at least {factor}x as fast as {BASELINE} at concurrency {c[1:]} "
                    f"(measured {ratio:.2f}x)",
                }
            )
    for lane, q in figures["quality"].items():
        if lane == REFERENCE:
            continue
        top1 = _floor(q["top1_agreement"] - TOP1_MARGIN)
        out.append(
            {
                "id": f"{lane}-top1",
                "left": f"quality.{lane}.top1_agreement",
                "op": ">=",
                "value": top1,
                "text": f"{lane} agrees with {REFERENCE} on the top token at >= {top1:.0%} of positions",
            }
        )
        kl = _ceil(q["kl_mean"] * KL_FACTOR + 1e-4)
        out.append(
            {
                "id": f"{lane}-kl",
                "left": f"quality.{lane}.kl_mean",
                "op": "<=",
                "value": kl,
                "text": f"{lane} mean KL vs {REFERENCE} <= {kl}",
            }
        )
        ppl = _ceil(q["perplexity"] * PPL_FACTOR, 3)
        out.append(
            {
                "id": f"{lane}-ppl",
                "left": f"quality.{lane}.perplexity",
                "op": "<=",
                "value": ppl,
                "text": f"{lane} perplexity <= {ppl}",
            }
        )
    return out


def _summary(doc: dict[str, Any], path: Path) -> str:
    f = doc["figures"]
    lines = [
        "# Gate A: Transformers/safetensors vs llama.cpp/GGUF on the same weights",
        "",
        f"`{doc['command']}` on {doc['machine']['cpu']} ({doc['machine']['logical_cpus']} logical CPUs), "
        f"{doc['date']}, project {doc['project_commit']}. "
        f"llama.cpp {doc['recipe']['llama_cpp']['llama_cpp_commit'][:12]} "
        f"(patch {doc['recipe']['llama_cpp']['patch_hash'][:12]}), torch {doc['recipe']['transformers']['torch']}, "
        f"transformers {doc['recipe']['transformers']['transformers']}; {THREADS} threads, greedy.",
        "",
        "| lane | size MiB | peak RSS MiB | TTFT ms (c1, longest) | prefill tok/s | decode tok/s c1 "
        "| p50/p95 ms | decode tok/s c8 | top-1 | mean KL | ppl |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lane, figs in f["lanes"].items():
        q = f["quality"][lane]
        by_prompt = figs["c1"]["prompts"]
        longest = by_prompt[max(by_prompt, key=lambda k: by_prompt[k]["prompt_tokens"])]
        lines.append(
            f"| {lane} | {figs['size_bytes'] / 2**20:.0f} | {figs['peak_rss_bytes'] / 2**20:.0f} | "
            f"{longest['ttft_ms']:.0f} | {longest['prefill_tok_s']:.0f} | {figs['c1']['decode_tok_s']:.1f} | "
            f"{figs['c1']['token_ms_p50']:.1f}/{figs['c1']['token_ms_p95']:.1f} | {figs['c8']['decode_tok_s']:.1f} | "
            f"{q['top1_agreement']:.3f} | {q['kl_mean']:.4f} | {q['perplexity']:.2f} |"
        )
    lines += ["", "Thresholds locked by this run (`noderuntime bench verify` re-checks them):", ""]
    lines += [f"- `{t['id']}`: {t['text']}" for t in doc["thresholds"]]
    lines += ["", f"Contract: `{path.name}`, signed by `{doc['signature']['public_key']}`.", ""]
    return "\n".join(lines)


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = doc["figures"]
    names = list(f["lanes"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), dpi=110)
    x = np.arange(len(names))
    c1 = [f["lanes"][n]["c1"]["decode_tok_s"] for n in names]
    c8 = [f["lanes"][n]["c8"]["decode_tok_s"] for n in names]
    axes[0].bar(x - 0.2, c1, 0.4, label="concurrency 1")
    axes[0].bar(x + 0.2, c8, 0.4, label="concurrency 8")
    axes[0].set_title("decode tok/s (higher is better)")
    axes[0].legend()
    axes[1].bar(x, [f["lanes"][n]["peak_rss_bytes"] / 2**20 for n in names], 0.6, color="tab:gray")
    axes[1].set_title("peak RSS, MiB")
    axes[2].bar(x, [f["quality"][n]["kl_mean"] for n in names], 0.6, color="tab:red")
    axes[2].set_title(f"mean KL vs {REFERENCE} (lower is better)")
    for ax in axes:
        ax.set_xticks(x, names, rotation=35, ha="right")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    from noderuntime.engine.base import transformers_versions
    from noderuntime.engine.llama import Vocab, build_info, default_flash_attn
    from noderuntime.models import catalogue as models
    from noderuntime.verify import contract, lanes
    from noderuntime.verify.agreement import log_softmax

    p = _common.parser(NAME, __doc__.split("\n\n")[0])
    p.add_argument("--lanes", default="", help="comma-separated lane names (default: all)")
    args = p.parse_args(argv)
    settings = _settings(args.quick)
    source = models.pull(progress=False)
    all_lanes = lanes.build(source)
    chosen = [n.strip() for n in args.lanes.split(",") if n.strip()] or list(all_lanes)
    if REFERENCE not in chosen:
        chosen.insert(0, REFERENCE)
    unknown = [n for n in chosen if n not in all_lanes]
    if unknown:
        raise SystemExit(f"unknown lanes {unknown}; known: {', '.join(all_lanes)}")
    vocab = Vocab(source)
    prompts = load_prompts(vocab, settings["prompts"])
    text = vocab.tokenize(TEXT.read_text(), add_special=vocab.add_bos, parse_special=False)[: settings["text_tokens"]]

    inputs = {"prompts": contract.input_record(PROMPTS), "text": contract.input_record(TEXT)}
    figures: dict[str, Any] = {"lanes": {}, "quality": {}}
    with tempfile.TemporaryDirectory(prefix="gate_a-") as tmp:
        logits_path = {name: Path(tmp) / f"{name}.npy" for name in chosen}
        for name in chosen:
            lane = all_lanes[name]
            files = (
                [*sorted(lane.path.glob("*.safetensors")), lane.path / "config.json"]
                if lane.path.is_dir()
                else [lane.path]
            )
            for file in files:
                key = name if len(files) == 1 else f"{name}/{file.name}"
                inputs[key] = contract.input_record(file)
            print(f"gate_a: lane {name} ({lane.backend}, {lane.precision})", flush=True)
            lane_figs = _run_lane(lane.backend, lane.path, prompts, text, settings, logits_path[name])
            lane_figs["size_bytes"] = lane.size_bytes()
            lane_figs["backend"] = lane.backend
            lane_figs["precision"] = lane.precision
            # the headline single-session figures: medians over the prompts
            c1 = lane_figs["c1"]
            for key in ("decode_tok_s", "token_ms_p50", "token_ms_p95"):
                c1[key] = statistics.median(x[key] for x in c1["prompts"].values())
            figures["lanes"][name] = lane_figs
        # the reference's float64 log-softmax once, not once a lane (a second each on 2 vCPUs)
        ref_lp = log_softmax(np.load(logits_path[REFERENCE]))
        for name in chosen:
            figures["quality"][name] = _quality(ref_lp, np.load(logits_path[name]), text)
    ref_out = figures["lanes"][REFERENCE]["outputs"]
    for name in chosen:
        outs = figures["lanes"][name]["outputs"]
        figures["quality"][name]["greedy_prefix_match"] = {
            k: next((i for i, (a, b) in enumerate(zip(outs[k], ref_out[k], strict=True)) if a != b), len(outs[k]))
            for k in outs
        }
    doc: dict[str, Any] = {
        "contract": 1,
        "benchmark": f"benchmarks.{NAME}",
        "args": _args_without_out(list(argv if argv is not None else sys.argv[1:])),
        "command": f"python -m benchmarks.{NAME}" + (" --quick" if args.quick else ""),
        "quick": bool(args.quick),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "project_commit": _common.git_commit(),
        "machine": _common.machine(),
        "recipe": {
            "llama_cpp": {
                **build_info(),
                "threads": THREADS,
                "n_batch": CHUNK,
                "n_ubatch": CHUNK,
                "flash_attn": default_flash_attn("cpu"),
            },
            "transformers": {
                **transformers_versions(),
                "threads": THREADS,
                "attention": "per-sequence SDPA (noderuntime.engine.torch_backend)",
            },
            "sampling": "greedy",
            "cpu_affinity": _lane_cores(),
            "settings": settings,
            "lanes": {n: {"backend": all_lanes[n].backend, "precision": all_lanes[n].precision} for n in chosen},
            "threshold_margins": {
                "speed_ratio_share": SPEED_MARGIN,
                "top1_minus": TOP1_MARGIN,
                "kl_factor": KL_FACTOR,
                "perplexity_factor": PPL_FACTOR,
            },
        },
        "inputs": inputs,
        "figures": figures,
    }
    doc["thresholds"] = _thresholds(figures)
    signed = contract.sign(doc, contract.signing_key())
    out = _common.out_path(NAME, args)
    out.parent.mkdir(parents=True, exist_ok=True)
    contract.write(out, signed)
    out.with_suffix(".md").write_text(_summary(signed, out))
    _plot(signed, out.with_suffix(".png"))
    rows = []
    for name in chosen:
        lf, q = figures["lanes"][name], figures["quality"][name]
        rows.append(
            [
                name,
                lf["size_bytes"] / 2**20,
                lf["peak_rss_bytes"] / 2**20,
                lf["c1"]["decode_tok_s"],
                lf["c8"]["decode_tok_s"],
                q["top1_agreement"],
                q["kl_mean"],
                q["perplexity"],
            ]
        )
    print(_common.table(["lane", "MiB", "RSS MiB", "tok/s c1", "tok/s c8", "top-1", "KL", "ppl"], rows))
    results = contract.check(signed)
    print(contract.results_table(results))
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


def _args_without_out(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        if a.startswith("--out="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main()
