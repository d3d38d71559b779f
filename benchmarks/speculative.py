"""Speculative decoding across a route: one session's speed over delayed seams, side by side.

    python -m benchmarks.speculative [--quick] [--out PATH]

For each model (SmolLM2-135M-Instruct and Gemma 3 270M, real weights; ``--quick``: SmolLM2
alone), node processes serve it whole, in 2 shards and in 3, each behind a link proxy of
this process that holds every piece ``d`` ms each way (``noderuntime.testing.linkproxy``):
every seam of a route, the client's to the head included, is ``d`` ms long. Then:

1. **Single session**, per workload, at d = 0, 5, 20 and 50 ms (routes; the one node at 0):
   the same greedy request without windows and with (``speculate`` 8), one after the other.
   Each speculative reply must equal its plain twin token for token. Figures: decode tok/s
   (from the first token's arrival to the last's), drafts sent and kept, tokens a window,
   round trips a token (one a plain step).
2. **Sixteen clients at once** at d = 0, on the one node and the 2-shard route: aggregate
   tok/s over a mix of the workloads, without windows and with.
3. **llama-server** from the same sources (d = 0): plain, and each of its n-gram
   ``--spec-type`` modes, on the same prompts and greedy; its own timings give decode
   tok/s and its drafts. The best n-gram mode is the single-machine anchor.

Workloads: *grounded*, where the reply is mostly in the prompt (edit a given function,
reformat a given JSON document, answer by quoting a given passage), and *free chat*.

With ``--ahead`` it measures windows in flight instead: each model's 3-shard route twice,
its head sending one window at a time (``up --windows-ahead 0``) and then windows behind one
in flight (the default), every workload at d = 0, 20 and 50 ms (0 and 20 quick) plain against
speculative in each, and sixteen clients at d = 0; written to ``speculative-ahead.json``.

With ``--draft MODEL[,MODEL...]`` it measures draft models instead: the 3-shard route of the
first model, its head drafting by prompt lookup and then with ``up --draft MODEL`` for each
(a catalogue name, a GGUF file of the same vocabulary, or ``first:N``: the model's own first
N layers and its head, an untrained early exit), every workload at d = 0, 20 and 50 ms (0 and
20 quick), plain against speculative in each; written to ``speculative-draft.json``.

Goals (the issue's): grounded on a 3-shard route at d = 20 ms >= 2.0x plain; free chat >=
0.97x plain at every d; one node at d = 0 on grounded >= llama-server's best n-gram mode;
16 clients >= 0.97x; every reply byte-identical.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from benchmarks import _common, serving

NAME = "speculative"
WINDOW = 8  # drafts a window may carry (the gateway's default)
MODELS = {
    # catalogue name -> (layers, cuts by shard count)
    "smollm2-135m": {1: [0, 30], 2: [0, 15, 30], 3: [0, 10, 20, 30]},
    "gemma3-270m": {1: [0, 18], 2: [0, 9, 18], 3: [0, 6, 12, 18]},
}
DELAYS_MS = (0, 5, 20, 50)
QUICK_DELAYS_MS = (0, 20)
DRAFT_DELAYS_MS = (0, 20, 50)
CLIENTS = 16
REPEATS_UNDELAYED = 3  # pairs a workload runs at d = 0 (see _route_lanes)
LLAMA_SERVER_MODES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")

_FUNCTION = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
_DOCUMENT = (
    '{"name":"river-mill","version":3,"owners":["ana","bo"],"limits":{"requests":120,"burst":20},'
    '"regions":[{"id":"north","nodes":4},{"id":"south","nodes":7}],"enabled":true}'
)
_PASSAGE = (
    "The mill stood by the river for two hundred years. Its wheel turned the stones that ground "
    "the village's grain, and in winter, when the river froze, the miller kept a fire burning "
    "so that the ice would not crack the axle. In 1911 a flood carried the wheel away. The "
    "stones were sold to a farm upstream, and the building became a school, which it still is."
)
WORKLOADS: dict[str, tuple[str, str]] = {
    # name -> (kind, the user's message)
    "edit_function": (
        "grounded",
        f"Rename the variable `total` to `running_sum` in this function and show the whole function:\n\n{_FUNCTION}",
    ),
    "reformat_json": (
        "grounded",
        f"Reformat this JSON document with two-space indentation, one key per line:\n\n{_DOCUMENT}",
    ),
    "quote_passage": (
        "grounded",
        f"Read the passage, then quote, word for word, the sentences about the flood and what "
        f"happened after it.\n\n{_PASSAGE}",
    ),
    "story": ("free", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    "advice": ("free", "What are three good ways to learn a new language as an adult? Explain each."),
}
QUICK_WORKLOADS = ("quote_passage", "story")


@attrs.frozen
class Reply:
    """One session, as the client saw it."""

    tokens: tuple[int, ...]
    frames: int  # Tokens frames: one round trip of the ring each
    first_frame: int  # tokens in the first (after prefill)
    decode_seconds: float  # from the first frame's arrival to the last's
    drafted: int
    accepted: int

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first frame, a second."""
        return (len(self.tokens) - self.first_frame) / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def round_trips_per_token(self) -> float:
        """Round trips of the ring a token, after the first frame (1.0: one a token, as without windows)."""
        decoded = len(self.tokens) - self.first_frame
        return (self.frames - 1) / decoded if decoded else 0.0


