"""No single tracker: killing one of two trackers under steady load fails no request.

Real processes on loopback: two trackers, two nodes of SmolLM2 (layers 0:15 and 15:30) given
both, and a gateway given both that asks the first and fails over to the second. The second
tracker starts only after the nodes: a tracker that is down when a node starts does not hold
it up, and the node trusts its key and registers there once it answers. Streaming clients
keep the gateway busy; the first tracker is killed (SIGKILL) while they do, and every request
completes, each reply the whole model's. Routes come from the first tracker before and from
the second after, so the nodes accepted the tickets of both. A node whose tracker never
answers stops at the first SIGTERM.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from noderuntime.services import localsystem
from noderuntime.services.cluster import ManagedProcess, start_all, stop_all
from noderuntime.services.ready import GatewayReady, NodeReady, TrackerReady, expect

from . import whole_model
from .test_faults import _free_port, _get

pytestmark = pytest.mark.slow

CLIENTS = 3
BEFORE, AFTER = 2, 3  # replies each client completes before the kill, and after it
MESSAGES = [{"role": "user", "content": "Name a colour and a fruit."}]
MAX_TOKENS = 12


class Client(threading.Thread):
    """Streams chat completions one after another until told to stop; counts those that completed."""

    def __init__(self, url: str, stop: threading.Event, expected: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = stop
        self.expected = expected  # the whole model's reply: what a route of the right ranges says
        self.completed = 0
        self.errors: list[str] = []
        self.start()

    def run(self) -> None:
        body = {"model": "smol", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0}
        while not self.stop.is_set():
            try:
                self.errors += self._one(body)
            except httpx.HTTPError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self.completed += 1

    def _one(self, body: dict[str, Any]) -> list[str]:
        """One streamed reply; what went wrong with it (nothing: it completed)."""
        text, done = "", False
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=60) as response:
            if response.status_code != 200:
                return [f"{response.status_code}: {response.read().decode(errors='replace')[:300]}"]
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return [str(event["error"])]
                    text += "".join(c.get("delta", {}).get("content") or "" for c in event.get("choices", []))
        if not done:
            return [f"the stream ended without [DONE]: {text!r}"]
        return [] if text == self.expected else [f"not the whole model's reply: {text!r}, not {self.expected!r}"]


def test_killing_one_of_two_trackers_under_steady_load_fails_no_request(smollm2: Path, tmp_path: Path) -> None:
    processes: list[ManagedProcess] = []

    def process(name: str, args: list[str]) -> ManagedProcess:
        made = ManagedProcess(name, args)
        processes.append(made)
        return made

    def tracker(name: str, listen: str) -> ManagedProcess:
        return process(name, ["tracker", "--local-swarm", "--listen", listen, "--data-dir", str(tmp_path / name)])

    stop = threading.Event()
    clients: list[Client] = []
    expected = whole_model.chat_reply(smollm2, MESSAGES, MAX_TOKENS)
    try:
        first = tracker("tracker-a", "127.0.0.1:0")
        first_url = expect(first.start(), TrackerReady).url
        second_port = _free_port()
        second_url = f"http://127.0.0.1:{second_port}"
        given = ["--tracker", first_url, "--tracker", second_url]
        flags = ["--threads", "1", "--slots", "4", "--ctx", "512", "--listen", "127.0.0.1:0", *given]
        nodes = [
            process(
                f"node{i}",
                ["up", "--model", str(smollm2), "--layers", layers, *flags, "--data-dir", str(tmp_path / f"n{i}")],
            )
            for i, layers in enumerate(("0:15", "15:30"))
        ]
        # the second tracker is not up yet: the nodes start with the first
        artifact = expect(start_all(nodes, timeout=90)[0], NodeReady).artifact
        second = tracker("tracker-b", f"127.0.0.1:{second_port}")
        second.start()
        localsystem._wait_routable(first_url, artifact, timeout=30)
        localsystem._wait_routable(second_url, artifact, timeout=30)  # they trusted its key, and registered
        ledger = str(tmp_path / "ledger.sqlite")
        gateway = process(
            "gateway",
            [
                "gateway",
                "--data-dir",
                str(tmp_path / "gateway"),
                *given,
                "--listen",
                "127.0.0.1:0",
                "--model",
                f"smol={smollm2}",
                "--audit-rate",
                "0",
                "--ledger",
                ledger,
            ],
        )
        url = expect(gateway.start(), GatewayReady).url

        clients = [Client(url, stop, expected) for _ in range(CLIENTS)]
        deadline = time.monotonic() + 60
        while min(c.completed for c in clients) < BEFORE:
            assert time.monotonic() < deadline and not any(c.errors for c in clients), [c.errors for c in clients]
            time.sleep(0.05)
        routed_by_first = _get(first_url + "/status")["routes_issued"]
        assert routed_by_first > 0 and _get(second_url + "/status")["routes_issued"] == 0
        first.signal(9)  # SIGKILL, mid-load
        killed_at = [c.completed for c in clients]
        while any(c.completed < k + AFTER for c, k in zip(clients, killed_at, strict=True)):
            assert time.monotonic() < deadline, [c.completed for c in clients]
            time.sleep(0.05)
        stop.set()
        for client in clients:
            client.join(60)
        assert not any(c.is_alive() for c in clients)
        assert [c.errors for c in clients] == [[]] * CLIENTS
        # the second tracker granted the routes since, and the nodes accepted its tickets
        assert _get(second_url + "/status")["routes_issued"] >= CLIENTS * AFTER
        standing = {s["url"]: s for s in _get(url + "/status")["trackers"]}
        assert standing[first_url]["failed"] >= 1 and standing[second_url]["answered"] >= CLIENTS * AFTER
    finally:
        stop.set()
        stop_all(processes)


def test_a_node_whose_tracker_never_answers_stops_at_the_first_sigterm(smollm2: Path, tmp_path: Path) -> None:
    # it waits for its tracker before it is ready; an operator who gives up on it (systemd's
    # stop, Ctrl-C) must not wait for the SIGKILL that follows
    down = f"http://127.0.0.1:{_free_port()}"
    args = ["up", "--model", str(smollm2), "--layers", "0:30", "--tracker", down, "--listen", "127.0.0.1:0"]
    node = ManagedProcess("node", [*args, "--data-dir", str(tmp_path)])
    node.launch()
    try:
        deadline = time.monotonic() + 60
        while not any("waiting for the tracker" in line for line in node.output):
            assert node.alive() and time.monotonic() < deadline, node.tail()
            time.sleep(0.05)
        asked = time.monotonic()
        status = node.stop(timeout=30)
        took = time.monotonic() - asked
        assert status == 0 and took < 10, (status, took, node.tail())
        assert any("received SIGTERM: stopping" in line for line in node.output), node.tail()
    finally:
        node.kill()
