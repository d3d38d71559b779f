"""Gate F's cross-implementation check: a route against Transformers' own model class.

Parity (Gate B) shows that shards reproduce the whole model in llama.cpp; it cannot show
that llama.cpp computes the architecture. Here the same weights, dequantized to float32,
run through a route of float32 shards (separate processes) and through Transformers'
``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``Gemma3ForCausalLM``, teacher-forced over
the same tokens; the report gives top-1 agreement and the KL divergence between the two
next-token distributions at every position.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from noderuntime.engine.base import transformers_versions
from noderuntime.engine.cores import machine_cores
from noderuntime.engine.llama import KvType, Recipe
from noderuntime.models.artifacts import inspect
from noderuntime.verify import lanes
from noderuntime.verify.parity import ranges_from_cuts
from noderuntime.verify.procchain import ProcessChain

_CHUNK = 128  # rows a step: the logits of a 262k vocabulary stay near 130 MB a step


def _team(threads: int | None) -> int:
    """The threads an engine computes with: as told, else one per core this process may run on."""
    return threads or len(machine_cores())


def route_logits(
    model: Path, cuts: Sequence[int], tokens: np.ndarray, *, threads: int | None = None, kv_type: KvType = "f32"
) -> np.ndarray:
    """Teacher-forced logits of every position of ``tokens`` through shards in separate processes.

    The KV cache is float32 unless told: llama.cpp's default f16 keys alone move logits by
    up to 0.3 against a float32 reference, which would measure the cache, not the
    architecture. Flash attention follows the cache (the recipe's default): off with a
    float32 one, which llama.cpp's would cast to f16 at every step; on with f16, as a CPU
    node runs.
    """
    n = len(tokens)
    context = max(256, -(-n // 256) * 256)
    recipe = Recipe(
        n_threads=_team(threads), n_ctx_per_seq=context, n_seq_max=1, n_batch=_CHUNK, n_ubatch=_CHUNK, kv_type=kv_type
    )
    with ProcessChain(model, ranges_from_cuts(cuts), recipe) as chain:
        return chain.teacher_forced(tokens, _CHUNK)


_ROWS = 16  # positions a block: float64 temporaries of a 262k vocabulary stay near 34 MB each


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Each row's log-probabilities, in a float64 copy (the caller's logits stay as they are)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
    return x


def compare_logits(reference: np.ndarray, ours: np.ndarray) -> dict[str, float]:
    """Top-1 agreement and KL(reference || ours) per position, in float64.

    Worked through a block of positions at a time: whole-array float64 temporaries of a
    large vocabulary (1.6 GB each for 768 positions of Gemma 3) made the comparison take
    longer than computing the logits, in page faults alone.
    """
    if reference.shape != ours.shape:
        raise ValueError(f"logits of shape {reference.shape} against {ours.shape}")
    kl = np.empty(len(reference), np.float64)
    diff = np.empty(len(reference), np.float64)
    for first in range(0, len(reference), _ROWS):
        block = slice(first, first + _ROWS)
        diff[block] = np.abs(reference[block].astype(np.float64) - ours[block]).max(axis=1)
        ref_log, got_log = log_softmax(reference[block]), log_softmax(ours[block])
        kl[block] = (np.exp(ref_log) * (ref_log - got_log)).sum(axis=1)
    return {
        "top1_agreement": float(np.mean(reference.argmax(axis=1) == ours.argmax(axis=1))),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "max_abs_logit_diff": float(diff.max()),
    }


def reference_logits(model: str | os.PathLike[str], tokens: Sequence[int], *, threads: int | None = None) -> np.ndarray:
    """Transformers' logits of every position of ``tokens``, its GGUF loader dequantizing ``model``.

    ``model`` may be a GGUF file or its :func:`lanes.hf_copy` (the same weights, loaded in
    seconds rather than a minute). The loader and :func:`lanes.float_gguf` dequantize with the
    same ``gguf`` functions, so these are the reference for a float32 route of ``model`` as
    well as for ``model`` itself: pass them as ``reference`` to both checks below to run
    Transformers once.
    """
    from noderuntime.engine import torch_backend as torchengine  # torch loads only for this check

    return torchengine.transformers_logits(Path(model), [int(t) for t in tokens], threads=_team(threads))


def check_agreement(
    model: str | os.PathLike[str],
    cuts: Sequence[int],
    tokens: Sequence[int],
    *,
    threads: int | None = None,
    reference: np.ndarray | None = None,
) -> dict[str, Any]:
    """Compare a float32 route of ``model`` with Transformers on the same float32 weights.

    ``reference``: :func:`reference_logits` of ``model`` and ``tokens``, if already computed.
    """
    from noderuntime.engine import torch_backend as torchengine  # torch loads only for this check

    source = Path(model)
    info = inspect(source)
    ids = np.asarray(tokens, dtype=np.int32)
    f32 = source if info.file_type == 0 else lanes.float_copy(source)  # file type 0: already all float32
    ours = route_logits(f32, cuts, ids, threads=threads)
    if reference is None:
        reference = torchengine.transformers_logits(f32, ids.tolist(), threads=_team(threads))
    return {
        "model": str(source),
        "architecture": info.architecture,
        "fingerprint": info.fingerprint,
        "cuts": list(cuts),
        "tokens": len(ids),
        "reference": "transformers " + transformers_versions()["transformers"],
        **compare_logits(reference, ours),
    }


def perplexity(logits: np.ndarray, tokens: np.ndarray) -> float:
    """exp of the mean negative log-likelihood of ``tokens[1:]`` under ``logits[:-1]``.

    A row's negative log-likelihood is its log-sum-exp less the next token's logit: the
    exponentials in the logits' float32, summed in float64, with no float64 copy of the row
    (768 positions of a 262k vocabulary: 0.32-0.35 s against 0.70-0.97 s for the float64
    log-softmax of every entry, on one core; the two perplexities agree to 5e-9 relative).
    """
    n = len(logits) - 1
    nll = np.empty(n, np.float64)
    for first in range(0, n, _ROWS):
        rows = np.arange(first, min(n, first + _ROWS))
        block = logits[rows]
        top = block.max(axis=1, keepdims=True)
        total = np.exp(block - top).sum(axis=1, dtype=np.float64)
        chosen = block[np.arange(len(rows)), tokens[rows + 1]].astype(np.float64)
        nll[rows] = np.log(total) + top[:, 0].astype(np.float64) - chosen
    return float(np.exp(nll.mean()))


def check_perplexity(
    model: str | os.PathLike[str],
    cuts: Sequence[int],
    tokens: Sequence[int],
    *,
    threads: int | None = None,
    reference: np.ndarray | None = None,
) -> dict[str, Any]:
    """Perplexity of ``tokens`` through a route of ``model`` as it is, the whole model, and Transformers.

    The route and the whole model run as a CPU node does by default (f16 KV cache, flash
    attention on): the figure a user of the route gets. Transformers reads the same file
    through its GGUF loader (dequantized to float32): the figure a user of Transformers
    would get from these weights. ``reference``: :func:`reference_logits` of ``model`` and
    ``tokens``, if already computed.

    How far the two lie apart moves with the low bits of llama.cpp's kernels, as the
    activations are quantized to 8 bits for every K-quant matmul: Gemma 3 270M Q4_K_M over
    768 tokens gave 1.015x Transformers' perplexity as nodes run it, and between 1.014x and
    1.032x with a float32 cache or flash attention off, by which matmul kernel ran.
    """
    path = Path(model)
    ids = np.asarray(tokens, dtype=np.int32)
    route = route_logits(path, cuts, ids, threads=threads, kv_type="f16")
    whole = route_logits(path, [cuts[0], cuts[-1]], ids, threads=threads, kv_type="f16")
    if reference is None:
        reference = reference_logits(path, ids.tolist(), threads=threads)
    figures: dict[str, Any] = {
        "tokens": len(ids),
        "cuts": list(cuts),
        "route": perplexity(route, ids),
        "whole_model": perplexity(whole, ids),
        "transformers_dequantized": perplexity(reference, ids),
        "route_logits_equal_whole": bool(np.array_equal(route, whole)),
    }
    figures["route_over_transformers"] = figures["route"] / figures["transformers_dequantized"]
    return figures


__all__ = [
    "check_agreement",
    "check_perplexity",
    "compare_logits",
    "log_softmax",
    "perplexity",
    "reference_logits",
    "route_logits",
]