def _prompts(model: Path, names: Sequence[str]) -> dict[str, list[int]]:
    """Each workload's chat prompt, rendered with the model's own template (a text prompt without one)."""
    from noderuntime.engine.llama import Vocab
    from noderuntime.models.chat import ChatTemplate, prompt_tokens

    vocab = Vocab(model)
    if not vocab.chat_template:
        # a pretrained model (Gemma 3 270M's file) has no chat template: the message as a text
        # completion's prompt, as the gateway's /v1/completions would send it
        return {name: vocab.tokenize(WORKLOADS[name][1] + "\n\n") for name in names}
    bos = vocab.piece(vocab.bos, special=True).decode("utf-8", "replace") if vocab.bos >= 0 else ""
    eos = vocab.piece(vocab.eos, special=True).decode("utf-8", "replace") if vocab.eos >= 0 else ""
    template = ChatTemplate(vocab.chat_template, bos_token=bos, eos_token=eos)
    return {name: prompt_tokens(template, vocab, [{"role": "user", "content": WORKLOADS[name][1]}]) for name in names}


async def _one(cluster: Any, dialer: Any, hops: Any, prompt: Sequence[int], new_tokens: int, speculate: int) -> Reply:
    from noderuntime.seams.client import GenerationRequest
    from protocol import Sampling

    request = GenerationRequest(tuple(prompt), new_tokens, Sampling(temperature=0.0), speculate=speculate)
    arrivals: list[float] = []
    first = 0
    async with cluster.open(dialer, request, hops=hops) as gen:
        while (event := await gen.next()) is not None:
            arrivals.append(time.perf_counter())
            if len(arrivals) == 1:
                first = len(event.token_ids)
    return Reply(tuple(gen.tokens), len(arrivals), first, arrivals[-1] - arrivals[0], gen.drafted, gen.accepted)


