"""A node the tracker placed moves when the swarm gains by it: it loads its new range beside the old, serves it,
then drains the old, and requests through the gateway all complete meanwhile, each the whole model's reply
(real processes on loopback, real llama.cpp on the demo model); then the tracker holds it down."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from noderuntime.access import identity
from noderuntime.engine import memplan
from noderuntime.engine.llama import Recipe
from noderuntime.models.artifacts import LayerRange
from noderuntime.services import localsystem
from noderuntime.services.cluster import ManagedProcess, start_all, stop_all
from noderuntime.services.ready import GatewayReady, NodeReady, TrackerReady, expect
from noderuntime.services.rebalancing import JITTER, Rebalancing, room
from noderuntime.testing.clusters import local_tracker_args
from noderuntime.tracker.client import request_reconsider
from noderuntime.tracker.messages import RebalanceReply, RebalanceRequest
from noderuntime.tracker.placement import Piece, choose

from . import whole_model

SLOTS, CTX = 2, 1024
SHORT = [{"role": "user", "content": "Count to five."}]
COUNTING = "1, 2, 3, 4,"
LONG = 500  # tokens: the long reply outlasts the joiners' start and the move (about 50 of them) tenfold


def test_a_placed_node_asks_at_its_interval_give_or_take_the_jitter() -> None:
    plan = Rebalancing(15, every=60.0)
    waits = [plan.wait(random.Random(seed)) for seed in range(200)]
    assert all(60.0 * (1 - JITTER) <= w <= 60.0 * (1 + JITTER) for w in waits)
    assert max(waits) - min(waits) > 60.0 * JITTER  # spread: nodes started together ask apart
    for bad in ({"max_layers": 0}, {"max_layers": 3, "every": 0.0}, {"max_layers": 3, "every": float("nan")}):
        with pytest.raises(ValueError):
            Rebalancing(**bad)


def test_a_move_needs_room_for_the_new_range_beside_the_old(smollm2: Path) -> None:
    recipe = memplan.capped(Recipe(n_threads=1, n_ctx_per_seq=CTX, n_seq_max=SLOTS, n_batch=512, n_ubatch=512))
    half = memplan.needs(smollm2, LayerRange(0, 15), recipe).host
    assert room(smollm2, LayerRange(15, 30), LayerRange(0, 15), recipe, 3 * half) == ""
    short = room(smollm2, LayerRange(15, 30), LayerRange(0, 15), recipe, int(1.5 * half))
    assert "beside layers 0:15" in short and "memory limit" in short


def _nodes(tracker_url: str) -> dict[str, Any]:
    return {n["node_id"]: n for n in httpx.get(tracker_url + "/v1/nodes", timeout=10).json()["nodes"]}


def _wait(condition: Callable[[], object], what: str, within: float = 90.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {within:.0f} s"
        time.sleep(0.05)


class _Streamed(threading.Thread):
    """A streamed text completion read in a thread: its text, the gateway's repair records, how it ended."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.text = ""
        self.repairs: list[dict[str, Any]] = []
        self.error: Any = None
        self.done = False
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=600) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    self.error = event.get("error", self.error)
                    self.repairs += event.get("repairs", [])
                    self.text += "".join(c.get("text") or "" for c in event.get("choices", []))


def _index(lines: list[str], *texts: str, after: int = -1) -> int:
    """The index of the first line after ``after`` that holds every one of ``texts``."""
    found = next((i for i, line in enumerate(lines) if i > after and all(t in line for t in texts)), None)
    assert found is not None, f"no line holds {texts} after line {after}:\n" + "\n".join(lines[after + 1 :][-60:])
    return found


