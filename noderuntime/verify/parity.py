"""Gate B: a chain of shard processes against the whole model, bit for bit.

Both sides see the same batches: a prefill of two sequences of different lengths in
one batch, then greedy decode steps with both sequences batched. Each side picks its
own greedy tokens, so the comparison covers the whole generation, not one step.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from noderuntime.engine.backends import BackendRuntime
from noderuntime.engine.cores import machine_cores
from noderuntime.engine.llama import Recipe, Rows, ShardEngine, StepResult
from noderuntime.models.artifacts import LayerRange, inspect
from noderuntime.verify.procchain import ProcessChain, ShardOutput


def ranges_from_cuts(cuts: Sequence[int]) -> list[LayerRange]:
    """``[0, 10, 20, 30]`` -> ``0:10, 10:20, 20:30``."""
    if len(cuts) < 2:
        raise ValueError("need at least two cut points, e.g. 0,15,30")
    return [LayerRange(a, b) for a, b in itertools.pairwise(cuts)]


def _step(
    whole: ShardEngine | ProcessChain,
    seq_ids: np.ndarray,
    positions: np.ndarray,
    outputs: np.ndarray,
    tokens: np.ndarray,
) -> StepResult | ShardOutput:
    """One batch through the whole model, in this process or in one of its own."""
    if isinstance(whole, ProcessChain):
        return whole.step(seq_ids, positions, outputs, tokens)
    return whole.run(Rows(seq_ids, positions, outputs, tokens=tokens), want_logits=True)


def check_parity(
    model: str | os.PathLike[str],
    cuts: Sequence[int],
    *,
    n_tokens: int = 32,
    prompt_lengths: Sequence[int] = (23, 41),
    recipe: Recipe | None = None,
    seed: int = 0,
    runtime: BackendRuntime | None = None,
) -> dict[str, Any]:
    """Compare shards in separate processes with the whole model; returns a JSON-able report.

    With a ``runtime`` (a GPU backend's build), the whole model runs in a process of its
    own as well: this process keeps the environment's CPU build.
    """
    info = inspect(model)
    ranges = ranges_from_cuts(cuts)
    if ranges[0].start != 0 or ranges[-1].end != info.n_layer:
        raise ValueError(f"cuts must start at 0 and end at {info.n_layer} for this model")
    n_seq = len(prompt_lengths)
    threads = len(machine_cores())  # as a node sizes its team: the cores this process may run on
    recipe = recipe or Recipe(n_threads=threads, n_ctx_per_seq=512, n_seq_max=n_seq, n_batch=512, n_ubatch=512)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, info.n_vocab, size=n).astype(np.int32) for n in prompt_lengths]

    seq_ids = np.concatenate([np.full(len(p), s, np.int32) for s, p in enumerate(prompts)])
    positions = np.concatenate([np.arange(len(p), dtype=np.int32) for p in prompts])
    tokens = np.concatenate(prompts)
    outputs = np.ones(len(tokens), dtype=bool)  # every row: hidden and logits are compared everywhere
    last_rows = np.cumsum([len(p) for p in prompts]) - 1

    max_logits = 0.0
    max_hidden = 0.0
    exact = True
    generated: dict[str, list[list[int]]] = {"whole": [[] for _ in prompts], "chain": [[] for _ in prompts]}
    whole: ShardEngine | ProcessChain = (
        ProcessChain(model, [LayerRange(0, info.n_layer)], recipe, output_hidden=True, runtime=runtime)
        if runtime is not None and runtime.site is not None
        else ShardEngine(model, recipe, output_hidden=True)
    )
    with whole, ProcessChain(model, ranges, recipe, output_hidden=True, runtime=runtime) as chain:
        cursor = [len(p) for p in prompts]
        next_tokens = {"whole": tokens, "chain": tokens}
        for step in range(n_tokens + 1):
            if step > 0:
                seq_ids = np.arange(n_seq, dtype=np.int32)
                positions = np.array(cursor, dtype=np.int32)
                outputs = np.ones(n_seq, dtype=bool)
                last_rows = np.arange(n_seq)
                cursor = [c + 1 for c in cursor]
            a = _step(whole, seq_ids, positions, outputs, next_tokens["whole"])
            b = chain.step(seq_ids, positions, outputs, next_tokens["chain"])
            assert a.logits is not None and b.logits is not None and a.hidden is not None and b.hidden is not None
            exact &= bool(np.array_equal(a.logits, b.logits) and np.array_equal(a.hidden, b.hidden))
            max_logits = max(max_logits, float(np.max(np.abs(a.logits - b.logits))))
            max_hidden = max(max_hidden, float(np.max(np.abs(a.hidden - b.hidden))))
            if step == n_tokens:
                break
            for side, result in (("whole", a), ("chain", b)):
                assert result.logits is not None
                picked = [int(np.argmax(result.logits[row])) for row in last_rows]
                for s, tok in enumerate(picked):
                    generated[side][s].append(tok)
                next_tokens[side] = np.array(picked, dtype=np.int32)
        shard_memory = [entry["memory"] for entry in chain.info]
        # as the shards' processes describe it: their build of llama.cpp, not necessarily this one's
        described = chain.info[0]["recipe"]
        whole_memory = whole.info[0]["memory"] if isinstance(whole, ProcessChain) else attrs.asdict(whole.memory())
    return {
        "model": str(model),
        "fingerprint": info.fingerprint,
        "cuts": list(cuts),
        "tokens": n_tokens,
        "prompt_lengths": list(prompt_lengths),
        "seed": seed,
        "recipe": described,
        "max_abs_diff_logits": max_logits,
        "max_abs_diff_hidden": max_hidden,
        "logits_and_hidden_equal": exact,
        "greedy_tokens_equal": generated["whole"] == generated["chain"],
        "generated_whole": generated["whole"],
        "generated_chain": generated["chain"],
        "shard_memory": shard_memory,
        "whole_memory": whole_memory,
        "parity": exact and generated["whole"] == generated["chain"],
    }
