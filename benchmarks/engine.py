"""Engine benchmark: the whole model vs a 2-shard chain in one process.

    python -m benchmarks.engine [--quick] [--out PATH]

Per lane, in its own process so peak RSS is that lane's: prefill tok/s of one
512-token prompt, and decode tok/s with 1, 4, 8 and 16 sequences batched. Lanes
alternate and each figure is the median over repeats, so the ratio chain/whole is
measured side by side on the same (shared, noisy) machine.
"""

from __future__ import annotations

import itertools
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _common

NAME = "engine"
BATCHES = (1, 4, 8, 16)


def _recipe() -> Any:
    from noderuntime.engine.llama import Recipe

    return Recipe(n_threads=2, n_ctx_per_seq=1024, n_seq_max=16, n_batch=512, n_ubatch=512)


def _lane(model: str, cuts: list[int], prefill_tokens: int, decode_steps: int, decode_prompt: int) -> dict[str, float]:
    from noderuntime.engine.llama import Rows, ShardEngine
    from noderuntime.models.artifacts import LayerRange

    recipe = _recipe()
    engines = [ShardEngine(model, recipe, LayerRange(a, b)) for a, b in itertools.pairwise(cuts)]
    rng = np.random.default_rng(0)
    n_vocab = engines[-1].n_vocab

    def run(rows: Rows) -> Any:
        hidden = None
        result = None
        for engine in engines:
            result = engine.run(
                Rows(
                    rows.seq_ids,
                    rows.positions,
                    rows.outputs,
                    tokens=rows.tokens if engine.is_head else None,
                    hidden=hidden,
                ),
            )
            hidden = result.hidden
        return result

    def clear() -> None:
        for engine in engines:
            for seq in range(recipe.n_seq_max):
                engine.remove_sequence(seq)

    figures: dict[str, float] = {}
    # prefill: one sequence, one batch
    tokens = rng.integers(3, n_vocab, size=prefill_tokens).astype(np.int32)
    outputs = np.zeros(prefill_tokens, bool)
    outputs[-1] = True
    run(Rows(np.zeros(prefill_tokens, np.int32), np.arange(prefill_tokens, dtype=np.int32), outputs, tokens=tokens))
    clear()  # warm-up done
    started = time.perf_counter()
    run(Rows(np.zeros(prefill_tokens, np.int32), np.arange(prefill_tokens, dtype=np.int32), outputs, tokens=tokens))
    figures["prefill_tok_s"] = prefill_tokens / (time.perf_counter() - started)
    clear()
    # decode: B sequences with a short prompt each, then steps of B rows
    for batch in BATCHES:
        prompt = decode_prompt
        seq = np.repeat(np.arange(batch, dtype=np.int32), prompt)
        pos = np.tile(np.arange(prompt, dtype=np.int32), batch)
        out = np.zeros(len(seq), bool)
        run(Rows(seq, pos, out, tokens=rng.integers(3, n_vocab, size=len(seq)).astype(np.int32)))
        seq_ids = np.arange(batch, dtype=np.int32)
        step_tokens = rng.integers(3, n_vocab, size=(decode_steps + 1, batch)).astype(np.int32)
        run(Rows(seq_ids, np.full(batch, prompt, np.int32), np.ones(batch, bool), tokens=step_tokens[0]))
        started = time.perf_counter()
        for step in range(1, decode_steps + 1):
            run(Rows(seq_ids, np.full(batch, prompt + step, np.int32), np.ones(batch, bool), tokens=step_tokens[step]))
        figures[f"decode_tok_s_b{batch}"] = batch * decode_steps / (time.perf_counter() - started)
        clear()
    figures["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for engine in engines:
        engine.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(NAME, __doc__ or "").parse_args(argv)
    from noderuntime.models import artifacts
    from noderuntime.models import catalogue as models

    model = models.pull(models.DEMO_MODEL, progress=False)
    info = artifacts.inspect(model)
    # the quick form (make test's) only shows that the lanes run and the JSON is whole: with
    # 128, 16 and 32 it took 23 s there, most of it prompt rows of the decode lanes
    repeats = 1 if args.quick else 3
    prefill_tokens = 64 if args.quick else 512
    decode_steps = 8 if args.quick else 64
    decode_prompt = 8 if args.quick else 32
    lanes = {"whole": [0, info.n_layer], "chain_2": [0, info.n_layer // 2, info.n_layer]}
    runs: dict[str, list[dict[str, float]]] = {lane: [] for lane in lanes}
    for _ in range(repeats):
        for lane, cuts in lanes.items():  # alternate lanes: both see the same machine state
            runs[lane].append(
                _common.in_fresh_process(_lane, str(model), cuts, prefill_tokens, decode_steps, decode_prompt)
            )
    figures: dict[str, Any] = {}
    for lane, results in runs.items():
        figures[lane] = {key: statistics.median(r[key] for r in results) for key in results[0]}
    figures["chain_over_whole"] = {
        key: figures["chain_2"][key] / figures["whole"][key] for key in figures["whole"] if key != "peak_rss_bytes"
    }
    recipe = _recipe().describe(info.quant)
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        recipe,
        figures,
        model={"name": info.name, "fingerprint": info.fingerprint},
        settings={
            "prefill_tokens": prefill_tokens,
            "decode_steps": decode_steps,
            "decode_prompt_tokens": decode_prompt,
            "repeats": repeats,
            "cuts": lanes,
            "raw": runs,
        },
    )
    rows = []
    for key in figures["whole"]:
        whole, chain = figures["whole"][key], figures["chain_2"][key]
        if key == "peak_rss_bytes":
            rows.append([key.replace("_bytes", " MB"), whole / 1e6, chain / 1e6, chain / whole])
        else:
            rows.append([key, whole, chain, chain / whole])
    print(_common.table(["figure", "whole", "2-shard chain", "chain/whole"], rows))
    print(f"\nwrote {Path(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
