"""Audits: what commitments cost, how soon audits catch a cheater, and that they flag no honest node.

    python -m benchmarks.audit [--quick] [--out PATH]

Three parts:

- ``commitments``: the CPU a hop's commitments take (``control/commitments.py``: BLAKE2b
  over the rows it takes in and gives out) per decode token and per 256-row prefill chunk,
  against the engine's own step for the same rows, on SmolLM2-135M (n_embd 576) and a
  random-weight model of Llama-3.2-1B's shape (2048). Goal: ≤ 1 % of a decode step on the
  1B shape.
- ``detection``: a real swarm of a tiny random Qwen3 (4 layers, two ranges): two honest
  nodes and a cheater for the first range, three honest nodes for the second, a tracker,
  a gateway auditing a share ``A`` of sessions. The cheater (``tests/cheating_node.py``,
  ``share=C``) adds 1e-3 of noise to every output of a share ``C`` of its sessions.
  Requests go out one at a time until the tracker excludes it; each trial counts the
  sessions it served until then, against the closed form (a cheated session is audited
  with probability ``A·C``: sessions until exclusion are geometric, mean ``1/(A·C)``), and
  the time from the end of the last request it served to its exclusion.
- ``honest``: the same swarm with no cheater, every session audited (``A`` = 1), several
  thousand sessions (``--quick``: 60) from four clients: honest nodes flagged (goal 0),
  suspicions, and what the audits cost against what was served (the auditors' reported
  compute over the served hops', from the gateway's counters and its ledger; goal: at
  most the audit rate's share).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import _common
from noderuntime.control.commitments import Commitment
from noderuntime.models import synth
from noderuntime.testing.audits import FIRST, AuditSwarm, running_audit_swarm

NAME = "audit"


# --- commitments


def commitment_costs(model: Path, label: str) -> dict[str, Any]:
    """Commitment CPU per decode row and per prefill chunk, beside the engine's step (whole model, 2 threads)."""
    from noderuntime.engine.base import Rows
    from noderuntime.engine.cores import machine_cores
    from noderuntime.engine.llama import Recipe, ShardEngine

    recipe = Recipe(n_threads=len(machine_cores()), n_ctx_per_seq=512, n_seq_max=1, n_batch=256, n_ubatch=256)
    with ShardEngine(model, recipe) as engine:
        n_embd = engine.n_embd
        tokens = np.random.default_rng(1).integers(100, 1000, 256).astype(np.int32)
        started = time.perf_counter()
        engine.run(Rows(np.zeros(256, np.int32), np.arange(256, dtype=np.int32), np.zeros(256, bool), tokens=tokens))
        prefill_ms = (time.perf_counter() - started) * 1e3
        steps = []
        for position in range(256, 256 + 24):
            started = time.perf_counter()
            one = Rows(np.zeros(1, np.int32), np.array([position], np.int32), np.ones(1, bool), np.array([7], np.int32))
            engine.run(one)
            steps.append((time.perf_counter() - started) * 1e3)
    rng = np.random.default_rng(2)
    row = rng.standard_normal((1, n_embd)).astype(np.float32)
    chunk = rng.standard_normal((256, n_embd)).astype(np.float32)

    def per_call_us(rows: np.ndarray, reps: int) -> float:
        commitment = Commitment(0)
        started = time.perf_counter()
        for k in range(reps):
            commitment.add_rows(k * len(rows), rows)
        return (time.perf_counter() - started) / reps * 1e6

    # a hop commits twice per step (what it took in, what it gave out)
    decode_us = 2 * min(per_call_us(row, 2000) for _ in range(5))
    prefill_us = 2 * min(per_call_us(chunk, 50) for _ in range(5))
    decode_ms = statistics.median(steps)
    return {
        "model": label,
        "n_embd": n_embd,
        "commit_per_decode_token_us": decode_us,
        "decode_step_ms": decode_ms,
        "commit_share_of_decode_step": decode_us / 1e3 / decode_ms,
        "commit_per_prefill_chunk_us": prefill_us,
        "prefill_chunk_ms": prefill_ms,
        "commit_share_of_prefill": prefill_us / 1e3 / prefill_ms,
    }


# --- a swarm's audits


