"""Churn: streaming load on a swarm whose nodes are killed, hung, drained and restarted on a schedule.

    python -m benchmarks.churn [--quick] [--minutes N] [--clients C] [--out PATH]

A real local system — tracker, relay, gateway, and two nodes for each range of SmolLM2
(0:15, 15:30; the second range's nodes reachable only through the relay) — serves C
streaming clients for N minutes (10; 2 with ``--quick``). Every few seconds one node
serving a session gets SIGKILL, SIGSTOP (woken after a while) or SIGTERM, in turn, and is
started again a few seconds later; its partner for the range is always up, so every
failure has a spare. Each request takes one of a few prompts and samplings (greedy and
seeded), whose undisturbed reply was recorded first, one request at a time.

Figures: requests served and failed (goal 0), replies equal to their undisturbed twin
(goal all), repairs, the stall each repair cost (from the failure to the next token, as
the client saw it: the longest gap between two tokens of a repaired reply) p50 / p99,
tokens replayed, false repairs (a repair whose failed node got no signal in the seconds
before), and at the end the slots, KV cells and sampler chains still held (goal 0).

Then the repair's stall at 64, 512 and 2,048 tokens generated: the tail killed at that
token of a greedy reply, measured at the client, beside the time the lost range alone
takes to prefill as many positions (what replaying only the lost span would cost at
best: the gateway replays the whole session, prompt and reply, through a new route).
The replay record a session costs: the gateway keeps its token ids (4 bytes a token);
a span replay would keep the hidden states each hop sent (n_embd x 4 bytes a token).
"""

from __future__ import annotations

import json
import random
import signal
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import attrs
import httpx

from benchmarks import _common
from noderuntime.services import localsystem
from noderuntime.services.cluster import ManagedProcess
from noderuntime.services.ready import NodeReady, expect

NAME = "churn"
PROMPTS = (
    "Tell a long story about a lighthouse keeper and a storm.",
    "Describe, step by step, how to bake bread at home.",
    "Write a letter from a sailor to his sister about the sea.",
    "Explain how rivers shape valleys over millions of years.",
)
SAMPLINGS: tuple[dict[str, Any], ...] = (
    {"temperature": 0},
    {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 17, "frequency_penalty": 0.2},
)
SIGNALS = (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM)
STALL_POINTS = (64, 512, 2048)


@attrs.define
class Outcome:
    """One request under churn."""

    template: int
    started: float
    ended: float = 0.0
    text: str = ""
    error: str = ""
    repairs: list[dict[str, Any]] = attrs.Factory(list)
    arrivals: list[float] = attrs.Factory(list)


def _stream(url: str, model: str, template: int, max_tokens: int) -> Outcome:
    prompt, sampling = divmod(template, len(SAMPLINGS))
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[prompt]}],
        "max_tokens": max_tokens,
        "stream": True,
        **SAMPLINGS[sampling],
    }
    outcome = Outcome(template, time.monotonic())
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=180) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.error = event["error"].get("message", "error")
                    continue
                outcome.repairs += event.get("repairs", [])
                for choice in event.get("choices", []):
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        outcome.text += delta
                        outcome.arrivals.append(time.monotonic())
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.ended = time.monotonic()
    return outcome


def _status(process: ManagedProcess) -> dict[str, Any]:
    with urllib.request.urlopen(expect(process.info, NodeReady).http + "/status", timeout=5) as response:
        status: dict[str, Any] = json.loads(response.read())
        return status


def _nodes(system: localsystem.LocalSystem) -> list[ManagedProcess]:
    return [p for p in system.processes if p.name.startswith("node")]