async def _route_lanes(
    model: Path,
    name: str,
    shards: int,
    cuts: list[int],
    prompts: dict[str, list[int]],
    delays: Sequence[int],
    args: Any,
    head_extra: Sequence[str] = (),
    crowd: bool | None = None,
) -> dict[str, Any]:
    """Every workload at every delay, plain then with windows; and 16 clients at d = 0 (``crowd``;
    by default up to 2 shards, and on a route whose head has ``head_extra``: flags for the head
    node alone, ``--draft MODEL``)."""
    from noderuntime.seams.dialer import open_dialer
    from noderuntime.testing.clusters import running_cluster
    from noderuntime.testing.linkproxy import LinkProxy

    out: dict[str, Any] = {"cuts": cuts, "delays": {}}
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_cluster(model, cuts, Path(tmp), slots=CLIENTS, ctx=1024, threads=2, head_extra=head_extra) as cluster,
    ):
        proxies = []
        for hop in cluster.hops:
            proxy = LinkProxy()
            proxy.target = int(hop.address.rpartition(":")[2])
            await trio.to_thread.run_sync(proxy.start)
            proxies.append(proxy)
        try:
            hops = tuple(
                attrs.evolve(hop, address=f"127.0.0.1:{proxy.port}")
                for hop, proxy in zip(cluster.hops, proxies, strict=True)
            )
            async with open_dialer() as dialer:
                await _one(cluster, dialer, hops, prompts[next(iter(prompts))], 8, 0)  # connections, page cache
                for delay in delays:
                    for proxy in proxies:
                        proxy.delay = delay / 1e3
                    lane: dict[str, Any] = {}
                    # where a reply takes a second or two, this machine's drift is as large as
                    # what is measured: such lanes run each pair several times, in turns
                    repeats = REPEATS_UNDELAYED if delay == 0 and not args.quick else 1
                    for workload, prompt in prompts.items():
                        plains, windows = [], []
                        for _ in range(repeats):
                            plains.append(await _one(cluster, dialer, hops, prompt, args.tokens, 0))
                            windows.append(await _one(cluster, dialer, hops, prompt, args.tokens, WINDOW))
                        lane[workload] = _pair(plains, windows)
                        print(f"  {name} {shards}-shard d={delay} ms {workload}: {_brief(lane[workload])}", flush=True)
                    out["delays"][str(delay)] = lane
                for proxy in proxies:
                    proxy.delay = 0.0
                if crowd or (crowd is None and (shards <= 2 or head_extra)):
                    out["clients"] = await _crowd(cluster, dialer, hops, list(prompts.values()), args.tokens)
                    print(f"  {name} {shards}-shard {CLIENTS} clients: {out['clients']}", flush=True)
        finally:
            for proxy in proxies:
                await trio.to_thread.run_sync(proxy.close)
    return out


def _pair(plains: list[Reply], windowed: list[Reply]) -> dict[str, Any]:
    """Plain replies and speculative ones to the same request: their median speeds, the rest of the last."""
    plain, windows = plains[-1], windowed[-1]
    plain_rate = statistics.median(r.decode_tok_s for r in plains)
    rate = statistics.median(r.decode_tok_s for r in windowed)
    return {
        "identical": all(r.tokens == plain.tokens for r in (*plains, *windowed)),
        "runs": len(plains),
        "tokens": len(plain.tokens),
        "plain_tok_s": round(plain_rate, 2),
        "speculative_tok_s": round(rate, 2),
        "speedup": round(rate / plain_rate, 3) if plain_rate else None,
        "drafted": windows.drafted,
        "accepted": windows.accepted,
        "acceptance": round(windows.accepted / windows.drafted, 3) if windows.drafted else None,
        "tokens_per_window": round((len(windows.tokens) - windows.first_frame) / max(1, windows.frames - 1), 3),
        "round_trips_per_token": {
            "plain": round(plain.round_trips_per_token, 3),
            "speculative": round(windows.round_trips_per_token, 3),
        },
    }


def _brief(pair: dict[str, Any]) -> str:
    return (
        f"{pair['plain_tok_s']:.1f} -> {pair['speculative_tok_s']:.1f} tok/s ({pair['speedup']}x), "
        f"kept {pair['accepted']}/{pair['drafted']}, identical {pair['identical']}"
    )