def detection_trial(swarm: AuditSwarm, audit_rate: float, cheat_rate: float, trial: int, cap: int) -> dict[str, Any]:
    """Start a cheater, ask until the tracker excludes it, or it served ``cap`` sessions: what it took.

    The tracker routes by cost, so a cheater that measured itself slow at start (a busy
    machine) is seldom chosen: after ``20 * cap`` requests the trial ends all the same, and
    says how many sessions the cheater served (a node nobody routes to cheats nobody).
    """
    name = f"cheat-{audit_rate}-{cheat_rate}-{trial}"
    cheater, node_id = swarm.start_node(name, FIRST, before=[f"share={cheat_rate}"], module="tests.cheating_node")
    rng = random.Random(name)
    excluded_at: list[float] = []
    stop = threading.Event()

    def watch() -> None:  # the moment the tracker excludes it, to 0.1 s
        while not stop.wait(0.1):
            if swarm.nodes()[node_id]["audit_failed"]:
                excluded_at.append(time.monotonic())
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    served_by_it = requests = 0
    first_served_end = None
    with httpx.Client() as client:
        while not excluded_at and served_by_it < cap and requests < 20 * cap:
            reply = swarm.ask(rng, client=client).raise_for_status().json()
            requests += 1
            if any(hop["node_id"].startswith(node_id[:16]) for hop in reply.get("route", [])):
                served_by_it += 1
                if first_served_end is None:
                    first_served_end = time.monotonic()
    deadline = time.monotonic() + 30
    while not excluded_at and time.monotonic() < deadline:
        time.sleep(0.1)  # the last audit may still run
    stop.set()
    watcher.join()
    cheater.stop()
    return {
        "audit_rate": audit_rate,
        "cheat_rate": cheat_rate,
        "requests": requests,
        "sessions_served_by_cheater": served_by_it,
        "excluded": bool(excluded_at),
        # requests go on while an audit runs: the time from the end of the first session it served
        "seconds_from_its_first_session_to_exclusion": (
            excluded_at[0] - first_served_end if excluded_at and first_served_end is not None else None
        ),
    }