def _admitted(system: localsystem.LocalSystem, node_id: str, within: float = 60.0) -> None:
    """Wait until the tracker routes through ``node_id`` again; RuntimeError if it does not."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with urllib.request.urlopen(system.tracker_url + "/v1/nodes", timeout=5) as response:
            nodes = json.loads(response.read())["nodes"]
        if any(n["node_id"] == node_id and n["admitted"] for n in nodes):
            return
        time.sleep(0.2)
    raise RuntimeError(f"node {node_id[:16]} restarted but was not admitted within {within:.0f} s: {nodes}")


class Chaos(threading.Thread):
    """Signals a node that serves a session every ``every`` seconds, and starts it again."""

    def __init__(self, system: localsystem.LocalSystem, every: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.system = system
        self.every = every
        self.stop = stop
        self.events: list[dict[str, Any]] = []  # what was done to whom, when
        self.start()

    def run(self) -> None:
        turn = 0
        while not self.stop.wait(self.every):
            busy = [p for p in _nodes(self.system) if p.alive() and _status(p)["active_sessions"]]
            if not busy:
                continue
            victim = random.choice(busy)
            signum = SIGNALS[turn % len(SIGNALS)]
            turn += 1
            node_id = expect(victim.info, NodeReady).node_id
            self.events.append({"at": time.monotonic(), "node": node_id[:16], "signal": signum.name})
            victim.signal(signum)
            time.sleep(4.0)  # a hung node stays hung a while; a killed one stays dead
            if signum == signal.SIGSTOP:
                victim.signal(signal.SIGCONT)
            victim.stop(timeout=15)
            restarted = expect(victim.restart(timeout=120), NodeReady)
            _admitted(self.system, restarted.node_id)
            self.events[-1]["back_at"] = time.monotonic()


def _load(system: localsystem.LocalSystem, clients: int, until: float, max_tokens: int) -> list[Outcome]:
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            outcome = _stream(
                system.gateway_url, system.model_id, rng.randrange(len(PROMPTS) * len(SAMPLINGS)), max_tokens
            )
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def _stall_s(outcome: Outcome) -> float:
    """The longest wait between two tokens of a reply (a repaired reply's stall, as the client saw it)."""
    gaps = [b - a for a, b in zip(outcome.arrivals, outcome.arrivals[1:], strict=False)]
    return max(gaps, default=0.0)


def _stalls_at(system: localsystem.LocalSystem, points: tuple[int, ...]) -> dict[str, Any]:
    """The tail killed at token N of a greedy reply: the stall at the client, for each N."""
    out: dict[str, Any] = {}
    for point in points:
        body = {
            "model": system.model_id,
            "messages": [{"role": "user", "content": PROMPTS[0] + " Make it very long."}],
            "max_tokens": point + 40,
            "temperature": 0,
            "stream": True,
            # SmolLM2's ends of generation, ruled out: the reply runs to its max_tokens
            "logit_bias": {"0": -100, "2": -100, "4": -100},
        }
        arrivals: list[float] = []
        repairs: list[dict[str, Any]] = []
        error = ""
        killed_at = 0.0
        victim: ManagedProcess | None = None
        with httpx.stream("POST", system.gateway_url + "/v1/chat/completions", json=body, timeout=600) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {response.read()[:300]!r}"
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                repairs += event.get("repairs", [])
                error = event.get("error", {}).get("message", error)
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    arrivals.append(time.monotonic())
                if len(arrivals) == point and victim is None:
                    victim = next(
                        p
                        for p in _nodes(system)
                        if p.name.startswith("node1") and p.alive() and _status(p)["active_sessions"]
                    )
                    victim.signal(signal.SIGKILL)
                    killed_at = time.monotonic()
        after = [t for t in arrivals if t > killed_at] if victim is not None else []
        out[str(point)] = {
            "client_stall_s": (after[0] - killed_at) if after else None,
            "gateway_stall_ms": repairs[0]["stall_ms"] if repairs else None,
            "replayed_tokens": repairs[0]["replayed_tokens"] if repairs else None,
            "repairs": len(repairs),
            "tokens": len(arrivals),
            "error": error,
        }
        if victim is not None:
            victim.stop(timeout=15)
            _admitted(system, expect(victim.restart(timeout=120), NodeReady).node_id)
    return out


def _span_prefill_ms(model: Path, positions: int, layers: tuple[int, int]) -> float:
    """What the lost range alone takes to prefill ``positions`` hidden rows: a span replay's least cost."""
    import numpy as np

    from noderuntime.engine.base import Rows
    from noderuntime.engine.cores import machine_cores
    from noderuntime.engine.llama import Recipe, ShardEngine
    from noderuntime.models.artifacts import LayerRange

    recipe = Recipe(n_threads=len(machine_cores()), n_ctx_per_seq=4096, n_seq_max=1, n_batch=256, n_ubatch=256)
    with ShardEngine(model, recipe, LayerRange(*layers)) as engine:
        hidden = np.random.default_rng(0).standard_normal((positions, engine.n_embd)).astype(np.float32)
        started = time.perf_counter()
        for start in range(0, positions, 256):
            rows = hidden[start : start + 256]
            last = start + len(rows) >= positions
            engine.run(
                Rows(
                    np.zeros(len(rows), np.int32),
                    np.arange(start, start + len(rows), dtype=np.int32),
                    np.arange(len(rows)) == len(rows) - 1 if last else np.zeros(len(rows), bool),
                    hidden=rows,
                )
            )
        return (time.perf_counter() - started) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = _common.parser(NAME, __doc__ or "")
    parser.add_argument("--minutes", type=float, help="how long the load runs (default 10; --quick 2)")
    parser.add_argument("--clients", type=int, default=3, help="concurrent streaming clients")
    args = parser.parse_args(argv)
    minutes = args.minutes or (2.0 if args.quick else 10.0)
    every = 12.0 if args.quick else 20.0  # seconds between two signals
    max_tokens = 96 if args.quick else 160
    points = STALL_POINTS if not args.quick else STALL_POINTS[:2]
    from noderuntime.models import catalogue as models

    with tempfile.TemporaryDirectory(prefix="churn-") as tmp:
        system = localsystem.start(
            listen="127.0.0.1:0",
            data_root=Path(tmp),
            replicas=2,
            slots=8,
            ctx=4096,
            quiet=True,
            node_options=("--hang-timeout", "2"),
        )
        try:
            templates = range(len(PROMPTS) * len(SAMPLINGS))
            twins = {t: _stream(system.gateway_url, system.model_id, t, max_tokens) for t in templates}
            assert not any(o.error for o in twins.values()), {t: o.error for t, o in twins.items()}
            began = time.monotonic()
            stop = threading.Event()
            chaos = Chaos(system, every, stop)
            outcomes = _load(system, args.clients, began + minutes * 60, max_tokens)
            stop.set()
            chaos.join(180)
            # every node idle, with nothing held, once the load is over
            time.sleep(3.0)
            leftovers = {p.name: _status(p) for p in _nodes(system) if p.alive()}
            stalls_at = _stalls_at(system, points)
        finally:
            system.stop()
    model = models.pull(models.DEMO_MODEL, progress=False)
    span_ms = {str(n): _span_prefill_ms(model, n + 30, (15, 30)) for n in points}

    served = [o for o in outcomes if not o.error]
    failed = [o for o in outcomes if o.error]
    equal = [o for o in served if o.text == twins[o.template].text]
    repaired = [o for o in outcomes if o.repairs]
    stalls = [_stall_s(o) for o in served if o.repairs]
    signalled: list[tuple[float, str]] = [(e["at"], e["node"]) for e in chaos.events]
    false_repairs = 0
    for o in repaired:
        for repair in o.repairs:
            # a repair away from a node that got no signal in the 10 s before the request ended
            if not any(node == repair.get("failed_node") and o.started - 10 <= at <= o.ended for at, node in signalled):
                false_repairs += 1
    leaked = {
        name: {k: s[k] for k in ("slots_leased", "slots_draining", "kv_cells", "samplers_live", "active_sessions")}
        for name, s in leftovers.items()
        if s["slots_leased"] or s["slots_draining"] or s["kv_cells"] or s["samplers_live"] or s["active_sessions"]
    }
    figures: dict[str, Any] = {
        "minutes": minutes,
        "clients": args.clients,
        "requests": len(outcomes),
        "requests_served": len(served),
        "requests_failed": len(failed),
        "failures": [o.error[:160] for o in failed][:20],
        "replies_equal_to_twin": len(equal),
        "replies_differing": len(served) - len(equal),
        "signals": chaos.events and {s.name: sum(e["signal"] == s.name for e in chaos.events) for s in SIGNALS},
        "signal_events": [
            {**e, "at": round(e["at"] - began, 2), "back_at": round(e.get("back_at", 0) - began, 2)}
            for e in chaos.events
        ],
        "repairs": sum(len(o.repairs) for o in outcomes),
        "repaired_requests": len(repaired),
        "false_repairs": false_repairs,
        "stall_p50_s": _common.percentile(stalls, 50) if stalls else None,
        "stall_p99_s": _common.percentile(stalls, 99) if stalls else None,
        "tokens_replayed": sum(r.get("replayed_tokens", 0) for o in outcomes for r in o.repairs),
        "leaked_at_end": leaked,
        "stall_by_tokens_generated": stalls_at,
        "span_replay_least_ms_by_tokens_generated": span_ms,
        "replay_record_bytes_per_token": {"whole_session_token_ids": 4, "span_hidden_states_smollm2": 576 * 4},
        "timeline": [
            {
                "started": round(o.started - began, 2),
                "ended": round(o.ended - began, 2),
                "failed": bool(o.error),
                "repairs": len(o.repairs),
                "stall_s": round(_stall_s(o), 3) if o.repairs else None,
            }
            for o in outcomes
        ],
    }
    figures["goals"] = {
        "no_failed_request": figures["requests_failed"] == 0,
        "every_reply_equals_its_twin": figures["replies_differing"] == 0,
        "nothing_leaked": not leaked,
        "stall_at_512_within_1s": (stalls_at.get("512", {}).get("client_stall_s") or 99) <= 1.0,
    }
    out = _common.out_path(NAME, args)
    recipe = {"model": "SmolLM2-135M-Instruct Q4_1", "ranges": ["0:15 (2 nodes)", "15:30 (2 nodes, relay only)"]}
    _common.write(out, NAME, args, recipe, figures)
    _plot(out.with_suffix(".png"), figures)
    rows = [[k, v] for k, v in figures.items() if isinstance(v, int | float | type(None)) or k == "goals"]
    print(_common.table(["figure", "value"], rows))
    print(
        _common.table(
            ["tokens generated", "client stall s", "gateway stall ms", "span prefill ms (least)"],
            [
                [n, stalls_at[n]["client_stall_s"], stalls_at[n]["gateway_stall_ms"], round(span_ms[n], 1)]
                for n in stalls_at
            ],
        )
    )
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def _plot(path: Path, figures: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = figures["timeline"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    done = [t["ended"] for t in timeline if not t["failed"]]
    top.hist(done, bins=max(10, int(figures["minutes"] * 6)), color="tab:blue", label="requests served")
    failed = [t["ended"] for t in timeline if t["failed"]]
    if failed:
        top.hist(failed, bins=max(10, int(figures["minutes"] * 6)), color="tab:red", label="requests failed")
    top.set_ylabel("requests ending")
    repaired = [(t["ended"], t["stall_s"]) for t in timeline if t["stall_s"] is not None]
    bottom.scatter(
        [r[0] for r in repaired], [r[1] for r in repaired], color="tab:orange", label="repaired reply's stall"
    )
    bottom.set_ylabel("stall (s)")
    bottom.set_xlabel("seconds")
    for axis in (top, bottom):
        for event in figures["signal_events"]:
            axis.axvline(event["at"], color="grey", linestyle=":", linewidth=1)
    for event in figures["signal_events"]:
        top.annotate(event["signal"][3:], (event["at"], 0), rotation=90, fontsize=7, color="grey")
    top.legend(loc="upper right")
    bottom.legend(loc="upper right")
    fig.suptitle("churn: nodes killed, hung and drained under streaming load (dotted: a signal)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
