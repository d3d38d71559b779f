"""Prefix reuse: a chat's later turns and a shared system message, beside llama-server's ``cache_prompt``.

    python -m benchmarks.prefix [--quick] [--out PATH]

SmolLM2-135M Q4_1 on this machine, three parts:

- ``kv``: what reusing N cached positions costs in the engine, each way llama.cpp offers.
  A sequence's state written to bytes and read back into another sequence (what a node's
  prefix cache does), against a copy between two sequences in place. With one KV stream
  per sequence (the recipe's), llama.cpp copies only whole streams, at the next batch:
  timed as the decode step that carries the copy, less a plain decode step.
- ``conversation``: one 12-turn chat (``--quick``: 5) opened by a long system message,
  ~1,500 prompt tokens by its last turn, streamed through the official ``openai`` client,
  greedy, 48 tokens a reply. Lanes: ``llama_server`` (``llama-server -np 16`` built from
  the same sources, ``cache_prompt`` on, its default), ``one_node`` (tracker, gateway, one
  node with the whole model) and ``local_system`` (the default 2 shards, the second via the
  relay). Each lane keeps its own history (its own replies); turns are interleaved across
  lanes, and two conversations (``--quick``: one) each open with a unique first line.
  Per turn: TTFT, prompt tokens, and the tokens the server took from its cache (ours:
  ``usage.prompt_tokens_details.cached_tokens``; llama-server: ``timings.cache_n``).
- ``shared``: many users, each chat opened by the model's default system message (what
  chat apps send), at 1, 8 and 16 clients (``--quick``: 1 and 4), two requests each, the
  lanes interleaved as in ``benchmarks.serving``: tok/s and TTFT p50, ratios over
  llama-server.

Goals (issue 49): the last turn's TTFT ≤ 1.5× the first's; TTFT per turn ≤ 1.2×
llama-server's on one node and ≤ 1.5× on the 2-shard route; on ``shared``, one node
≥ 0.85× llama-server's tok/s at every level, TTFT p50 ≤ 1.5×.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import trio

from benchmarks import _common, serving

NAME = "prefix"
LANES = ["llama_server", "one_node", "local_system"]

# ~330 tokens for SmolLM2's tokenizer: what a deployed assistant's instructions look like
SYSTEM = (
    "You are Harbor, the assistant of a small public library in a coastal town. You help "
    "visitors find books, explain how to borrow and return them, and answer questions about "
    "opening hours, events, the reading room, the children's corner and the local history "
    "archive. Be friendly, brief and concrete. When you are not sure of a fact about the "
    "library, say so and suggest asking at the front desk. The library opens at nine in the "
    "morning and closes at six in the evening on weekdays, and at one in the afternoon on "
    "Saturdays; it is closed on Sundays and public holidays. A library card is free for "
    "residents and costs ten euros a year for visitors. Members may borrow up to eight books "
    "for three weeks and renew them twice unless someone else has reserved them. Late returns "
    "cost twenty cents a day per book. The reading room is quiet: no phone calls, no food. "
    "The children's corner hosts a story hour every Wednesday at four. The local history "
    "archive holds maps, photographs and newspapers since 1850; it can be visited by "
    "appointment. Printing costs ten cents a page, scanning is free. Wireless internet is free "
    "for everyone; the password is on the card at the front desk. Answer in plain prose, "
    "without lists unless the visitor asks for one, and never invent titles that the library "
    "may not hold: describe the kind of book instead."
)
TURNS = [
    "Hello! I just moved here. How do I get a library card?",
    "Is it free for me? I rent a flat in town.",
    "What can you tell me about the opening hours on weekends?",
    "I like sea stories. What kind of books would you suggest?",
    "Can I renew a book online, or do I have to come in?",
    "What happens if I return a book a week late?",
    "My daughter is six. Is there anything for children?",
    "I am researching the history of the harbour. Where should I start?",
    "Can I bring my laptop and work in the reading room?",
    "How much does it cost to print a twenty-page document?",
    "Thanks. One more thing: is there an event this week for adults?",
    "Great, thank you for all your help today. Any last advice for a new member?",
]
MAX_TOKENS = 48


def _client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat through the official client: timing, text, and what the server says it reused."""
    client = _client(url)
    arrivals: list[float] = []
    text = ""
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                arrivals.append(time.perf_counter())
                text += choice.delta.content
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        timings = (chunk.model_extra or {}).get("timings") or timings  # llama-server's own figures
    client.close()
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    if cached is None and "cache_n" in timings:
        cached = timings["cache_n"]
    return {
        "started": started,
        "arrivals": arrivals,
        "text": text,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": cached,
        "timings": timings,
    }