def honest_soak(swarm: AuditSwarm, sessions: int, clients: int) -> dict[str, Any]:
    """``sessions`` requests from ``clients`` clients, every one audited: what the audits said of honest nodes."""
    done = [0]
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client() as http:
            while True:
                with lock:
                    if done[0] >= sessions:
                        return
                    done[0] += 1
                swarm.ask(rng, client=http).raise_for_status()

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(1000 + i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    while True:  # the audit queue drains
        audits = swarm.audits()
        if time.monotonic() - started > 3600 or audits["chosen"] <= sum(
            audits[k] for k in ("audited", "skipped_queue_full", "skipped_no_auditors", "skipped_busy", "skipped_error")
        ):
            break
        time.sleep(0.5)
    from noderuntime.control.ledger import Ledger

    served_ms = sum(n["compute_ms"] for n in Ledger(swarm.ledger).totals()["nodes"])
    nodes = swarm.nodes()
    return {
        "sessions": sessions,
        "seconds": time.monotonic() - started,
        "audited": audits["audited"],
        "skipped": {
            k: audits[k] for k in ("skipped_queue_full", "skipped_no_auditors", "skipped_busy", "skipped_error")
        },
        "honest_nodes_failed": sum(1 for n in nodes.values() if n["audit_failed"]),
        "honest_hops_passed": sum(n["audits"]["passed"] for n in nodes.values()),
        "suspicions": sum(n["audits"]["suspected"] for n in nodes.values()),
        "outvoted": sum(n["audits"]["outvoted"] for n in nodes.values()),
        "audit_compute_ms": audits["compute_ms"],
        "served_compute_ms": served_ms,
        "audit_compute_over_served": audits["compute_ms"] / served_ms if served_ms else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(NAME, __doc__ or "")
    args = p.parse_args(argv)
    from benchmarks.seams import LARGER_SHAPE
    from noderuntime.engine.llama import Recipe
    from noderuntime.models import catalogue as models

    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="audit-") as tmp:
        root = Path(tmp)
        demo = models.pull(models.DEMO_MODEL, progress=False)
        larger = synth.write_model(root / "1b-shape.gguf", synth.ModelShape(**LARGER_SHAPE), quant="Q4_0")
        figures["commitments"] = [
            commitment_costs(demo, "SmolLM2-135M Q4_1"),
            commitment_costs(larger, "1B shape Q4_0"),
        ]
        larger.unlink()
        grid = [(1.0, 1.0), (0.5, 1.0)] if args.quick else [(1.0, 1.0), (0.5, 1.0), (1.0, 0.5), (0.5, 0.5), (0.25, 1.0)]
        trials = 1 if args.quick else 4
        with running_audit_swarm(root / "swarm", audit_rate=grid[0][0], slots=8) as swarm:
            rows = []
            for audit_rate, cheat_rate in grid:
                if audit_rate != swarm.audit_rate:
                    swarm.set_audit_rate(audit_rate)
                runs = [detection_trial(swarm, audit_rate, cheat_rate, t, cap=60) for t in range(trials)]
                caught = [r["sessions_served_by_cheater"] for r in runs if r["excluded"]]
                latencies = [r["seconds_from_its_first_session_to_exclusion"] for r in runs if r["excluded"]]
                rows.append(
                    {
                        "audit_rate": audit_rate,
                        "cheat_rate": cheat_rate,
                        "trials": runs,
                        "excluded": len(caught),
                        # trials the tracker seldom routed through the cheater: ended by requests, not caught
                        "seldom_routed": sum(
                            1 for r in runs if not r["excluded"] and r["sessions_served_by_cheater"] < 60
                        ),
                        "mean_cheater_sessions_to_exclusion": statistics.mean(caught) if caught else None,
                        "closed_form_mean": 1 / (audit_rate * cheat_rate),
                        "p_detect_within_10_sessions_closed_form": 1 - (1 - audit_rate * cheat_rate) ** 10,
                        "seconds_to_exclusion_p50": statistics.median(latencies) if latencies else None,
                    }
                )
            figures["detection"] = rows
            swarm.set_audit_rate(1.0)
            figures["honest"] = honest_soak(swarm, 60 if args.quick else 3000, 4)
    first = figures["commitments"]
    figures["goals"] = {
        "commitments_at_most_1pct_of_a_1b_decode_step": first[1]["commit_share_of_decode_step"] <= 0.01,
        "every_cheater_routed_60_times_excluded": all(
            r["excluded"] + r["seldom_routed"] == len(r["trials"]) for r in figures["detection"]
        ),
        "no_honest_node_flagged": figures["honest"]["honest_nodes_failed"] == 0,
        "audits_at_most_the_rate_share_of_compute": (figures["honest"]["audit_compute_over_served"] or 0) <= 1.0,
    }
    path = _common.out_path(NAME, args)
    _common.write(
        path,
        NAME,
        args,
        Recipe(n_threads=1, n_ctx_per_seq=256, n_seq_max=8).describe("Q8_0"),
        figures,
        settings={
            "swarm": "tiny random Qwen3 (4 layers, n_embd 64), layers 0:2 (2 honest + the cheater) and 2:4 (3 honest), "
            "1 thread a node, requests of 24 prompt tokens and 12 seeded tokens",
            "cheat": "tests/cheating_node.py share=C: 1e-3 noise on every output of a share C of its sessions",
        },
    )
    print(
        _common.table(
            ["model", "commit µs/token", "decode ms", "share", "commit µs/chunk", "prefill ms"],
            [
                [
                    c["model"],
                    c["commit_per_decode_token_us"],
                    c["decode_step_ms"],
                    c["commit_share_of_decode_step"],
                    c["commit_per_prefill_chunk_us"],
                    c["prefill_chunk_ms"],
                ]
                for c in first
            ],
        )
    )
    print()
    print(
        _common.table(
            ["audit rate", "cheat rate", "caught", "seldom routed", "mean sessions", "closed form", "s to exclusion"],
            [
                [
                    r["audit_rate"],
                    r["cheat_rate"],
                    f"{r['excluded']}/{len(r['trials'])}",
                    r["seldom_routed"],
                    r["mean_cheater_sessions_to_exclusion"],
                    r["closed_form_mean"],
                    r["seconds_to_exclusion_p50"],
                ]
                for r in figures["detection"]
            ],
        )
    )
    honest = figures["honest"]
    print(
        f"\nhonest: {honest['sessions']} sessions, {honest['audited']} audited, "
        f"{honest['honest_nodes_failed']} honest nodes flagged, {honest['suspicions']} suspicions, "
        f"audit compute {honest['audit_compute_over_served']:.2f}× served"
    )
    print(f"goals: {figures['goals']}\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
