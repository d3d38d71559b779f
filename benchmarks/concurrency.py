"""Concurrency benchmark: many route sessions on one node and on a 2-shard route.

    python -m benchmarks.concurrency [--quick] [--out PATH]

At 1, 2, 4, 8 and 16 concurrent sessions (greedy, short prompts, the same number of
generated tokens each), three lanes side by side on SmolLM2:

- ``engine``: the raw engine, all sequences decoded in lockstep, one batch per step
  with llama.cpp's sampler chains — the ceiling on this machine;
- ``node``: one node serving the whole model, each session a client over an in-memory
  seam with real protocol frames, batched by the node's central batcher;
- ``route_2``: a 2-shard in-process route (0:15, 15:30).

Aggregate decode tok/s counts every token after each session's first, over the time
from the first first-token to the last token; latency is the gap between consecutive
tokens of a session (p50/p95). Goal: node >= 0.90 x engine at every concurrency.
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

from benchmarks import _common

NAME = "concurrency"
PROMPT = 16


def _recipe() -> Any:
    from noderuntime.engine.llama import Recipe

    return Recipe(n_threads=2, n_ctx_per_seq=256, n_seq_max=16, n_batch=256, n_ubatch=256)


def _prompts(n: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(5)
    return [tuple(int(t) for t in rng.integers(100, 40000, size=PROMPT)) for _ in range(n)]


def _summarize(arrivals: list[list[float]]) -> dict[str, float]:
    firsts = [a[0] for a in arrivals]
    lasts = [a[-1] for a in arrivals]
    tokens = sum(len(a) - 1 for a in arrivals)
    gaps = [b - a for arr in arrivals for a, b in itertools.pairwise(arr)]
    span = max(lasts) - min(firsts)
    return {
        "decode_tok_s": tokens / span if span > 0 else float("nan"),
        "latency_p50_ms": _common.percentile(gaps, 50) * 1e3,
        "latency_p95_ms": _common.percentile(gaps, 95) * 1e3,
    }


def _engine_lane(model: str, sessions: int, new_tokens: int) -> dict[str, float]:
    from noderuntime.engine.llama import Rows, ShardEngine
    from protocol import Sampling

    with ShardEngine(model, _recipe()) as engine:
        prompts = _prompts(sessions)
        chains = [engine.new_sampler(Sampling(), p) for p in prompts]
        seq = np.repeat(np.arange(sessions, dtype=np.int32), PROMPT)
        pos = np.tile(np.arange(PROMPT, dtype=np.int32), sessions)
        out = np.zeros(len(seq), bool)
        out[PROMPT - 1 :: PROMPT] = True
        rows = Rows(seq, pos, out, tokens=np.array([t for p in prompts for t in p], np.int32))
        result = engine.run(rows, samplers={PROMPT * i + PROMPT - 1: chains[i] for i in range(sessions)})
        now = time.perf_counter()
        arrivals = [[now] for _ in range(sessions)]
        tokens = np.array([result.sampled[PROMPT * i + PROMPT - 1] for i in range(sessions)], np.int32)
        seq_ids = np.arange(sessions, dtype=np.int32)
        for step in range(new_tokens - 1):
            rows = Rows(seq_ids, np.full(sessions, PROMPT + step, np.int32), np.ones(sessions, bool), tokens=tokens)
            result = engine.run(rows, samplers=dict(enumerate(chains)))
            now = time.perf_counter()
            for i in range(sessions):
                arrivals[i].append(now)
            tokens = np.array([result.sampled[i] for i in range(sessions)], np.int32)
        for chain in chains:
            chain.close()
    return _summarize(arrivals)


async def _route_lane(model: str, cuts: list[int], sessions: int, new_tokens: int) -> dict[str, float]:
    from noderuntime.seams.client import GenerationRequest, open_route_generation, over_stream
    from noderuntime.services.localroute import open_local_route

    prompts = _prompts(sessions)
    arrivals: list[list[float]] = [[] for _ in range(sessions)]
    async with open_local_route(model, cuts, _recipe()) as route:

        async def one(i: int) -> None:
            stream = await route.network.connect(route.hops[0])
            request = GenerationRequest(prompts[i], new_tokens)
            async with open_route_generation(
                over_stream(stream), route.hops, request, artifact=route.artifact, recipe=route.recipe
            ) as gen:
                while await gen.next() is not None:
                    arrivals[i].append(time.perf_counter())

        async with trio.open_nursery() as nursery:
            for i in range(sessions):
                nursery.start_soon(one, i)
    return _summarize(arrivals)


def _lane_main(lane: str, model: str, n_layer: int, sessions: int, new_tokens: int) -> dict[str, float]:
    if lane == "engine":
        result = _engine_lane(model, sessions, new_tokens)
    else:
        cuts = [0, n_layer] if lane == "node" else [0, n_layer // 2, n_layer]
        result = trio.run(_route_lane, model, cuts, sessions, new_tokens)
    return result


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(NAME, __doc__ or "").parse_args(argv)
    from noderuntime.models import artifacts
    from noderuntime.models import catalogue as models

    model = str(models.pull(models.DEMO_MODEL, progress=False))
    info = artifacts.inspect(model)
    levels = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16]
    new_tokens = 16 if args.quick else 64
    repeats = 1 if args.quick else 3
    runs: dict[str, dict[int, list[dict[str, float]]]] = {
        lane: {n: [] for n in levels} for lane in ("engine", "node", "route_2")
    }
    for _ in range(repeats):
        for n in levels:  # lanes alternate at each level: the same machine state for all three
            for lane in runs:
                runs[lane][n].append(_common.in_fresh_process(_lane_main, lane, model, info.n_layer, n, new_tokens))
    figures: dict[str, Any] = {}
    for lane, per_level in runs.items():
        figures[lane] = {
            str(n): {key: statistics.median(r[key] for r in results) for key in results[0]}
            for n, results in per_level.items()
        }
    figures["node_over_engine"] = {
        str(n): figures["node"][str(n)]["decode_tok_s"] / figures["engine"][str(n)]["decode_tok_s"] for n in levels
    }
    figures["route_2_over_engine"] = {
        str(n): figures["route_2"][str(n)]["decode_tok_s"] / figures["engine"][str(n)]["decode_tok_s"] for n in levels
    }
    figures["node_gain_1_to_8"] = figures["node"]["8"]["decode_tok_s"] / figures["node"]["1"]["decode_tok_s"]
    figures["goal_node_at_least_0_90_engine"] = all(v >= 0.90 for v in figures["node_over_engine"].values())
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        _recipe().describe(info.quant),
        figures,
        settings={
            "prompt_tokens": PROMPT,
            "new_tokens": new_tokens,
            "repeats": repeats,
            "levels": levels,
            "raw": {lane: {str(n): r for n, r in per.items()} for lane, per in runs.items()},
        },
    )
    png = _common.plot(
        Path(path).with_suffix(".png"),
        "Aggregate decode throughput (SmolLM2-135M Q4_1, 2 threads)",
        "concurrent sessions",
        "decode tokens / s",
        {
            lane: (levels, [figures[lane][str(n)]["decode_tok_s"] for n in levels])
            for lane in ("engine", "node", "route_2")
        },
        logx=True,
    )
    rows = []
    for n in levels:
        rows.append(
            [n]
            + [figures[lane][str(n)]["decode_tok_s"] for lane in ("engine", "node", "route_2")]
            + [
                figures["node_over_engine"][str(n)],
                figures["node"][str(n)]["latency_p50_ms"],
                figures["node"][str(n)]["latency_p95_ms"],
                figures["route_2"][str(n)]["latency_p50_ms"],
            ]
        )
    print(
        _common.table(
            [
                "sessions",
                "engine tok/s",
                "node tok/s",
                "route_2 tok/s",
                "node/engine",
                "node p50 ms",
                "node p95 ms",
                "route_2 p50 ms",
            ],
            rows,
        )
    )
    print(
        f"\nnode gain 1 -> 8 sessions: {figures['node_gain_1_to_8']:.2f}x; "
        f"goal node >= 0.90 x engine: {'met' if figures['goal_node_at_least_0_90_engine'] else 'MISSED'}"
    )
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