async def _crowd(cluster: Any, dialer: Any, hops: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Sixteen sessions at once over the workloads, without windows and with: aggregate tok/s."""
    result: dict[str, Any] = {}
    for label, speculate in (("plain", 0), ("speculative", WINDOW)):
        replies: list[Reply] = []

        async def client(i: int, speculate: int = speculate, replies: list[Reply] = replies) -> None:
            replies.append(await _one(cluster, dialer, hops, prompts[i % len(prompts)], new_tokens, speculate))

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(CLIENTS):
                nursery.start_soon(client, i)
        seconds = time.perf_counter() - started
        result[label] = {
            "tok_s": round(sum(len(r.tokens) for r in replies) / seconds, 2),
            "drafted": sum(r.drafted for r in replies),
            "accepted": sum(r.accepted for r in replies),
        }
        result.setdefault("outputs", {})[label] = sorted(r.tokens for r in replies)
    outputs = result.pop("outputs")
    result["identical"] = outputs["plain"] == outputs["speculative"]
    result["ratio"] = round(result["speculative"]["tok_s"] / result["plain"]["tok_s"], 3)
    return result


def _llama_server_lanes(model: Path, prompts: dict[str, list[int]], new_tokens: int) -> dict[str, Any]:
    """llama-server, one session at a time, plain and with each n-gram mode (greedy, d = 0)."""
    binary = serving._llama_server()
    port = serving.LLAMA_SERVER_PORT
    out: dict[str, Any] = {}
    for mode in LLAMA_SERVER_MODES:
        extra = [] if mode == "none" else ["--spec-type", mode, "--spec-draft-n-max", str(WINDOW)]
        proc = serving._start_llama_server(binary, model, port, 1, 2048, *extra)
        try:
            lane: dict[str, Any] = {}
            for workload, prompt in prompts.items():
                body = {"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "cache_prompt": False}
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/completion",
                    data=json.dumps(body).encode(),
                    headers={"content-type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=600) as response:
                    timings = json.loads(response.read())["timings"]
                lane[workload] = {
                    "tok_s": round(timings["predicted_per_second"], 2),
                    "drafted": timings.get("draft_n", 0),
                    "accepted": timings.get("draft_n_accepted", 0),
                }
            out[mode] = lane
            print(f"  llama-server {mode}: {lane}", flush=True)
        finally:
            proc.terminate()
            proc.wait(10)
    return out


def _summary(models: dict[str, Any]) -> dict[str, Any]:
    """The goals, from the lanes."""
    summary: dict[str, Any] = {}
    identical = total = 0
    for name, lanes in models.items():
        mine: dict[str, Any] = {}
        for shards, lane in lanes["routes"].items():
            for delay, workloads in lane["delays"].items():
                for workload, pair in workloads.items():
                    total += 1
                    identical += pair["identical"]
                    kind = WORKLOADS[workload][0]
                    mine.setdefault(f"{shards}-shard d={delay} {kind}", []).append(pair["speedup"])
            if "clients" in lane:
                total += 1
                identical += lane["clients"]["identical"]
                mine[f"{shards}-shard {CLIENTS} clients"] = lane["clients"]["ratio"]
        speedups = {k: round(statistics.geometric_mean(v), 3) if isinstance(v, list) else v for k, v in mine.items()}
        grounded_one = [
            p["speculative_tok_s"]
            for w, p in lanes["routes"]["1"]["delays"]["0"].items()
            if WORKLOADS[w][0] == "grounded"
        ]
        anchor = lanes.get("llama_server", {})
        best = None
        for mode, lane in anchor.items():
            if mode == "none":
                continue
            rate = statistics.mean(v["tok_s"] for w, v in lane.items() if WORKLOADS[w][0] == "grounded")
            if best is None or rate > best[1]:
                best = (mode, rate)
        speedups["one_node_grounded_tok_s"] = round(statistics.mean(grounded_one), 2) if grounded_one else None
        if best is not None:
            speedups["llama_server_best_ngram"] = {"mode": best[0], "grounded_tok_s": round(best[1], 2)}
            speedups["one_node_over_llama_server_ngram"] = round(statistics.mean(grounded_one) / best[1], 3)
        summary[name] = speedups
    summary["byte_identical"] = f"{identical}/{total}"
    return summary


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    p = _common.parser(NAME, __doc__ or "")
    p.add_argument("--models", default=None, help="comma-separated catalogue names (default: both; quick: SmolLM2)")
    p.add_argument("--tokens", type=int, default=None, help="tokens each reply generates (default 96; quick 40)")
    p.add_argument(
        "--draft",
        default=None,
        metavar="MODEL",
        help="measure a draft model instead: the first model's 3-shard route with its head drafting by prompt "
        "lookup, then with MODEL (a catalogue name, a GGUF file of the same vocabulary, or first:N for the "
        "model's own first N layers and its head)",
    )
    p.add_argument(
        "--ahead",
        action="store_true",
        help="measure windows in flight instead: each model's 3-shard route with its head sending one window "
        "at a time (--windows-ahead 0), then windows behind one in flight (the default)",
    )
    args = p.parse_args(argv)
    args.tokens = args.tokens or (40 if args.quick else 96)
    names = args.models.split(",") if args.models else (["smollm2-135m"] if args.quick else list(MODELS))
    delays = QUICK_DELAYS_MS if args.quick else DELAYS_MS
    workloads = QUICK_WORKLOADS if args.quick else tuple(WORKLOADS)
    figures: dict[str, Any] = {}
    from noderuntime.models import catalogue

    if args.draft is not None:
        return _main_draft(args, names[0], QUICK_DELAYS_MS if args.quick else DRAFT_DELAYS_MS, workloads)
    if args.ahead:
        return _main_ahead(args, names, QUICK_DELAYS_MS if args.quick else DRAFT_DELAYS_MS, workloads)

    for name in names:
        model = catalogue.pull(name, progress=False)
        prompts = _prompts(model, workloads)
        lanes: dict[str, Any] = {"prompt_tokens": {w: len(p) for w, p in prompts.items()}, "routes": {}}
        for shards, cuts in MODELS[name].items():
            lane_delays = (0,) if shards == 1 else delays
            lanes["routes"][str(shards)] = trio.run(_route_lanes, model, name, shards, cuts, prompts, lane_delays, args)
        lanes["llama_server"] = _llama_server_lanes(model, prompts, args.tokens)
        figures[name] = lanes
    figures["summary"] = _summary(figures)
    recipe = {
        "models": names,
        "window": WINDOW,
        "delays_ms_each_way": list(delays),
        "tokens": args.tokens,
        "workloads": {w: WORKLOADS[w][0] for w in workloads},
        "sampling": "greedy",
        "nodes": "one process per range, 2 threads each, on this machine's cores; every seam through a "
        "link proxy that holds each piece d ms each way",
        "llama_server": f"--parallel 1, --threads 2, --spec-draft-n-max {WINDOW}, each n-gram --spec-type",
    }
    path = _common.out_path(NAME, args)
    _common.write(path, NAME, args, recipe, figures)
    _plot(path.with_suffix(".png"), figures, names, delays)
    rows = []
    for name in names:
        for key, value in figures["summary"][name].items():
            rows.append([name, key, json.dumps(value) if isinstance(value, dict) else value])
    print(_common.table(["model", "figure", "value"], rows))
    print(f"byte-identical: {figures['summary']['byte_identical']}")
    print(f"wrote {path}")
    return 0


def early_exit(model: Path, n_layer: int, out: Path) -> Path:
    """A whole model of ``model``'s first ``n_layer`` blocks, its output norm and its head: a
    draft of the same vocabulary that costs ``n_layer / n`` of a token (no training, so its
    guesses are rougher than a trained small model's)."""
    from noderuntime.models import artifacts
    from noderuntime.models import gguf as ggufio

    source = ggufio.read(model)
    count = f"{source.get('general.architecture')}.block_count"
    fields = [
        ggufio.uint32_field(count, n_layer) if key == count else field.raw for key, field in source.fields.items()
    ]
    tensors = [t for t in source.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < n_layer]
    out.parent.mkdir(parents=True, exist_ok=True)
    with model.open("rb") as data:
        ggufio.write(out, fields, [(t, data) for t in tensors], alignment=source.alignment)
    artifacts.inspect(out)  # a readable whole model, or ArtifactError
    return out


def _head_lanes(
    args: Any,
    name: str,
    model: Path,
    prompts: dict[str, list[int]],
    delays: Sequence[int],
    heads: dict[str, tuple[str, ...]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The 3-shard route once for each of ``heads`` (its head's extra flags): every workload at
    every delay and 16 clients at d = 0, plain against speculative; the lanes, and a summary
    by head, delay and kind of workload."""
    cuts = MODELS[name][3]
    lanes_by_head: dict[str, Any] = {}
    for label, head_extra in heads.items():
        print(f"{name} 3-shard route, head {label}", flush=True)
        lanes_by_head[label] = trio.run(_route_lanes, model, name, 3, cuts, prompts, delays, args, head_extra, True)
    summary: dict[str, Any] = {}
    identical = total = 0
    for label, lanes in lanes_by_head.items():
        for delay, lane in lanes["delays"].items():
            for kind in ("grounded", "free"):
                pairs = [pair for w, pair in lane.items() if WORKLOADS[w][0] == kind]
                speedups = [pair["speedup"] for pair in pairs if pair["speedup"]]
                kept = sum(pair["accepted"] for pair in pairs)
                sent = sum(pair["drafted"] for pair in pairs)
                summary[f"{label} d={delay} {kind}"] = {
                    "speedup": round(statistics.geometric_mean(speedups), 3) if speedups else None,
                    "acceptance": round(kept / sent, 3) if sent else None,
                    "drafted": sent,
                }
            for pair in lane.values():
                total += 1
                identical += pair["identical"]
        if "clients" in lanes:
            total += 1
            identical += lanes["clients"]["identical"]
            summary[f"{label} {CLIENTS} clients d=0"] = {
                "speedup": lanes["clients"]["ratio"],
                "acceptance": None,
                "drafted": lanes["clients"]["speculative"]["drafted"],
            }
    summary["byte_identical"] = f"{identical}/{total}"
    return lanes_by_head, summary


def _lanes_recipe(
    args: Any, delays: Sequence[int], workloads: Sequence[str], nodes: str = "", **which: Any
) -> dict[str, Any]:
    """The recipe of a run of :func:`_head_lanes`: ``which`` models and heads, then what every lane shares."""
    return {
        **which,
        "window": WINDOW,
        "delays_ms_each_way": list(delays),
        "tokens": args.tokens,
        "workloads": {w: WORKLOADS[w][0] for w in workloads},
        "sampling": "greedy",
        "nodes": "one process per range, 2 threads each, on this machine's cores; every seam through a link "
        "proxy that holds each piece d ms each way" + nodes,
    }


def ahead_over_one(lanes: dict[str, Any], delays: Sequence[int]) -> dict[str, float]:
    """Windows in flight against one at a time, by delay and kind of workload: the geometric mean
    of each workload's speedup over plain in one lane over its speedup in the other. Each lane's
    plain replies ran beside its speculative ones, so this cancels the machine's drift between
    the lanes (their plain rates differed by up to a fifth at d = 0), as their raw rates would not."""
    over: dict[str, float] = {}
    for delay in delays:
        one, ahead = (lanes[label]["delays"][str(delay)] for label in ("one at a time", "ahead"))
        for kind in ("grounded", "free"):
            ratios = [
                pair["speedup"] / one[w]["speedup"]
                for w, pair in ahead.items()
                if WORKLOADS[w][0] == kind and pair["speedup"] and one[w]["speedup"]
            ]
            over[f"d={delay} {kind}"] = round(statistics.geometric_mean(ratios), 3)
    return over


def _main_ahead(args: Any, names: Sequence[str], delays: Sequence[int], workloads: Sequence[str]) -> int:
    """``--ahead``: each model's 3-shard route, one window at a time and then windows in flight."""
    from noderuntime.models import catalogue

    heads: dict[str, tuple[str, ...]] = {"one at a time": ("--windows-ahead", "0"), "ahead": ()}
    figures: dict[str, Any] = {}
    rows = []
    series: dict[str, tuple[Sequence[float], Sequence[float]]] = {}
    for name in names:
        model = catalogue.pull(name, progress=False)
        prompts = _prompts(model, workloads)
        lanes, summary = _head_lanes(args, name, model, prompts, delays, heads)
        over = summary["ahead_over_one_at_a_time"] = ahead_over_one(lanes, delays)
        figures[name] = {"prompt_tokens": {w: len(p) for w, p in prompts.items()}, "heads": lanes, "summary": summary}
        for key, value in summary.items():
            if isinstance(value, dict) and "speedup" in value:
                rows.append([name, key, value["speedup"], value["acceptance"], value["drafted"]])
        for key, value in over.items():
            rows.append([name, f"ahead / one at a time {key}", value, None, None])
        for label in heads:
            for kind in ("grounded", "free"):
                series[f"{name} {label} {kind}"] = (
                    [float(d) for d in delays],
                    [summary[f"{label} d={d} {kind}"]["speedup"] or 1.0 for d in delays],
                )
    recipe = _lanes_recipe(
        args,
        delays,
        workloads,
        models=list(names),
        cuts={name: MODELS[name][3] for name in names},
        heads={label: " ".join(extra) or "(defaults: --windows-ahead 3)" for label, extra in heads.items()},
    )
    path = args.out if args.out is not None else _common.RESULTS / f"{NAME}-ahead{'.quick' if args.quick else ''}.json"
    _common.write(path, NAME, args, recipe, figures)
    title = "3-shard routes: speculative / plain, one window at a time and windows in flight"
    _common.plot(path.with_suffix(".png"), title, "seam delay each way (ms)", "speculative / plain (x)", series)
    print(_common.table(["model", "lane", "speedup", "acceptance", "drafted"], rows))
    print("byte-identical: " + ", ".join(f"{n} {figures[n]['summary']['byte_identical']}" for n in names))
    print(f"wrote {path}")
    return 0


def _main_draft(args: Any, name: str, delays: Sequence[int], workloads: Sequence[str]) -> int:
    """``--draft``: one route, drafting by prompt lookup and then with the draft model."""
    from noderuntime.models import catalogue

    model = catalogue.pull(name, progress=False)
    drafts: dict[str, Path] = {}
    for spec in args.draft.split(","):
        if spec.startswith("first:"):  # the model's own first layers (early_exit)
            n_layer = int(spec.partition(":")[2])
            drafts[spec] = early_exit(model, n_layer, _common.cache_dir(NAME) / f"{model.stem}-first{n_layer}.gguf")
        elif spec in catalogue.KNOWN_MODELS:
            drafts[spec] = catalogue.pull(spec, progress=False)
        else:
            drafts[spec] = Path(spec)
    prompts = _prompts(model, workloads)
    cuts = MODELS[name][3]
    figures: dict[str, Any] = {"prompt_tokens": {w: len(p) for w, p in prompts.items()}}
    drafters: dict[str, tuple[str, ...]] = {"lookup": ()}
    drafters.update({spec: ("--draft", str(path)) for spec, path in drafts.items()})
    figures["drafters"], summary = _head_lanes(args, name, model, prompts, delays, drafters)
    figures["summary"] = summary
    recipe = _lanes_recipe(
        args,
        delays,
        workloads,
        "; the head started with --draft MODEL in a draft's lanes",
        model=name,
        drafts={spec: path.name for spec, path in drafts.items()},
        cuts=cuts,
    )
    path = args.out if args.out is not None else _common.RESULTS / f"{NAME}-draft{'.quick' if args.quick else ''}.json"
    _common.write(path, NAME, args, recipe, figures)
    series: dict[str, tuple[Sequence[float], Sequence[float]]] = {
        f"{drafter} {kind}": (
            [float(d) for d in delays],
            [summary[f"{drafter} d={d} {kind}"]["speedup"] or 1.0 for d in delays],
        )
        for drafter in drafters
        for kind in ("grounded", "free")
    }
    title = f"{name} 3-shard route: speculative / plain, by drafter"
    _common.plot(path.with_suffix(".png"), title, "seam delay each way (ms)", "speculative / plain (x)", series)
    rows = [
        [key, value["speedup"], value["acceptance"], value["drafted"]]
        for key, value in summary.items()
        if key != "byte_identical"
    ]
    print(_common.table(["lane", "speedup", "acceptance", "drafted"], rows))
    print(f"byte-identical: {summary['byte_identical']}")
    print(f"wrote {path}")
    return 0


def _plot(path: Path, figures: dict[str, Any], names: Sequence[str], delays: Sequence[int]) -> None:
    series: dict[str, tuple[Sequence[float], Sequence[float]]] = {}
    for name in names:
        for shards in ("2", "3"):
            lane = figures[name]["routes"][shards]["delays"]
            for kind in ("grounded", "free"):
                ys = [
                    statistics.geometric_mean(
                        [p["speedup"] for w, p in lane[str(d)].items() if WORKLOADS[w][0] == kind and p["speedup"]]
                        or [1.0]
                    )
                    for d in delays
                ]
                series[f"{name} {shards}-shard {kind}"] = ([float(d) for d in delays], ys)
    _common.plot(path, "Speculative over plain decode, one session", "seam delay each way (ms)", "speedup (x)", series)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
