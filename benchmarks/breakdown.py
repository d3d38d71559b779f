"""Where a served request's time goes: first token and each token after, stage by stage.

    python -m benchmarks.breakdown [--quick] [--out PATH] [--lane one_node|local_system|grpc_route]
                                   [--profile DIR]

Starts one lane of ``benchmarks.serving`` (tracker, gateway, nodes) with every process
recording its timeline (:mod:`noderuntime.operations.timeline`; all processes read one
monotonic clock), then:

- **first token**: single streamed requests one after another, each split into the stages
  its processes recorded, from the client's send to the first content chunk back:
  the gateway's parsing and template, the tracker's grant, opening the route's seam, the
  head's admission, each node's prefill ticks, the first token's way back, the SSE chunk;
- **each token after**: at 1 and 8 clients, the node's ticks (engine time; the rest of the
  tick: the hop to the engine thread and back, and with co-located nodes the wait for the
  turn on the cores; time between ticks) and CPU seconds per token of every process and
  of each of its threads, user and system time apart (Python and the engine count as
  user time; syscalls, the socket writes and the wake-ups they cause as system time);
  with ``--profile DIR``, a py-spy flame graph (SVG) and a table of the hottest frames of
  each process at 8 clients.

Medians, in milliseconds. The JSON holds the stage table, the tick split and the frames.
"""

from __future__ import annotations

import collections
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from benchmarks import _common, serving, tokenpath
from benchmarks.serving import PROMPTS, cpu_seconds

NAME = "breakdown"

# The first token's stages, in order: (process kind, stage). A stage's time is from the
# previous stage found to this one; stages a lane does not have are skipped.
FIRST_TOKEN = [
    ("gateway", "gateway.received"),
    ("gateway", "gateway.tokenized"),
    ("gateway", "gateway.granting"),
    ("gateway", "gateway.granted"),
    ("gateway", "gateway.opened"),
    ("node0", "node.admitted"),
    ("node0", "tick.started"),
    ("node0", "tick.finished"),
    ("node1", "node.admitted"),
    ("node1", "tick.started"),
    ("node1", "tick.finished"),
    ("gateway", "gateway.first_tokens"),
    ("gateway", "gateway.chunk"),
]


def _ns(seconds: float) -> int:
    """A ``perf_counter`` reading in the timelines' unit (``perf_counter_ns``: the same clock)."""
    return round(seconds * 1e9)


def _kind(record: dict[str, Any]) -> str:
    argv = " ".join(record["argv"])
    for kind in ("gateway", "tracker", "relay"):
        if f" {kind} " in f" {argv} " or argv.endswith(f" {kind}"):
            return kind
    if " up " in f" {argv} ":
        layers = argv.split("--layers", 1)[1].split()[0] if "--layers" in argv else "0:"
        return "node" + str(layers)
    return "other"


def _by_kind(records: list[dict[str, Any]]) -> dict[str, list[tuple[str, int, str]]]:
    """Each process's events under ``gateway``, ``node0``, ``node1``, ... (nodes by first layer)."""
    kinds: dict[str, list[tuple[str, int, str]]] = {}
    nodes = []
    for record in records:
        kind = _kind(record)
        if kind.startswith("node"):
            nodes.append((int(kind[4:].split(":")[0]), record))
        else:
            kinds[kind] = [tuple(e) for e in record["events"]]
    for i, (_, record) in enumerate(sorted(nodes, key=lambda n: n[0])):
        kinds[f"node{i}"] = [tuple(e) for e in record["events"]]
    return kinds


