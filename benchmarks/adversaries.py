"""An open swarm under every attack at once: do honest clients and nodes notice?

    python -m benchmarks.adversaries [--quick] [--out PATH]

A real swarm on loopback: a tracker, six nodes of the demo model (SmolLM2-135M, 30 layers)
in two routes of three shards (0:10, 10:20, 20:30, each served twice), and a gateway whose
honest clients (four, each with its own API key) stream chat completions one after another.
The tracker runs with probe references for the three ranges and ``--require-probe``, as
``docs/operating.md`` has an open swarm's tracker run: a node is admitted once it answers
its known-answer probe. The gateway lets one API key run at most two sessions at once
(``--running-per-key 2``).

The same honest load in three phases: quiet; all attacks at once by 100 sybil identities
(``--quick``: 35); and, to tell their effects apart, only the attacks that take no route
grant. The sybils are throwaway Ed25519 keys in a process of their own, each from an
address of its own on loopback, signing their requests as nodes do; each plays one role:

- ``huge_numbers``: registered on a shard, heartbeats with ``10**400``, NaN, infinities;
- ``layer_vote``: registered claiming the 30-layer artifact has 31 layers, beating to stay;
- ``placement``: placement requests claiming 1e9 tokens/s, renewed;
- ``route_flood``: route grants asking day-long tickets, four a second each;
- ``audit_flood``: one session each, then audit grants of it;
- ``framing``: a session through an honest node, audits of it, and a report that the
  auditors (the sybil signing as itself, or forging the auditor granted) saw other rows;
- ``line``: one API key, spelled another way by each sybil, two completions at a time each,
  to fill the gateway's line (the two spellings with trailing spaces never leave: the HTTP
  client refuses to send them, which counts as ``LocalProtocolError``).

Figures: honest requests completed (goal 100 %), honest TTFT p50 (goal: under attack at
most 1.5x quiet), honest nodes excluded or no longer admitted (goal 0), what each attack
was answered, an honest joiner's placement, the CPU each process spent, and the swarm
tracker's RSS.

Memory, on a separate tracker (the same ``Tracker`` and HTTP app, in a subprocess of its
own so that its RSS is its alone, on the allocator ``noderuntime tracker`` runs on), first:
200 registrations to warm it, its RSS, then 100,000 throwaway registrations (``--quick``:
10,000) over HTTP, then their expiry (the tracker's own ``expire`` with its clock an hour
ahead, as its loop does once three heartbeat intervals pass: 180 s at that size). Once the
replay window of their signatures (60 s) has passed, while the swarm runs, one signed
request prunes the replay cache, the tracker's sweep runs, and RSS is taken again, and after
a full collection. Goal: within 10 % of before. A last figure, after a ``malloc_trim``,
tells memory the allocator keeps from memory still held. And what a tracker on the default
settings (no probe references, no manifest) makes of the layer vote, in process.

The attackers share this machine's cores with the swarm: what they spend (signing, HTTP)
is CPU the honest nodes do not get, which a real attacker's machines would not take.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks import _common
from benchmarks.burst import stream_chat
from benchmarks.serving import DEFAULT_SYSTEM, PROMPTS, system_message
from benchmarks.sybils import (
    ATTACKER_KEY,
    LINE_STREAMS,
    MAX_TOKENS,
    PACE,
    ROLES,
    ROUTE_PACE,
    STAMPS,
    attack_process,
    post,
    registration,
)
from noderuntime.operations.memory import ALLOCATOR_ENV, release_free_pages, system_allocator_environ
from noderuntime.testing.clusters import local_gateway_args

NAME = "adversaries"
RANGES = ((0, 10), (10, 20), (20, 30))
COPIES = 2  # nodes per range: two routes of three shards
NODE_SLOTS = 4
CTX = 512
HONEST_CLIENTS = 4
RUNNING_PER_KEY = 2
SYBILS, QUICK_SYBILS = 100, 35
REQUESTS, QUICK_REQUESTS = 12, 3  # per honest client and phase
REGISTRATIONS, QUICK_REGISTRATIONS = 100_000, 10_000
ATTACK_HEAD_START = 3.0  # seconds the attacks run before the honest load begins
SETTLE_S = 5.0  # seconds after an attacked phase before the next
# the lanes under attack: all attacks at once, and (to tell their effects apart) those that take no route grant
LANES = {
    "attack": ROLES,
    "attack_without_route_grants": ("huge_numbers", "layer_vote", "placement", "line"),
}
REGISTER_WORKERS = 8
SIGNATURE_WINDOW_S = 61.0  # access.signing.WINDOW_MS and a second
WARM_REGISTRATIONS = 200


# --- the honest side


async def _honest_request(url: str, model: str, key: str, prompt: str) -> dict[str, Any]:
    """One streamed chat under ``key``: its status, TTFT and tokens, or its error."""
    async with httpx.AsyncClient(timeout=300, headers={"authorization": f"Bearer {key}"}) as client:
        done = await stream_chat(client, url, model, prompt, MAX_TOKENS)
    arrivals = done["arrivals"]
    error = done["error"] or ("" if arrivals or done["status"] != 200 else "no token")
    ttft = arrivals[0] - done["started"] if arrivals and not done["error"] else None
    return {"status": done["status"], "error": error, "ttft": ttft, "tokens": len(arrivals)}


async def _honest_load(url: str, model: str, keys: list[str], requests_each: int) -> list[dict[str, Any]]:
    """Each key's client sends ``requests_each`` requests one after another, all clients at once."""
    results: list[dict[str, Any]] = []

    async def client(i: int, key: str) -> None:
        for r in range(requests_each):
            results.append(await _honest_request(url, model, key, PROMPTS[(i + r) % len(PROMPTS)]))

    async with trio.open_nursery() as nursery:
        for i, key in enumerate(keys):
            nursery.start_soon(client, i, key)
    return results


