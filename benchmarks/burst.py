"""A burst beyond the swarm's slots: does every request wait its turn, or is it refused?

    python -m benchmarks.burst [--quick] [--out PATH]

16 streaming chat clients, 3 requests each one after another (48 in all; ``--quick``: 2
each), against lanes started together on this machine, measured one after another:

- ``llama_server``: ``llama-server --parallel 16`` (what a user would run instead: a slot
  for every client, so nothing waits);
- ``one_node``: the default ``noderuntime up`` slots (8) on one whole-model node behind
  the gateway: twice as many clients as slots, so half of them wait in the gateway's line
  (``--queue-timeout`` 10 s, the default) for a slot to free;
- ``one_node_no_line``: the same with ``--queue-limit 0``: nobody waits, a request that
  finds every slot taken is refused at once (429), as before the line;
- ``local_system``: the default local system (two shards, the second via the relay), 8
  slots each.

Per lane: requests completed, not served (by HTTP status; 0: the connection failed), failed
after their stream began; TTFT p50/p95/max (from the request to its first token: the time
in line counts); aggregate tokens/s; and the gateway's own count of its line.
"""

from __future__ import annotations

import collections
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks import _common
from benchmarks.serving import (
    DEFAULT_SYSTEM,
    LLAMA_SERVER_PORT,
    PROMPTS,
    _llama_server,
    _start_llama_server,
    system_message,
)

NAME = "burst"
CLIENTS = 16
NODE_SLOTS = 8  # noderuntime up's default
LLAMA_SERVER_SLOTS = 16
CTX = 1024
LANES = ("llama_server", "one_node", "one_node_no_line", "local_system")


async def stream_chat(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat: its status, when it was sent, when each content chunk came, and any error."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system_message("unique")}, {"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    arrivals: list[float] = []
    started = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return {
                    "status": response.status_code,
                    "started": started,
                    "arrivals": [],
                    "error": response.text[:200],
                }
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:  # an error after the stream began: the request failed
                    return {"status": 200, "started": started, "arrivals": arrivals, "error": str(data["error"])[:200]}
                for choice in data.get("choices", []):
                    if (choice.get("delta") or {}).get("content"):
                        arrivals.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return {"status": 0, "started": started, "arrivals": arrivals, "error": f"{type(exc).__name__}: {exc}"[:200]}
    return {"status": 200, "started": started, "arrivals": arrivals, "error": ""}


async def burst(url: str, model: str, requests_each: int, max_tokens: int) -> tuple[list[dict[str, Any]], float]:
    """``CLIENTS`` clients at once, each sending ``requests_each`` requests one after another."""
    results: list[dict[str, Any]] = []

    async def client_loop(i: int) -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            for r in range(requests_each):
                results.append(await stream_chat(client, url, model, PROMPTS[(i + r) % len(PROMPTS)], max_tokens))

    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(CLIENTS):
            nursery.start_soon(client_loop, i)
    return results, time.perf_counter() - began


def summarize(results: list[dict[str, Any]], wall: float, line: dict[str, Any] | None) -> dict[str, Any]:
    """What came of the burst's requests."""
    completed = [r for r in results if r["status"] == 200 and not r["error"]]
    ttft = [r["arrivals"][0] - r["started"] for r in completed if r["arrivals"]]
    statuses = collections.Counter(str(r["status"]) for r in results if r["status"] != 200)
    errors = collections.Counter(r["error"] for r in results if r["error"])
    return {
        "requests": len(results),
        "completed": len(completed),
        "not_served_by_status": dict(statuses),
        "failed_in_stream": sum(1 for r in results if r["status"] == 200 and r["error"]),
        "errors": dict(errors.most_common(5)),
        "ttft_p50_ms": _common.percentile(ttft, 50) * 1e3 if ttft else None,
        "ttft_p95_ms": _common.percentile(ttft, 95) * 1e3 if ttft else None,
        "ttft_max_ms": max(ttft) * 1e3 if ttft else None,
        "tokens": sum(len(r["arrivals"]) for r in results),
        "tokens_per_s": sum(len(r["arrivals"]) for r in results) / wall,
        "wall_s": wall,
        "gateway_line": line,  # the gateway's own count (None for llama-server)
    }


def _line(url: str) -> dict[str, Any] | None:
    try:
        status = httpx.get(url + "/status", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    line = status.get("line") if isinstance(status, dict) else None
    return line if isinstance(line, dict) else None


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(NAME, __doc__ or "")
    args = p.parse_args(argv)
    from noderuntime.engine.llama import Recipe
    from noderuntime.models import artifacts
    from noderuntime.models import catalogue as models
    from noderuntime.services import localsystem

    model = models.pull(models.DEMO_MODEL, progress=False)
    info = artifacts.inspect(model)
    requests_each = 2 if args.quick else 3
    max_tokens = 32 if args.quick else 64
    server = _llama_server()
    figures: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        served: dict[str, tuple[str, str]] = {}
        proc = _start_llama_server(server, model, LLAMA_SERVER_PORT, LLAMA_SERVER_SLOTS, CTX)

        def stop() -> None:
            proc.terminate()
            proc.wait(10)

        stack.callback(stop)
        served["llama_server"] = (f"http://127.0.0.1:{LLAMA_SERVER_PORT}", str(model))
        for lane, cuts, gateway_options in (
            ("one_node", (0, info.n_layer), ()),
            ("one_node_no_line", (0, info.n_layer), ("--queue-limit", "0")),
            ("local_system", None, ()),
        ):
            system = localsystem.start(
                listen="127.0.0.1:0",
                data_root=Path(stack.enter_context(tempfile.TemporaryDirectory())),
                slots=NODE_SLOTS,
                ctx=CTX,
                quiet=True,
                cuts=cuts,
                gateway_options=gateway_options,
            )
            stack.callback(system.stop)
            served[lane] = (system.gateway_url, system.model_id)
        for lane in LANES:
            url, model_id = served[lane]
            with httpx.Client(timeout=120) as warm:  # one request first: nothing cold is measured
                warm.post(
                    url + "/v1/chat/completions",
                    json={"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                )
            results, wall = trio.run(burst, url, model_id, requests_each, max_tokens)
            figures[lane] = summarize(results, wall, None if lane == "llama_server" else _line(url))
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        Recipe(n_threads=2, n_ctx_per_seq=CTX).describe(info.quant),
        figures,
        settings={
            "clients": CLIENTS,
            "requests_per_client": requests_each,
            "max_tokens": max_tokens,
            "node_slots": NODE_SLOTS,
            "llama_server_slots": LLAMA_SERVER_SLOTS,
            "ctx_per_session": CTX,
            "system_message": system_message("unique").replace(DEFAULT_SYSTEM, "<SmolLM2's default system message>"),
            "gateway": "the defaults: --queue-timeout 10, --queue-limit 256, --queue-per-key 64",
            "llama_server": f"llama-server from the patched sources, --parallel {LLAMA_SERVER_SLOTS}, --threads 2",
        },
    )
    rows = [
        [
            lane,
            f"{f['completed']}/{f['requests']}",
            sum(f["not_served_by_status"].values()),
            f["failed_in_stream"],
            f["ttft_p50_ms"] or 0.0,
            f["ttft_p95_ms"] or 0.0,
            f["tokens_per_s"],
        ]
        for lane, f in figures.items()
    ]
    headers = ["lane", "completed", "not served", "failed in stream", "TTFT p50 ms", "TTFT p95 ms", "tok/s"]
    print(_common.table(headers, rows))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
