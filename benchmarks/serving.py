"""Serving: the whole stack against llama.cpp's own server, side by side, on this machine.

    python -m benchmarks.serving [--quick] [--out PATH]
    python -m benchmarks.serving --table RESULT.json   # its ratios as the docs' table

Lanes, all started at once on the same machine and measured one at a time, the same
model (SmolLM2-135M Q4_1) and the same client (streaming chat, greedy, the same prompts,
two requests per client), under two workloads (``--workloads``):

- ``unique``: each chat opened by a system message with a unique first line, so that no
  server reuses a cached prefix (every prompt prefilled whole);
- ``shared``: each chat opened by the model's default system message, the same every
  time, as chat apps send it (llama-server reuses it from its slots, a node from its
  prefix cache).

- ``llama_server``: llama.cpp's ``llama-server -np 16`` (continuous batching), built
  from the same vendored llama.cpp, patches and CMake flags as the wheel
  (``kernels_patch/build.py --server``, cached beside it), 2 threads;
- ``llama_cpp_python``: llama-cpp-python's own server, 2 threads;
- ``one_node``: one whole-model node behind the gateway (tracker, gateway, one node);
- ``local_system``: the default ``noderuntime up`` (2 shards, the second via the relay);
- ``grpc_route``: 2 shards, both over gRPC, no relay.

At 1, 4, 8 and 16 concurrent clients (``--quick``: 1 and 4): TTFT p50/p95,
inter-token latency p50/p95 (gaps between streamed chunks), aggregate tokens/s
(chunks over the level's wall time) and CPU seconds per token of every process
of the lane. Ratios against ``llama_server`` per level.

This machine's speed drifts by tens of percent within minutes (llama-server alone gave
67 to 112 tok/s for one client in one hour), so lanes are not run one after another:
every level of every lane runs in each of two rounds (``--quick``: one), interleaved,
each round starting with another lane, and each figure pools its lane's rounds.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
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


def _ready(proc: subprocess.Popen[bytes], url: str, what: str, within: float = 60) -> subprocess.Popen[bytes]:
    """``proc`` once ``url`` answers (within ``within`` seconds); killed, and an error, if it does not."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{what} did not start")


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
    return _ready(proc, f"http://127.0.0.1:{port}/v1/models", "llama-cpp-python's server")


# SmolLM2's chat template puts this in when a chat has no system message of its own
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
WORKLOADS = ("unique", "shared")


def system_message(workload: str = "unique") -> str:
    """The chat's system message.

    ``unique``: one no server has seen (the default one after a unique first line), so that
    no server reuses a cached prefix: the servers at their slowest, every prompt prefilled
    whole. ``shared``: the model's default one, the same in every chat, as chat apps send it.
    """
    if workload == "shared":
        return DEFAULT_SYSTEM
    return f"Request {uuid.uuid4().hex[:8]}.\n{DEFAULT_SYSTEM}"


