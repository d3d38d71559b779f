"""Backends: certify each GPU device found here for routes that mix it with CPU shards.

    python -m benchmarks.backends [--quick] [--out PATH] [--device vulkan:0] [--model PATH]

For each device of a GPU backend whose build is in the cache (``kernels_patch/build.py
--backend vulkan|cuda|hip --install``; a Vulkan software renderer such as llvmpipe counts
when there is no other Vulkan device): Gate B on the device (shards in separate processes
equal the whole model on that device, bit for bit); the mixed route, a CPU shard, a shard
on the device and a CPU shard, teacher-forced over at least 512 tokens against the whole
model on the CPU (top-1 agreement, mean and max KL); decode tok/s of each shard and of the
route, and of the whole model on the CPU; and, for context, the whole model on the device
against the whole model on the CPU (how far the backend alone moves the logits).

Each device's result is a contract (``noderuntime.verify.contract``), signed like Gate A's:
thresholds derived from what was measured, with margins, and under ``covers`` the
artifact and the pair of recipe fingerprints (CPU, device) it certifies, which
``noderuntime.verify.certificates.covered_pair`` reads back. ``noderuntime bench verify FILE``
checks it. Written to ``benchmarks/results/backends-<backend>-<device name>.json``.

The full run uses the demo model (SmolLM2-135M) with 4 of its 30 layers on the device and
the committed text; ``--quick`` a tiny random model written here (the same bytes each
time) and random tokens, which is what the tests run.
"""

from __future__ import annotations

import math
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _common

NAME = "backends"
TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
THREADS = 2
TOKENS = 512  # teacher-forced positions of the mixed route, at least
GPU_BACKENDS = ("vulkan", "cuda", "hip")

# how the thresholds are derived from the measured figures
TOP1_MARGIN = 0.02
KL_FACTOR = 2.0
KL_FLOOR = 1e-12  # a KL measured as 0 (or a float64 rounding below it) still locks a finite bound


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "model": "tiny random Llama (4 layers, written here, seed 1)",
            "mixed_cuts": [0, 1, 3, 4],
            "gate_b_cuts": [0, 1, 3, 4],
            "gate_b_tokens": 8,
            "gate_b_prompts": [5, 17],
            "tokens": TOKENS,
            "token_source": "random",
            "decode_steps": 16,
        }
    return {
        "model": "smollm2-135m",
        "mixed_cuts": [0, 13, 17, 30],
        "gate_b_cuts": [0, 15, 30],
        "gate_b_tokens": 4,
        "gate_b_prompts": [9, 15],
        "tokens": TOKENS,
        "token_source": "text",
        "decode_steps": 8,
    }


def _tiny_model(folder: Path) -> Path:
    from noderuntime.models import synth

    shape = synth.ModelShape(n_layer=4, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=320, context_length=1024)
    return synth.write_model(folder / "tiny.gguf", shape, quant="Q8_0", seed=1)


def find_devices(wanted: str | None) -> list[tuple[str, Any, str]]:
    """(device, its backend's runtime, its description) for each GPU device found (or just ``wanted``)."""
    from noderuntime.engine import backends

    found = []
    kinds = [backends.parse_device(wanted)[0]] if wanted else list(GPU_BACKENDS)
    if "cpu" in kinds:
        raise SystemExit("backends: certifies GPU devices; the CPU is what they are held against")
    for kind in kinds:
        if backends.locate(kind)["site"] is None:
            print(f"backends: no {kind} build in the cache ({' '.join(backends.build_command(kind))})", flush=True)
            continue
        try:
            runtime = backends.runtime(kind)
        except backends.NoDeviceError:
            if kind != "vulkan":
                print(f"backends: the {kind} build sees no device", flush=True)
                continue
            runtime = backends.runtime(kind, software=True)  # only a software renderer: certify that
        own = [d for d in runtime.devices() if d["registry"] in backends.REGISTRY_NAMES[kind]]
        for index, device in enumerate(own):
            name = f"{kind}:{index}"
            if wanted in (None, name):
                found.append((name, runtime, device["description"]))
    if wanted and not found:
        raise SystemExit(f"backends: no device {wanted} here")
    return found


def slug(device: str, description: str) -> str:
    """``vulkan-llvmpipe`` for llvmpipe on Vulkan, ``cuda-nvidia-geforce-rtx-4090``: the result file's name."""
    words = re.sub(r"[^a-z0-9]+", "-", description.split("(")[0].lower()).strip("-")
    return f"{device.split(':')[0]}-{words or 'device'}"


def _floor(x: float, digits: int = 4) -> float:
    scale = 10.0**digits
    return math.floor(x * scale) / scale


def _ceil_sig(x: float, sig: int = 2) -> float:
    if x <= 0:
        return KL_FLOOR
    scale = 10.0 ** (sig - 1 - math.floor(math.log10(x)))
    return max(math.ceil(x * scale) / scale, KL_FLOOR)