def first_token_stages(kinds: dict[str, list[tuple[str, int, str]]], requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Per request, each stage's time from the previous one found (ms); medians over requests."""
    per_stage: dict[str, list[float]] = collections.defaultdict(list)
    totals = []
    for request in requests:
        if not request["arrivals"]:
            continue
        start, end = _ns(request["started"]), _ns(request["arrivals"][0])
        previous = start
        for kind, stage in FIRST_TOKEN:
            times = [t for s, t, _ in kinds.get(kind, ()) if s == stage and previous <= t <= end]
            if not times:
                continue
            # a tick's start is the first after the previous stage; its finish, the last before
            # the next kind of stage (prefill can take several ticks)
            at = times[-1] if stage == "tick.finished" else times[0]
            per_stage[f"{kind} {stage}"].append((at - previous) / 1e6)
            previous = at
        per_stage["client received the chunk"].append((end - previous) / 1e6)
        totals.append((end - start) / 1e6)
    stages = {name: statistics.median(values) for name, values in per_stage.items()}
    return {"stages_ms": stages, "ttft_ms": statistics.median(totals) if totals else None, "requests": len(totals)}


def tick_split(events: list[tuple[str, int, str]], start: int, end: int) -> dict[str, Any]:
    """A node's ticks inside ``[start, end]``: engine time, the rest of each tick, and time between ticks."""
    ticks = []
    current: dict[str, int] = {}
    for stage, t, _ in events:
        if not start <= t <= end:
            continue
        if stage in ("tick.started", "engine.started", "engine.finished"):
            current[stage] = t
        elif stage == "tick.finished" and len(current) == 3:
            ticks.append((current["tick.started"], current["engine.started"], current["engine.finished"], t))
            current = {}
    if len(ticks) < 2:
        return {"ticks": len(ticks)}
    engine = [(c - b) / 1e6 for _, b, c, _ in ticks]
    hop = [((b - a) + (d - c)) / 1e6 for a, b, c, d in ticks]
    between = [(nxt[0] - cur[3]) / 1e6 for cur, nxt in itertools.pairwise(ticks)]
    wall = (ticks[-1][3] - ticks[0][0]) / 1e6
    return {
        "ticks": len(ticks),
        "engine_ms_p50": statistics.median(engine),
        # the tail: a tick stretched by whatever else ran on the team's cores
        "engine_ms_p90": _common.percentile(engine, 90),
        "engine_ms_p99": _common.percentile(engine, 99),
        "thread_hop_ms_p50": statistics.median(hop),
        "between_ticks_ms_p50": statistics.median(between),
        "between_ticks_ms_p99": _common.percentile(between, 99),
        "engine_share_of_wall": sum(engine) / wall if wall else None,
        "hop_share_of_wall": sum(hop) / wall if wall else None,
        "between_share_of_wall": sum(between) / wall if wall else None,
    }


def _hottest(raw: Path, top: int = 25) -> list[dict[str, Any]]:
    """The frames with the most samples (inclusive and own) in a py-spy ``raw`` (folded) profile."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        for frame in set(frames):
            inclusive[frame] += n
        own[frames[-1]] += n
    return [
        {"frame": frame, "inclusive": n / total, "own": own[frame] / total}
        for frame, n in inclusive.most_common(top)
        if total
    ]


def thread_cpu(pids: dict[str, int]) -> dict[str, dict[str, tuple[str, float, float]]]:
    """Each process's live threads: by thread id, its name and its CPU seconds so far, user and system.

    The process's first thread is named ``main`` (trio's, in every process of the project);
    the others go by the names the kernel knows them by
    (:mod:`noderuntime.operations.threadnames`): ``grpc-asyncio``, ``engine`` with its OpenMP
    team, trio's worker threads all as ``trio workers``.
    """
    out: dict[str, dict[str, tuple[str, float, float]]] = {}
    for name, pid in pids.items():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # the process has ended
        threads = out[name] = {}
        for tid in tids:
            try:
                comm, user, system = _common.stat_cpu(f"/proc/{pid}/task/{tid}/stat")
            except OSError:
                continue  # the thread ended while listed
            label = "main" if tid == str(pid) else "trio workers" if comm.startswith("Trio thread") else comm
            threads[tid] = (label, user, system)
    return out


def per_token(
    before: dict[str, dict[str, tuple[str, float, float]]],
    after: dict[str, dict[str, tuple[str, float, float]]],
    tokens: int,
) -> dict[str, dict[str, dict[str, float]]]:
    """Milliseconds of user and system CPU a token, per process and thread name, between two
    :func:`thread_cpu` readings: of the threads alive at the second (a thread that ended between
    them is missing, which the process's own total, :func:`benchmarks.serving.cpu_seconds`, holds)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, threads in after.items():
        for tid, (label, user, system) in threads.items():
            _, user_was, system_was = before.get(name, {}).get(tid, (label, 0.0, 0.0))
            if user - user_was or system - system_was:
                split = out.setdefault(name, {}).setdefault(label, {"user_ms": 0.0, "system_ms": 0.0})
                split["user_ms"] += (user - user_was) / tokens * 1e3
                split["system_ms"] += (system - system_was) / tokens * 1e3
    return out


def _profile(pids: dict[str, int], seconds: float, directory: Path) -> list[subprocess.Popen[bytes]]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    procs = []
    for name, pid in pids.items():
        if name == "tracker":
            continue  # a few requests a second: nothing to see
        for fmt, suffix in (("flamegraph", "svg"), ("raw", "txt")):
            out = str(directory / f"{name}.{suffix}")
            procs.append(
                subprocess.Popen(
                    [
                        spy,
                        "record",
                        "-p",
                        str(pid),
                        "-d",
                        str(int(seconds)),
                        "-r",
                        "97",
                        "--nonblocking",
                        "-f",
                        fmt,
                        "-o",
                        out,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
    return procs


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(NAME, __doc__ or "")
    p.add_argument("--lane", choices=["one_node", "local_system", "grpc_route"], default="one_node")
    p.add_argument("--profile", type=Path, default=None, help="py-spy flame graphs of every process at 8 clients")
    args = p.parse_args(argv)
    from noderuntime.engine.llama import Recipe
    from noderuntime.models import artifacts
    from noderuntime.models import catalogue as models
    from noderuntime.operations import timeline
    from noderuntime.services import localsystem

    model = models.pull(models.DEMO_MODEL, progress=False)
    info = artifacts.inspect(model)
    singles = 5 if args.quick else 12
    # requests per client: one client's tokens are few, and a thread's CPU is counted in 10 ms ticks
    requests = {1: 1 if args.quick else 8, 8: 1 if args.quick else 2}
    max_tokens = 24 if args.quick else 64
    figures: dict[str, Any] = {"lane": args.lane}
    with tempfile.TemporaryDirectory() as tmp:
        records = Path(tmp) / "timelines"
        records.mkdir()
        os.environ[timeline.ENV] = str(records)
        try:
            system = localsystem.start(
                listen="127.0.0.1:0",
                data_root=Path(tmp) / "data",
                slots=16,
                ctx=1024,
                quiet=True,
                cuts=(0, info.n_layer) if args.lane == "one_node" else None,
                relay_last=args.lane == "local_system",
            )
        finally:
            del os.environ[timeline.ENV]
        url, model_id = system.gateway_url, system.model_id
        pids = {p.name: p.pid for p in system.processes}
        windows: dict[str, tuple[int, int]] = {}
        try:
            trio.run(serving.run_clients, url, model_id, 1, 2, 8)  # warm-up
            singles_done = []
            for i in range(singles):
                singles_done.append(trio.run(serving.stream_chat, url, model_id, PROMPTS[i % len(PROMPTS)], max_tokens))
            cpu: dict[str, Any] = {}
            by_thread: dict[str, Any] = {}
            for clients in (1, 8):
                before, threads_before = cpu_seconds(pids), thread_cpu(pids)
                spies = []
                if args.profile is not None and clients == 8:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    spies = _profile(pids, 10 if args.quick else 20, args.profile)
                start = time.perf_counter_ns()
                done = trio.run(serving.run_clients, url, model_id, clients, requests[clients], max_tokens)["results"]
                windows[str(clients)] = (start, time.perf_counter_ns())
                after, threads_after = cpu_seconds(pids), thread_cpu(pids)
                for spy in spies:
                    spy.wait(120)
                tokens = max(1, sum(len(r["arrivals"]) for r in done))
                cpu[str(clients)] = {name: (after[name] - before[name]) / tokens * 1e3 for name in pids}
                by_thread[str(clients)] = per_token(threads_before, threads_after, tokens)
        finally:
            system.stop()
        read = timeline.read(records)
        kinds = _by_kind(read)
    figures["first_token"] = first_token_stages(kinds, singles_done)
    if args.lane == "grpc_route":
        # one decode token's way round the route, step by step (single requests, one at a time)
        generations = [(_ns(r["started"]), _ns(r["arrivals"][-1])) for r in singles_done if r["arrivals"]]
        figures["decode_token_path"] = tokenpath.token_stages(read, "grpc", generations)
    figures["cpu_ms_per_token"] = cpu
    figures["cpu_ms_per_token_by_thread"] = by_thread
    figures["ticks"] = {
        clients: {node: tick_split(kinds[node], *window) for node in sorted(kinds) if node.startswith("node")}
        for clients, window in windows.items()
    }
    if args.profile is not None:
        figures["hottest_frames_at_8_clients"] = {
            name: _hottest(args.profile / f"{name}.txt") for name in pids if (args.profile / f"{name}.txt").exists()
        }
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        Recipe(n_threads=2, n_ctx_per_seq=1024).describe(info.quant),
        figures,
        settings={
            "lane": args.lane,
            "single_requests": singles,
            "requests_per_client": requests,
            "max_tokens": max_tokens,
            "slots": 16,
        },
    )
    print(_common.table(["stage", "ms (p50)"], list(figures["first_token"]["stages_ms"].items())))
    print(f"TTFT p50 {figures['first_token']['ttft_ms']:.1f} ms over {figures['first_token']['requests']} requests")
    if "decode_token_path" in figures:
        way = figures["decode_token_path"]
        rows = [[step["shard"], step["stage"], step["what"], step["us"]] for step in way["steps"]]
        print(_common.table(["shard", "stage", "what led to it", "us (p50)"], rows))
        print(f"a decode token round the route: {way['token_us']:.0f} us over {way['tokens']} tokens")
    for clients, nodes in figures["ticks"].items():
        for node, split in nodes.items():
            print(f"{clients} clients, {node}: {split}")
        print(f"{clients} clients, CPU ms per token: {cpu[clients]}")
        rows = [
            [clients, name, label, split["user_ms"], split["system_ms"]]
            for name, threads in by_thread[clients].items()
            for label, split in sorted(threads.items())
        ]
        print(_common.table(["clients", "process", "thread", "user ms/token", "system ms/token"], rows))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