async def stream_chat(url: str, model: str, prompt: str, max_tokens: int, workload: str = "unique") -> dict[str, Any]:
    """One streamed chat request: when it was sent and when each content chunk arrived (perf_counter s)."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system_message(workload)}, {"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    arrivals: list[float] = []
    # the clock starts once the client exists: making one (its TLS context) takes ~20 ms
    # here, a cost of this benchmark's client, not of any server
    async with httpx.AsyncClient(timeout=300) as client:
        started = time.perf_counter()
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                for choice in data.get("choices", []):
                    if (choice.get("delta") or {}).get("content"):
                        arrivals.append(time.perf_counter())
    return {"started": started, "arrivals": arrivals}


Streamer = Callable[[str, str, str, int, str], Awaitable[dict[str, Any]]]


async def run_clients(
    url: str,
    model: str,
    clients: int,
    requests_each: int,
    max_tokens: int,
    workload: str = "unique",
    stream: Streamer = stream_chat,
) -> dict[str, Any]:
    """``clients`` streaming clients, ``requests_each`` requests one after another each: what arrived when."""
    results: list[dict[str, Any]] = []

    async def one(i: int) -> None:
        for r in range(requests_each):
            results.append(await stream(url, model, PROMPTS[(i + r) % len(PROMPTS)], max_tokens, workload))

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(clients):
            nursery.start_soon(one, i)
    return {"results": results, "wall_s": time.perf_counter() - started}


def summarize(runs: list[dict[str, Any]], cpu: dict[str, float]) -> dict[str, Any]:
    """One lane at one level, over its rounds: percentiles over every request, throughput over all walls."""
    results = [r for run in runs for r in run["results"]]
    wall = sum(run["wall_s"] for run in runs)
    ttft = [r["arrivals"][0] - r["started"] for r in results if r["arrivals"]]
    gaps = [b - a for r in results for a, b in itertools.pairwise(r["arrivals"])]
    chunks = sum(len(r["arrivals"]) for r in results)
    tokens = max(1, chunks)
    return {
        "ttft_p50_ms": _common.percentile(ttft, 50) * 1e3,
        "ttft_p95_ms": _common.percentile(ttft, 95) * 1e3,
        "itl_p50_ms": _common.percentile(gaps, 50) * 1e3,
        "itl_p95_ms": _common.percentile(gaps, 95) * 1e3,
        "tokens_per_s": chunks / wall,
        "tokens_per_s_by_round": [sum(len(r["arrivals"]) for r in run["results"]) / run["wall_s"] for run in runs],
        "chunks": chunks,
        "requests": len(results),
        "wall_s": wall,
        "cpu_s_per_token": {name: seconds / tokens for name, seconds in cpu.items()},
        "cpu_s_per_token_total": sum(cpu.values()) / tokens,
    }


LEVELS = [1, 4, 8, 16]
LANES = ["llama_server", "llama_cpp_python", "one_node", "local_system", "grpc_route"]
ROUNDS = 2  # every lane runs every level this many times, interleaved (this machine drifts)


def _start_lane(
    stack: contextlib.ExitStack, lane: str, server: Path, model: Path, n_layer: int, slots: int, ctx: int
) -> tuple[str, str, dict[str, int]]:
    """Start ``lane``'s processes (stopped when ``stack`` closes): its URL, model id and process ids."""
    from noderuntime.services import localsystem

    if lane in ("llama_server", "llama_cpp_python"):
        if lane == "llama_server":
            proc = _start_llama_server(server, model, LLAMA_SERVER_PORT, slots, ctx)
            url = f"http://127.0.0.1:{LLAMA_SERVER_PORT}"
        else:
            proc = _start_llama_cpp_server(model, LLAMA_CPP_PYTHON_PORT)
            url = f"http://127.0.0.1:{LLAMA_CPP_PYTHON_PORT}"

        def stop() -> None:
            proc.terminate()
            proc.wait(10)

        stack.callback(stop)
        return url, str(model), {lane: proc.pid}
    tmp = stack.enter_context(tempfile.TemporaryDirectory())
    system = localsystem.start(
        listen="127.0.0.1:0",
        data_root=Path(tmp),
        slots=slots,
        ctx=ctx,
        quiet=True,
        cuts=(0, n_layer) if lane == "one_node" else None,
        relay_last=lane != "grpc_route",
    )
    stack.callback(system.stop)
    return system.gateway_url, system.model_id, {f"{p.name}": p.pid for p in system.processes}


def lane_settings(server: Path, slots: int) -> dict[str, str]:
    """How :func:`_start_lane` runs each lane, in words, for a result's settings (``server``: llama-server's binary)."""
    return {
        "llama_server": f"llama-server from the patched sources, --parallel {slots}, --threads 2, "
        f"cache_prompt on (its default) ({server})",
        "llama_cpp_python": "python -m llama_cpp.server, whole model, n_threads 2, n_ctx 1024",
        "one_node": "tracker, gateway, one node with the whole model, 2 threads, --prefix-cache 256 MiB (the default)",
        "local_system": "tracker, relay, 2 shard processes (0:15 direct, 15:30 via relay), 1 thread each, gateway",
        "grpc_route": "tracker, 2 shard processes over gRPC, 1 thread each, gateway",
    }


LLAMA_SERVER_PORT = 18124
LLAMA_CPP_PYTHON_PORT = 18123


