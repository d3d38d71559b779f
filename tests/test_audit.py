"""Audits catch nodes that compute something else than their recipe, and never an honest one.

A real swarm of a tiny random Qwen3 (4 layers, two ranges): a tracker, a gateway that
audits every session (``--audit-rate 1``), two honest nodes for the first range and three
for the second; the first honest node is the tracker's referee. Each test starts one cheater
for the first range (``tests/cheating_node.py``: another quantization, a skipped layer, noise
on one decode step in a hundred, another session's activations replayed), sends requests until the
tracker has excluded it (two auditors and the referee agreeing), and checks what everyone
says: the tracker's reason, the gateway's ledger (the cheater's records of the audited
request disputed), and that no honest node was ever judged against.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from noderuntime.control.ledger import Ledger
from noderuntime.models import synth
from noderuntime.testing.audits import FIRST, SHAPE, AuditSwarm, get_json, running_audit_swarm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuditSwarm]:
    with running_audit_swarm(tmp_path_factory.mktemp("audit"), audit_rate=1, slots=4) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def cheaper(swarm: AuditSwarm) -> Path:
    """The swarm's weights in Q4_0."""
    return synth.write_model(swarm.root / "tiny-q4.gguf", SHAPE, quant="Q4_0", seed=5)


def test_honest_replies_of_any_length_pass_their_audits(swarm: AuditSwarm) -> None:
    """A one-token reply too: its audit is the prompt alone, with nothing teacher-forced after it."""
    before = swarm.audits()
    rng = random.Random("lengths")
    for max_tokens in (1, 2, 1, 5):
        assert swarm.ask(rng, max_tokens=max_tokens).status_code == 200
    deadline = time.monotonic() + 30
    while (after := swarm.audits())["audited"] - before["audited"] < 4:
        assert after["skipped_error"] == before["skipped_error"], after
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    assert after["passed"] - before["passed"] == 8 and after["failed"] == before["failed"], after


@pytest.mark.parametrize("cheat", ["quant", "skip", "noise", "replay"])
def test_a_cheating_node_is_caught_by_audits_and_excluded(swarm: AuditSwarm, cheaper: Path, cheat: str) -> None:
    how = f"quant={cheaper}" if cheat == "quant" else cheat
    cheater, node_id = swarm.start_node(f"cheat-{cheat}", FIRST, before=[how], module="tests.cheating_node")
    rng = random.Random(cheat)
    started = time.monotonic()
    asked = 0
    while not swarm.nodes()[node_id]["audit_failed"]:
        assert asked < 60, f"the {cheat} cheater was not caught in {asked} requests: {swarm.nodes()[node_id]}"
        assert swarm.ask(rng).status_code == 200
        asked += 1
        time.sleep(0.2)  # the audits run after each request, in the background
    caught = swarm.nodes()[node_id]
    assert not caught["admitted"] and "auditors" in caught["audit_failed"] and "referee" in caught["audit_failed"]
    assert caught["audits"]["failed"] >= 1
    # its records of the audited request are disputed in the gateway's ledger, and not counted
    disputed = Ledger(swarm.ledger).totals()["disputed"]
    assert any(d["node_id"] == node_id for d in disputed)
    # no honest node was ever judged against; an auditor a cheater outvoted is not an honest one
    for honest in swarm.honest:
        standing = swarm.nodes()[honest]
        assert not standing["audit_failed"] and standing["audits"]["failed"] == 0, standing
    # it stays out, and the swarm serves on without it
    assert [swarm.ask(rng).status_code for _ in range(3)] == [200] * 3
    assert node_id in swarm.audits()["excluded"]
    # the swarm map's node list and `noderuntime status` say why it is out
    all_nodes = get_json(swarm.tracker + "/v1/status/nodes?state=all&limit=200")["nodes"]
    listed = {n["node_id"]: n for n in all_nodes}
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