def _summary(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    completed = [r for r in results if r["status"] == 200 and not r["error"]]
    ttft = sorted(r["ttft"] for r in completed)
    return {
        "requests": len(results),
        "completed": len(completed),
        "completed_share": round(len(completed) / len(results), 4) if results else None,
        "not_completed": dict(
            collections.Counter(f"{r['status']}: {r['error'][:80]}" for r in results if r not in completed)
        ),
        "ttft_p50_ms": round(_common.percentile(ttft, 50) * 1e3, 1) if ttft else None,
        "ttft_p95_ms": round(_common.percentile(ttft, 95) * 1e3, 1) if ttft else None,
        "ttft_max_ms": round(max(ttft) * 1e3, 1) if ttft else None,
        "ttft_ms_sorted": [round(t * 1e3, 1) for t in ttft],
        "tokens": sum(r["tokens"] for r in results),
        "wall_s": round(wall, 2),
    }


def _get(url: str) -> dict[str, Any]:
    answer = httpx.get(url, timeout=30)
    answer.raise_for_status()
    data: dict[str, Any] = answer.json()
    return data


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid``."""
    _, user, system = _common.stat_cpu(f"/proc/{pid}/stat")
    return user + system


def _honest_placement(tracker: str, artifact: str, n_layer: int) -> dict[str, Any]:
    """Where the tracker would place an honest joiner now (a fresh key, its reservation freed at once)."""
    from noderuntime.access.identity import Identity
    from noderuntime.access.signing import sign

    me = Identity.generate()
    asked = json.dumps(
        {"node_id": me.node_id.hex(), "artifact": artifact, "n_layer": n_layer, "max_layers": 10}
    ).encode()
    headers = {"content-type": "application/json", **sign(me, "POST", "/v1/placement", asked, STAMPS.now_ms())}
    answer = httpx.post(tracker + "/v1/placement", content=asked, headers=headers, timeout=30)
    leave = json.dumps({"node_id": me.node_id.hex()}).encode()
    headers = {"content-type": "application/json", **sign(me, "POST", "/v1/nodes/leave", leave, STAMPS.now_ms())}
    httpx.post(tracker + "/v1/nodes/leave", content=leave, headers=headers, timeout=30)
    placed = answer.json().get("layers") if answer.status_code == 200 else None
    return {"status": answer.status_code, "layers": placed}


def _honest_nodes(tracker: str, honest: list[str]) -> dict[str, Any]:
    """What the tracker says of the honest nodes: listed, admitted, excluded by audit."""
    listed = {n["node_id"]: n for n in _get(tracker + "/v1/nodes")["nodes"]}
    excluded = [n for n in honest if n not in listed or not listed[n]["admitted"] or listed[n]["audit_failed"]]
    return {"honest": len(honest), "excluded_or_not_admitted": len(excluded), "which": [n[:12] for n in excluded]}


def _attacked_phase(
    swarm: dict[str, Any],
    sybils: int,
    roles: tuple[str, ...],
    keys: list[str],
    requests_each: int,
    pids: dict[str, int],
) -> dict[str, Any]:
    """The honest load while the sybils of ``roles`` attack (the others idle), from their process."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    attacker = ctx.Process(target=attack_process, args=(child, swarm, sybils, roles))
    attacker.start()
    cpu = {name: _cpu_s(pid) for name, pid in pids.items()}
    try:
        parent.recv()  # started
        time.sleep(ATTACK_HEAD_START)
        placement = _honest_placement(swarm["tracker"], swarm["artifact"], swarm["n_layer"])
        began = time.perf_counter()
        attacked = trio.run(_honest_load, swarm["gateway"], swarm["model"], keys, requests_each)
        figures = _summary(attacked, time.perf_counter() - began)
    finally:
        parent.send("stop")
        answers = parent.recv() if parent.poll(60) else {}
        attacker.join(30)
    seconds = answers.pop("_seconds", None)
    figures["honest_joiner_placement"] = placement
    figures["cpu_s"] = {
        "attackers": round(answers.pop("_cpu_s", 0.0), 1),
        **{name: round(_cpu_s(pid) - cpu[name], 1) for name, pid in pids.items()},
        "attack_seconds": round(seconds, 1) if seconds else None,
    }
    figures["attacks"] = {role: answer for role, answer in answers.items() if answer["sybils"]}
    return figures


def swarm_phases(root: Path, sybils: int, requests_each: int) -> dict[str, Any]:
    """The real swarm, its quiet phase and its attacked one."""
    from noderuntime.models import catalogue as models
    from noderuntime.services.cluster import ManagedProcess, start_all, stop_all
    from noderuntime.services.ready import GatewayReady, NodeReady, TrackerReady, expect

    model = models.pull(models.DEMO_MODEL, progress=False)
    refs = root / "refs.json"
    ranges = ",".join(f"{a}:{b}" for a, b in RANGES)
    subprocess.run(
        [
            *(sys.executable, "-m", "noderuntime", "probe", "reference", "--model", str(model)),
            *("--ranges", ranges, "--threads", "1", "--out", str(refs)),
        ],
        check=True,
        capture_output=True,
    )
    keys = [f"sk-honest-{i}" for i in range(HONEST_CLIENTS)]
    (root / "keys").write_text("\n".join([*keys, ATTACKER_KEY]) + "\n")
    processes: list[ManagedProcess] = []
    try:
        tracker = ManagedProcess(
            "tracker",
            [
                *("tracker", "--local-swarm", "--listen", "127.0.0.1:0", "--data-dir", str(root / "t")),
                *("--probe-references", str(refs), "--require-probe"),
            ],
        )
        processes.append(tracker)
        ready_tracker = expect(tracker.start(60), TrackerReady)
        tracker_url = ready_tracker.url
        nodes = [
            ManagedProcess(
                f"node{i}{c}",
                [
                    *("up", "--model", str(model), "--layers", f"{a}:{b}", "--listen", "127.0.0.1:0"),
                    *("--tracker", tracker_url, "--data-dir", str(root / f"node{i}{c}")),
                    *("--slots", str(NODE_SLOTS), "--ctx", str(CTX), "--threads", "1"),
                ],
            )
            for i, (a, b) in enumerate(RANGES)
            for c in range(COPIES)
        ]
        processes += nodes
        honest = [expect(info, NodeReady).node_id for info in start_all(nodes, timeout=180)]
        deadline = time.monotonic() + 120
        while _honest_nodes(tracker_url, honest)["excluded_or_not_admitted"]:  # each answers its probe
            if time.monotonic() > deadline:
                raise RuntimeError(f"honest nodes not admitted: {_honest_nodes(tracker_url, honest)}")
            time.sleep(0.5)
        gateway = ManagedProcess(
            "gateway",
            [
                *local_gateway_args(root / "gateway", tracker_url, f"smol={model}"),
                *("--api-key-file", str(root / "keys"), "--running-per-key", str(RUNNING_PER_KEY)),
            ],
        )
        processes.append(gateway)
        gateway_url = expect(gateway.start(60), GatewayReady).url
        described = _get(tracker_url + "/v1/nodes")["nodes"][0]
        swarm = {
            "tracker": tracker_url,
            "gateway": gateway_url,
            "model": "smol",
            "artifact": described["artifact"],
            "recipe": described["recipe"],
            "n_layer": described["n_layer"],
            "ranges": [list(r) for r in RANGES],
        }
        warm = trio.run(_honest_load, gateway_url, "smol", keys, 1)  # nothing cold is measured
        if any(r["error"] for r in warm):
            raise RuntimeError(f"the swarm does not serve: {warm}")
        pids = {"tracker": tracker.pid, "gateway": gateway.pid}
        figures: dict[str, Any] = {"tracker_rss_bytes": {"start": _rss(pids["tracker"])}}
        cpu = {name: _cpu_s(pid) for name, pid in pids.items()}
        placement = _honest_placement(tracker_url, swarm["artifact"], swarm["n_layer"])
        began = time.perf_counter()
        quiet = trio.run(_honest_load, gateway_url, "smol", keys, requests_each)
        figures["quiet"] = _summary(quiet, time.perf_counter() - began) | {"honest_joiner_placement": placement}
        figures["quiet"]["cpu_s"] = {name: round(_cpu_s(pid) - cpu[name], 1) for name, pid in pids.items()}
        figures["tracker_rss_bytes"]["after_quiet"] = _rss(pids["tracker"])
        for lane, roles in LANES.items():
            figures[lane] = _attacked_phase(swarm, sybils, roles, keys, requests_each, pids)
            figures[lane]["honest_nodes_after"] = _honest_nodes(tracker_url, honest)
            figures[lane]["shape_after"] = _get(tracker_url + "/v1/artifacts")["artifacts"].get(swarm["artifact"])
            figures["tracker_rss_bytes"]["after_" + lane] = _rss(pids["tracker"])
            time.sleep(SETTLE_S)  # the sybils' last requests end, their grants' slots are beaten free
        figures["honest_nodes_at_end"] = _honest_nodes(tracker_url, honest)
        figures["sybils_listed_at_end"] = len(_get(tracker_url + "/v1/nodes")["nodes"]) - len(honest)
        return figures
    finally:
        stop_all(processes)


# --- memory: 100,000 throwaway registrations, and their expiry


def rss_tracker_main() -> None:
    """A tracker (default settings) on loopback for the memory part; commands on stdin, answers on stdout.

    ``stats``: its RSS and what it keeps; ``expire``: drop what expired with the clock an hour
    ahead (what its own loop does once the nodes' intervals pass); ``gc``: a full collection.
    """
    from noderuntime.access.identity import Identity
    from noderuntime.operations.httpserve import serve_http
    from noderuntime.tracker.app import Tracker

    tracker = Tracker(Identity.generate())

    def stats() -> dict[str, Any]:
        signers, digests = tracker.signatures.statistics()
        return {
            "rss_bytes": _rss(os.getpid()),
            "peak_rss_bytes": _common.peak_rss(os.getpid()),
            "allocated_blocks": sys.getallocatedblocks(),
            "nodes": len(tracker.state.nodes),
            "challenges": len(tracker.challenges),
            "last_probed": len(tracker.last_probed),
            "joined": len(tracker.joined),
            "reservations": len(tracker.placement.reservations),
            "signers": signers,
            "digests": digests,
        }

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
            print(json.dumps({"url": url}), flush=True)
            while True:
                command = (await trio.to_thread.run_sync(sys.stdin.readline)).strip()
                if command in ("", "quit"):
                    break
                if command == "expire":
                    tracker.expire(time.time() + 3600)
                elif command == "gc":
                    gc.collect()
                elif command == "trim":  # glibc gives the free pages of its heaps back (a diagnostic)
                    release_free_pages()
                print(json.dumps(stats()), flush=True)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _register_many(url: str, count: int) -> float:
    """``count`` throwaway nodes register (fresh keys, signed capability and request); the seconds it took."""
    from noderuntime.access.identity import Identity
    from noderuntime.access.signing import sign

    swarm = {"artifact": "ab" * 32, "recipe": "0123456789abcdef"}
    left = count
    began = time.monotonic()

    async def worker(w: int) -> None:
        nonlocal left
        async with httpx.AsyncClient(timeout=60) as client:
            while left > 0:
                left -= 1
                me = Identity.generate()
                # public addresses: this tracker's swarm is not declared local (nothing dials them)
                body = json.dumps(registration(me, swarm, (0, 30), 30, f"11.{w}.0.1:7000")).encode()
                headers = {"content-type": "application/json"}
                headers |= sign(me, "POST", "/v1/nodes/register", body, STAMPS.now_ms())
                answer = await client.post(url + "/v1/nodes/register", content=body, headers=headers)
                if answer.status_code != 200:
                    raise RuntimeError(f"a throwaway registration was refused: {answer.status_code} {answer.text}")

    async with trio.open_nursery() as nursery:
        for w in range(REGISTER_WORKERS):
            nursery.start_soon(worker, w)
    return time.monotonic() - began


def _signed_leave(url: str) -> int:
    """One signed request (a stranger leaving): the tracker prunes its replay cache as it checks it."""
    from noderuntime.access.identity import Identity
    from noderuntime.access.signing import sign

    me = Identity.generate()
    body = json.dumps({"node_id": me.node_id.hex()}).encode()
    headers = {"content-type": "application/json", **sign(me, "POST", "/v1/nodes/leave", body, STAMPS.now_ms())}
    return httpx.post(url + "/v1/nodes/leave", content=body, headers=headers, timeout=30).status_code


class Memory:
    """The separate tracker of the memory part: its RSS before many throwaway registrations, with them, and
    after they expired.

    :meth:`register` fills it and lets the nodes expire; :meth:`finish`, once the replay window of
    their signatures has passed (the swarm's phases run meanwhile; this tracker idles), prunes it
    and measures again.
    """

    def __init__(self) -> None:
        # on the allocator `noderuntime tracker` re-executes itself on (operations.memory)
        environ = system_allocator_environ() or dict(os.environ)
        self.allocator = environ.get(ALLOCATOR_ENV, "pymalloc")
        self.child = subprocess.Popen(
            [sys.executable, "-c", "from benchmarks.adversaries import rss_tracker_main; rss_tracker_main()"],
            cwd=Path(__file__).resolve().parents[1],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=environ,
        )
        self.url = json.loads(self._line())["url"]
        self.figures: dict[str, Any] = {}
        self.expired_at = 0.0

    def _line(self) -> str:
        assert self.child.stdout is not None
        return self.child.stdout.readline()

    def ask(self, command: str) -> dict[str, Any]:
        """Send one command to the tracker's process (see :func:`rss_tracker_main`); what it answers."""
        assert self.child.stdin is not None
        self.child.stdin.write(command + "\n")
        self.child.stdin.flush()
        answer: dict[str, Any] = json.loads(self._line())
        return answer

    def register(self, registrations: int) -> None:
        """A warm-up (the same requests: lazy imports, caches), RSS before, the registrations, their expiry."""
        trio.run(_register_many, self.url, WARM_REGISTRATIONS)
        self.ask("expire")
        before = self.ask("gc")
        seconds = trio.run(_register_many, self.url, registrations)
        self.figures = {
            "tracker": "a subprocess of its own: noderuntime.tracker.app.Tracker with its defaults, served over "
            "HTTP on loopback (benchmarks.adversaries.rss_tracker_main), without its expiry loop: every "
            "registration stays until the expiry step, as if all beat; the registrations come from this process",
            "python_allocator": self.allocator,
            "registrations": registrations,
            "warm_up_registrations_before": WARM_REGISTRATIONS,
            "registration_seconds": round(seconds, 1),
            "registrations_per_s": round(registrations / seconds, 1),
            "before": before,
            "registered": self.ask("stats"),
            "after_expiry": self.ask("expire"),
        }
        self.expired_at = time.monotonic()

    def finish(self) -> dict[str, Any]:
        """After the signature window: one signed request prunes the replay cache; RSS after, and after a
        full collection. The figures; the tracker's process ends."""
        time.sleep(max(0.0, self.expired_at + SIGNATURE_WINDOW_S - time.monotonic()))
        status = _signed_leave(self.url)
        # the sweep the tracker's loop runs within a second of it
        self.figures["after_the_signature_window"] = self.ask("expire") | {"pruning_request_status": status}
        self.figures["after_gc"] = self.ask("gc")
        # not what the goal is judged on: how much of what stays is free memory the allocator keeps
        self.figures["after_gc_and_malloc_trim"] = self.ask("trim")
        after, before = self.figures["after_gc"]["rss_bytes"], self.figures["before"]["rss_bytes"]
        self.figures["rss_after_over_before"] = round(after / before, 4)
        self.close()
        return self.figures

    def close(self) -> None:
        """End the tracker's process (idempotent)."""
        if self.child.poll() is None:
            with contextlib.suppress(OSError):
                assert self.child.stdin is not None
                self.child.stdin.write("quit\n")
                self.child.stdin.flush()
            try:
                self.child.wait(30)
            except subprocess.TimeoutExpired:
                self.child.kill()


def default_tracker_layer_vote() -> dict[str, Any]:
    """A tracker on the default settings (no probe references, no manifest): two honest nodes of the
    30-layer demo model, each sending the proof of its shape that real nodes send, and three sybils
    claiming 31. What the tracker shows, and whom a route goes through."""
    from noderuntime.access.identity import Identity
    from noderuntime.models import artifacts
    from noderuntime.models import catalogue as models
    from noderuntime.operations.httpserve import serve_http
    from noderuntime.services.noderun import shape_proof
    from noderuntime.tracker.app import Tracker

    info = artifacts.inspect(models.pull(models.DEMO_MODEL, progress=False))
    proof = shape_proof(info)
    assert proof is not None, "the demo model gives a proof of its shape"
    swarm = {"artifact": info.fingerprint, "recipe": "0123456789abcdef"}

    async def main() -> dict[str, Any]:
        tracker = Tracker(Identity.generate())
        async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=30) as client:
            url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
            honest = [Identity.generate() for _ in range(2)]
            for me, layers in zip(honest, ((0, 15), (15, 30)), strict=True):
                body = registration(me, swarm, layers, 30, "11.0.0.1:1") | {"shape": proof.model_dump(mode="json")}
                await post(client, url, "/v1/nodes/register", body, me)
            statuses = []
            for layers in ((0, 16), (16, 31), (0, 31)):
                me = Identity.generate()
                body = registration(me, swarm, layers, 31, "11.0.0.2:1")
                statuses.append((await post(client, url, "/v1/nodes/register", body, me)).status_code)
            route = await post(client, url, "/v1/routes", {"artifact": swarm["artifact"], "tokens": 100})
            shown = (await client.get(url + "/v1/artifacts")).json()["artifacts"][swarm["artifact"]]
            nursery.cancel_scope.cancel()
        ids = {me.node_id.hex() for me in honest}
        hops = [h["node_id"] for h in route.json().get("hops", [])] if route.status_code == 200 else []
        return {
            "sybil_registrations": statuses,
            "n_layer_shown": shown["n_layer"],
            "route_status": route.status_code,
            "route_through_honest_nodes_only": bool(hops) and all(h in ids for h in hops),
        }

    return trio.run(main)


