"""Seam benchmark: per-hop round trips per transport, and a 2-shard route's decode speed per transport.

    python -m benchmarks.seams [--quick] [--out PATH]

1. Round trip of one frame over a seam and back, for memory, gRPC and the relay (sealed, and
   unsealed beside it), with a
   decode-size frame (one token of SmolLM2: 2442 bytes) and a prefill-size frame (256
   tokens: ~590 KB): p50 and p95. For gRPC also a seam's opening plus its first round
   trip, on a new connection and on the spare a connector keeps per recent peer.
2. Single-session greedy decode tok/s of SmolLM2 split 0:15 / 15:30 over two real node
   processes, seam over gRPC and over the relay, against the whole model decoding in one
   process with no network at all (the same engine, recipe and threads). Bytes per token
   counted on the wire between the shards. Goals: gRPC >= 0.90x, relay >= 0.85x. The relay
   lane runs twice: sealed end to end, as nodes run it, and with every seam of its cluster
   unsealed (``--insecure-plaintext-seams``, the client's seam to the head too; goal:
   sealed >= 0.97x unsealed, side by side). The same
   again with each shard process pinned to its own core, against the whole model on one.
   And the whole model served by one node process to the same client: a route with no
   seam between shards, to tell what the seam costs from what serving costs.
3. Where a route's extra time per token goes, in four parts that add up to it: the two
   ranges chained in one process (a route with nothing between its shards, each range's
   weights evicting the other's from the caches as on one machine) against the whole
   model; the engine's own calls inside the route's nodes against those chained calls;
   the rest of each tick (the round trip to the engine thread; the tests check only that
   a node counts the engine's time within the tick's, and this lane says how much of the
   tick it is); and the time between the ticks. Each range alone, over and over, shows
   what a shard gains on a machine of its own: its weights stay in the caches.
4. What one thread wake-up costs on this machine: a trio task's round trip to the engine
   thread and to the asyncio loop's thread (the two crossings a gRPC route makes for
   every tick and every seam direction), each after a few milliseconds of idling, as
   between two decode ticks, and again after reading 64 MiB, as a tick reads a shard's
   weights and leaves the caches cold for the code that runs next.
5. Where one decode token's time goes, step by step: the nodes of a gRPC route and of a
   relay route record their timelines (:mod:`noderuntime.operations.timeline`), and each token is
   followed from the tail's tick through the seams, both nodes' threads, the sessions,
   the batchers and the engines back to the tail's next tick.
6. What idling alone costs the engine, part of why its calls run slower inside a route
   than chained: each range's call back to back, and after idling as long as the other
   range's call takes, in one process with nothing else running.
7. All of it again on a random-weight model of Llama-3.2-1B's shape (Q4_0, written for
   the run), whose token costs about three times SmolLM2's: which parts stay fixed and
   which grow with the model.
8. The decode lanes of 2 and 3 (whole, chained, one node, gRPC, relay, each range alone)
   once more on a random-weight model of Llama-3.1-8B's shape (Q4_0, 4.2 GiB), the size
   of model a route exists for, where one token costs over ten times SmolLM2's. Its
   clusters take turns (gRPC and relay together, then the one node): each holds its own
   copy of the weights. It runs only where the memory is free, and records why not.

``--demo-shape`` measures a random-weight model of SmolLM2's shape and quant in place of
SmolLM2 itself, for a machine that has no copy of the demo model and cannot fetch one
(decode speed does not depend on the weights' values).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import trio

from benchmarks import _common, seam_figures, tokenpath, transport_costs

NAME = "seams"
DEMO_CUTS = [0, 15, 30]
# Llama-3.2-1B's shape (tied output, 128k vocabulary); random weights decode at the same speed
LARGER_SHAPE: dict[str, Any] = {
    "n_layer": 16,
    "n_embd": 2048,
    "n_ff": 8192,
    "n_head": 32,
    "n_head_kv": 8,
    "n_vocab": 128256,
    "rope_freq_base": 500000.0,
}
LARGER_CUTS = [0, 8, 16]
# Llama-3.1-8B's shape (untied output, 128k vocabulary)
LARGEST_SHAPE: dict[str, Any] = {
    "n_layer": 32,
    "n_embd": 4096,
    "n_ff": 14336,
    "n_head": 32,
    "n_head_kv": 8,
    "n_vocab": 128256,
    "rope_freq_base": 500000.0,
    "tied_output": False,
}
LARGEST_CUTS = [0, 16, 32]
# llama.cpp repacks Q4_0 weights into memory of its own on CPUs with wide vectors: each
# process running a range holds a copy of it. Two clusters and this process's own engine
# hold the model three times over, beside its file in the page cache
LARGEST_MEMORY_FACTOR = 4.5
# SmolLM2-135M's shape, for --demo-shape
DEMO_SHAPE: dict[str, Any] = {
    "n_layer": 30,
    "n_embd": 576,
    "n_ff": 1536,
    "n_head": 9,
    "n_head_kv": 3,
    "n_vocab": 49152,
    "context_length": 8192,
    "rope_freq_base": 100000.0,
}
ROUNDS = 5
TIMELINE_REPEATS = 3  # generations per route with the nodes' timelines on
# the decode tok/s lanes, each run `repeats` times; ratios are between medians
LANES_1_CORE = ("whole_1core", "grpc_1core_each", "head_alone_1core", "tail_alone_1core")


def _in_process_recipe(threads: int) -> Any:
    """The recipe of the lanes that run the engine in this process (whole, chained, alone)."""
    from noderuntime.engine.llama import Recipe

    return Recipe(n_threads=threads, n_ctx_per_seq=512, n_seq_max=4, n_batch=512, n_ubatch=512)


def _engine_decode(model: str, new_tokens: int, threads: int = 2, layers: tuple[int, int] | None = None) -> float:
    """Decode tok/s of the whole model, or of one layer range alone, in this process with no network.

    A range that is not the head is fed random hidden rows (its speed does not depend on
    their values); the tail samples as the whole model does.
    """
    from noderuntime.engine.llama import Rows, ShardEngine
    from noderuntime.models.artifacts import LayerRange
    from protocol import Sampling

    recipe = _in_process_recipe(threads)
    rng = np.random.default_rng(0)
    with ShardEngine(model, recipe, None if layers is None else LayerRange(*layers)) as engine:
        chain = engine.new_sampler(Sampling()) if engine.is_tail else None

        def step(start: int, tokens: np.ndarray) -> int | None:
            n = len(tokens)
            out = np.zeros(n, bool)
            out[-1] = True
            hidden = None if engine.is_head else (rng.standard_normal((n, engine.n_embd)) * 0.1).astype(np.float32)
            rows = Rows(
                np.zeros(n, np.int32),
                np.arange(start, start + n, dtype=np.int32),
                out,
                tokens=tokens if engine.is_head else None,
                hidden=hidden,
            )
            result = engine.run(rows, samplers={n - 1: chain} if chain is not None else None)
            return result.sampled.get(n - 1)

        prompt = np.arange(100, 140, dtype=np.int32)
        token = step(0, prompt)
        started = time.perf_counter()
        for i in range(new_tokens):
            token = step(len(prompt) + i, np.array([token if token is not None else 100], np.int32))
        seconds = time.perf_counter() - started
        if chain is not None:
            chain.close()
    return new_tokens / seconds


def _engine_after_idle(model: str, cuts: list[int], calls: int, rounds: int = 3) -> dict[str, Any]:
    """Each range's decode call back to back, and after idling as long as the other range's call takes.

    That idle is what a shard of a 2-shard route does while the other one computes a token,
    here with no network, no other process and no other thread. Bursts of each kind take
    turns ``rounds`` times; medians of the calls (ms).
    """
    from noderuntime.engine.llama import Rows, ShardEngine
    from noderuntime.models.artifacts import LayerRange
    from protocol import Sampling

    recipe = _in_process_recipe(2)
    rng = np.random.default_rng(0)
    names = ("head", "tail")
    times: dict[str, dict[str, list[float]]] = {n: {"back_to_back": [], "after_idle": []} for n in names}
    with contextlib.ExitStack() as stack:
        engines = {
            name: stack.enter_context(ShardEngine(model, recipe, LayerRange(a, b)))
            for name, (a, b) in zip(names, itertools.pairwise(cuts), strict=True)
        }
        chain = engines["tail"].new_sampler(Sampling())
        stack.callback(chain.close)
        position = dict.fromkeys(names, 0)

        def call(name: str) -> float:
            engine = engines[name]
            n = 1 if position[name] else 40
            start = position[name]
            rows = Rows(
                np.zeros(n, np.int32),
                np.arange(start, start + n, dtype=np.int32),
                np.arange(n) == n - 1,
                tokens=np.full(n, 100, np.int32) if engine.is_head else None,
                hidden=None if engine.is_head else (rng.standard_normal((n, engine.n_embd)) * 0.1).astype(np.float32),
            )
            started = time.perf_counter()
            engine.run(rows, samplers={n - 1: chain} if engine.is_tail else None)
            position[name] += n
            return time.perf_counter() - started

        for name in names:
            for _ in range(4):  # the prompt, then warm calls
                call(name)
        for _ in range(rounds):
            for name, other in (names, names[::-1]):
                times[name]["back_to_back"] += [call(name) for _ in range(calls)]
                idle = statistics.median(times[other]["back_to_back"] or times[name]["back_to_back"])
                for _ in range(calls):
                    time.sleep(idle)
                    times[name]["after_idle"].append(call(name))
    out: dict[str, Any] = {
        name: {kind: statistics.median(v) * 1e3 for kind, v in kinds.items()} for name, kinds in times.items()
    }
    out["extra_ms_per_token"] = sum(out[n]["after_idle"] - out[n]["back_to_back"] for n in names)
    return out


def _chained_decode(model: str, new_tokens: int, cuts: list[int], threads: int = 2) -> tuple[float, list[float]]:
    """Decode tok/s of the two ranges chained in this process, and each range's engine ms per token.

    The head's hidden rows go straight into the tail, token by token: a route with no
    seam, no threads and no event loop between its shards, whose weights still take
    turns in the caches as two shards' do on one machine.
    """
    from noderuntime.engine.llama import Rows, ShardEngine
    from noderuntime.models.artifacts import LayerRange
    from protocol import Sampling

    recipe = _in_process_recipe(threads)
    with (
        ShardEngine(model, recipe, LayerRange(cuts[0], cuts[1])) as head,
        ShardEngine(model, recipe, LayerRange(cuts[1], cuts[2])) as tail,
    ):
        chain = tail.new_sampler(Sampling())
        try:

            def step(start: int, tokens: np.ndarray) -> tuple[int, float, float]:
                n = len(tokens)
                out = np.zeros(n, bool)
                out[-1] = True
                seq, positions = np.zeros(n, np.int32), np.arange(start, start + n, dtype=np.int32)
                first = head.run(Rows(seq, positions, out, tokens=tokens))
                second = tail.run(Rows(seq, positions, out, hidden=first.hidden), samplers={n - 1: chain})
                return second.sampled[n - 1], first.seconds, second.seconds

            prompt = np.arange(100, 140, dtype=np.int32)
            token, _, _ = step(0, prompt)
            spent = [0.0, 0.0]
            started = time.perf_counter()
            for i in range(new_tokens):
                token, head_s, tail_s = step(len(prompt) + i, np.array([token], np.int32))
                spent[0] += head_s
                spent[1] += tail_s
            seconds = time.perf_counter() - started
        finally:
            chain.close()
    return new_tokens / seconds, [s / new_tokens * 1e3 for s in spent]


async def _route_rate(
    cluster: Any,
    dialer: Any,
    new_tokens: int,
    ticks: list[list[float]] | None = None,
    engine: list[list[float]] | None = None,
) -> float:
    """One session's decode tok/s.

    Appends each shard's mean decode tick (ms) to ``ticks``, and the part of it spent in
    the engine's own call to ``engine``; the rest is the engine thread's round trip.
    """
    from noderuntime.seams.client import GenerationRequest, open_route_generation

    session = os.urandom(16)
    request = GenerationRequest(tuple(range(100, 140)), new_tokens + 1)
    arrivals = []
    before: list[dict[str, Any]] = []
    async with open_route_generation(
        dialer,
        cluster.hops,
        request,
        artifact=cluster.artifact,
        recipe=cluster.recipe,
        ticket=cluster.ticket(session, client=dialer.node_id),
        session_id=session,
    ) as gen:
        while await gen.next() is not None:
            arrivals.append(time.perf_counter())
            if ticks is not None and len(arrivals) == 1:  # the prompt's ticks are done: decode ticks from here
                before = [(await cluster.status(i))["batcher"] for i in range(len(cluster.hops))]
    if ticks is not None:
        after = [(await cluster.status(i))["batcher"] for i in range(len(cluster.hops))]
        for out, key in ((ticks, "busy_seconds"), (engine, "engine_seconds")):
            if out is not None:
                out.append(
                    [(b[key] - a[key]) / (b["ticks"] - a["ticks"]) * 1e3 for a, b in zip(before, after, strict=True)]
                )
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def _pinned_decode(model: str, new_tokens: int, layers: tuple[int, int] | None) -> float:
    os.sched_setaffinity(0, {0})
    return _engine_decode(model, new_tokens, 1, layers)


def _engine_on_one_core(model: str, new_tokens: int, layers: tuple[int, int] | None = None) -> float:
    return _common.in_fresh_process(_pinned_decode, model, new_tokens, layers)


async def _pinned_lanes(model: Path, cuts: list[int], new_tokens: int, repeats: int) -> dict[str, Any]:
    """One core per shard process (as if each were its own 1-core host) vs the whole model on one core."""
    from noderuntime.seams.dialer import open_dialer
    from noderuntime.testing.clusters import running_cluster

    rates: dict[str, Any] = {"whole_1core": [], "grpc_1core_each": [], "head_alone_1core": [], "tail_alone_1core": []}
    head, tail = (cuts[0], cuts[1]), (cuts[1], cuts[2])
    ticks: list[list[float]] = []
    engine: list[list[float]] = []
    prefix = [["taskset", "-c", "0"], ["taskset", "-c", "1"]]
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_cluster(model, cuts, Path(tmp), slots=4, threads=1, prefix=prefix) as direct,
    ):
        async with open_dialer() as dialer:
            await _route_rate(direct, dialer, 8)
            for _ in range(repeats):
                rates["whole_1core"].append(await trio.to_thread.run_sync(_engine_on_one_core, str(model), new_tokens))
                rates["grpc_1core_each"].append(await _route_rate(direct, dialer, new_tokens, ticks, engine))
                for name, layers in (("head_alone_1core", head), ("tail_alone_1core", tail)):
                    rates[name].append(
                        await trio.to_thread.run_sync(_engine_on_one_core, str(model), new_tokens, layers)
                    )
            rates["decode_tick_ms"] = ticks
            rates["decode_engine_ms"] = engine
    return rates


async def _lanes(
    model: Path, cuts: list[int], new_tokens: int, repeats: int, route_names: Sequence[str] = seam_figures.ROUTES
) -> dict[str, list[Any]]:
    """Whole model, the routes and each range alone, interleaved run by run (the machine is noisy).

    ``one_node`` is the whole model served by one node process to the same client: a route
    with no seam between shards, which pays the client's seam and the node's threads only.
    The clusters of ``route_names`` run side by side.
    """
    from noderuntime.seams.dialer import open_dialer
    from noderuntime.testing.clusters import running_cluster

    rates: dict[str, Any] = {k: [] for k in seam_figures.LANES if k not in seam_figures.ROUTES or k in route_names} | {
        "chained_engine_ms": []
    }
    head, tail = (cuts[0], cuts[1]), (cuts[1], cuts[2])
    ticks: dict[str, list[list[float]]] = {k: [] for k in route_names}
    engine: dict[str, list[list[float]]] = {k: [] for k in route_names}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        options: dict[str, tuple[list[int], dict[str, Any]]] = {
            "one_node": ([cuts[0], cuts[-1]], {}),
            "grpc": (cuts, {}),
            "relay": (cuts, {"relay_only": [1]}),
            # every seam of this cluster unsealed, its client's to the head included (see below)
            "relay_plaintext": (cuts, {"relay_only": [1], "extra": ["--insecure-plaintext-seams"]}),
        }
        routes = {
            name: stack.enter_context(
                running_cluster(model, options[name][0], Path(tmp) / name, slots=4, threads=2, **options[name][1])
            )
            for name in route_names
        }
        async with open_dialer() as sealed, open_dialer(plaintext=True) as plaintext:
            dialers = {name: plaintext if name == "relay_plaintext" else sealed for name in routes}
            for name, cluster in routes.items():
                await _route_rate(cluster, dialers[name], 8)  # warm-up: connections, page cache
            for _ in range(repeats):
                rates["whole"].append(await trio.to_thread.run_sync(_engine_decode, str(model), new_tokens))
                rate, engine_ms = await trio.to_thread.run_sync(_chained_decode, str(model), new_tokens, cuts)
                rates["chained"].append(rate)
                rates["chained_engine_ms"].append(engine_ms)
                for name, cluster in routes.items():
                    rate = await _route_rate(cluster, dialers[name], new_tokens, ticks[name], engine[name])
                    rates[name].append(rate)
                for name, layers in (("head_alone", head), ("tail_alone", tail)):
                    rates[name].append(await trio.to_thread.run_sync(_engine_decode, str(model), new_tokens, 2, layers))
            for name in routes:
                rates[f"{name}_decode_tick_ms"] = ticks[name]
                rates[f"{name}_decode_engine_ms"] = engine[name]
    return rates


async def _timelines(model: Path, cuts: list[int], new_tokens: int, repeats: int) -> dict[str, Any]:
    """Where one decode token's time goes on a 2-shard route over gRPC and over the relay.

    The node processes record their timelines (``NODERUNTIME_TIMELINE``); each route runs
    ``repeats`` generations of ``new_tokens``, taking turns.
    """
    from noderuntime.operations import timeline
    from noderuntime.seams.dialer import open_dialer
    from noderuntime.testing.clusters import running_cluster

    windows: dict[str, list[tuple[int, int]]] = {"grpc": [], "relay": []}
    rates: dict[str, list[float]] = {"grpc": [], "relay": []}
    with tempfile.TemporaryDirectory() as tmp:
        records = {k: Path(tmp) / k for k in windows}
        for directory in records.values():
            directory.mkdir()
        with (
            running_cluster(
                model, cuts, Path(tmp) / "grpc-nodes", slots=4, threads=2, env={timeline.ENV: str(records["grpc"])}
            ) as direct,
            running_cluster(
                model,
                cuts,
                Path(tmp) / "relay-nodes",
                relay_only=[1],
                slots=4,
                threads=2,
                env={timeline.ENV: str(records["relay"])},
            ) as relayed,
        ):
            routes = {"grpc": direct, "relay": relayed}
            async with open_dialer() as dialer:
                for cluster in routes.values():
                    await _route_rate(cluster, dialer, 8)
                for _ in range(repeats):
                    for name, cluster in routes.items():
                        since = time.perf_counter_ns()
                        rates[name].append(await _route_rate(cluster, dialer, new_tokens))
                        windows[name].append((since, time.perf_counter_ns()))
        # the nodes have exited and written their timelines
        return {
            name: tokenpath.token_stages(timeline.read(records[name]), name, windows[name])
            | {"decode_tok_s": statistics.median(rates[name])}
            for name in windows
        }


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
    p = _common.parser(NAME, __doc__ or "")
    p.add_argument("--demo-shape", action="store_true", help="a random-weight model of SmolLM2's shape and quant")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="seams-") as tmp:
        return _main(args, Path(tmp))


def _main(args: Any, tmp: Path) -> int:
    from noderuntime.engine.llama import Recipe
    from noderuntime.models import artifacts, synth
    from noderuntime.models import catalogue as models

    if args.demo_shape:
        model = synth.write_model(
            tmp / "smollm2-shape.gguf", synth.ModelShape(**DEMO_SHAPE), quant="Q4_1", embedding_quant="Q8_0"
        )
    else:
        model = models.pull(models.DEMO_MODEL, progress=False)
    count = 50 if args.quick else 400
    big_count = 10 if args.quick else 60
    new_tokens = 32 if args.quick else 128
    repeats = 2 if args.quick else 7
    hops: dict[str, Any] = {}
    from noderuntime.testing.seams import PLAINTEXT_RELAY

    kinds = ("memory", "grpc", "relay", PLAINTEXT_RELAY)
    small: dict[str, list[float]] = {k: [] for k in kinds}
    large: dict[str, list[float]] = {k: [] for k in kinds}
    # transports take turns over several rounds: this shared machine drifts between fast and
    # slow spells lasting seconds, and one transport measured in one spell would carry it
    for _ in range(ROUNDS):
        for kind in kinds:
            small[kind] += trio.run(transport_costs.round_trips, kind, transport_costs.DECODE_FRAME, count // ROUNDS)
            large[kind] += trio.run(
                transport_costs.round_trips, kind, transport_costs.PREFILL_FRAME, big_count // ROUNDS
            )
    for kind in kinds:
        hops[kind] = {
            "decode_frame_bytes": transport_costs.DECODE_FRAME,
            "decode_rtt_p50_us": _common.percentile(small[kind], 50) * 1e6,
            "decode_rtt_p95_us": _common.percentile(small[kind], 95) * 1e6,
            "prefill_frame_bytes": transport_costs.PREFILL_FRAME,
            "prefill_rtt_p50_ms": _common.percentile(large[kind], 50) * 1e3,
            "prefill_rtt_p95_ms": _common.percentile(large[kind], 95) * 1e3,
        }
    wake_ups = trio.run(transport_costs.wake_ups, 50 if args.quick else 400)
    hops["grpc"]["seam_open_and_first_round_trip"] = trio.run(
        transport_costs.seam_opens, 20 if args.quick else 100, tmp
    )
    demo = _route_figures(
        trio.run(_lanes, model, DEMO_CUTS, new_tokens, repeats), model, DEMO_CUTS, new_tokens, repeats
    )
    demo["token_stages"] = trio.run(_timelines, model, DEMO_CUTS, new_tokens, TIMELINE_REPEATS)
    larger_tokens = 16 if args.quick else 64
    larger_repeats = 2 if args.quick else 7
    larger_path = synth.write_model(
        tmp / "llama-1b-shape.gguf", synth.ModelShape(**LARGER_SHAPE), quant="Q4_0", name="seams-1b-shape"
    )
    larger = _route_figures(
        trio.run(_lanes, larger_path, LARGER_CUTS, larger_tokens, larger_repeats),
        larger_path,
        LARGER_CUTS,
        larger_tokens,
        larger_repeats,
    )
    larger["token_stages"] = trio.run(_timelines, larger_path, LARGER_CUTS, larger_tokens, TIMELINE_REPEATS)
    larger |= {
        "shape": LARGER_SHAPE,
        "quant": "Q4_0",
        "model_bytes": larger_path.stat().st_size,
        "cuts": LARGER_CUTS,
        "new_tokens": larger_tokens,
        "repeats": larger_repeats,
    }
    largest = _largest_lanes(tmp, 8 if args.quick else 32, 2 if args.quick else 5)
    figures = {
        "hops": hops,
        "wake_ups": wake_ups,
        "whole_model_one_process_decode_tok_s": demo["whole_decode_tok_s"],
        "route_grpc_decode_tok_s": demo["grpc_decode_tok_s"],
        "route_relay_decode_tok_s": demo["relay_decode_tok_s"],
        "route_grpc_over_whole": demo["grpc_over_whole"],
        "route_relay_over_whole": demo["relay_over_whole"],
        "one_node_decode_tok_s": demo["one_node_decode_tok_s"],
        "one_node_over_whole": demo["one_node_over_whole"],
        "route_grpc_over_one_node": demo["grpc_over_one_node"],
        "route_relay_over_one_node": demo["relay_over_one_node"],
        "seam_bytes_per_decode_token": _seam_bytes_per_token(str(model)),
        "route_grpc_ms_per_token": 1e3 / demo["grpc_decode_tok_s"],
        "route_grpc_decode_tick_ms_head_tail": demo["decode_tick_ms_head_tail"]["grpc"],
        "route_relay_ms_per_token": 1e3 / demo["relay_decode_tok_s"],
        "route_relay_decode_tick_ms_head_tail": demo["decode_tick_ms_head_tail"]["relay"],
        "whole_model_ms_per_token": 1e3 / demo["whole_decode_tok_s"],
        "route_gap_ms_per_token": demo["gap_ms_per_token"],
        "where_the_gap_goes_ms": demo["where_the_gap_goes_ms"],
        "engine_after_idle_ms": demo["engine_after_idle_ms"],
        "decode_tick_ms_head_tail": demo["decode_tick_ms_head_tail"],
        "decode_engine_ms_head_tail": demo["decode_engine_ms_head_tail"],
        "alone_decode_tok_s": demo["alone_decode_tok_s"],
        "pinned_one_core_per_process": demo["pinned_one_core_per_process"],
        "chained_decode_tok_s": demo["chained_decode_tok_s"],
        "chained_over_whole": demo["chained_over_whole"],
        "route_grpc_over_chained": demo["grpc_over_chained"],
        "route_relay_over_chained": demo["relay_over_chained"],
        "goal_grpc_0_90": demo["goal_grpc_0_90"],
        "goal_relay_0_85": demo["goal_relay_0_85"],
        "route_relay_plaintext_decode_tok_s": demo["relay_plaintext_decode_tok_s"],
        "route_relay_over_relay_plaintext": demo["relay_over_relay_plaintext"],
        "goal_relay_sealed_0_97": demo["goal_relay_sealed_0_97"],
        "token_stages_us": demo["token_stages"],
        "raw": demo["raw"],
        "larger_model": larger,
        "largest_model": largest,
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
            "round_trip_rounds": ROUNDS,
            "cuts": DEMO_CUTS,
            "processes": f"one per shard, 2 threads each, on this {os.cpu_count()}-core machine",
            "demo_model": f"random weights, SmolLM2-135M's shape and quant (Q4_1, embedding Q8_0): {DEMO_SHAPE}"
            if args.demo_shape
            else "SmolLM2-135M-Instruct Q4_1",
        },
    )
    demo_label = "SmolLM2-135M shape" if args.demo_shape else "SmolLM2-135M"
    png = seam_figures.plot(path, demo, larger, largest, demo_label)
    print(
        _common.table(
            ["transport", "decode RTT p50 µs", "p95 µs", "prefill RTT p50 ms", "p95 ms"],
            [
                [k, v["decode_rtt_p50_us"], v["decode_rtt_p95_us"], v["prefill_rtt_p50_ms"], v["prefill_rtt_p95_ms"]]
                for k, v in hops.items()
            ],
        )
    )
    opens = hops["grpc"]["seam_open_and_first_round_trip"]
    print(
        f"\ngRPC seam open + first round trip, p50: {opens['plain_new_connection_p50_ms']:.2f} ms on a new "
        f"connection, {opens['plain_spare_connection_p50_ms']:.2f} ms on a spare; with TLS "
        f"{opens['tls_new_connection_p50_ms']:.2f} and {opens['tls_spare_connection_p50_ms']:.2f} ms"
    )
    print(
        f"\nthread wake-ups after {transport_costs.WAKE_IDLE * 1e3:.0f} ms idle: engine thread round trip "
        f"{wake_ups['worker_thread_round_trip_us']:.0f} µs (trio.to_thread "
        f"{wake_ups['to_thread_round_trip_us']:.0f} µs), asyncio round trip "
        f"{wake_ups['asyncio_thread_round_trip_us']:.0f} µs "
        f"({wake_ups['worker_thread_round_trip_after_sweep_us']:.0f} and "
        f"{wake_ups['asyncio_thread_round_trip_after_sweep_us']:.0f} µs after reading "
        f"{transport_costs.SWEEP_BYTES >> 20} MiB); a gRPC route token makes two of each: "
        f"{wake_ups['grpc_route_thread_wake_ups_ms_per_token']:.2f} ms "
        f"({wake_ups['grpc_route_thread_wake_ups_after_sweep_ms_per_token']:.2f} ms cold)\n"
    )
    rows = []
    for label, lane in ((demo_label, demo), ("1B-shape", larger)):
        pinned = lane["pinned_one_core_per_process"]
        parts = lane["where_the_gap_goes_ms"]
        for name, rate, ratio, key in (
            ("whole model, one process", lane["whole_decode_tok_s"], 1.0, None),
            ("2 ranges chained, one process", lane["chained_decode_tok_s"], lane["chained_over_whole"], None),
            ("whole model, one node", lane["one_node_decode_tok_s"], lane["one_node_over_whole"], "one_node"),
            ("2 shards over gRPC", lane["grpc_decode_tok_s"], lane["grpc_over_whole"], "grpc"),
            ("2 shards over the relay", lane["relay_decode_tok_s"], lane["relay_over_whole"], "relay"),
            ("whole model, 1 core", pinned["whole_model_1_core_decode_tok_s"], 1.0, None),
            (
                "2 shards over gRPC, 1 core each",
                pinned["route_grpc_1_core_per_shard_decode_tok_s"],
                pinned["route_over_whole"],
                "grpc_pinned",
            ),
        ):
            gap = [parts[key][k] for k in seam_figures.GAP_PARTS] if key else [""] * len(seam_figures.GAP_PARTS)
            rows.append([f"{label}: {name}", rate, ratio, *gap])
    if "skipped" in largest:
        rows.append(["8B-shape: skipped", largest["skipped"], "", *[""] * len(seam_figures.GAP_PARTS)])
    else:
        parts = largest["where_the_gap_goes_ms"]
        for name, key in (
            ("whole model, one process", None),
            ("2 ranges chained, one process", "chained"),
            ("whole model, one node", "one_node"),
            ("2 shards over gRPC", "grpc"),
            ("2 shards over the relay", "relay"),
        ):
            rate = largest[f"{key or 'whole'}_decode_tok_s"]
            gap = (
                [parts[key][k] for k in seam_figures.GAP_PARTS] if key in parts else [""] * len(seam_figures.GAP_PARTS)
            )
            rows.append([f"8B-shape: {name}", rate, rate / largest["whole_decode_tok_s"], *gap])
    print()
    print(
        _common.table(
            ["lane", "decode tok/s", "vs whole", *(f"+ms {k.replace('_', ' ')}" for k in seam_figures.GAP_PARTS)], rows
        )
    )
    for label, lane in ((demo_label, demo), ("1B-shape", larger)):
        idle = lane["engine_after_idle_ms"]
        print(
            f"\n{label}: one engine call back to back / after idling one other range's call, in one process: "
            f"head {idle['head']['back_to_back']:.2f} / {idle['head']['after_idle']:.2f} ms, "
            f"tail {idle['tail']['back_to_back']:.2f} / {idle['tail']['after_idle']:.2f} ms "
            f"(+{idle['extra_ms_per_token']:.2f} ms a token)"
        )
    for label, lane in ((demo_label, demo), ("1B-shape", larger)):
        print(f"\n{label}: where one decode token's time goes (median µs, {TIMELINE_REPEATS} generations)")
        print(tokenpath.stage_table(lane["token_stages"]))
    per_token = _seam_bytes_per_token(str(model))["total"]
    print(f"\nseam bytes per decode token: {per_token:.0f}\nwrote {path} and {png}")
    return 0


def _largest_lanes(tmp: Path, new_tokens: int, repeats: int) -> dict[str, Any]:
    """The decode lanes on a model of Llama-3.1-8B's shape, or why they were skipped."""
    from noderuntime.models import synth

    try:
        path = synth.write_model(
            tmp / "llama-8b-shape.gguf", synth.ModelShape(**LARGEST_SHAPE), quant="Q4_0", name="seams-8b-shape"
        )
    except OSError as exc:  # a full disk, most likely: the figures of the other models still count
        return {"skipped": f"cannot write the model: {exc}", "shape": LARGEST_SHAPE}
    try:
        size = path.stat().st_size
        needed, available = int(size * LARGEST_MEMORY_FACTOR), _memory_available()
        if available < needed:
            return {
                "skipped": f"needs {needed / 2**30:.1f} GiB of available memory; this machine has "
                f"{available / 2**30:.1f} GiB",
                "shape": LARGEST_SHAPE,
            }
        # two routes' clusters side by side, then the third's: three at once would not fit
        rates = trio.run(_lanes, path, LARGEST_CUTS, new_tokens, repeats, ("grpc", "relay", "relay_plaintext"))
        for key, values in trio.run(_lanes, path, LARGEST_CUTS, new_tokens, repeats, ("one_node",)).items():
            rates[key] = rates.get(key, []) + values
        figures = seam_figures.rate_figures(rates)
    finally:
        path.unlink()
    return figures | {
        "shape": LARGEST_SHAPE,
        "quant": "Q4_0",
        "model_bytes": size,
        "cuts": LARGEST_CUTS,
        "new_tokens": new_tokens,
        "repeats": repeats,
    }


