"""Soak: the whole system under concurrent streaming clients that end their requests every way.

    python -m benchmarks.soak [--minutes N] [--clients C] [--quick] [--out PATH]

A real multi-process system — tracker, relay, gateway and three shard processes of
SmolLM2-135M (layers 0:10, 10:20, 20:30), the last one reachable only through the
relay — serves C concurrent streaming clients for N minutes. Each request takes a
random prompt of random length and ends one of these ways:

- ``complete``: read to the end; the text must equal the prompt's solo reference;
- ``stop``: a stop string cut from the middle of the reference; the text must equal
  the reference up to it;
- ``disconnect_prefill``: the client hangs up before the first token;
- ``disconnect_decode``: the client hangs up after a random number of chunks;
- ``disconnect_between``: the client reads a chunk, waits, then hangs up;
- ``deadline``: the client gives up after a short random deadline.

References are made first, one request at a time (solo, greedy). Throughout, every
process is sampled (RSS, open file descriptors, trio tasks); at the end the system
must be idle — no sequence slot and no KV cell in use on any node — and the counts
must be back at their baseline. Any failure of a request the client did not cancel
is an error, by kind; a completed text that differs from its reference is a
mismatch. A soak lasts its minutes and at least ``--requests`` requests, so that a slow
machine still tries every ending often enough. ``--quick`` runs 15 seconds and at least
48 requests (about 17 s on 2 vCPUs) with four clients and eight prompts (the ``make test``
version).
"""

from __future__ import annotations

import functools
import json
import os
import random
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from benchmarks import _common
from noderuntime.engine.llama import Recipe
from noderuntime.services import localsystem
from noderuntime.services.cluster import ManagedProcess
from noderuntime.services.ready import NodeReady, RelayReady, expect

NAME = "soak"
ENDINGS = ("complete", "stop", "disconnect_prefill", "disconnect_decode", "disconnect_between", "deadline")
WORDS = (  # noqa: SIM905 - a sentence of words reads better than a column of them
    "river stone lantern orchard copper meadow harbor violin thunder candle marble falcon garden "
    "silver winter pepper ladder canyon feather compass island mirror pocket saddle tunnel velvet"
).split()
STRUCTURED_SHARE = 0.25
STRUCTURED: tuple[dict[str, Any], ...] = (
    {"response_format": {"type": "json_object"}},
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "words",
                "schema": {
                    "type": "object",
                    "properties": {"words": {"type": "array", "items": {"type": "string"}}},
                    "required": ["words"],
                },
            },
        }
    },
    {"grammar": 'root ::= ("yes" | "no") " " [a-z ]*'},
)
SAMPLE_SECONDS = 10.0
SETTLE_SECONDS = 90.0


@attrs.frozen
class Prompt:
    """A prompt, its token budget and its solo reference text."""

    text: str
    max_tokens: int
    reference: str = ""
    constraint: dict[str, Any] | None = None  # a structured-output request's fields


def _prompts(rng: random.Random, count: int) -> list[Prompt]:
    prompts = []
    for i in range(count):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.choice((2, 10, 40, 120, 250))))
        text = f"Item {i}. Write a sentence using some of these words: {words}"
        # a share of structured-output requests: their grammar state lives and dies with the session
        constraint = STRUCTURED[i % len(STRUCTURED)] if rng.random() < STRUCTURED_SHARE else None
        prompts.append(Prompt(text, rng.randint(8, 48), constraint=constraint))
    return prompts


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        data: dict[str, Any] = json.loads(response.read())
        return data