def thresholds(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """The claims a run locks: Gate B exact on the device, and the mixed route within its measured tolerance."""
    mixed = figures["mixed_route"]
    top1 = max(0.0, _floor(mixed["top1_agreement"] - TOP1_MARGIN))
    mean_kl = _ceil_sig(mixed["mean_kl"] * KL_FACTOR)
    max_kl = _ceil_sig(mixed["max_kl"] * KL_FACTOR)
    return [
        {
            "id": "gate-b-logits",
            "left": "gate_b.max_abs_diff_logits",
            "op": "<=",
            "value": 0.0,
            "text": "shards on the device equal the whole model on the device: logits bit for bit",
        },
        {
            "id": "gate-b-hidden",
            "left": "gate_b.max_abs_diff_hidden",
            "op": "<=",
            "value": 0.0,
            "text": "and the hidden states at every seam",
        },
        {
            "id": "gate-b-greedy",
            "left": "gate_b.greedy_tokens_equal",
            "op": ">=",
            "value": 1,
            "text": "and the greedy tokens of both sequences",
        },
        {
            "id": "mixed-tokens",
            "left": "mixed_route.tokens",
            "op": ">=",
            "value": TOKENS,
            "text": f"the mixed route is compared over at least {TOKENS} teacher-forced positions",
        },
        {
            "id": "mixed-top1",
            "left": "mixed_route.top1_agreement",
            "op": ">=",
            "value": top1,
            "text": f"CPU, device, CPU shards agree with the whole model on the CPU on the top token at >= {top1:.2%} "
            f"of positions (measured {mixed['top1_agreement']:.4f}, margin {TOP1_MARGIN})",
        },
        {
            "id": "mixed-mean-kl",
            "left": "mixed_route.mean_kl",
            "op": "<=",
            "value": mean_kl,
            "text": f"mean KL(whole CPU || mixed route) <= {mean_kl:g} (measured {mixed['mean_kl']:.3g}, x{KL_FACTOR})",
        },
        {
            "id": "mixed-max-kl",
            "left": "mixed_route.max_kl",
            "op": "<=",
            "value": max_kl,
            "text": f"KL at every position <= {max_kl:g} (measured {mixed['max_kl']:.3g}, x{KL_FACTOR})",
        },
    ]


def _tokens(model: Path, n: int, source: str, n_vocab: int) -> list[int]:
    if source == "random":
        rng = np.random.default_rng(0)
        return [int(t) for t in rng.integers(3, n_vocab, size=n)]
    from noderuntime.engine.llama import Vocab

    vocab = Vocab(model)
    ids = vocab.tokenize(TEXT.read_text(), add_special=vocab.add_bos, parse_special=False)[:n]
    if len(ids) < n:
        raise SystemExit(f"backends: {TEXT} gives {len(ids)} tokens, fewer than {n}")
    return ids


def certify(
    device: str, runtime: Any, description: str, model: Path, settings: dict[str, Any], args: list[str], *, quick: bool
) -> dict[str, Any]:
    """One device's contract, signed."""
    from noderuntime.engine.llama import Recipe
    from noderuntime.models.artifacts import inspect
    from noderuntime.verify import contract
    from noderuntime.verify.mixed import check_mixed_route
    from noderuntime.verify.parity import check_parity

    info = inspect(model)
    prompts = settings["gate_b_prompts"]
    on_device = Recipe(n_threads=THREADS, n_ctx_per_seq=512, n_seq_max=len(prompts), device=device)
    print(f"backends: Gate B on {device} ({description}), cuts {settings['gate_b_cuts']}", flush=True)
    began = time.perf_counter()
    parity = check_parity(
        model,
        settings["gate_b_cuts"],
        n_tokens=settings["gate_b_tokens"],
        prompt_lengths=prompts,
        recipe=on_device,
        runtime=runtime,
    )
    gate_b_seconds = time.perf_counter() - began
    cuts = settings["mixed_cuts"]
    devices = ["cpu", device, "cpu"]
    print(f"backends: mixed route {devices} at cuts {cuts} against the whole model on the CPU", flush=True)
    began = time.perf_counter()
    tokens = _tokens(model, settings["tokens"], settings["token_source"], info.n_vocab)
    mixed = check_mixed_route(
        model,
        cuts,
        devices,
        [None, runtime, None],
        tokens,
        threads=THREADS,
        decode_steps=settings["decode_steps"],
        whole_on_device=True,
    )
    mixed_seconds = time.perf_counter() - began
    figures: dict[str, Any] = {
        "gate_b": {
            "max_abs_diff_logits": parity["max_abs_diff_logits"],
            "max_abs_diff_hidden": parity["max_abs_diff_hidden"],
            "greedy_tokens_equal": int(parity["greedy_tokens_equal"]),
            "tokens": parity["tokens"],
            "seconds": round(gate_b_seconds, 2),
        },
        "mixed_route": {
            **mixed["agreement"],
            "tokens": mixed["tokens"],
            "seconds": round(mixed_seconds, 2),
        },
        # context, not a claim: the whole model on the device against the whole model on the CPU
        "whole_on_device": {k: v for k, v in mixed["whole_on_device"].items() if k != "device"},
        "decode": {
            "steps": mixed["decode"]["steps"],
            "route_tokens_per_s": mixed["decode"]["route_tokens_per_s"],
            "whole_cpu_tokens_per_s": mixed["decode"]["whole_cpu_tokens_per_s"],
            "shards": {
                f"{s['layers'][0]}:{s['layers'][1]} {s['device']}": s["decode_tokens_per_s"] for s in mixed["shards"]
            },
            "greedy_tokens_equal_whole_cpu": int(mixed["decode"]["greedy_tokens_equal"]),
        },
    }
    doc: dict[str, Any] = {
        "contract": 1,
        "benchmark": f"benchmarks.{NAME}",
        "args": args,
        "command": "python -m benchmarks." + " ".join([NAME, *args]),
        "quick": quick,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "project_commit": _common.git_commit(),
        "machine": _common.machine(),
        "device": {"name": device, "description": description, "backend": device.split(":")[0]},
        "covers": {"artifact": mixed["artifact"], "cpu_recipe": mixed["cpu_recipe"], "gpu_recipe": mixed["gpu_recipe"]},
        "recipe": {
            "cpu": next(s["recipe"] for s in mixed["shards"] if s["device"] == "cpu"),
            "gpu": next(s["recipe"] for s in mixed["shards"] if s["device"] != "cpu"),
            "gate_b": parity["recipe"],
            "settings": settings,
            "threshold_margins": {"top1_minus": TOP1_MARGIN, "kl_factor": KL_FACTOR, "kl_floor": KL_FLOOR},
        },
        "inputs": {
            "model": contract.input_record(model),
            **({"text": contract.input_record(TEXT)} if settings["token_source"] == "text" else {}),
        },
        "figures": figures,
    }
    doc["thresholds"] = thresholds(figures)
    return contract.sign(doc, contract.signing_key())


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    from noderuntime.models import catalogue as models
    from noderuntime.verify import contract

    p = _common.parser(NAME, __doc__.split("\n\n")[0])
    p.add_argument("--device", help="certify only this device (vulkan:0, cuda:1, ...)")
    p.add_argument("--model", type=Path, help="a GGUF model (default: the demo model; --quick: a tiny random one)")
    args = p.parse_args(argv)
    settings = _settings(args.quick)
    with tempfile.TemporaryDirectory(prefix="backends-") as tmp:
        if args.model is not None:
            model = args.model
            settings["model"] = str(model)
        else:
            model = _tiny_model(Path(tmp)) if args.quick else models.pull(progress=False)
        devices = find_devices(args.device)
        if not devices:
            print("backends: no GPU device here to certify")
            return
        if args.out is not None:
            devices = devices[:1]  # one file: the first device found
        rows = []
        for device, runtime, description in devices:
            rerun = [*(["--quick"] if args.quick else []), "--device", device]
            rerun += ["--model", str(args.model)] if args.model is not None else []
            signed = certify(device, runtime, description, model, settings, rerun, quick=args.quick)
            name = f"{NAME}-{slug(device, description)}"
            out = args.out or _common.RESULTS / (f"{name}.quick.json" if args.quick else f"{name}.json")
            contract.write(out, signed)
            f = signed["figures"]
            for shard, tps in f["decode"]["shards"].items():
                rows.append([device, f"shard {shard}", "", "", tps])
            rows.append(
                [
                    device,
                    "mixed route",
                    f["mixed_route"]["top1_agreement"],
                    f["mixed_route"]["mean_kl"],
                    f["decode"]["route_tokens_per_s"],
                ]
            )
            rows.append([device, "whole model, cpu", 1.0, 0.0, f["decode"]["whole_cpu_tokens_per_s"]])
            alone = f["whole_on_device"]
            rows.append([device, f"whole model, {device}", alone["top1_agreement"], alone["mean_kl"], ""])
            exact = f["gate_b"]["max_abs_diff_logits"] == 0 and f["gate_b"]["greedy_tokens_equal"]
            gate_b = "exact" if exact else "DIFFERS"
            print(f"backends: Gate B on {device}: {gate_b}; wrote {out}")
            print(contract.results_table(contract.check(signed)))
        print(_common.table(["device", "what", "top-1", "mean KL", "decode tok/s"], rows))


if __name__ == "__main__":
    main(sys.argv[1:])
