"""Gate D: a route across separate hosts (network namespaces), one host reachable only via the relay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from noderuntime.access.identity import Identity, load_or_create_key
from noderuntime.access.tickets import issue
from noderuntime.services.cluster import ROOT, ManagedProcess, stop_all
from noderuntime.services.ready import NodeReady, RelayReady, expect
from noderuntime.tracker.messages import encode_hops

from . import netns
from .isolation import skip_unless_possible
from .test_node_core import requests, solo_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def _namespaces() -> None:
    skip_unless_possible(netns.unavailable_reason())


def _status(hosts: netns.Hosts, host: str, url: str) -> dict[str, Any]:
    code = (
        "import json,sys,urllib.request;print(urllib.request.urlopen(sys.argv[1]+'/status',timeout=5).read().decode())"
    )
    out = subprocess.run(
        [*hosts.prefix(host), sys.executable, "-c", code, url], capture_output=True, text=True, check=True
    )
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def _client(hosts: netns.Hosts, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    path = tmp / f"spec-{os.urandom(4).hex()}.json"
    path.write_text(json.dumps(spec))
    out = subprocess.run(
        [*hosts.prefix("head"), sys.executable, "-m", "tests.route_client", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _wait_idle(hosts: netns.Hosts, nodes: list[tuple[str, str]], within: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + within
    while True:
        states = [_status(hosts, host, url) for host, url in nodes]
        if all(
            s["active_sessions"] == 0 and s["slots_leased"] == 0 and s["slots_draining"] == 0 and s["kv_cells"] == 0
            for s in states
        ):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.2)


def test_route_across_hosts_with_a_relay_only_node(smollm2: Path, tmp_path: Path) -> None:
    issuer = Identity.generate()
    key = issuer.node_id.hex()
    with netns.gate_d_hosts() as hosts:
        a = hosts.addr
        # the topology is what it claims: the NAT host reaches only the relay
        assert netns.reachable(hosts, "mid", a["head"]) and netns.reachable(hosts, "nat", a["relay_b"])
        assert not netns.reachable(hosts, "mid", a["nat"]) and not netns.reachable(hosts, "head", a["nat"])
        assert not netns.reachable(hosts, "nat", a["head"]) and not netns.reachable(hosts, "nat", a["mid"])
        relay = ManagedProcess(
            "relay",
            ["relay", "--listen", "0.0.0.0:0", "--issuer-key", key, "--http", f"{a['relay_a']}:0"],
            prefix=hosts.prefix("relay"),
        )
        processes = [relay]
        try:
            port = expect(relay.start(), RelayReady).port
            specs = [
                ("head", "0:10", ["--listen", f"{a['head']}:0"]),
                ("mid", "10:20", ["--listen", f"{a['mid']}:0"]),
                ("nat", "20:30", ["--relay", f"ws://{a['relay_b']}:{port}"]),
            ]
            nodes = []
            for host, layers, extra in specs:
                process = ManagedProcess(
                    host,
                    [
                        "up",
                        "--model",
                        str(smollm2),
                        "--layers",
                        layers,
                        "--data-dir",
                        str(tmp_path / host),
                        "--issuer-key",
                        key,
                        "--slots",
                        "4",
                        "--ctx",
                        "512",
                        "--http",
                        f"{a[host]}:0",
                        *extra,
                    ],
                    prefix=hosts.prefix(host),
                )
                process.launch()
                processes.append(process)
                nodes.append(process)
            infos = [expect(p.wait_ready(90), NodeReady) for p in nodes]
            # the relay as the dialling host sees it, on network A
            plan = [attrs.evolve(i.hop(), relay=f"ws://{a['relay_a']}:{port}" if i.relay else "") for i in infos]
            artifact = bytes.fromhex(infos[0].artifact)
            status_urls = [(host, info.http) for (host, _, _), info in zip(specs, infos, strict=True)]

            client_key = tmp_path / "client.pem"
            client = load_or_create_key(client_key)  # whom the tickets let reach the head

            def spec(session: bytes, request: Any, **extra: Any) -> dict[str, Any]:
                ticket = issue(
                    issuer, session_id=session, epoch=0, artifact=artifact, hops=plan, client=client.node_id, local=True
                )
                return {
                    "client_key": str(client_key),
                    "hops": encode_hops(plan),
                    "artifact": infos[0].artifact,
                    "recipe": infos[0].recipe,
                    "ticket": ticket.hex(),
                    "session_id": session.hex(),
                    "prompt": list(request.prompt_tokens),
                    "max_tokens": request.max_tokens,
                    **extra,
                }

            request = requests(1, seed=8)[0]
            result = _client(hosts, spec(os.urandom(16), request), tmp_path)
            if "error" in result:
                print(*(p.tail() for p in processes), sep="\n----\n")
            assert tuple(result["tokens"]) == solo_greedy(smollm2, request)
            _wait_idle(hosts, status_urls)
            assert _status(hosts, "mid", infos[1].http)["seams"]["relay"] == 1

            # the relay dies in the middle of a generation
            long = type(request)(tuple(range(300, 340)), 400)
            failed = _client(hosts, spec(os.urandom(16), long, kill_pid=relay.pid, kill_after=10), tmp_path)
            assert "error" in failed, failed
            assert failed["code"] == 14  # UNAVAILABLE
            assert failed["seconds_after_kill"] < 10, failed
            _wait_idle(hosts, status_urls)
        finally:
            stop_all(processes)
