"""The seams benchmark's figures from its lanes' rates, where a route's gap to the whole model
goes, and its plot (used by ``benchmarks.seams``)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _common

LANES = ("whole", "chained", "one_node", "grpc", "relay", "relay_plaintext", "head_alone", "tail_alone")
# relay_plaintext: the relay lane without its end-to-end channel, to tell what sealing costs
ROUTES = ("one_node", "grpc", "relay", "relay_plaintext")
GAP_PARTS = ("split", "engine_slower", "worker_round_trip", "between_ticks")


def median_ticks(ticks: list[list[float]]) -> list[float]:
    return [statistics.median(run[i] for run in ticks) for i in range(len(ticks[0]))]


def rate_figures(rates: dict[str, Any]) -> dict[str, Any]:
    """Medians and ratios of one model's decode lanes (:func:`_lanes`)."""
    med = {k: statistics.median(v) for k, v in rates.items() if k in LANES}
    whole, one, grpc, relay = med["whole"], med["one_node"], med["grpc"], med["relay"]
    plaintext = med["relay_plaintext"]
    ticks = {k: median_ticks(rates[f"{k}_decode_tick_ms"]) for k in ROUTES}
    engine = {k: median_ticks(rates[f"{k}_decode_engine_ms"]) for k in ROUTES}
    chained = median_ticks(rates["chained_engine_ms"])
    # what each route's engine calls are held against (ms per token): the whole model for
    # one node; the ranges chained in one process for two shards sharing this machine's caches
    reference: dict[str, Sequence[float]] = {
        "one_node": (1e3 / whole,),
        "grpc": chained,
        "relay": chained,
        "relay_plaintext": chained,
    }
    routes = {"one_node": one, "grpc": grpc, "relay": relay, "relay_plaintext": plaintext}
    return {
        "whole_decode_tok_s": whole,
        "chained_decode_tok_s": med["chained"],
        "chained_over_whole": med["chained"] / whole,
        "chained_engine_ms_head_tail": chained,
        "one_node_decode_tok_s": one,
        "grpc_decode_tok_s": grpc,
        "relay_decode_tok_s": relay,
        "relay_plaintext_decode_tok_s": plaintext,
        # the relayed seam sealed end to end, against the same lane unsealed (goal 0.97)
        "relay_over_relay_plaintext": relay / plaintext,
        "goal_relay_sealed_0_97": relay / plaintext >= 0.97,
        "one_node_over_whole": one / whole,
        "grpc_over_whole": grpc / whole,
        "relay_over_whole": relay / whole,
        "grpc_over_one_node": grpc / one,
        "relay_over_one_node": relay / one,
        "grpc_over_chained": grpc / med["chained"],
        "relay_over_chained": relay / med["chained"],
        "goal_grpc_0_90": grpc / whole >= 0.90,
        "goal_relay_0_85": relay / whole >= 0.85,
        "gap_ms_per_token": {k: 1e3 / route - 1e3 / whole for k, route in routes.items()},
        "where_the_gap_goes_ms": {
            k: gap_parts(route, whole, reference[k], ticks[k], engine[k]) for k, route in routes.items()
        },
        "decode_tick_ms_head_tail": ticks,
        "decode_engine_ms_head_tail": engine,
        "alone_decode_tok_s": {
            "head": med["head_alone"],
            "tail": med["tail_alone"],
            # above 1: a range alone runs faster than inside the chain, its weights staying cached
            "chained_ms_over_alone_ms": sum(chained) / (1e3 / med["head_alone"] + 1e3 / med["tail_alone"]),
        },
        "raw": rates,
    }


def gap_parts(
    route: float, whole: float, reference: Sequence[float], ticks: list[float], engine: list[float]
) -> dict[str, float]:
    """Split a route's extra time per token into four parts that add up to it.

    ``split``: the engine calls of the ranges with nothing between them (``reference``,
    ms per token each) against the whole model;
    ``engine_slower``: the engine's own calls inside the route's nodes against those (other
    work on the same cores while a tick runs: the client, the other process, the node's
    own threads);
    ``worker_round_trip``: the ticks outside the engine call, mostly the hop to the engine
    thread and back;
    ``between_ticks``: the rest of the token's time (seams, the event loops, sessions).
    """
    reference_ms = sum(reference)
    return {
        "split": reference_ms - 1e3 / whole,
        "engine_slower": sum(engine) - reference_ms,
        "worker_round_trip": sum(ticks) - sum(engine),
        "between_ticks": 1e3 / route - sum(ticks),
    }


def plot(path: Path, demo: dict[str, Any], larger: dict[str, Any], largest: dict[str, Any], demo_label: str) -> Path:
    """Route / whole model against the whole model's time per token, one point per model."""
    pinned_lanes = (demo, larger)
    lanes = (*pinned_lanes, *(() if "skipped" in largest else (largest,)))
    shared_ms = [1e3 / lane["whole_decode_tok_s"] for lane in lanes]
    pinned_ms = [1e3 / lane["pinned_one_core_per_process"]["whole_model_1_core_decode_tok_s"] for lane in pinned_lanes]
    cores = os.cpu_count()
    every_ms = shared_ms + pinned_ms
    return _common.plot(
        path.with_suffix(".png"),
        f"route vs whole model in one process ({demo_label}, 1B and 8B shapes)",
        "whole model's decode time per token (ms)",
        "route decode tok/s / whole model's",
        {
            f"gRPC, 2 threads per shard, {cores} cores": (shared_ms, [lane["grpc_over_whole"] for lane in lanes]),
            f"relay, 2 threads per shard, {cores} cores": (shared_ms, [lane["relay_over_whole"] for lane in lanes]),
            f"whole model in one node (no seam between shards), {cores} cores": (
                shared_ms,
                [lane["one_node_over_whole"] for lane in lanes],
            ),
            "gRPC, 1 core per shard (SmolLM2 and 1B shape only)": (
                pinned_ms,
                [lane["pinned_one_core_per_process"]["route_over_whole"] for lane in pinned_lanes],
            ),
            "goal gRPC 0.90": ([min(every_ms), max(every_ms)], [0.90, 0.90]),
            "goal relay 0.85": ([min(every_ms), max(every_ms)], [0.85, 0.85]),
        },
        logx=True,
    )
