"""An auditing swarm of real processes: what the audit tests and ``benchmarks.audit`` run cheaters against.

A tiny random Qwen3 (4 layers) in two ranges: a tracker, two honest nodes for the first
range and three for the second, and a gateway that audits a share of sessions and keeps
a ledger. The first honest node is the tracker's referee (``--referee``): an operator's
node whose re-execution confirms two auditors before a node is excluded.
Cheaters (or any other node) join with :meth:`AuditSwarm.start_node`.
"""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from noderuntime.access import identity
from noderuntime.models import synth
from noderuntime.services.cluster import ManagedProcess, start_all, stop_all
from noderuntime.services.ready import GatewayReady, NodeReady, TrackerReady, expect

SHAPE = synth.TINY_SHAPES["qwen3"]  # 4 layers
FIRST, SECOND = "0:2", "2:4"


def get_json(url: str) -> dict[str, Any]:
    """The JSON object a GET of ``url`` answers."""
    with urllib.request.urlopen(url, timeout=10) as response:
        data: dict[str, Any] = json.loads(response.read())
        return data


class AuditSwarm:
    """A tracker, five honest nodes (two of the first range, three of the second) and an auditing gateway.

    Made with :func:`running_audit_swarm`, which starts it and stops every process it started.
    """

    def __init__(self, root: Path, audit_rate: float, *, slots: int) -> None:
        """The swarm's files under ``root`` (the model is written now); nothing runs until :meth:`start`."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.model = synth.write_model(root / "tiny-q8.gguf", SHAPE, quant="Q8_0", seed=5)
        self.audit_rate = audit_rate
        self.slots = slots
        self.ledger = root / "ledger.sqlite"
        self.processes: list[ManagedProcess] = []
        self.tracker = ""
        self.gateway = ""
        self.honest: list[str] = []  # node ids
        self._gateway: ManagedProcess | None = None

    def start(self) -> None:
        """Start the tracker, the honest nodes and the gateway, each once its ready line says the last is up."""
        referee = identity.load_or_create(self.root / "h0").node_id.hex()  # h0's key, made before it starts
        tracker = ManagedProcess(
            "tracker",
            [
                *("tracker", "--listen", "127.0.0.1:0", "--data-dir", str(self.root / "t")),
                *("--referee", referee, "--local-swarm"),
            ],
        )
        self.processes.append(tracker)
        self.tracker = expect(tracker.start(60), TrackerReady).url
        nodes = [ManagedProcess(f"h{i}", self.node_args(f"h{i}", FIRST if i < 2 else SECOND)) for i in range(5)]
        self.processes += nodes
        self.honest = [expect(line, NodeReady).node_id for line in start_all(nodes)]
        gateway = ManagedProcess(
            "gateway",
            [
                *("gateway", "--tracker", self.tracker, "--listen", "127.0.0.1:0"),
                *("--model", f"tiny={self.model}", "--ctx", "256"),
                *("--audit-rate", str(self.audit_rate), "--ledger", str(self.ledger)),
                *("--data-dir", str(self.root / "gateway")),
            ],
        )
        self.processes.append(gateway)
        self._gateway = gateway
        self.gateway = expect(gateway.start(60), GatewayReady).url

    def node_args(self, name: str, layers: str) -> list[str]:
        """The arguments of ``up`` for a node of this swarm serving ``layers``, its data in ``root/name``."""
        return [
            *("up", "--model", str(self.model), "--layers", layers, "--listen", "127.0.0.1:0"),
            *("--tracker", self.tracker, "--data-dir", str(self.root / name)),
            *("--slots", str(self.slots), "--ctx", "256", "--threads", "1"),
        ]

    def start_node(
        self, name: str, layers: str, *, before: Sequence[str] = (), module: str = "noderuntime"
    ) -> tuple[ManagedProcess, str]:
        """Start ``python -m module *before up ...`` for ``layers`` (a cheater, say): the process and its node id.

        It is stopped with the swarm, if not before.
        """
        process = ManagedProcess(name, [*before, *self.node_args(name, layers)], module=module)
        self.processes.append(process)
        return process, expect(process.start(60), NodeReady).node_id

    def ask(self, rng: random.Random, *, max_tokens: int = 12, client: httpx.Client | None = None) -> httpx.Response:
        """One completion through the gateway: 24 random prompt tokens, sampled with a seed ``rng`` draws."""
        prompt = [rng.randrange(3, SHAPE.n_vocab) for _ in range(24)]
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": rng.randrange(1000),
        }
        post = httpx.post if client is None else client.post
        return post(self.gateway + "/v1/completions", json=body, timeout=60)

    def nodes(self) -> dict[str, dict[str, Any]]:
        """The tracker's nodes, by node id."""
        return {n["node_id"]: n for n in get_json(self.tracker + "/v1/nodes")["nodes"]}

    def audits(self) -> dict[str, Any]:
        """The gateway's audit counters."""
        audits: dict[str, Any] = get_json(self.gateway + "/status")["audits"]
        return audits

    def set_audit_rate(self, rate: float) -> None:
        """Restart the gateway auditing a share ``rate`` of sessions (a start flag; nothing else changes)."""
        if self._gateway is None:
            raise RuntimeError("the swarm's gateway is not started")
        self._gateway.stop()
        self._gateway.argv[self._gateway.argv.index("--audit-rate") + 1] = str(rate)
        self.audit_rate = rate
        self.gateway = expect(self._gateway.restart(60), GatewayReady).url

    def stop(self) -> None:
        """Stop every process the swarm started."""
        stop_all(self.processes)


@contextmanager
def running_audit_swarm(root: Path, *, audit_rate: float, slots: int) -> Iterator[AuditSwarm]:
    """An :class:`AuditSwarm` under ``root``, started; every process stopped when the block ends, or a start fails."""
    swarm = AuditSwarm(root, audit_rate, slots=slots)
    try:
        swarm.start()
        yield swarm
    finally:
        swarm.stop()