@pytest.mark.repairs_expected  # the sessions the old range still serves are handed over: each one a repair
def test_a_placed_node_moves_make_before_break_while_requests_through_the_gateway_complete(
    smollm2: Path, tmp_path: Path
) -> None:
    processes: list[ManagedProcess] = []
    flags = ["--slots", str(SLOTS), "--ctx", str(CTX), "--threads", "1", "--drain-timeout", "10"]
    # what the replies must be: the whole model's, alone (a route composed wrongly after the move still
    # answers, only not this); the long reply cannot end before its length, as no end token can be drawn
    ends = sorted(whole_model.vocabulary(smollm2).eog_tokens)
    long_body = {
        "model": "smol",
        "prompt": COUNTING,
        "max_tokens": LONG,
        "temperature": 0,
        "logit_bias": {str(token): -100 for token in ends},
    }
    long_reference = whole_model.completion(smollm2, COUNTING, LONG, banned=ends)
    short_reference = whole_model.chat_reply(smollm2, SHORT, 24)

    def node(name: str, *extra: str) -> ManagedProcess:
        argv = ["up", "--model", str(smollm2), "--listen", "127.0.0.1:0", "--tracker", tracker_url, *flags, *extra]
        process = ManagedProcess(name, [*argv, "--data-dir", str(tmp_path / name)], keep_lines=None)
        processes.append(process)
        return process

    stop = threading.Event()
    try:
        tracker = ManagedProcess(
            "tracker",
            local_tracker_args(tmp_path / "t", "--expire-after", "5"),
        )
        processes.append(tracker)
        tracker_url = expect(tracker.start(), TrackerReady).url
        # a pinned node on the second half; the placed one, of at most half the model, takes the first
        first = expect(node("first", "--layers", "15:30").start(60), NodeReady)
        mover_process = node("mover", "--max-layers", "15", "--rebalance-every", "1")
        mover = expect(mover_process.start(60), NodeReady)
        assert tuple(mover.layers) == (0, 15)
        localsystem._wait_routable(tracker_url, first.artifact)
        # no audits: every session on the mover is a reply's, each handed-over one repaired by the gateway
        serve = ["--listen", "127.0.0.1:0", "--model", f"smol={smollm2}", "--audit-rate", "0"]
        gateway = ManagedProcess(
            "gateway", ["gateway", "--data-dir", str(tmp_path / "gateway"), "--tracker", tracker_url, *serve]
        )
        processes.append(gateway)
        url = expect(gateway.start(), GatewayReady).url

        # a long reply, in flight through the mover's first range (the only node on it yet) until the move
        in_flight = _Streamed(url, long_body)
        _wait(lambda: len(in_flight.text) > 20 or not in_flight.is_alive(), "the long reply's first tokens")
        # (read as a list: a thread appends to the output meanwhile, which iterating it would trip on)
        opened = [line for line in list(mover_process.output) if " opened: layers" in line]
        assert len(opened) == 1, opened  # its session, the mover's first
        session = opened[0].split("session=", 1)[1].split()[0]

        # requests go on through the gateway, two at a time, for as long as the swarm changes
        results: list[tuple[int, str]] = []

        def ask() -> None:
            body = {"model": "smol", "messages": SHORT, "max_tokens": 24, "temperature": 0}
            while not stop.is_set():
                try:
                    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
                    text = reply.json()["choices"][0]["message"]["content"] if reply.status_code == 200 else reply.text
                    results.append((reply.status_code, text))
                except httpx.HTTPError as exc:
                    results.append((0, str(exc)))

        # two pinned nodes join on the first half: now it is the second half that is thin, and the
        # placed node gains the swarm more than the margin by moving there (the first half stays
        # served). On the first half: the second holds the output head, and a step of its layers
        # takes twice as long (SmolLM2's 49,152-token head), so two nodes on it would not outweigh one
        # there; the margin holds however the two joiners' measurements share the cores
        joiners = [node("second-a", "--layers", "0:15"), node("second-b", "--layers", "0:15")]
        start_all(joiners, timeout=60)
        askers = [threading.Thread(target=ask) for _ in range(2)]
        for asker in askers:
            asker.start()
        _wait(lambda: _nodes(tracker_url)[mover.node_id]["layers"] == [15, 30], "moved at the tracker")
        _wait(lambda: any("moved from layers 0:15 to 15:30" in line for line in list(mover_process.output)), "moved")
        # it serves its new range under its own identity, and its old engine is gone once drained
        status = httpx.get(mover.http + "/status", timeout=10).json()
        assert status["layers"] == [15, 30] and status["node_id"] == mover.node_id
        served = len(results)
        _wait(lambda: len(results) >= served + 4, "four more replies after the move")  # through it and the others
        stop.set()
        for asker in askers:
            asker.join(timeout=90)
        in_flight.join(600)

        # make before break, in the mover's own order of events: told to move, it registered its new
        # range (the tracker routes to it from then on) before its old range handed over the long
        # reply's session, which was still running then
        lines = list(mover_process.output)
        told = _index(lines, "moves this node to layers 15:30")
        registered = _index(lines, "registered with the tracker", after=told)
        draining = _index(lines, "serving layers 15:30; draining layers 0:15", after=registered)
        ended = _index(lines, f"session={session} ", " ended: ")
        assert ended > draining and " ended: node_stopped " in lines[ended], lines[ended]
        drained = _index(lines, "drained:", after=ended)
        _index(lines, "moved from layers 0:15 to 15:30", after=drained)
        # the long reply went on on the nodes that still serve the first half, as if nothing had moved
        assert in_flight.done and in_flight.error is None, (in_flight.error, in_flight.text[-200:])
        (repair,) = in_flight.repairs
        assert "leaving" in repair["failed"] and repair["failed_node"] == mover.node_id[:16], repair
        assert repair["bit_exact"] and in_flight.text == long_reference
        # and every other reply completed, each the whole model's; each session the old range handed
        # over was repaired once, and nothing else was
        wrong = [r for r in results if r != (200, short_reference)]
        assert results and not wrong, (wrong, short_reference)
        handed_over = int(lines[drained].split("drained:")[1].split()[0])
        assert handed_over >= 1
        assert httpx.get(url + "/status", timeout=10).json()["counters"]["repairs"] == handed_over

        # held down: the first half's nodes leave, which a move back would cover (the tracker's own
        # choice for the mover, were it free to move), but the tracker does not say move
        for joiner in joiners:
            joiner.stop()
        _wait(lambda: not _routable(tracker_url, first.artifact), "the first half uncovered")
        assert choose([Piece(15, 30, 1.0)], 30, 15, 1.0).layers == (0, 15)
        reply = trio.run(_reconsider, tracker_url, tmp_path / "mover")
        assert reply.layers is None and reply.hold_seconds > 0, reply
        assert sum("moves this node to layers" in line for line in list(mover_process.output)) == 1
    finally:
        stop.set()
        stop_all(processes)


def _routable(tracker_url: str, artifact: str) -> bool:
    artifacts = httpx.get(tracker_url + "/v1/artifacts", timeout=10).json()["artifacts"]
    return bool(artifacts.get(artifact, {}).get("routable"))


async def _reconsider(tracker_url: str, data_dir: Path) -> RebalanceReply:
    """What the tracker answers the node whose key is in ``data_dir`` when it asks whether to move."""
    me = identity.load_or_create(data_dir)
    async with httpx.AsyncClient() as client:
        return await request_reconsider(
            client, tracker_url, me, RebalanceRequest(node_id=me.node_id.hex(), max_layers=15)
        )