def _start_llama_server(
    binary: Path, model: Path, port: int, slots: int, ctx: int, *extra: str, within: float = 60
) -> subprocess.Popen[bytes]:
    """llama-server on ``model`` with ``slots`` of ``ctx`` each and 2 threads (and ``extra`` flags),
    once its health answers (a large model loads for ``within`` seconds)."""
    proc = subprocess.Popen(
        [
            str(binary),
            "--model",
            str(model),
            "--threads",
            "2",
            "--parallel",
            str(slots),
            "--ctx-size",
            str(ctx * slots),  # shared by the slots: each holds ctx
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return _ready(proc, f"http://127.0.0.1:{port}/health", "llama-server", within)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds each process (and its waited-for children) has used so far."""
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            times = psutil.Process(pid).cpu_times()
            out[name] = times.user + times.system + times.children_user + times.children_system
        except psutil.Error:
            out[name] = 0.0
    return out


def _llama_server() -> Path:
    """llama-server built from the wheel's sources and flags (kernels_patch/build.py, cached outside the clone)."""
    script = Path(__file__).resolve().parents[1] / "kernels_patch" / "build.py"
    command = [sys.executable, str(script), "--python", sys.executable, "--server"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cannot build llama-server: {done.stderr[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(NAME, __doc__ or "")
    p.add_argument("--lanes", default=",".join(LANES), help="comma-separated lanes to run (llama_server always runs)")
    p.add_argument("--levels", default=None, help="comma-separated client counts (default 1,4,8,16; --quick 1,4)")
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="unique (no prefix to reuse), shared (one system message)"
    )
    p.add_argument(
        "--table", metavar="JSON", default=None, help="print a result's ratios as the docs' Markdown table; run nothing"
    )
    args = p.parse_args(argv)
    if args.table:
        try:
            result = json.loads(Path(args.table).read_text())
        except (OSError, ValueError) as exc:
            p.error(f"cannot read {args.table}: {exc}")
        if not _has_workload_ratios(result):
            p.error(f"{args.table} is not a serving result with ratios by workload (one since both workloads ran)")
        print(ratio_table(result))
        return 0
    from noderuntime.engine.llama import Recipe
    from noderuntime.models import artifacts
    from noderuntime.models import catalogue as models

    model = models.pull(models.DEMO_MODEL, progress=False)
    info = artifacts.inspect(model)
    levels = [1, 4] if args.quick else LEVELS
    if args.levels:
        levels = [int(n) for n in args.levels.split(",")]
    workloads = [w for w in WORKLOADS if w in args.workloads.split(",")]
    requests_each = 1 if args.quick else 2
    max_tokens = 24 if args.quick else 64
    slots, ctx = 16, 1024
    server = _llama_server()
    lanes = ["llama_server"] + [lane for lane in LANES[1:] if lane in args.lanes.split(",")]
    rounds = 1 if args.quick else ROUNDS
    with contextlib.ExitStack() as stack:
        served = {lane: _start_lane(stack, lane, server, model, info.n_layer, slots, ctx) for lane in lanes}
        for url, model_id, _ in served.values():
            trio.run(run_clients, url, model_id, 1, 1, 4)  # warm-up
        measured = measure_levels(served, lanes, levels, workloads, rounds, requests_each, max_tokens)
    figures: dict[str, Any] = {
        workload: {lane: {str(n): measured[workload, lane, n] for n in levels} for lane in lanes}
        for workload in workloads
    }
    figures["ratios_over_llama_server"] = {workload: ratios(figures[workload], lanes, levels) for workload in workloads}
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        Recipe(n_threads=2, n_ctx_per_seq=ctx).describe(info.quant),
        figures,
        settings={
            "levels": levels,
            "workloads": {
                w: system_message(w).replace(DEFAULT_SYSTEM, "<SmolLM2's default system message>") for w in workloads
            },
            "requests_per_client": requests_each,
            "max_tokens": max_tokens,
            "slots": slots,
            "ctx_per_session": ctx,
            **lane_settings(server, slots),
            "llama_cpp_python_version": _version(),
        },
    )
    png = _common.plot(
        Path(path).with_suffix(".png"),
        "Streaming chat completions, aggregate throughput",
        "concurrent clients",
        "tokens / s",
        {
            f"{lane} ({workload})": (levels, [figures[workload][lane][str(n)]["tokens_per_s"] for n in levels])
            for workload in workloads
            for lane in lanes
        },
    )
    rows = []
    for workload in workloads:
        base = figures[workload]["llama_server"]
        for level in levels:
            for lane in lanes:
                f = figures[workload][lane][str(level)]
                rows.append(
                    [
                        workload,
                        level,
                        lane,
                        f["tokens_per_s"],
                        f["tokens_per_s"] / base[str(level)]["tokens_per_s"],
                        f["ttft_p50_ms"],
                        f["itl_p50_ms"],
                        f["cpu_s_per_token_total"] * 1e3,
                    ]
                )
    header = ["workload", "clients", "lane", "tok/s", "x llama-server", "TTFT p50 ms", "ITL p50 ms", "CPU ms/token"]
    print(_common.table(header, rows))
    print(f"\nwrote {path} and {png}")
    return 0


def measure_levels(
    served: dict[str, tuple[str, str, dict[str, int]]],
    lanes: list[str],
    levels: list[int],
    workloads: list[str],
    rounds: int,
    requests_each: int,
    max_tokens: int,
    stream: Streamer = stream_chat,
) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Every (workload, lane, level), ``rounds`` times, interleaved: each round starts with another lane."""
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    cpu: dict[tuple[str, str, int], dict[str, float]] = {}
    for r in range(rounds):
        order = lanes[r % len(lanes) :] + lanes[: r % len(lanes)]
        for workload in workloads:
            for level in levels:
                for lane in order:
                    url, model_id, pids = served[lane]
                    before = cpu_seconds(pids)
                    run = trio.run(run_clients, url, model_id, level, requests_each, max_tokens, workload, stream)
                    runs.setdefault((workload, lane, level), []).append(run)
                    after = cpu_seconds(pids)
                    spent = cpu.setdefault((workload, lane, level), dict.fromkeys(pids, 0.0))
                    for name in pids:
                        spent[name] += after[name] - before[name]
    return {key: summarize(runs[key], cpu[key]) for key in runs}


# the docs' columns, in their order: what a user would run instead of llama-server
TABLE_COLUMNS = {
    "one_node": "one node + gateway",
    "local_system": "local system (2 shards, relay)",
    "grpc_route": "2 shards over gRPC",
    "llama_cpp_python": "llama-cpp-python's server",
}


def _has_workload_ratios(result: Any) -> bool:
    """Whether ``result`` is a serving result whose ratios are keyed by workload, lane and level."""
    if not isinstance(result, dict) or result.get("benchmark") != NAME:
        return False
    figures, settings = result.get("figures"), result.get("settings")
    if not isinstance(figures, dict) or not isinstance(settings, dict):
        return False
    ratios, levels = figures.get("ratios_over_llama_server"), settings.get("levels")
    if not isinstance(ratios, dict) or not ratios or not set(ratios) <= set(WORKLOADS) or not isinstance(levels, list):
        return False

    def share(by_level: Any, n: Any) -> bool:
        one = by_level.get(str(n)) if isinstance(by_level, dict) else None
        return isinstance(one, dict) and isinstance(one.get("tokens_per_s"), (int, float))

    return all(
        isinstance(by_lane, dict) and all(share(by_level, n) for by_level in by_lane.values() for n in levels)
        for by_lane in ratios.values()
    )


def ratio_table(result: dict[str, Any]) -> str:
    """A serving result's tok/s over llama-server's as the Markdown table ``docs/performance.md`` shows.

    Rows by workload, then clients; a column for each lane the run measured, two decimals.
    The docs' tables are this function's output for the JSON they link, and a test holds them to it.
    """
    figures = result["figures"]["ratios_over_llama_server"]
    levels = result["settings"]["levels"]
    workloads = [w for w in WORKLOADS if w in figures]
    lanes = [lane for lane in TABLE_COLUMNS if all(lane in figures[w] for w in workloads)]
    lines = [
        "| clients | workload | " + " | ".join(TABLE_COLUMNS[lane] for lane in lanes) + " |",
        "| ---: | --- | " + " | ".join("---:" for _ in lanes) + " |",
    ]
    for workload in workloads:
        for n in levels:
            cells = [f"{figures[workload][lane][str(n)]['tokens_per_s']:.2f}" for lane in lanes]
            lines.append(f"| {n} | {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(figures: dict[str, Any], lanes: list[str], levels: list[int]) -> dict[str, Any]:
    """Each lane's tok/s, TTFT p50 and ITL p50 over llama-server's, per level."""
    base = figures["llama_server"]
    return {
        lane: {
            str(n): {
                "tokens_per_s": figures[lane][str(n)]["tokens_per_s"] / base[str(n)]["tokens_per_s"],
                "ttft_p50": figures[lane][str(n)]["ttft_p50_ms"] / base[str(n)]["ttft_p50_ms"],
                "itl_p50": figures[lane][str(n)]["itl_p50_ms"] / base[str(n)]["itl_p50_ms"],
            }
            for n in levels
        }
        for lane in lanes[1:]
    }


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("llama_cpp_python")


if __name__ == "__main__":
    raise SystemExit(main())