def goals(figures: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, each against what was measured (all attacks at once; the diagnostic lane aside)."""
    quiet, attack = figures["quiet"], figures["attack"]
    ratio = attack["ttft_p50_ms"] / quiet["ttft_p50_ms"] if attack["ttft_p50_ms"] and quiet["ttft_p50_ms"] else None
    rss = figures["memory"]["rss_after_over_before"]
    return {
        "honest_completed_share_quiet": quiet["completed_share"],
        "honest_completed_share_attack": attack["completed_share"],
        "honest_completed_100_percent": quiet["completed_share"] == attack["completed_share"] == 1.0,
        "ttft_p50_attack_over_quiet": round(ratio, 3) if ratio is not None else None,
        "ttft_p50_within_1_5x": ratio is not None and ratio <= 1.5,
        "honest_nodes_excluded": figures["honest_nodes_at_end"]["excluded_or_not_admitted"],
        "tracker_rss_after_over_before": rss,
        "tracker_rss_within_10_percent": abs(rss - 1) <= 0.10,
    }


def plot(path: Path, figures: dict[str, Any], sybils: int) -> Path:
    """The honest requests' TTFT in each phase, in order (a PNG beside the JSON)."""
    return _common.plot(
        path,
        f"Honest TTFT, quiet and under {sybils} sybils",
        "share of the honest requests completed",
        "TTFT (ms)",
        {
            phase: ([(i + 1) / len(ttft) for i in range(len(ttft))], ttft)
            for phase in ("quiet", *LANES)
            for ttft in (figures[phase]["ttft_ms_sorted"],)
        },
    )


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(NAME, __doc__ or "")
    args = p.parse_args(argv)
    sybils = QUICK_SYBILS if args.quick else SYBILS
    requests_each = QUICK_REQUESTS if args.quick else REQUESTS
    registrations = QUICK_REGISTRATIONS if args.quick else REGISTRATIONS
    memory = Memory()
    try:
        # first, so that the replay window of the registrations' signatures passes while the swarm runs
        memory.register(registrations)
        with tempfile.TemporaryDirectory(prefix="adversaries-") as tmp:
            figures = swarm_phases(Path(tmp), sybils, requests_each)
        figures["memory"] = memory.finish()
    finally:
        memory.close()
    figures["default_tracker_layer_vote"] = default_tracker_layer_vote()
    figures["goals"] = goals(figures)
    recipe = {
        "model": "SmolLM2-135M-Instruct Q4_1 (the demo model), 30 layers",
        "swarm": f"{COPIES * len(RANGES)} nodes: layers {', '.join(f'{a}:{b}' for a, b in RANGES)}, {COPIES} each; "
        f"--slots {NODE_SLOTS} --ctx {CTX} --threads 1",
        "tracker": "noderuntime tracker --probe-references (the three ranges, noderuntime probe reference) "
        "--require-probe; otherwise its defaults",
        "gateway": f"noderuntime gateway --api-key-file ({HONEST_CLIENTS} honest keys and the attacker's) "
        f"--running-per-key {RUNNING_PER_KEY}; otherwise its defaults",
        "honest_load": f"{HONEST_CLIENTS} clients, each its own key, {requests_each} streamed chats each one after "
        f"another per phase, max_tokens {MAX_TOKENS}, temperature 0, a unique system message",
        "sybils": sybils,
        "roles": {role: sum(1 for k in range(sybils) if ROLES[k % len(ROLES)] == role) for role in ROLES},
        "lanes": {lane: list(roles) for lane, roles in LANES.items()},
        "pace_s": PACE,
        "route_flood_pace_s": ROUTE_PACE,
        "line_streams_per_sybil": LINE_STREAMS,
        "attack_head_start_s": ATTACK_HEAD_START,
        "system_message": system_message("unique").replace(DEFAULT_SYSTEM, "<SmolLM2's default system message>"),
        "registrations": registrations,
        "note": "attackers, swarm and tracker share this machine's cores",
    }
    out = _common.out_path(NAME, args)
    _common.write(out, NAME, args, recipe, figures)
    png = out.with_suffix(".png")
    phases = ("quiet", *LANES)
    plot(png, figures, sybils)
    rows = [
        [phase, f"{f['completed']}/{f['requests']}", f["ttft_p50_ms"], f["ttft_p95_ms"], f["ttft_max_ms"]]
        for phase in phases
        for f in (figures[phase],)
    ]
    print(_common.table(["phase", "honest completed", "TTFT p50 ms", "p95 ms", "max ms"], rows))
    attacks = [
        [role, a["sybils"], a["requests_per_s"], json.dumps(a["answers"])]
        for role, a in figures["attack"]["attacks"].items()
    ]
    print(_common.table(["attack", "sybils", "req/s", "answers"], attacks))
    mem = figures["memory"]
    print(
        f"honest nodes excluded: {figures['goals']['honest_nodes_excluded']}; tracker RSS "
        f"{mem['before']['rss_bytes'] / 2**20:.1f} MiB before {registrations:,} registrations, "
        f"{mem['registered']['rss_bytes'] / 2**20:.1f} MiB with them, {mem['after_gc']['rss_bytes'] / 2**20:.1f} MiB "
        f"after they expired (x{mem['rss_after_over_before']})"
    )
    print(json.dumps(figures["goals"]))
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
