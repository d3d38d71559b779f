"""Seam benchmark: per-hop round trips per transport, and a 2-shard route's decode speed per transport.

    python -m benchmarks.seams [--quick] [--out PATH]

1. Round trip of one frame over a seam and back, for memory, gRPC and the relay, with a
   decode-size frame (one token of SmolLM2: 2442 bytes) and a prefill-size frame (256
   tokens: ~590 KB): p50 and p95.
2. Single-session greedy decode tok/s of SmolLM2 split 0:15 / 15:30 over two real node
   processes, seam over gRPC and over the relay, against the whole model decoding in one
   process with no network at all (the same engine, recipe and threads). Bytes per token
   counted on the wire between the shards. Goals: gRPC >= 0.90x, relay >= 0.85x.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

from benchmarks import _common

NAME = "seams"
DECODE_FRAME = 2442
PREFILL_FRAME = 256 * 576 * 4 + 300


async def _round_trips(kind: str, size: int, count: int) -> list[float]:
    from tests.test_transports import seam

    payload = os.urandom(size)
    times = []
    async with seam(kind) as (client, server):

        async def echo() -> None:
            while True:
                await server.send(await server.receive())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(echo)
            for i in range(count + 5):
                started = time.perf_counter()
                await client.send(payload)
                await client.receive()
                if i >= 5:  # warm-up
                    times.append(time.perf_counter() - started)
            nursery.cancel_scope.cancel()
    return times


def _whole_model_decode(model: str, new_tokens: int, threads: int = 2) -> float:
    from noderuntime.engine import Recipe, Rows, SamplingParams, ShardEngine

    recipe = Recipe(n_threads=threads, n_ctx_per_seq=512, n_seq_max=4, n_batch=512, n_ubatch=512)
    with ShardEngine(model, recipe) as engine:
        chain = engine.new_sampler(SamplingParams())
        prompt = np.arange(100, 140, dtype=np.int32)
        out = np.zeros(len(prompt), bool)
        out[-1] = True
        result = engine.run(
            Rows(np.zeros(len(prompt), np.int32), np.arange(len(prompt), dtype=np.int32), out, tokens=prompt),
            samplers={len(prompt) - 1: chain},
        )
        token = result.sampled[len(prompt) - 1]
        started = time.perf_counter()
        for step in range(new_tokens):
            result = engine.run(
                Rows(
                    np.zeros(1, np.int32),
                    np.array([len(prompt) + step], np.int32),
                    np.ones(1, bool),
                    tokens=np.array([token], np.int32),
                ),
                samplers={0: chain},
            )
            token = result.sampled[0]
        seconds = time.perf_counter() - started
        chain.close()
    return new_tokens / seconds


async def _route_rate(cluster: Any, dialer: Any, new_tokens: int) -> float:
    from noderuntime.client import GenerationRequest, open_route_generation

    session = os.urandom(16)
    request = GenerationRequest(tuple(range(100, 140)), new_tokens + 1)
    arrivals = []
    async with open_route_generation(
        dialer,
        cluster.hops,
        request,
        artifact=cluster.artifact,
        recipe=cluster.recipe,
        ticket=cluster.ticket(session),
        session_id=session,
    ) as gen:
        while await gen.next() is not None:
            arrivals.append(time.perf_counter())
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def _pinned_whole(conn: Any, model: str, new_tokens: int) -> None:
    os.sched_setaffinity(0, {0})
    conn.send(_whole_model_decode(model, new_tokens, threads=1))


def _whole_on_one_core(model: str, new_tokens: int) -> float:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_pinned_whole, args=(child, model, new_tokens))
    proc.start()
    rate: float = parent.recv()
    proc.join()
    return rate


async def _pinned_lanes(model: Path, new_tokens: int, repeats: int) -> dict[str, Any]:
    """One core per shard process (as if each were its own 1-core host) vs the whole model on one core."""
    from noderuntime.dialer import open_dialer
    from tests.clusters import running_cluster

    rates: dict[str, Any] = {"whole_1core": [], "grpc_1core_each": []}
    prefix = [["taskset", "-c", "0"], ["taskset", "-c", "1"]]
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_cluster(model, [0, 15, 30], Path(tmp), slots=4, threads=1, prefix=prefix) as direct,
    ):
        async with open_dialer() as dialer:
            await _route_rate(direct, dialer, 8)
            for _ in range(repeats):
                rates["whole_1core"].append(await trio.to_thread.run_sync(_whole_on_one_core, str(model), new_tokens))
                rates["grpc_1core_each"].append(await _route_rate(direct, dialer, new_tokens))
            ticks = [(await direct.status(i))["batcher"] for i in range(2)]
            rates["engine_ms_per_tick"] = [t["busy_seconds"] / t["ticks"] * 1e3 for t in ticks]
    return rates


async def _lanes(model: Path, new_tokens: int, repeats: int) -> dict[str, list[float]]:
    """Whole model, gRPC route and relay route, interleaved run by run (the machine is shared and noisy)."""
    from noderuntime.dialer import open_dialer
    from tests.clusters import running_cluster

    rates: dict[str, Any] = {"whole": [], "grpc": [], "relay": []}
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_cluster(model, [0, 15, 30], Path(tmp) / "grpc", slots=4, threads=2) as direct,
        running_cluster(model, [0, 15, 30], Path(tmp) / "relay", relay_only=[1], slots=4, threads=2) as relayed,
    ):
        async with open_dialer() as dialer:
            await _route_rate(direct, dialer, 8)  # warm-up: connections, page cache
            await _route_rate(relayed, dialer, 8)
            for _ in range(repeats):
                rates["whole"].append(await trio.to_thread.run_sync(_whole_model_decode, str(model), new_tokens))
                rates["grpc"].append(await _route_rate(direct, dialer, new_tokens))
                rates["relay"].append(await _route_rate(relayed, dialer, new_tokens))
            # where a route's time goes: engine time per tick on each shard (from /status)
            for name, cluster in (("grpc", direct), ("relay", relayed)):
                ticks = [(await cluster.status(i))["batcher"] for i in range(2)]
                rates[f"{name}_engine_ms_per_tick"] = [t["busy_seconds"] / t["ticks"] * 1e3 for t in ticks]
    return rates


def _seam_bytes_per_token(model: str) -> dict[str, float]:
    """Bytes on the seam per decode token, from the frames the codec writes."""
    from protocol import Activations, FrameEncoder, Header, Identity, NamedTensor, Phase, Span, Tokens

    ident = Identity("r" * 32, os.urandom(16), 0, os.urandom(32), os.urandom(8), Span(0, 15))
    header = Header(ident, Phase.DECODE, 100, Span(100, 101), 100)
    encoder = FrameEncoder()
    (down,) = encoder.encode(Activations(header, (NamedTensor("hidden_states", np.zeros((1, 576), np.float32)),)))
    (up,) = encoder.encode(Tokens(header, (12345,)))
    del model
    return {"activations_frame": float(len(down)), "tokens_frame": float(len(up)), "total": float(len(down) + len(up))}


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(NAME, __doc__ or "").parse_args(argv)
    from noderuntime import artifacts, models
    from noderuntime.engine import Recipe

    model = models.pull(models.DEMO_MODEL, progress=False)
    count = 50 if args.quick else 400
    big_count = 10 if args.quick else 60
    new_tokens = 32 if args.quick else 128
    repeats = 2 if args.quick else 7
    hops: dict[str, Any] = {}
    for kind in ("memory", "grpc", "relay"):
        small = trio.run(_round_trips, kind, DECODE_FRAME, count)
        large = trio.run(_round_trips, kind, PREFILL_FRAME, big_count)
        hops[kind] = {
            "decode_frame_bytes": DECODE_FRAME,
            "decode_rtt_p50_us": _common.percentile(small, 50) * 1e6,
            "decode_rtt_p95_us": _common.percentile(small, 95) * 1e6,
            "prefill_frame_bytes": PREFILL_FRAME,
            "prefill_rtt_p50_ms": _common.percentile(large, 50) * 1e3,
            "prefill_rtt_p95_ms": _common.percentile(large, 95) * 1e3,
        }
    rates = trio.run(_lanes, model, new_tokens, repeats)
    pinned = trio.run(_pinned_lanes, model, new_tokens, repeats)
    whole_1 = statistics.median(pinned["whole_1core"])
    grpc_1 = statistics.median(pinned["grpc_1core_each"])
    whole_rate = statistics.median(rates["whole"])
    grpc_route = {"decode_tok_s": statistics.median(rates["grpc"])}
    relay_route = {"decode_tok_s": statistics.median(rates["relay"])}
    figures = {
        "hops": hops,
        "whole_model_one_process_decode_tok_s": whole_rate,
        "route_grpc_decode_tok_s": grpc_route["decode_tok_s"],
        "route_relay_decode_tok_s": relay_route["decode_tok_s"],
        "route_grpc_over_whole": grpc_route["decode_tok_s"] / whole_rate,
        "route_relay_over_whole": relay_route["decode_tok_s"] / whole_rate,
        "seam_bytes_per_decode_token": _seam_bytes_per_token(str(model)),
        "route_grpc_ms_per_token": 1e3 / grpc_route["decode_tok_s"],
        "route_grpc_engine_ms_per_tick_head_tail": rates["grpc_engine_ms_per_tick"],
        "route_relay_ms_per_token": 1e3 / relay_route["decode_tok_s"],
        "route_relay_engine_ms_per_tick_head_tail": rates["relay_engine_ms_per_tick"],
        "whole_model_ms_per_token": 1e3 / whole_rate,
        "pinned_one_core_per_process": {
            "whole_model_1_core_decode_tok_s": whole_1,
            "route_grpc_1_core_per_shard_decode_tok_s": grpc_1,
            "route_over_whole": grpc_1 / whole_1,
            "engine_ms_per_tick_head_tail": pinned["engine_ms_per_tick"],
            "raw": pinned,
        },
        "goal_grpc_0_90": grpc_route["decode_tok_s"] / whole_rate >= 0.90,
        "goal_relay_0_85": relay_route["decode_tok_s"] / whole_rate >= 0.85,
        "raw": rates,
    }
    info = artifacts.inspect(model)
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        Recipe(n_threads=2).describe(info.quant),
        figures,
        settings={
            "new_tokens": new_tokens,
            "repeats": repeats,
            "round_trips": count,
            "cuts": [0, 15, 30],
            "processes": "one per shard, 2 threads each, on this 2-core machine",
        },
    )
    print(
        _common.table(
            ["transport", "decode RTT p50 µs", "p95 µs", "prefill RTT p50 ms", "p95 ms"],
            [
                [k, v["decode_rtt_p50_us"], v["decode_rtt_p95_us"], v["prefill_rtt_p50_ms"], v["prefill_rtt_p95_ms"]]
                for k, v in hops.items()
            ],
        )
    )
    print()
    print(
        _common.table(
            ["lane", "decode tok/s", "vs whole model"],
            [
                ["whole model, one process", whole_rate, 1.0],
                ["2 shards over gRPC", grpc_route["decode_tok_s"], figures["route_grpc_over_whole"]],
                ["2 shards over the relay", relay_route["decode_tok_s"], figures["route_relay_over_whole"]],
                ["whole model, 1 core (pinned)", whole_1, 1.0],
                ["2 shards over gRPC, 1 core each", grpc_1, grpc_1 / whole_1],
            ],
        )
    )
    per_token = _seam_bytes_per_token(str(model))["total"]
    print(f"\nseam bytes per decode token: {per_token:.0f}\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
