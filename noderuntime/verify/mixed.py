"""A route that mixes devices, against the whole model on the CPU: the tolerance a certificate locks.

Gate B holds bit for bit on one backend; across backends it cannot (a GPU sums in another
order, and its kernels round differently), so a route of a CPU shard, a GPU shard and a CPU
shard is held to a measured tolerance instead. Teacher-forced over the same tokens, each
side in processes of its own (the GPU shard's process loads its backend's build), the
report gives top-1 agreement and the KL divergence between the two next-token
distributions at every position (:func:`noderuntime.verify.agreement.compare_logits`),
and the recipe fingerprints the comparison covers. ``benchmarks.backends`` locks these
figures into a signed contract; :mod:`noderuntime.verify.certificates` reads back which
pair of recipes a verified certificate covers, for the tracker.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from noderuntime.engine.backends import BackendRuntime
from noderuntime.engine.llama import Recipe
from noderuntime.models.artifacts import LayerRange, inspect
from noderuntime.verify.agreement import compare_logits
from noderuntime.verify.parity import ranges_from_cuts
from noderuntime.verify.procchain import ProcessChain

CHUNK = 128  # teacher-forced rows a step


def recipe_for(n_tokens: int, *, threads: int = 2, device: str = "cpu") -> Recipe:
    """The recipe both sides run: a node's defaults (``--batch 512``, the device's flash attention, f16 KV).

    Threads, context and slots are not in a recipe's fingerprint, so a certificate made
    with this recipe covers nodes started with ``noderuntime up``'s defaults on that device.
    """
    context = max(256, -(-n_tokens // 256) * 256)
    return Recipe(n_threads=threads, n_ctx_per_seq=context, n_seq_max=1, n_batch=512, n_ubatch=512, device=device)


def greedy_decode(chain: ProcessChain, start: int, token: int, steps: int) -> dict[str, Any]:
    """``steps`` greedy decode steps of sequence 0 from position ``start``: tokens, and tok/s per shard and route."""
    before = list(chain.seconds)
    tokens = []
    began = time.perf_counter()
    for step in range(steps):
        row = np.array([token], np.int32)
        result = chain.step(np.zeros(1, np.int32), np.array([start + step], np.int32), np.ones(1, bool), row)
        assert result.logits is not None
        token = int(np.argmax(result.logits[-1]))
        tokens.append(token)
    wall = time.perf_counter() - began
    spent = [after - was for after, was in zip(chain.seconds, before, strict=True)]
    return {
        "tokens": tokens,
        "route_tokens_per_s": steps / wall,
        "shard_tokens_per_s": [steps / s for s in spent],
    }


def check_mixed_route(
    model: str | os.PathLike[str],
    cuts: Sequence[int],
    devices: Sequence[str],
    runtimes: Sequence[BackendRuntime | None],
    tokens: Sequence[int],
    *,
    threads: int = 2,
    decode_steps: int = 16,
    whole_on_device: bool = False,
) -> dict[str, Any]:
    """Shards of ``model`` on ``devices`` (one per range of ``cuts``) against the whole model on the CPU.

    Both sides are teacher-forced over ``tokens``, then decode ``decode_steps`` greedy
    tokens each from there (for their speed). ``runtimes`` gives each shard's process its
    backend's build (None: the environment's CPU build). ``whole_on_device`` also compares
    the whole model on the GPU shard's device with the CPU: how far that backend alone
    moves the logits, beside what the mixed route's share of it does. Returns a JSON-able report.
    """
    info = inspect(model)
    ranges = ranges_from_cuts(cuts)
    if ranges[0].start != 0 or ranges[-1].end != info.n_layer:
        raise ValueError(f"cuts must start at 0 and end at {info.n_layer} for this model")
    if not len(devices) == len(runtimes) == len(ranges):
        raise ValueError("give one device and one runtime per range")
    ids = np.asarray(tokens, dtype=np.int32)
    cells = len(ids) + decode_steps
    cpu = recipe_for(cells, threads=threads)
    # each built for its device, not evolved from the CPU's: flash attention's default
    # differs by device, and the GPU recipe certified must be the one `up` runs there
    recipes = [recipe_for(cells, threads=threads, device=device) for device in devices]
    with ProcessChain(model, [LayerRange(0, info.n_layer)], cpu) as whole:
        reference = whole.teacher_forced(ids, CHUNK)
        whole_decode = greedy_decode(whole, len(ids), int(np.argmax(reference[-1])), decode_steps)
        cpu_fingerprint = whole.info[0]["fingerprint"]
    with ProcessChain(model, ranges, cpu, recipes=recipes, runtimes=runtimes) as chain:
        ours = chain.teacher_forced(ids, CHUNK)
        route_decode = greedy_decode(chain, len(ids), int(np.argmax(ours[-1])), decode_steps)
        shards = [
            {
                "layers": [r.start, r.end],
                "device": device,
                "fingerprint": entry["fingerprint"],
                "recipe": entry["recipe"],
                "decode_tokens_per_s": tps,
            }
            for r, device, entry, tps in zip(
                ranges, devices, chain.info, route_decode["shard_tokens_per_s"], strict=True
            )
        ]
    whole_device = None
    if whole_on_device:
        index = next(i for i, device in enumerate(devices) if device != "cpu")
        recipe = recipes[index]
        with ProcessChain(model, [LayerRange(0, info.n_layer)], recipe, runtime=runtimes[index]) as alone:
            whole_device = {"device": devices[index], **compare_logits(reference, alone.teacher_forced(ids, CHUNK))}
    gpu = sorted({s["fingerprint"] for s in shards if s["device"] != "cpu"})
    if any(s["fingerprint"] != cpu_fingerprint for s in shards if s["device"] == "cpu") or len(gpu) != 1:
        raise ValueError(f"expected CPU shards of recipe {cpu_fingerprint} and one GPU recipe, got {shards}")
    return {
        "model": str(model),
        "artifact": info.fingerprint,
        "cuts": list(cuts),
        "devices": list(devices),
        "tokens": len(ids),
        "cpu_recipe": cpu_fingerprint,
        "gpu_recipe": gpu[0],
        "agreement": compare_logits(reference, ours),
        "shards": shards,
        "decode": {
            "steps": decode_steps,
            "route_tokens_per_s": route_decode["route_tokens_per_s"],
            "whole_cpu_tokens_per_s": whole_decode["route_tokens_per_s"],
            "greedy_tokens_equal": route_decode["tokens"] == whole_decode["tokens"],
        },
        **({"whole_on_device": whole_device} if whole_device is not None else {}),
    }


__all__ = ["check_mixed_route", "greedy_decode", "recipe_for"]
