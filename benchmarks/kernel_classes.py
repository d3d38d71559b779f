"""Drift classes on the CPU: one commit built for two instruction sets, side by side.

    python -m benchmarks.kernel_classes [--quick] [--out PATH]

A recipe names the kernel class of the build a shard runs on (``engine.llama.kernel_class``:
the instruction sets and CPU kernels llama.cpp's system info lists), and routes, repairs
and audits claim bit-exactness only within one class. This measures whether that is
needed: the project's own wheel (``GGML_NATIVE``: this machine's instruction sets) and a
build of the same sources and patches for AVX2 alone (``kernels_patch/build.py --cpu-isa
avx2``, built once and kept apart as a GPU backend's build is), each in a process of its
own, on the same model, prompt and recipe: the head shard's hidden states after the
prompt's prefill and after each of a few decode steps, bit for bit and by how much, and
the whole model's greedy continuation (where the two first part).

On a machine without AVX-512 the two builds may compile the same kernels; the kernel
classes they report say so, and the JSON records them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _common

NAME = "kernel_classes"
ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 96
DECODE_STEPS = 8
GREEDY_TOKENS = 64
THREADS = 2


def _child(model: str, cut: int, out: str) -> None:
    """In the build this process loaded: the head's hidden states and the greedy continuation."""
    from noderuntime.engine.base import Rows
    from noderuntime.engine.llama import Recipe, ShardEngine, kernel_class
    from noderuntime.models.artifacts import LayerRange, inspect

    info = inspect(Path(model))
    prompt = np.random.default_rng(7).integers(100, min(info.n_vocab, 20_000), PROMPT_TOKENS).astype(np.int32)
    recipe = Recipe(n_threads=THREADS, n_ctx_per_seq=512, n_seq_max=1)

    def rows(tokens: np.ndarray, start: int, last_only: bool) -> Rows:
        n = len(tokens)
        outputs = np.zeros(n, np.bool_)
        outputs[-1 if last_only else 0 :] = True
        return Rows(np.zeros(n, np.int32), np.arange(start, start + n, dtype=np.int32), outputs, tokens=tokens)

    hidden = []
    with ShardEngine(model, recipe, LayerRange(0, cut), output_hidden=True) as head:
        result = head.run(rows(prompt, 0, last_only=False), want_logits=False)
        hidden.append(np.asarray(result.hidden, np.float32))
        # decode steps fed the same tokens in both builds, so each step compares like with like
        for step, token in enumerate(prompt[:DECODE_STEPS]):
            one = head.run(rows(np.asarray([token], np.int32), PROMPT_TOKENS + step, True), want_logits=False)
            hidden.append(np.asarray(one.hidden, np.float32))
    generated: list[int] = []
    first_logits = np.zeros(0, np.float32)
    with ShardEngine(model, recipe, LayerRange(0, info.n_layer)) as whole:
        result = whole.run(rows(prompt, 0, last_only=True), want_logits=True)
        for position in range(PROMPT_TOKENS, PROMPT_TOKENS + GREEDY_TOKENS):
            logits = np.asarray(result.logits, np.float32)[-1]
            if not first_logits.size:
                first_logits = logits
            token = int(np.argmax(logits))
            generated.append(token)
            result = whole.run(rows(np.asarray([token], np.int32), position, True), want_logits=True)
    np.savez(
        out,
        prefill=hidden[0],
        decode=np.concatenate(hidden[1:]),
        generated=np.asarray(generated, np.int32),
        first_logits=first_logits,
        kernel_class=np.asarray(kernel_class()),
    )


def _run_child(model: Path, cut: int, site: str | None, out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    if site is not None:
        # the build of another instruction set, ahead of the environment's own wheel
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, str(ROOT), env.get("PYTHONPATH", "")) if p)
    subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_classes", "--child", str(model), str(cut), str(out)],
        check=True,
        env=env,
        cwd=ROOT,
    )
    with np.load(out) as data:
        return {key: data[key] for key in data.files}


