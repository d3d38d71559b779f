"""One decode token's way round a 2-shard route, read from the nodes' timelines: each step's
median time, stage by stage (used by ``benchmarks.seams`` and ``benchmarks.breakdown``)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks import _common

# A decode token's way round a 2-shard route, as (shard, stage) in the timeline, from the
# tail's tick to the tail's next tick, with what each step between two stages is.
_ARRIVAL = {
    "grpc": "grpclib sends; the wire; the peer's asyncio thread wakes, reads HTTP/2",
    "relay": "the websocket to the relay, the relay, the websocket from it",
}


def _token_path(transport: str) -> list[tuple[str, str, str]]:
    """The stages of one token on a 2-shard route over ``transport``: (shard, stage, what led to it)."""
    path: list[tuple[str, str, str]] = [("tail", "tick.finished", "")]
    for shard, seam_out, peer, seam_in in (("tail", "up", "head", "down"), ("head", "down", "tail", "up")):
        path.append((shard, f"{seam_out}.sent", "session: the tick's rows become a frame"))
        if transport == "grpc":
            # grpclib's send returns after the peer may already have read the frame: the way
            # goes on from the start of the send ("written" is measured beside it)
            path.append((shard, f"grpc.{_grpc_side(shard)}.writing", "to the asyncio thread"))
            path.append((peer, f"grpc.{_grpc_side(peer)}.read", _ARRIVAL[transport]))
            path.append((peer, f"{seam_in}.received", "to the trio thread"))
        else:
            path.append((peer, f"{seam_in}.received", _ARRIVAL[transport]))
        path += [
            (peer, f"{seam_in}.decoded", "frame decoded, checked"),
            (peer, "step.submitted", "session: the event becomes a step"),
            (peer, "tick.started", "batcher: step to tick"),
            (peer, "engine.started", "to the engine thread"),
            (peer, "engine.finished", "the engine"),
            (peer, "tick.finished", "back to the trio thread"),
        ]
    return path


def _grpc_side(shard: str) -> str:
    # the head dials the tail: the head's end of their seam is the gRPC client
    return "client" if shard == "head" else "server"


def token_stages(records: list[dict[str, Any]], transport: str, windows: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Median time of each step of a decode token round a 2-shard route, from the nodes' timelines.

    ``records`` are the node processes' timelines (:func:`noderuntime.operations.timeline.read`);
    ``windows`` are the (start, end) ``perf_counter_ns`` of each generation measured.
    Each token is followed stage by stage, taking for each the first record of it after
    the stage before; a token whose way cannot be followed to the end within its
    generation is left out.
    """
    shards: dict[str, list[tuple[str, int]]] = {}
    for record in records:
        argv = record["argv"]
        if "--layers" in argv:
            start = int(argv[argv.index("--layers") + 1].split(":")[0])
            shards["head" if start == 0 else "tail"] = [(stage, ns) for stage, ns, _thread in record["events"]]
    path = _token_path(transport)
    steps: list[list[float]] = [[] for _ in path[1:]]
    totals: list[float] = []
    for since, until in windows:
        times: dict[tuple[str, str], list[int]] = {}
        for shard, events in shards.items():
            for stage, ns in events:
                if since <= ns <= until:
                    times.setdefault((shard, stage), []).append(ns)
        for spent in _follow(times, path):
            for i, us in enumerate(spent):
                steps[i].append(us)
            totals.append(sum(spent))
    sends = {}
    if transport == "grpc":
        for shard, events in shards.items():
            side = _grpc_side(shard)
            started: int | None = None
            spent = []
            for stage, ns in events:
                if stage == f"grpc.{side}.writing":
                    started = ns
                elif stage == f"grpc.{side}.written" and started is not None:
                    spent.append((ns - started) / 1e3)
                    started = None
            if spent:
                sends[shard] = statistics.median(spent)
    return {
        "tokens": len(totals),
        "token_us": statistics.median(totals) if totals else None,
        "steps": [
            {"shard": shard, "stage": stage, "what": what, "us": statistics.median(us)}
            for (shard, stage, what), us in zip(path[1:], steps, strict=True)
            if us
        ],
        "grpclib_send_us": sends,
    }


def _follow(times: dict[tuple[str, str], list[int]], path: list[tuple[str, str, str]]) -> list[list[float]]:
    """Each token's time (µs) from one stage of ``path`` to the next, through one generation's stages."""
    cursor = dict.fromkeys(times, 0)

    def next_after(key: tuple[str, str], ns: int) -> int | None:
        series = times.get(key, [])
        i = cursor.get(key, 0)
        while i < len(series) and series[i] < ns:
            i += 1
        cursor[key] = i
        return series[i] if i < len(series) else None

    tokens: list[list[float]] = []
    start = next_after(path[0][:2], 0)
    while start is not None:
        at, spent = start, []
        for shard, stage, _ in path[1:]:
            found = next_after((shard, stage), at)
            if found is None:
                return tokens  # the generation ended on the way
            spent.append((found - at) / 1e3)
            at = found
        tokens.append(spent)
        start = at  # the tail's tick that ends one token starts the next
    return tokens


def stage_table(stages: dict[str, Any]) -> str:
    """The gRPC and relay routes' steps side by side, in the token's order; a step one lacks is blank."""
    rows: list[list[Any]] = [[s["shard"], s["what"], round(s["us"]), ""] for s in stages["grpc"]["steps"]]
    keys = [(s["shard"], s["stage"], s["what"]) for s in stages["grpc"]["steps"]]
    pending: list[tuple[tuple[str, str, str], list[Any]]] = []  # the relay's own steps, until the next shared one
    for step in stages["relay"]["steps"]:
        key = (step["shard"], step["stage"], step["what"])
        if key not in keys:
            pending.append((key, [step["shard"], step["what"], "", round(step["us"])]))
            continue
        at = keys.index(key)
        keys[at:at] = [k for k, _ in pending]
        rows[at:at] = [row for _, row in pending]
        rows[at + len(pending)][3] = round(step["us"])
        pending = []
    rows += [row for _, row in pending]
    tokens = [stages[k]["token_us"] for k in ("grpc", "relay")]
    rows.append(["", "one token", *(round(us) if us is not None else "" for us in tokens)])
    return _common.table(["shard", "step (to the stage)", "gRPC µs", "relay µs"], rows)