async def stream_openai(url: str, model: str, prompt: str, max_tokens: int, workload: str) -> dict[str, Any]:
    """:func:`benchmarks.serving.stream_chat` through the official client (in a thread: it blocks)."""
    messages = [{"role": "system", "content": serving.system_message(workload)}, {"role": "user", "content": prompt}]
    return await trio.to_thread.run_sync(chat, url, model, messages, max_tokens)


def conversations(
    served: dict[str, tuple[str, str, dict[str, int]]], lanes: list[str], count: int, turns: int
) -> dict[str, list[list[dict[str, Any]]]]:
    """``count`` conversations of ``turns`` turns per lane, turn by turn interleaved across lanes."""
    out: dict[str, list[list[dict[str, Any]]]] = {lane: [] for lane in lanes}
    for c in range(count):
        system = f"Visitor {uuid.uuid4().hex[:8]}.\n{SYSTEM}"  # nothing of it cached at its first turn
        history = {lane: [{"role": "system", "content": system}] for lane in lanes}
        for lane in lanes:
            out[lane].append([])
        for t in range(turns):
            order = lanes[(c + t) % len(lanes) :] + lanes[: (c + t) % len(lanes)]
            for lane in order:
                url, model_id, _ = served[lane]
                history[lane].append({"role": "user", "content": TURNS[t]})
                result = chat(url, model_id, history[lane], MAX_TOKENS)
                history[lane].append({"role": "assistant", "content": result["text"]})
                ttft = (result["arrivals"][0] - result["started"]) * 1e3 if result["arrivals"] else None
                out[lane][c].append(
                    {
                        "turn": t + 1,
                        "ttft_ms": ttft,
                        "prompt_tokens": result["prompt_tokens"],
                        "cached_tokens": result["cached_tokens"],
                        "reply_chars": len(result["text"]),
                    }
                )
    return out


def _per_turn(runs: list[list[dict[str, Any]]], turns: int) -> list[dict[str, Any]]:
    """Each turn's median TTFT over the conversations, with the last conversation's token counts."""
    rows = []
    for t in range(turns):
        ttfts = [run[t]["ttft_ms"] for run in runs if run[t]["ttft_ms"] is not None]
        last = runs[-1][t]
        prompt, cached = last["prompt_tokens"], last["cached_tokens"]
        rows.append(
            {
                "turn": t + 1,
                "ttft_ms": statistics.median(ttfts) if ttfts else None,
                "ttft_ms_each": ttfts,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "prefilled_tokens": prompt - cached if prompt is not None and cached is not None else None,
            }
        )
    return rows