def _memory_available() -> int:
    """Bytes the kernel reckons it can give without swapping (``MemAvailable``)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _route_figures(
    rates: dict[str, Any], model: Path, cuts: list[int], new_tokens: int, repeats: int
) -> dict[str, Any]:
    """Medians and ratios of one model's lanes, with its pinned lanes run after them."""
    pinned = trio.run(_pinned_lanes, model, cuts, new_tokens, repeats)
    after_idle = _common.in_fresh_process(_engine_after_idle, str(model), cuts, max(8, new_tokens // 4))
    figures = seam_figures.rate_figures(rates)
    med = {k: statistics.median(v) for k, v in pinned.items() if k in LANES_1_CORE}
    whole_1, grpc_1 = med["whole_1core"], med["grpc_1core_each"]
    ticks = seam_figures.median_ticks(pinned["decode_tick_ms"])
    engine = seam_figures.median_ticks(pinned["decode_engine_ms"])
    # two shards pinned to a core each are held against each range alone on one core
    reference = (1e3 / med["head_alone_1core"], 1e3 / med["tail_alone_1core"])
    figures["gap_ms_per_token"]["grpc_pinned"] = 1e3 / grpc_1 - 1e3 / whole_1
    figures["where_the_gap_goes_ms"]["grpc_pinned"] = seam_figures.gap_parts(grpc_1, whole_1, reference, ticks, engine)
    figures["decode_tick_ms_head_tail"]["grpc_pinned"] = ticks
    figures["decode_engine_ms_head_tail"]["grpc_pinned"] = engine
    # part of engine_slower: a shard's call after idling while the other computes
    figures["engine_after_idle_ms"] = after_idle
    figures["alone_decode_tok_s"] |= {"head_1_core": med["head_alone_1core"], "tail_1_core": med["tail_alone_1core"]}
    figures["pinned_one_core_per_process"] = {
        "whole_model_1_core_decode_tok_s": whole_1,
        "route_grpc_1_core_per_shard_decode_tok_s": grpc_1,
        "route_over_whole": grpc_1 / whole_1,
        "raw": pinned,
    }
    return figures


if __name__ == "__main__":
    raise SystemExit(main())
