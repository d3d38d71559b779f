"""Audits catch nodes that compute something else than their recipe, and never an honest one.

A real swarm of a tiny random Qwen3 (4 layers, two ranges): a tracker, a gateway that
audits every session (``--audit-rate 1``), two honest nodes for the first range and three
for the second. Each test starts one cheater for the first range (``tests/cheating_node.py``:
another quantization, a skipped layer, noise on one step in a hundred, another session's
activations replayed), sends requests until the tracker has excluded it, and checks what
everyone says: the tracker's reason, the gateway's ledger (the cheater's records of the
audited request disputed), and that no honest node was ever judged against.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from noderuntime.control.ledger import Ledger
from noderuntime.models import synth
from noderuntime.services.cluster import ManagedProcess, start_all, stop_all
from noderuntime.services.ready import GatewayReady, NodeReady, TrackerReady, expect

pytestmark = pytest.mark.slow

SHAPE = synth.TINY_SHAPES["qwen3"]  # 4 layers
FIRST, SECOND = "0:2", "2:4"


@attrs.define
class Swarm:
    root: Path
    model: Path
    cheaper: Path  # the same weights in Q4_0
    tracker: str
    gateway: str
    ledger: Path
    processes: list[ManagedProcess]
    honest: list[str]  # node ids

    def node_args(self, name: str, layers: str) -> list[str]:
        return [
            "up",
            "--model",
            str(self.model),
            "--layers",
            layers,
            "--listen",
            "127.0.0.1:0",
            "--tracker",
            self.tracker,
            "--data-dir",
            str(self.root / name),
            "--slots",
            "4",
            "--ctx",
            "256",
            "--threads",
            "1",
        ]

    def nodes(self) -> dict[str, dict[str, Any]]:
        with urllib.request.urlopen(self.tracker + "/v1/nodes", timeout=10) as response:
            return {n["node_id"]: n for n in json.loads(response.read())["nodes"]}

    def ask(self, rng: random.Random, length: int = 24, max_tokens: int = 12) -> int:
        prompt = [rng.randrange(3, SHAPE.n_vocab) for _ in range(length)]
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": rng.randrange(1000),
        }
        return httpx.post(self.gateway + "/v1/completions", json=body, timeout=60).status_code


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    root = tmp_path_factory.mktemp("audit")
    model = synth.write_model(root / "tiny-q8.gguf", SHAPE, quant="Q8_0", seed=5)
    cheaper = synth.write_model(root / "tiny-q4.gguf", SHAPE, quant="Q4_0", seed=5)
    tracker = ManagedProcess("tracker", ["tracker", "--listen", "127.0.0.1:0", "--data-dir", str(root / "tracker")])
    processes = [tracker]
    try:
        url = expect(tracker.start(60), TrackerReady).url
        swarm = Swarm(root, model, cheaper, url, "", root / "ledger.sqlite", processes, [])
        nodes = [ManagedProcess(f"h{i}", swarm.node_args(f"h{i}", FIRST if i < 2 else SECOND)) for i in range(5)]
        processes += nodes
        swarm.honest = [expect(line, NodeReady).node_id for line in start_all(nodes)]
        gateway = ManagedProcess(
            "gateway",
            [
                "gateway",
                "--tracker",
                url,
                "--listen",
                "127.0.0.1:0",
                "--model",
                f"tiny={model}",
                "--ctx",
                "256",
                "--audit-rate",
                "1",
                "--ledger",
                str(swarm.ledger),
            ],
        )
        processes.append(gateway)
        swarm.gateway = expect(gateway.start(60), GatewayReady).url
        yield swarm
    finally:
        stop_all(processes)


def _audits(swarm: Swarm) -> dict[str, Any]:
    with urllib.request.urlopen(swarm.gateway + "/status", timeout=10) as response:
        audits: dict[str, Any] = json.loads(response.read())["audits"]
        return audits


def test_honest_replies_of_any_length_pass_their_audits(swarm: Swarm) -> None:
    """A one-token reply too: its audit is the prompt alone, with nothing teacher-forced after it."""
    before = _audits(swarm)
    rng = random.Random("lengths")
    for max_tokens in (1, 2, 1, 5):
        assert swarm.ask(rng, max_tokens=max_tokens) == 200
    deadline = time.monotonic() + 30
    while (after := _audits(swarm))["audited"] - before["audited"] < 4:
        assert after["skipped_error"] == before["skipped_error"], after
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    assert after["passed"] - before["passed"] == 8 and after["failed"] == before["failed"], after


@pytest.mark.parametrize("cheat", ["quant", "skip", "noise", "replay"])
def test_a_cheating_node_is_caught_by_audits_and_excluded(swarm: Swarm, cheat: str) -> None:
    how = f"quant={swarm.cheaper}" if cheat == "quant" else cheat
    cheater = ManagedProcess(
        f"cheat-{cheat}", [how, *swarm.node_args(f"cheat-{cheat}", FIRST)], module="tests.cheating_node"
    )
    swarm.processes.append(cheater)
    node_id = expect(cheater.start(60), NodeReady).node_id
    rng = random.Random(cheat)
    started = time.monotonic()
    asked = 0
    while not swarm.nodes()[node_id]["audit_failed"]:
        assert asked < 60, f"the {cheat} cheater was not caught in {asked} requests: {swarm.nodes()[node_id]}"
        assert swarm.ask(rng) == 200
        asked += 1
        time.sleep(0.2)  # the audits run after each request, in the background
    caught = swarm.nodes()[node_id]
    assert not caught["admitted"] and "auditors" in caught["audit_failed"]
    assert caught["audits"]["failed"] >= 1
    # its records of the audited request are disputed in the gateway's ledger, and not counted
    disputed = Ledger(swarm.ledger).totals()["disputed"]
    assert any(d["node_id"] == node_id for d in disputed)
    # no honest node was ever judged against; an auditor a cheater outvoted is not an honest one
    for honest in swarm.honest:
        standing = swarm.nodes()[honest]
        assert not standing["audit_failed"] and standing["audits"]["failed"] == 0, standing
    # it stays out, and the swarm serves on without it
    assert [swarm.ask(rng) for _ in range(3)] == [200] * 3
    assert node_id in _audits(swarm)["excluded"]
    # the swarm map's node list and `noderuntime status` say why it is out
    with urllib.request.urlopen(swarm.tracker + "/v1/status/nodes?state=all&limit=200", timeout=10) as response:
        listed = {n["node_id"]: n for n in json.loads(response.read())["nodes"]}
    assert "auditors" in listed[node_id]["audit_failed"] and not listed[node_id]["admitted"]
    shown = subprocess.run(
        [sys.executable, "-m", "noderuntime", "status", "--tracker", swarm.tracker],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert f"{node_id[:12]} is excluded from routes by audits" in shown, shown
    print(f"{cheat}: caught after {asked} requests, {time.monotonic() - started:.1f} s")
    cheater.stop()
