"""Serving benchmark: the whole system through its gateway vs llama-cpp-python's own OpenAI server.

    python -m benchmarks.serving [--quick] [--out PATH]

Both serve SmolLM2-135M Q4_1 with 2 threads per process on this machine: ours as the
local system (tracker, relay, two shard processes — the second behind the relay —
and the gateway), theirs as one ``python -m llama_cpp.server`` process with the whole
model. At 1, 4 and 8 concurrent streaming clients (greedy, the same prompts, 48
tokens each, two requests per client), measured side by side level by level: time
to first token, inter-token latency p50/p95 (gaps between streamed chunks) and
aggregate tokens/s (chunks over the wall time of the level).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks import _common

NAME = "serving"
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "List some facts about the moon.",
    "Describe a walk through a forest in autumn.",
    "What makes bread rise? Explain step by step.",
    "Tell me about the history of the printing press.",
    "Give advice for learning to play the guitar.",
    "Describe the water cycle.",
]


def _start_llama_cpp_server(model: Path, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--n_threads",
            "2",
            "--n_ctx",
            "1024",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--interrupt_requests",
            "False",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("llama-cpp-python's server did not start")


async def _client(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    # a unique first line: llama-cpp-python's server reuses the KV of a repeated prompt prefix
    content = f"Request {uuid.uuid4().hex[:8]}.\n{prompt}"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    arrivals: list[float] = []
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream("POST", url + "/v1/chat/completions", json=body) as response,
    ):
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            for choice in data.get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    arrivals.append(time.perf_counter())
    return {"started": started, "arrivals": arrivals}


async def _level(url: str, model: str, clients: int, requests_each: int, max_tokens: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = []

    async def one(i: int) -> None:
        for r in range(requests_each):
            results.append(await _client(url, model, PROMPTS[(i + r) % len(PROMPTS)], max_tokens))

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(clients):
            nursery.start_soon(one, i)
    wall = time.perf_counter() - started
    ttft = [r["arrivals"][0] - r["started"] for r in results if r["arrivals"]]
    gaps = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    chunks = sum(len(r["arrivals"]) for r in results)
    return {
        "ttft_p50_ms": _common.percentile(ttft, 50) * 1e3,
        "ttft_p95_ms": _common.percentile(ttft, 95) * 1e3,
        "itl_p50_ms": _common.percentile(gaps, 50) * 1e3,
        "itl_p95_ms": _common.percentile(gaps, 95) * 1e3,
        "tokens_per_s": chunks / wall,
        "chunks": chunks,
        "requests": len(results),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(NAME, __doc__ or "").parse_args(argv)
    from noderuntime.engine.llama import Recipe
    from noderuntime.models import artifacts
    from noderuntime.models import catalogue as models
    from noderuntime.services import localsystem

    model = models.pull(models.DEMO_MODEL, progress=False)
    levels = [1, 4] if args.quick else [1, 4, 8]
    requests_each = 1 if args.quick else 2
    max_tokens = 24 if args.quick else 48
    figures: dict[str, Any] = {"noderuntime": {}, "llama_cpp_server": {}}
    with tempfile.TemporaryDirectory() as tmp:
        system = localsystem.start(listen="127.0.0.1:0", data_root=Path(tmp), slots=16, ctx=1024, quiet=True)
        node_threads = max(1, (os.cpu_count() or 2) // 2)
        theirs = _start_llama_cpp_server(model, 18123)
        try:
            targets = {
                "noderuntime": (system.gateway_url, system.model_id),
                "llama_cpp_server": ("http://127.0.0.1:18123", str(model)),
            }
            for url, model_id in targets.values():  # warm-up
                trio.run(_level, url, model_id, 1, 1, 4)
            for level in levels:
                for name, (url, model_id) in targets.items():
                    figures[name][str(level)] = trio.run(_level, url, model_id, level, requests_each, max_tokens)
        finally:
            theirs.terminate()
            theirs.wait(10)
            system.stop()
    figures["aggregate_ratio_noderuntime_over_llama_cpp"] = {
        str(n): figures["noderuntime"][str(n)]["tokens_per_s"] / figures["llama_cpp_server"][str(n)]["tokens_per_s"]
        for n in levels
    }
    info = artifacts.inspect(model)
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        Recipe(n_threads=2, n_ctx_per_seq=1024).describe(info.quant),
        figures,
        settings={
            "levels": levels,
            "requests_per_client": requests_each,
            "max_tokens": max_tokens,
            "noderuntime": "local system: 2 shard processes (0:15 direct, 15:30 via relay), slots 16, "
            f"{node_threads} thread(s) each (co-located nodes split the cores)",
            "llama_cpp_server": "python -m llama_cpp.server, whole model, n_threads 2, n_ctx 1024",
            "llama_cpp_python": _version(),
        },
    )
    png = _common.plot(
        Path(path).with_suffix(".png"),
        "Streaming chat completions, aggregate throughput",
        "concurrent clients",
        "tokens / s",
        {
            name: (levels, [figures[name][str(n)]["tokens_per_s"] for n in levels])
            for name in ("noderuntime", "llama_cpp_server")
        },
    )
    rows = []
    for level in levels:
        for name in ("noderuntime", "llama_cpp_server"):
            f = figures[name][str(level)]
            rows.append(
                [level, name, f["tokens_per_s"], f["ttft_p50_ms"], f["ttft_p95_ms"], f["itl_p50_ms"], f["itl_p95_ms"]]
            )
    print(_common.table(["clients", "server", "tok/s", "TTFT p50 ms", "TTFT p95", "ITL p50 ms", "ITL p95"], rows))
    print(f"\nwrote {path} and {png}")
    return 0


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("llama_cpp_python")


if __name__ == "__main__":
    raise SystemExit(main())
