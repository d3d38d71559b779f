"""What a session's independence from its batch-mates costs, measured in the engine.

    python -m benchmarks.invariance [--quick] [--out PATH]

A node guarantees that a session's output does not depend on who else is batched
(``tests/test_batch_invariance.py``). Three choices keep it, each with a price this
benchmark measures against the choice llama-server makes, on the same engine, in one
process, one lane after another (median of repeated runs):

- **one KV stream per sequence** (llama-server: one unified stream). A ubatch then holds
  the same number of rows of each sequence, so a prefill chunk cannot share a tick with
  decode rows: the node alternates decode ticks and prefill ticks. Unified, one batch
  carries both. Measured: 7 sessions decoding while an 8th prefills a 41-token prompt
  (SmolLM2's chat prompt), as two ticks (streams) or one (unified), and 8 decode rows;
  the same for a full node of 16 slots (15 decoding, 16 decode rows).
- **decode rows of consecutive sequence ids** (a consequence of the streams): rows of
  sequences 0, 2, 4, ... run as several graphs. Measured: 8 decode rows, ids 0..7 against
  0, 2, ..., 14 (the batcher and the lease manager keep ids low and together).
- **no weight repacking** (llama-server repacks Q4_0, Q4_K, IQ4_NL and Q8_0 weights for its
  gemm, whose sums differ from its gemv's, so a row's bits would depend on the batch).
  Measured on Gemma 3 270M Q4_K_M (SmolLM2's Q4_1 has no repacked layout) and on a
  4-layer cut of Qwen3-30B-A3B's shape in Q4_0 (random weights, 1.7 GB, written once into
  ``~/.cache/noderuntime/benchmarks/invariance``; the full shape is ``benchmarks.full_size``'s):
  decode of 1 and 8 rows and a 41-token prefill, repack off and on.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _common

NAME = "invariance"
PROMPT = 41  # SmolLM2's chat prompt for the serving benchmark's requests
DECODING = 7


class _Lane:
    """An engine with some sequences prefilled, timing the batches it is given."""

    def __init__(self, path: Path, **recipe: Any) -> None:
        from noderuntime.engine.llama import Recipe, ShardEngine

        self.recipe = Recipe(n_threads=2, n_ctx_per_seq=1024, n_seq_max=16, **recipe)
        self.engine = ShardEngine(path, self.recipe)
        self.positions: dict[int, int] = {}

    def run(self, parts: list[tuple[int, int]]) -> float:
        """One batch: ``(seq_id, rows)`` each (rows > 1: a prefill from the sequence's start); seconds."""
        from noderuntime.engine.base import Rows

        seq_ids, positions, tokens, outputs = [], [], [], []
        for seq, n in parts:
            if n > 1:
                self.engine.remove_sequence(seq)
                self.positions[seq] = 0
            start = self.positions.get(seq, 0)
            seq_ids.append(np.full(n, seq, np.int32))
            positions.append(np.arange(start, start + n, dtype=np.int32))
            tokens.append(np.arange(100 + start, 100 + start + n, dtype=np.int32) % 1000)
            out = np.zeros(n, bool)
            out[-1] = True
            outputs.append(out)
            self.positions[seq] = start + n
        rows = Rows(
            np.concatenate(seq_ids), np.concatenate(positions), np.concatenate(outputs), tokens=np.concatenate(tokens)
        )
        started = time.perf_counter()
        self.engine.run(rows, want_logits=True)
        return time.perf_counter() - started

    def prefill(self, seqs: range) -> None:
        for seq in seqs:
            self.run([(seq, PROMPT)])

    def __enter__(self) -> _Lane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.close()


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _streams_against_unified(path: Path, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for lane, unified in (("streams", False), ("unified", True)):
        with _Lane(path, kv_unified=unified) as engine:
            engine.prefill(range(16))
            decode7 = [(s, 1) for s in range(DECODING)]
            decode15 = [(s, 1) for s in range(15)]  # a full node of 16 slots: 15 decoding, 1 new prompt
            mixed, apart, decode8, spread, mixed16, apart16, decode16 = [], [], [], [], [], [], []
            for _ in range(repeats):
                if unified:
                    mixed.append(engine.run([*decode7, (DECODING, PROMPT)]))
                    mixed16.append(engine.run([*decode15, (15, PROMPT)]))
                apart.append(engine.run(decode7) + engine.run([(DECODING, PROMPT)]))
                apart16.append(engine.run(decode15) + engine.run([(15, PROMPT)]))
                decode8.append(engine.run([(s, 1) for s in range(8)]))
                decode16.append(engine.run([(s, 1) for s in range(16)]))
                spread.append(engine.run([(s, 1) for s in range(0, 16, 2)]))
            out[lane] = {
                "decode7_then_prefill41_ms": _median_ms(apart),
                "decode15_then_prefill41_ms": _median_ms(apart16),
                "decode8_ms": _median_ms(decode8),
                "decode16_ms": _median_ms(decode16),
                "decode8_spread_ids_ms": _median_ms(spread),
            }
            if unified:
                out[lane]["decode7_with_prefill41_ms"] = _median_ms(mixed)
                out[lane]["decode15_with_prefill41_ms"] = _median_ms(mixed16)
    return out


def _repack(path: Path, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for lane, repack in (("off", False), ("on", True)):
        with _Lane(path, repack=repack) as engine:
            engine.prefill(range(8))
            one, eight, prefill = [], [], []
            for _ in range(repeats):
                one.append(engine.run([(0, 1)]))
                eight.append(engine.run([(s, 1) for s in range(8)]))
                prefill.append(engine.run([(8, PROMPT)]))
            out[lane] = {
                "decode1_ms": _median_ms(one),
                "decode8_ms": _median_ms(eight),
                "prefill41_ms": _median_ms(prefill),
            }
    return out


def _moe_model() -> Path:
    """A 4-layer cut of Qwen3-30B-A3B's shape in Q4_0, written once and kept outside the clone."""
    from noderuntime.models import synth

    cache = _common.cache_dir(NAME)
    path = cache / "qwen3-30b-a3b-shape-4l-q4_0.gguf"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        synth.write_model(path, synth.qwen3_30b_a3b_shape(4), quant="Q4_0", name="qwen3-30b-a3b-shape-4l")
    return path


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(NAME, __doc__ or "").parse_args(argv)
    from noderuntime.engine.llama import Recipe
    from noderuntime.models import artifacts
    from noderuntime.models import catalogue as models

    repeats = 8 if args.quick else 30
    smol = models.pull(models.DEMO_MODEL, progress=False)
    gemma = models.pull("gemma3-270m", progress=False)
    figures: dict[str, Any] = {
        "kv_streams": _streams_against_unified(smol, repeats),
        "repack_gemma3_q4_k_m": _repack(gemma, repeats),
        "repack_qwen3moe_q4_0": _repack(_moe_model(), repeats),
    }
    streams, unified = figures["kv_streams"]["streams"], figures["kv_streams"]["unified"]
    # what a burst of 7 decoding sessions and 1 new prompt costs each way, and the 8-row decode
    figures["cost_of_isolation"] = {
        "prefill_beside_decode": streams["decode7_then_prefill41_ms"] / unified["decode7_with_prefill41_ms"],
        "prefill_beside_decode15": streams["decode15_then_prefill41_ms"] / unified["decode15_with_prefill41_ms"],
        "decode8": streams["decode8_ms"] / unified["decode8_ms"],
        "decode16": streams["decode16_ms"] / unified["decode16_ms"],
        "spread_ids": streams["decode8_spread_ids_ms"] / streams["decode8_ms"],
        "repack_decode8": figures["repack_gemma3_q4_k_m"]["off"]["decode8_ms"]
        / figures["repack_gemma3_q4_k_m"]["on"]["decode8_ms"],
        "repack_prefill41": figures["repack_gemma3_q4_k_m"]["off"]["prefill41_ms"]
        / figures["repack_gemma3_q4_k_m"]["on"]["prefill41_ms"],
    }
    moe = figures["repack_qwen3moe_q4_0"]
    for measure in ("decode1", "decode8", "prefill41"):
        figures["cost_of_isolation"][f"repack_moe_q4_0_{measure}"] = (
            moe["off"][f"{measure}_ms"] / moe["on"][f"{measure}_ms"]
        )
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        Recipe(n_threads=2, n_ctx_per_seq=1024, n_seq_max=16).describe(artifacts.inspect(smol).quant),
        figures,
        settings={"repeats": repeats, "prompt_tokens": PROMPT, "decoding_sessions": DECODING, "slots": 16},
    )
    rows = [
        ["7 decode + 41-token prefill, two ticks (streams)", streams["decode7_then_prefill41_ms"]],
        ["7 decode + 41-token prefill, one tick (unified)", unified["decode7_with_prefill41_ms"]],
        ["15 decode + 41-token prefill, two ticks (streams)", streams["decode15_then_prefill41_ms"]],
        ["15 decode + 41-token prefill, one tick (unified)", unified["decode15_with_prefill41_ms"]],
        ["8 decode rows, streams", streams["decode8_ms"]],
        ["8 decode rows, unified", unified["decode8_ms"]],
        ["16 decode rows, streams", streams["decode16_ms"]],
        ["16 decode rows, unified", unified["decode16_ms"]],
        ["8 decode rows, streams, ids 0,2,..,14", streams["decode8_spread_ids_ms"]],
    ]
    for key, label in (("repack_gemma3_q4_k_m", "Gemma 3 Q4_K_M"), ("repack_qwen3moe_q4_0", "Qwen3-MoE Q4_0")):
        for lane in ("off", "on"):
            r = figures[key][lane]
            rows += [
                [f"{label} repack {lane}: decode 1", r["decode1_ms"]],
                [f"{label} repack {lane}: decode 8", r["decode8_ms"]],
                [f"{label} repack {lane}: prefill 41", r["prefill41_ms"]],
            ]
    print(_common.table(["batch", "ms (p50)"], rows))
    print("\ncost of isolation (x):", {k: round(v, 3) for k, v in figures["cost_of_isolation"].items()})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