def _proc_sample(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _status_url(process: ManagedProcess) -> str:
    info = process.info
    return (info.http if isinstance(info, NodeReady | RelayReady) else info.url) + "/status"


def _tasks(system: localsystem.LocalSystem) -> dict[str, int]:
    return {process.name: int(_get(_status_url(process))["tasks"]) for process in system.processes}


def _sample(system: localsystem.LocalSystem, tasks: dict[str, int] | None = None) -> dict[str, dict[str, int]]:
    """RSS and descriptors of each process, with ``tasks`` (asked of each process when not given)."""
    tasks = tasks if tasks is not None else _tasks(system)
    return {process.name: {**_proc_sample(process.pid), "tasks": tasks[process.name]} for process in system.processes}


def _wait_idle(system: localsystem.LocalSystem, within: float = 60.0) -> list[dict[str, Any]]:
    urls = [expect(p.info, NodeReady).http + "/status" for p in system.processes if p.name.startswith("node")]
    deadline = time.monotonic() + within
    while True:
        states = [_get(u) for u in urls]
        if all(
            s["active_sessions"] == 0
            and s["slots_leased"] == 0
            and s["slots_draining"] == 0
            and s["kv_cells"] == 0
            and s["samplers_live"] == 0
            for s in states
        ):
            return states
        if time.monotonic() > deadline:
            return states
        time.sleep(0.2)


async def _complete(client: httpx.AsyncClient, url: str, model: str, prompt: Prompt) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt.text}],
        "max_tokens": prompt.max_tokens,
        "temperature": 0,
        **(prompt.constraint or {}),
    }
    response = await client.post(url + "/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return str(response.json()["choices"][0]["message"]["content"])


@attrs.define
class Tally:
    """What the clients saw."""

    requests: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(ENDINGS, 0))
    cancelled: int = 0
    completed: int = 0
    checked: int = 0
    mismatches: list[dict[str, str]] = attrs.Factory(list)
    errors: dict[str, int] = attrs.Factory(dict)
    ttft: list[float] = attrs.Factory(list)
    duration: list[float] = attrs.Factory(list)
    tokens: int = 0

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: Prompt, ending: str, rng: random.Random, tally: Tally
) -> None:
    tally.requests[ending] += 1
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt.text}],
        "max_tokens": prompt.max_tokens,
        "temperature": 0,
        "stream": True,
        **(prompt.constraint or {}),
    }
    expected = prompt.reference
    if ending == "stop":
        cut = rng.randint(len(expected) // 3, max(len(expected) // 3, 2 * len(expected) // 3))
        stop = expected[cut : cut + 4]
        if len(stop) == 4 and stop.strip():
            body["stop"] = [stop]
            expected = expected[: expected.index(stop)]
    hang_up_after = {
        "disconnect_decode": rng.randint(1, 12),
        "disconnect_between": rng.randint(1, 6),
    }.get(ending)
    deadline = rng.uniform(0.05, 1.5) if ending == "deadline" else 600.0
    started = time.perf_counter()
    text: list[str] = []
    chunks = 0
    cancelled = False
    finished = False
    with trio.move_on_after(deadline) as scope:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
            if ending == "disconnect_prefill":
                await trio.sleep(rng.uniform(0.0, 0.1))
                cancelled = True
                return _done(tally, cancelled)
            if response.status_code != 200:
                tally.error(f"http_{response.status_code}")
                return None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    finished = True
                    break
                event = json.loads(data)
                if "error" in event:
                    tally.error(str(event["error"].get("code") or event["error"].get("type")))
                    return None
                delta = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
                if delta:
                    if not text:
                        tally.ttft.append(time.perf_counter() - started)
                    text.append(delta)
                    chunks += 1
                    if hang_up_after is not None and chunks >= hang_up_after:
                        if ending == "disconnect_between":
                            await trio.sleep(rng.uniform(0.0, 0.2))
                        cancelled = True
                        break
    if scope.cancelled_caught:
        cancelled = True
    if cancelled or not finished:
        if not cancelled:
            tally.error("stream_ended_early")
            return None
        return _done(tally, True)
    tally.completed += 1
    tally.tokens += chunks
    tally.duration.append(time.perf_counter() - started)
    got = "".join(text)
    if ending in ("complete", "stop", "deadline"):
        tally.checked += 1
        if got != expected:
            tally.mismatches.append({"prompt": prompt.text[:60], "expected": expected, "got": got})
    return None


def _done(tally: Tally, cancelled: bool) -> None:
    if cancelled:
        tally.cancelled += 1


async def _soak(
    url: str,
    model: str,
    prompts: list[Prompt],
    clients: int,
    seconds: float,
    at_least: int,
    seed: int,
    tally: Tally,
) -> None:
    stop_at = trio.current_time() + seconds

    def more() -> bool:
        return trio.current_time() < stop_at or sum(tally.requests.values()) < at_least

    async def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient() as client:
            while more():
                prompt = rng.choice(prompts)
                ending = rng.choice(ENDINGS)
                try:
                    await _one(client, url, model, prompt, ending, rng, tally)
                except (httpx.HTTPError, json.JSONDecodeError) as exc:
                    tally.error(type(exc).__name__)

    async with trio.open_nursery() as nursery:
        for i in range(clients):
            nursery.start_soon(worker, i)


def main() -> None:
    """Run the soak and write its JSON."""
    parser = _common.parser(NAME, __doc__ or "")
    parser.add_argument("--minutes", type=float, help="how long to soak (default 30; --quick: 0.25)")
    parser.add_argument("--clients", type=int, help="concurrent clients (default 6; --quick: 4)")
    parser.add_argument("--requests", type=int, help="go on until this many requests (default 0; --quick: 48)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    minutes = args.minutes if args.minutes is not None else (0.25 if args.quick else 30.0)
    clients = args.clients or (4 if args.quick else 6)
    at_least = args.requests if args.requests is not None else (48 if args.quick else 0)
    out = _common.out_path(NAME, args)
    rng = random.Random(args.seed)

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        system = localsystem.start(
            listen="127.0.0.1:0", data_root=Path(tmp), cuts=(0, 10, 20, 30), slots=8, ctx=1024, quiet=True
        )
        try:
            url = system.gateway_url

            async def references() -> list[Prompt]:
                made = []
                async with httpx.AsyncClient() as client:
                    for prompt in _prompts(rng, 8 if args.quick else 16):
                        made.append(
                            attrs.evolve(prompt, reference=await _complete(client, url, system.model_id, prompt))
                        )
                return made

            prompts = trio.run(references)
            _wait_idle(system)
            lowest, _ = _common.lowest_tasks(functools.partial(_tasks, system), within=1.0)
            baseline = _sample(system, lowest)
            samples: list[dict[str, Any]] = [{"t": 0.0, **baseline}]
            tally = Tally()
            started = time.monotonic()

            async def soak_and_sample() -> None:
                async with trio.open_nursery() as nursery:

                    async def sampler() -> None:
                        while True:
                            await trio.sleep(SAMPLE_SECONDS)
                            sample = await trio.to_thread.run_sync(_sample, system)
                            samples.append({"t": round(time.monotonic() - started, 1), **sample})

                    nursery.start_soon(sampler)
                    await _soak(url, system.model_id, prompts, clients, minutes * 60, at_least, args.seed, tally)
                    nursery.cancel_scope.cancel()

            trio.run(soak_and_sample)
            elapsed = time.monotonic() - started
            idle = _wait_idle(system)
            # pooled connections the servers close after their keep-alive (10 s) may still hold tasks
            settled, settled_after = _common.lowest_tasks(
                functools.partial(_tasks, system),
                within=SETTLE_SECONDS,
                until=lambda lowest: all(lowest[n] <= baseline[n]["tasks"] for n in baseline),
            )
            final = _sample(system, settled)
            # after the soak the system still serves, and serves the same text
            after = trio.run(_complete_one, url, system.model_id, prompts[0])
        finally:
            system.stop()

    leaks = {
        name: {
            "tasks": final[name]["tasks"] - baseline[name]["tasks"],
            "fds": final[name]["fds"] - baseline[name]["fds"],
            "rss_mib": round((final[name]["rss_kib"] - baseline[name]["rss_kib"]) / 1024, 1),
            "rss_peak_mib": round(max(s[name]["rss_kib"] for s in samples[1:] or samples) / 1024, 1),
        }
        for name in baseline
    }
    node_state = [
        {k: s[k] for k in ("node_id", "active_sessions", "slots_leased", "slots_draining", "kv_cells", "samplers_live")}
        for s in idle
    ]
    ttft_ms = {f"p{q}": round(_common.percentile(tally.ttft, q) * 1e3, 1) for q in (50, 95, 99)}
    figures: dict[str, Any] = {
        "minutes": round(elapsed / 60, 2),
        "clients": clients,
        "requests_floor": at_least,
        "requests": sum(tally.requests.values()),
        "requests_by_ending": tally.requests,
        "completed": tally.completed,
        "checked_against_reference": tally.checked,
        "mismatches": len(tally.mismatches),
        "cancelled_by_client": tally.cancelled,
        "errors": sum(tally.errors.values()),
        "errors_by_kind": tally.errors,
        "tokens_streamed": tally.tokens,
        "ttft_ms": ttft_ms,
        "request_seconds": {f"p{q}": round(_common.percentile(tally.duration, q), 3) for q in (50, 95, 99)},
        "nodes_at_end": node_state,
        "idle_at_end": all(
            s["slots_leased"] == 0 and s["kv_cells"] == 0 and s["active_sessions"] == 0 and s["samplers_live"] == 0
            for s in idle
        ),
        # every node's prefix cache: repeated prompts were reused, within each node's budget
        "prefix_cache": [s["prefix_cache"] for s in idle],
        "prefix_hits": sum(s["prefix_cache"]["hits"] for s in idle if s["prefix_cache"]),
        "prefix_within_budget": all(
            s["prefix_cache"]["bytes"] <= s["prefix_cache"]["budget_bytes"] for s in idle if s["prefix_cache"]
        ),
        "structured_share": STRUCTURED_SHARE,
        "leaks": leaks,
        "settled_after_seconds": round(settled_after, 1),
        "serves_after": after == prompts[0].reference,
    }
    recipe = {
        "model": "SmolLM2-135M-Instruct Q4_1",
        "shards": ["0:10", "10:20", "20:30 (relay only)"],
        "slots": 8,
        "ctx": 1024,
        **Recipe(n_threads=max(1, (os.cpu_count() or 2) // 3), n_ctx_per_seq=1024, n_seq_max=8).describe("Q4_1"),
    }
    _common.write(out, NAME, args, recipe, figures, samples=samples, mismatch_examples=tally.mismatches[:5])
    print(
        _common.table(
            ["minutes", "requests", "completed", "cancelled", "errors", "mismatches", "ttft p50 ms", "idle"],
            [
                [
                    figures["minutes"],
                    figures["requests"],
                    tally.completed,
                    tally.cancelled,
                    figures["errors"],
                    len(tally.mismatches),
                    ttft_ms["p50"],
                    figures["idle_at_end"],
                ]
            ],
        )
    )
    print(
        _common.table(
            ["process", "tasks Δ", "fds Δ", "RSS Δ MiB", "RSS peak MiB"], [[n, *v.values()] for n, v in leaks.items()]
        )
    )
    print(f"wrote {out}")


async def _complete_one(url: str, model: str, prompt: Prompt) -> str:
    async with httpx.AsyncClient() as client:
        return await _complete(client, url, model, prompt)


if __name__ == "__main__":
    main()
