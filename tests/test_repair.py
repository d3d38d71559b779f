"""Route repair: a generation survives a node leaving mid-reply and goes on byte for byte.

A real local system — tracker, relay, gateway, and two nodes for each of three ranges of
SmolLM2 (0:10, 10:20, 20:30; the last range's nodes reachable only through the relay) —
serves streamed chat completions through the official client's wire format. In each case a
node serving the reply is killed (SIGKILL), hung (SIGSTOP) or drained (SIGTERM) mid-reply,
and the reply must equal, byte for byte, the same request's undisturbed reply: greedy,
seeded sampling, a JSON schema's grammar, logprobs, two choices. The killed node is
started again for the next case. Without the repair (before the gateway resumed sessions,
and before a seeded draw depended on the seed and the position alone) each of these ended
in an error event, or went on with other text.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from noderuntime.services import localsystem
from noderuntime.services.cluster import ManagedProcess
from noderuntime.services.ready import NodeReady, expect

from . import whole_model

pytestmark = pytest.mark.slow

STORY = [{"role": "user", "content": "Tell a long story about a lighthouse keeper and a storm."}]
# a prompt of about 700 tokens: its prefill takes long enough to be caught in
LONG = [{"role": "user", "content": "Summarise, then go on: " + "The keeper climbed the stairs again. " * 90}]
CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "seeded": {
        "temperature": 0.9,
        "top_p": 0.92,
        "top_k": 40,
        "min_p": 0.02,
        "seed": 1234,
        "frequency_penalty": 0.3,
        "presence_penalty": 0.2,
    },
    "grammar": {
        "temperature": 0.7,
        "seed": 7,
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "keeper",
                "schema": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "years": {"type": "integer"},
                        "story": {"type": "string"},
                    },
                    "required": ["name", "years", "story"],
                },
            },
        },
    },
    "logprobs": {"temperature": 0.8, "seed": 99, "logprobs": True, "top_logprobs": 3},
    "two_choices": {"temperature": 0.8, "seed": 5, "n": 2},
    "long_prompt": {"temperature": 0.9, "seed": 21, "messages": LONG},
}
MAX_TOKENS = 80


class Reply(threading.Thread):
    """A streamed chat completion read in a thread: its text per choice, logprobs, repairs, error."""

    def __init__(self, url: str, model: str, options: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.body = {"model": model, "messages": STORY, "max_tokens": MAX_TOKENS, "stream": True, **options}
        self.url = url
        self.text: dict[int, str] = {}
        self.logprobs: list[Any] = []
        self.repairs: list[dict[str, Any]] = []
        self.error: dict[str, Any] | None = None
        self.done = False
        self.arrivals: list[float] = []
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=self.body, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done = True
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    self.error = event["error"]
                    continue
                self.repairs += event.get("repairs", [])
                for choice in event.get("choices", []):
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        self.text[choice["index"]] = self.text.get(choice["index"], "") + delta
                        self.arrivals.append(time.monotonic())
                    if choice.get("logprobs"):
                        self.logprobs += choice["logprobs"]["content"]

    def wait_text(self, chars: int, within: float = 60) -> None:
        deadline = time.monotonic() + within
        while sum(len(t) for t in self.text.values()) < chars:
            assert self.is_alive() and time.monotonic() < deadline, (self.error, self.text)
            time.sleep(0.01)

    def finished(self) -> Reply:
        self.join(120)
        assert not self.is_alive() and self.error is None and self.done, (self.error, self.repairs)
        return self


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[localsystem.LocalSystem]:
    running = localsystem.start(
        listen="127.0.0.1:0",
        data_root=tmp_path_factory.mktemp("repair"),
        cuts=(0, 10, 20, 30),
        replicas=2,
        slots=4,
        ctx=1024,
        quiet=True,
        node_options=("--hang-timeout", "1.5"),
        # no audits: a session a test finds on a node must be its reply's, not an audit replaying another
        gateway_options=("--audit-rate", "0"),
    )
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def references(system: localsystem.LocalSystem) -> dict[str, Reply]:
    """Each case's undisturbed reply, all asked at once (the nodes batch them: a row's bits do not
    depend on its batch-mates, so each is the reply it would be alone)."""
    replies = {name: Reply(system.gateway_url, system.model_id, options) for name, options in CASES.items()}
    return {name: reply.finished() for name, reply in replies.items()}


def _nodes(system: localsystem.LocalSystem, ranges: str) -> list[ManagedProcess]:
    return [p for p in system.processes if p.name.split(".")[0] == f"node{ranges}"]


def _status(process: ManagedProcess) -> dict[str, Any]:
    with urllib.request.urlopen(expect(process.info, NodeReady).http + "/status", timeout=5) as response:
        status: dict[str, Any] = json.loads(response.read())
        return status


def _serving(system: localsystem.LocalSystem, ranges: str) -> ManagedProcess:
    """The node of range ``ranges`` (0, 1 or 2) that holds a session now."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for process in _nodes(system, ranges):
            if process.alive() and _status(process)["active_sessions"]:
                return process
        time.sleep(0.02)
    raise AssertionError(f"no node of range {ranges} serves a session")


def _idle_everywhere(system: localsystem.LocalSystem, but: ManagedProcess | None = None, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    live = [p for p in system.processes if p.name.startswith("node") and p.alive() and p is not but]
    while True:
        states = [_status(p) for p in live]
        if all(s["active_sessions"] == 0 and s["kv_cells"] == 0 and s["slots_leased"] == 0 for s in states):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.1)


