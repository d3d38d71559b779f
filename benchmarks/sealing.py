"""What sealing direct seams costs: decode speed sealed against plaintext, seam opening, frames.

    python -m benchmarks.sealing [--quick] [--out PATH]

1. Single-session greedy decode tok/s over a 2-shard route on gRPC, sealed end to end (as
   every node runs it) and with ``--insecure-plaintext-seams`` on both nodes and the
   client, the two clusters side by side, runs interleaved, on three model sizes:
   SmolLM2-135M (the demo model), and random-weight models of Llama-3.2-1B's and
   Llama-3.1-8B's shapes (the 8B only where memory allows). Goal: sealed >= 0.97x
   plaintext.
2. Opening a seam and its first decode-size round trip, on a new connection and on the
   spare connection a connector keeps per peer: plaintext, sealed (the channel's
   handshake inside the gRPC stream), and TLS pinned to a certificate (gRPC's own
   option, the alternative that was weighed).
3. One frame's round trip, decode-size and prefill-size, over plaintext gRPC and sealed
   gRPC.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
from pathlib import Path
from typing import Any

import trio

from benchmarks import _common, transport_costs
from benchmarks.seams import (
    DEMO_CUTS,
    LARGER_CUTS,
    LARGER_SHAPE,
    LARGEST_CUTS,
    LARGEST_SHAPE,
    _memory_available,
    _route_rate,
)

NAME = "sealing"
PLAINTEXT_FLAG = "--insecure-plaintext-seams"
# two clusters hold the 8B shape's repacked weights twice, beside its file in the page cache
LARGEST_MEMORY_FACTOR = 3.0


async def _decode_lanes(model: Path, cuts: list[int], new_tokens: int, repeats: int) -> dict[str, Any]:
    """Sealed and plaintext gRPC routes side by side, runs interleaved: tok/s of each run."""
    from noderuntime.seams.dialer import open_dialer
    from noderuntime.testing.clusters import running_cluster

    rates: dict[str, list[float]] = {"sealed": [], "plaintext": []}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        sealed = stack.enter_context(running_cluster(model, cuts, Path(tmp) / "sealed", slots=4, threads=2))
        plain = stack.enter_context(
            running_cluster(model, cuts, Path(tmp) / "plaintext", slots=4, threads=2, extra=[PLAINTEXT_FLAG])
        )
        async with open_dialer() as dialer, open_dialer(plaintext=True) as plain_dialer:
            lanes = {"sealed": (sealed, dialer), "plaintext": (plain, plain_dialer)}
            for cluster, connector in lanes.values():
                await _route_rate(cluster, connector, 8)  # warm-up: connections, page cache
            for i in range(repeats):
                # alternate which goes first: the machine drifts between fast and slow spells
                order = list(lanes) if i % 2 == 0 else list(reversed(lanes))
                for name in order:
                    cluster, connector = lanes[name]
                    rates[name].append(await _route_rate(cluster, connector, new_tokens))
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "sealed_decode_tok_s": med["sealed"],
        "plaintext_decode_tok_s": med["plaintext"],
        "sealed_over_plaintext": med["sealed"] / med["plaintext"],
        "goal_sealed_0_97": med["sealed"] / med["plaintext"] >= 0.97,
        "runs_tok_s": rates,
        "cuts": cuts,
        "new_tokens": new_tokens,
        "repeats": repeats,
    }


def _frames(count: int, big_count: int, rounds: int = 5) -> dict[str, Any]:
    small: dict[str, list[float]] = {"grpc": [], "sealed_grpc": []}
    large: dict[str, list[float]] = {"grpc": [], "sealed_grpc": []}
    for _ in range(rounds):  # kinds take turns: the machine drifts
        for kind in small:
            small[kind] += trio.run(transport_costs.round_trips, kind, transport_costs.DECODE_FRAME, count // rounds)
            large[kind] += trio.run(
                transport_costs.round_trips, kind, transport_costs.PREFILL_FRAME, big_count // rounds
            )
    return {
        kind: {
            "decode_frame_bytes": transport_costs.DECODE_FRAME,
            "decode_rtt_p50_us": _common.percentile(small[kind], 50) * 1e6,
            "prefill_frame_bytes": transport_costs.PREFILL_FRAME,
            "prefill_rtt_p50_ms": _common.percentile(large[kind], 50) * 1e3,
        }
        for kind in small
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write its JSON."""
    args = _common.parser(NAME, __doc__ or "").parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        return _main(args, Path(tmp))


def _main(args: Any, tmp: Path) -> int:
    from noderuntime.models import catalogue as models
    from noderuntime.models import synth

    quick = bool(args.quick)
    frames = _frames(50 if quick else 400, 10 if quick else 60)
    opens = trio.run(transport_costs.seam_opens, 20 if quick else 100, tmp, ("plain", "sealed", "tls"))
    demo = models.pull(models.DEMO_MODEL, progress=False)
    lanes: dict[str, Any] = {
        "smollm2-135m": trio.run(_decode_lanes, demo, DEMO_CUTS, 32 if quick else 128, 3 if quick else 7)
    }
    one_b = synth.write_model(tmp / "1b.gguf", synth.ModelShape(**LARGER_SHAPE), quant="Q4_0", name="sealing-1b")
    lanes["llama-1b-shape"] = trio.run(_decode_lanes, one_b, LARGER_CUTS, 16 if quick else 64, 3 if quick else 7)
    one_b.unlink()
    try:
        eight_b = synth.write_model(tmp / "8b.gguf", synth.ModelShape(**LARGEST_SHAPE), quant="Q4_0", name="sealing-8b")
    except OSError as exc:
        lanes["llama-8b-shape"] = {"skipped": f"cannot write the model: {exc}"}
    else:
        needed, available = int(eight_b.stat().st_size * LARGEST_MEMORY_FACTOR), _memory_available()
        if available < needed:
            lanes["llama-8b-shape"] = {
                "skipped": f"needs {needed / 2**30:.1f} GiB available; this machine has {available / 2**30:.1f} GiB"
            }
        else:
            lanes["llama-8b-shape"] = trio.run(
                _decode_lanes, eight_b, LARGEST_CUTS, 8 if quick else 32, 2 if quick else 5
            )
        eight_b.unlink()
    figures = {"decode": lanes, "seam_open_and_first_round_trip": opens, "frame_round_trips": frames}
    recipe = {"quant": "Q4_1 (SmolLM2), Q4_0 (shapes)", "backend": "cpu", "threads_per_node": 2, "slots": 4}
    _common.write(_common.out_path(NAME, args), NAME, args, recipe, figures)
    rows = []
    for label, lane in lanes.items():
        if "skipped" in lane:
            rows.append([label, "-", "-", lane["skipped"][:40]])
            continue
        rows.append(
            [
                label,
                f"{lane['sealed_decode_tok_s']:.1f}",
                f"{lane['plaintext_decode_tok_s']:.1f}",
                f"{lane['sealed_over_plaintext']:.3f}",
            ]
        )
    print(_common.table(["model", "sealed tok/s", "plaintext tok/s", "sealed/plaintext"], rows))
    open_rows = [
        [mode, f"{opens[f'{mode}_new_connection_p50_ms']:.2f}", f"{opens[f'{mode}_spare_connection_p50_ms']:.2f}"]
        for mode in ("plain", "sealed", "tls")
    ]
    print(_common.table(["seam", "open+RTT new conn ms", "open+RTT spare ms"], open_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