def avx2_site() -> str:
    """The AVX2 build's folder, built (several minutes) and unpacked once per machine."""
    build = [sys.executable, str(ROOT / "kernels_patch" / "build.py"), "--backend", "cpu", "--cpu-isa", "avx2"]
    subprocess.run([*build, "--install"], check=True)
    located = json.loads(subprocess.run([*build, "--locate"], check=True, capture_output=True, text=True).stdout)
    site: str = located["site"]
    return site


def compare(native: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Where the two builds' results agree and by how much they differ."""
    figures: dict[str, Any] = {
        "kernel_class_native": str(native["kernel_class"]),
        "kernel_class_avx2": str(other["kernel_class"]),
    }
    for key in ("prefill", "decode"):
        a, b = native[key], other[key]
        figures[key] = {
            "rows": int(a.shape[0]),
            "bit_identical": bool(np.array_equal(a.view(np.uint32), b.view(np.uint32))),
            "rows_identical": int(sum(np.array_equal(x, y) for x, y in zip(a, b, strict=True))),
            "max_abs_diff": float(np.max(np.abs(a - b))),
            "max_rel_diff": float(np.max(np.abs(a - b)) / max(1e-30, float(np.max(np.abs(a))))),
        }
    la, lb = native["first_logits"], other["first_logits"]
    figures["first_logits_max_abs_diff"] = float(np.max(np.abs(la - lb)))
    ga, gb = native["generated"].tolist(), other["generated"].tolist()
    parted = next((i for i, (x, y) in enumerate(zip(ga, gb, strict=True)) if x != y), None)
    figures["greedy"] = {"tokens": len(ga), "identical": ga == gb, "first_difference_at": parted}
    return figures


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    p = _common.parser(NAME, __doc__ or "")
    args = p.parse_args(argv)
    from benchmarks.seams import LARGER_SHAPE
    from noderuntime.engine.llama import Recipe
    from noderuntime.models import catalogue as models
    from noderuntime.models import synth

    site = avx2_site()
    results = []
    with tempfile.TemporaryDirectory(prefix="kernel-classes-") as tmp:
        root = Path(tmp)
        lanes = [("SmolLM2-135M Q4_1", models.pull(models.DEMO_MODEL, progress=False), 15)]
        if not args.quick:
            larger = synth.write_model(root / "1b-shape.gguf", synth.ModelShape(**LARGER_SHAPE), quant="Q4_0")
            lanes.append(("Llama-3.2-1B shape Q4_0 (random weights)", larger, LARGER_SHAPE["n_layer"] // 2))
        for name, model, cut in lanes:
            native = _run_child(model, cut, None, root / "native.npz")
            other = _run_child(model, cut, site, root / "avx2.npz")
            results.append({"model": name, "head_layers": [0, cut], **compare(native, other)})
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        Recipe(n_threads=THREADS, n_ctx_per_seq=512, n_seq_max=1).describe("Q4_1"),
        {"lanes": results},
        settings={
            "prompt_tokens": PROMPT_TOKENS,
            "decode_steps": DECODE_STEPS,
            "greedy_tokens": GREEDY_TOKENS,
            "avx2_build": site,
        },
    )
    print(
        _common.table(
            ["model", "prefill bit-identical", "max |diff|", "decode bit-identical", "greedy parts at"],
            [
                [
                    r["model"],
                    f"{r['prefill']['rows_identical']}/{r['prefill']['rows']} rows",
                    r["prefill"]["max_abs_diff"],
                    f"{r['decode']['rows_identical']}/{r['decode']['rows']} rows",
                    "never" if r["greedy"]["identical"] else r["greedy"]["first_difference_at"],
                ]
                for r in results
            ],
        )
    )
    for r in results:
        print(f"{r['model']}: native {r['kernel_class_native']}\n  avx2   {r['kernel_class_avx2']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