def _disturbed(system: localsystem.LocalSystem, case: str, ranges: str, signum: int, after: int = 40) -> Reply:
    """The case's reply with the serving node of ``ranges`` sent ``signum`` after ``after`` characters."""
    reply = Reply(system.gateway_url, system.model_id, CASES[case])
    reply.wait_text(after)
    victim = _serving(system, ranges)
    victim.signal(signum)
    try:
        reply.finished()
        _idle_everywhere(system, but=victim)
    finally:
        _back(system, victim)
    return reply


def _back(system: localsystem.LocalSystem, process: ManagedProcess) -> None:
    """Start a node the test stopped again, and wait until routes may use it (its probe passed)."""
    process.stop(timeout=5)
    node_id = expect(process.restart(), NodeReady).node_id
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(system.tracker_url + "/v1/nodes", timeout=5) as response:
            nodes = json.loads(response.read())["nodes"]
        if any(n["node_id"] == node_id and n["admitted"] for n in nodes):
            return
        assert time.monotonic() < deadline, f"{process.name} was not admitted again"
        time.sleep(0.1)


def _same(reply: Reply, reference: Reply) -> None:
    assert reply.text == reference.text
    assert reply.logprobs == reference.logprobs
    assert len(reply.repairs) == 1 and reply.repairs[0]["bit_exact"], reply.repairs


@pytest.mark.repairs_expected
@pytest.mark.parametrize(
    ("case", "ranges"),
    [("greedy", "2"), ("seeded", "1"), ("grammar", "0"), ("logprobs", "2"), ("two_choices", "1")],
    ids=["greedy-tail", "seeded-middle", "grammar-head", "logprobs-tail", "two-choices-middle"],
)
def test_a_killed_node_mid_reply_is_repaired_and_the_reply_is_unchanged(
    system: localsystem.LocalSystem, references: dict[str, Reply], case: str, ranges: str
) -> None:
    reply = _disturbed(system, case, ranges, signal.SIGKILL)
    if case == "two_choices":
        assert reply.text == references[case].text and reply.repairs  # the choice that met it, repaired
    else:
        _same(reply, references[case])


@pytest.mark.repairs_expected
def test_a_hung_node_is_noticed_by_its_silence_and_repaired(
    system: localsystem.LocalSystem, references: dict[str, Reply]
) -> None:
    reply = _disturbed(system, "seeded", "2", signal.SIGSTOP)
    _same(reply, references["seeded"])
    assert "not a heartbeat" in reply.repairs[0]["failed"]


@pytest.mark.repairs_expected
def test_a_node_that_leaves_politely_hands_its_sessions_over(
    system: localsystem.LocalSystem, references: dict[str, Reply]
) -> None:
    reply = _disturbed(system, "greedy", "1", signal.SIGTERM)
    _same(reply, references["greedy"])
    assert "leaving" in reply.repairs[0]["failed"]


def _in_prefill(system: localsystem.LocalSystem, ranges: str, before: dict[str, dict[str, int]]) -> ManagedProcess:
    """The node of range ``ranges`` that holds a session it has prefilled part of, and decoded nothing of.

    ``before``: each node's batcher counts before the session began (the system idle but for it).
    """
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for process in _nodes(system, ranges):
            if process.alive():
                status = _status(process)
                rows, was = status["batcher"], before[process.name]
                prefilling = rows["prefill_rows"] > was["prefill_rows"] and rows["decode_rows"] == was["decode_rows"]
                if status["active_sessions"] and prefilling:
                    return process
        time.sleep(0.005)
    raise AssertionError(f"no node of range {ranges} was seen prefilling")


def _counters(system: localsystem.LocalSystem) -> dict[str, int]:
    with urllib.request.urlopen(system.gateway_url + "/status", timeout=5) as response:
        counters: dict[str, int] = json.loads(response.read())["counters"]
        return counters


def test_a_node_killed_during_prefill_costs_the_reply_nothing(
    system: localsystem.LocalSystem, references: dict[str, Reply]
) -> None:
    _idle_everywhere(system)
    before = {p.name: _status(p)["batcher"] for p in _nodes(system, "1") if p.alive()}
    counted = _counters(system)
    reply = Reply(system.gateway_url, system.model_id, CASES["long_prompt"])
    # it holds the session and has run part of its long prompt, and no token has come yet
    victim = _in_prefill(system, "1", before)
    victim.signal(signal.SIGKILL)
    try:
        reply.finished()
    finally:
        _back(system, victim)
    assert reply.text == references["long_prompt"].text
    # the kill landed before the first token: the gateway opened another route for the request (a
    # retry), where a kill after it would have resumed the reply on one (a repair, after_tokens > 0)
    now = _counters(system)
    assert reply.repairs == [] and now["repairs"] == counted["repairs"], reply.repairs
    assert now["retries"] > counted["retries"], (counted, now)


@pytest.mark.repairs_expected
def test_with_no_spare_left_the_reply_ends_in_a_typed_error_and_nothing_leaks(
    system: localsystem.LocalSystem, smollm2: Path
) -> None:
    victim, spare = _nodes(system, "1")
    spare.stop(timeout=5)  # the spare leaves first (it tells the tracker): nobody else serves 10:20
    # a reply far longer than the moment between its first text and the kill: no end token can be drawn
    ends = {str(token): -100 for token in whole_model.vocabulary(smollm2).eog_tokens}
    reply = Reply(system.gateway_url, system.model_id, {**CASES["greedy"], "max_tokens": 600, "logit_bias": ends})
    try:
        reply.wait_text(40)
        assert _serving(system, "1") is victim
        victim.signal(signal.SIGKILL)
        reply.join(60)
        assert not reply.is_alive() and reply.error is not None, reply.repairs
        assert reply.error["code"] in ("no_route", "route_failed"), reply.error
        _idle_everywhere(system, but=victim)
    finally:
        for process in (victim, spare):
            _back(system, process)