def kv_paths(model: Path, positions: tuple[int, ...], ctx: int) -> list[dict[str, Any]]:
    """Saving and restoring N positions, against an in-place copy of the whole stream, on the whole model."""
    import numpy as np

    from noderuntime.engine.base import Rows
    from noderuntime.engine.cores import machine_cores
    from noderuntime.engine.llama import Recipe, ShardEngine

    recipe = Recipe(n_threads=len(machine_cores()), n_ctx_per_seq=ctx, n_seq_max=3, n_batch=256, n_ubatch=256)
    rows: list[dict[str, Any]] = []
    with ShardEngine(model, recipe) as engine:

        def prefill(seq: int, n: int) -> None:
            tokens = np.random.default_rng(n).integers(100, 40_000, n).astype(np.int32)
            for start in range(0, n, 256):
                piece = tokens[start : start + 256]
                flags = np.zeros(len(piece), bool)
                engine.run(
                    Rows(
                        np.full(len(piece), seq, np.int32),
                        np.arange(start, start + len(piece), dtype=np.int32),
                        flags,
                        tokens=piece,
                    )
                )

        def decode_ms(seq: int, position: int) -> float:
            started = time.perf_counter()
            engine.run(
                Rows(
                    np.array([seq], np.int32), np.array([position], np.int32), np.ones(1, bool), np.array([7], np.int32)
                )
            )
            return (time.perf_counter() - started) * 1e3

        for n in positions:
            prefill(0, n)
            saves, restores, copies, plains = [], [], [], []
            for _ in range(5):
                started = time.perf_counter()
                state = engine.save_sequence(0)
                saves.append((time.perf_counter() - started) * 1e3)
                started = time.perf_counter()
                engine.restore_sequence(1, state, n)
                restores.append((time.perf_counter() - started) * 1e3)
                engine.remove_sequence(1)
                engine.copy_sequence(0, 2, n)
                copies.append(decode_ms(2, n))  # the copy happens with this batch
                plains.append(decode_ms(2, n + 1))
                engine.remove_sequence(2)
            engine.remove_sequence(0)
            rows.append(
                {
                    "positions": n,
                    "state_bytes": len(state),
                    "save_ms": statistics.median(saves),
                    "restore_ms": statistics.median(restores),
                    "copy_ms": max(0.0, statistics.median(copies) - statistics.median(plains)),
                    "copied_bytes": engine.memory().kv // recipe.n_seq_max,  # one whole stream
                    "prefill_ms_avoided": None,
                }
            )
        for row in rows:  # what the reuse saves: prefilling those positions
            n = int(row["positions"])
            started = time.perf_counter()
            prefill(0, n)
            row["prefill_ms_avoided"] = (time.perf_counter() - started) * 1e3
            engine.remove_sequence(0)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(NAME, __doc__ or "")
    p.add_argument("--lanes", default=",".join(LANES), help="comma-separated lanes (llama_server always runs)")
    args = p.parse_args(argv)
    from noderuntime.engine.llama import Recipe
    from noderuntime.models import artifacts
    from noderuntime.models import catalogue as models

    model = models.pull(models.DEMO_MODEL, progress=False)
    info = artifacts.inspect(model)
    lanes = ["llama_server"] + [lane for lane in LANES[1:] if lane in args.lanes.split(",")]
    turns, count = (5, 1) if args.quick else (len(TURNS), 2)
    levels = [1, 4] if args.quick else [1, 8, 16]
    rounds = 1 if args.quick else 2
    slots, ctx = 16, 4096
    kv = kv_paths(model, (256, 1024) if args.quick else (256, 1024, 2048), ctx)
    server = serving._llama_server()
    with contextlib.ExitStack() as stack:
        served = {lane: serving._start_lane(stack, lane, server, model, info.n_layer, slots, ctx) for lane in lanes}
        for url, model_id, _ in served.values():
            chat(url, model_id, [{"role": "user", "content": "Hello"}], 4)  # warm-up
        talks = conversations(served, lanes, count, turns)
        shared = serving.measure_levels(served, lanes, levels, ["shared"], rounds, 2, 64, stream=stream_openai)
    per_turn = {lane: _per_turn(talks[lane], turns) for lane in lanes}
    base = per_turn["llama_server"]
    figures: dict[str, Any] = {
        "kv": kv,
        "conversation": per_turn,
        "conversation_runs": talks,
        "conversation_ttft_over_llama_server": {
            lane: [
                (row["ttft_ms"] / b["ttft_ms"]) if row["ttft_ms"] and b["ttft_ms"] else None
                for row, b in zip(per_turn[lane], base, strict=True)
            ]
            for lane in lanes[1:]
        },
        "conversation_last_over_first_turn": {
            lane: per_turn[lane][-1]["ttft_ms"] / per_turn[lane][0]["ttft_ms"] for lane in lanes
        },
        "shared": {lane: {str(n): shared["shared", lane, n] for n in levels} for lane in lanes},
    }
    figures["shared_over_llama_server"] = serving.ratios(figures["shared"], lanes, levels)
    goals: dict[str, bool] = {}
    for lane in lanes[1:]:
        bound = 1.2 if lane == "one_node" else 1.5
        ratios = [r for r in figures["conversation_ttft_over_llama_server"][lane] if r is not None]
        goals[f"{lane}_last_turn_within_1.5x_first"] = figures["conversation_last_over_first_turn"][lane] <= 1.5
        goals[f"{lane}_every_turn_within_{bound}x_llama_server"] = all(r <= bound for r in ratios)
    if "one_node" in lanes:
        shares = figures["shared_over_llama_server"]["one_node"]
        goals["one_node_shared_tokens_per_s_at_least_0.85x"] = all(v["tokens_per_s"] >= 0.85 for v in shares.values())
        goals["one_node_shared_ttft_p50_within_1.5x"] = all(v["ttft_p50"] <= 1.5 for v in shares.values())
    figures["goals"] = goals
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        Recipe(n_threads=2, n_ctx_per_seq=ctx).describe(info.quant),
        figures,
        settings={
            "turns": turns,
            "conversations": count,
            "max_tokens_per_reply": MAX_TOKENS,
            "levels": levels,
            "slots": slots,
            "ctx_per_session": ctx,
            "client": f"openai {_openai_version()}, streaming, temperature 0",
            **{lane: how for lane, how in serving.lane_settings(server, slots).items() if lane in LANES},
        },
    )
    png = _common.plot(
        Path(path).with_suffix(".png"),
        "A 12-turn chat: time to first token per turn",
        "turn",
        "TTFT ms (median over conversations)",
        {lane: ([r["turn"] for r in per_turn[lane]], [r["ttft_ms"] or 0 for r in per_turn[lane]]) for lane in lanes},
    )
    rows = [
        [r["turn"], r["prompt_tokens"]]
        + [
            x
            for lane in lanes
            for x in (per_turn[lane][r["turn"] - 1]["ttft_ms"], per_turn[lane][r["turn"] - 1]["prefilled_tokens"])
        ]
        for r in per_turn[lanes[0]]
    ]
    print(_common.table(["turn", "prompt"] + [f"{lane} {x}" for lane in lanes for x in ("TTFT ms", "prefilled")], rows))
    print()
    print(
        _common.table(
            ["clients", "lane", "tok/s", "x llama-server", "TTFT p50 ms"],
            [
                [
                    n,
                    lane,
                    figures["shared"][lane][str(n)]["tokens_per_s"],
                    figures["shared"][lane][str(n)]["tokens_per_s"]
                    / figures["shared"]["llama_server"][str(n)]["tokens_per_s"],
                    figures["shared"][lane][str(n)]["ttft_p50_ms"],
                ]
                for n in levels
                for lane in lanes
            ],
        )
    )
    print()
    print(
        _common.table(
            ["positions", "state MiB", "save ms", "restore ms", "copy ms", "prefill ms"],
            [
                [
                    r["positions"],
                    r["state_bytes"] / 2**20,
                    r["save_ms"],
                    r["restore_ms"],
                    r["copy_ms"],
                    r["prefill_ms_avoided"],
                ]
                for r in kv
            ],
        )
    )
    print(f"\ngoals: {goals}\nwrote {path} and {png}")
    return 0


def _openai_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("openai")


if __name__ == "__main__":
    raise SystemExit(main())
