"""Nodes started without ``--layers``: each sizes what it can hold, the tracker places it, and together they
serve a model none of them can hold, as the whole model would (real processes on loopback, real llama.cpp)."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from noderuntime.engine import memplan
from noderuntime.engine.llama import Recipe
from noderuntime.models.artifacts import LayerRange
from noderuntime.services import localsystem
from noderuntime.services.cluster import ManagedProcess, start_all, stop_all
from noderuntime.services.joining import holdable
from noderuntime.services.ready import GatewayReady, NodeReady, TrackerReady, expect
from noderuntime.testing.clusters import local_gateway_args, local_tracker_args

from . import whole_model

SLOTS, CTX = 2, 512


def _recipe() -> Recipe:
    return memplan.capped(Recipe(n_threads=1, n_ctx_per_seq=CTX, n_seq_max=SLOTS, n_batch=512, n_ubatch=512))


def _limits(model: Path) -> list[int]:
    """Three memory limits between what the last layer alone and the whole model need."""
    recipe = _recipe()
    tail = memplan.needs(model, LayerRange(29, 30), recipe).host
    whole = memplan.needs(model, LayerRange(0, 30), recipe).host
    return [int(tail + (whole - tail) * share) for share in (0.3, 0.55, 0.8)]


def test_what_a_node_can_hold_is_the_widest_range_that_fits_at_either_end(smollm2: Path) -> None:
    recipe = _recipe()
    limits = _limits(smollm2)
    held = [holdable(smollm2, recipe, memplan.Budget(host=limit)) for limit in limits]
    assert 0 < held[0] < held[1] < held[2] < 30
    budget, k = memplan.Budget(host=limits[0]), held[0]
    for layers in (LayerRange(0, k), LayerRange(10, 10 + k), LayerRange(30 - k, 30)):
        assert budget.admits(memplan.needs(smollm2, layers, recipe))
    assert not budget.admits(memplan.needs(smollm2, LayerRange(29 - k, 30), recipe))  # one more is too many
    assert holdable(smollm2, recipe, memplan.Budget(host=100 << 20)) == 0
    assert holdable(smollm2, recipe, memplan.Budget(host=4 << 30)) == 30


def _routable(tracker_url: str, artifact: str) -> bool:
    artifacts = httpx.get(tracker_url + "/v1/artifacts", timeout=10).json()["artifacts"]
    return bool(artifacts.get(artifact, {}).get("routable"))


def test_nodes_without_layers_cover_a_model_none_can_hold_serve_it_and_a_newcomer_fills_a_hole(
    smollm2: Path, tmp_path: Path
) -> None:
    processes: list[ManagedProcess] = []

    def node(name: str, limit: int) -> ManagedProcess:
        flags = ["--memory-limit", str(limit), "--slots", str(SLOTS), "--ctx", str(CTX), "--threads", "1"]
        argv = ["up", "--model", str(smollm2), "--listen", "127.0.0.1:0", "--tracker", tracker_url, *flags]
        process = ManagedProcess(name, [*argv, "--data-dir", str(tmp_path / name)])
        processes.append(process)
        return process

    try:
        tracker = ManagedProcess(
            "tracker",
            local_tracker_args(tmp_path / "t", "--expire-after", "2"),
        )
        processes.append(tracker)
        tracker_url = expect(tracker.start(), TrackerReady).url
        limits = _limits(smollm2)
        nodes = [node(f"node{i}", limit) for i, limit in enumerate(limits)]
        # started together: the tracker counts the ones still loading, so they take different gaps
        ready = [expect(info, NodeReady) for info in start_all(nodes, timeout=60)]
        ranges = [tuple(r.layers) for r in ready]
        assert all(end - start < 30 for start, end in ranges), ranges
        covered = set().union(*(range(start, end) for start, end in ranges))
        assert covered == set(range(30)), ranges
        artifact = ready[0].artifact
        localsystem._wait_routable(tracker_url, artifact)
        gateway = ManagedProcess(
            "gateway",
            local_gateway_args(tmp_path / "gateway", tracker_url, f"smol={smollm2}"),
        )
        processes.append(gateway)
        url = expect(gateway.start(), GatewayReady).url
        # serving it: the reply is the whole model's, which a chain of the wrong ranges would not give
        messages = [{"role": "user", "content": "Name a colour."}]
        body = {"model": "smol", "messages": messages, "max_tokens": 8, "temperature": 0}
        expected = whole_model.chat_reply(smollm2, messages, 8)
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == expected
        assert reply.json()["usage"]["completion_tokens"] > 0

        # one that no other covers dies without a word: once the tracker drops it, a newcomer
        # of the same memory, started without --layers, is given the hole it left
        only = {
            k: set(range(start, end)) - set().union(*(range(a, b) for j, (a, b) in enumerate(ranges) if j != k))
            for k, (start, end) in enumerate(ranges)
        }
        lost = next((k for k, layers in only.items() if layers), None)
        assert lost is not None, ranges  # the first layer's node at least: joiners chain from it
        nodes[lost].kill()
        deadline = time.monotonic() + 20
        while _routable(tracker_url, artifact):
            assert time.monotonic() < deadline, "the tracker kept a dead node"
            time.sleep(0.2)
        newcomer = expect(node("newcomer", limits[lost]).start(60), NodeReady)
        start, end = newcomer.layers
        assert only[lost] <= set(range(start, end)), (ranges, lost, newcomer.layers)
        localsystem._wait_routable(tracker_url, artifact)
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == expected
    finally:
        stop_all(processes)


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A tracker that refuses every placement, as one that does not know the model's layer count would."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        body = json.dumps({"detail": "artifact 0123… has 32 layers by its nodes, not 30"}).encode()
        self.send_response(409)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("memory", "message"),
    [("100MiB", "not even one layer of"), ("4GiB", "the tracker refused to place this node: artifact 0123")],
    ids=["no-layer-fits", "the-tracker-refuses"],
)
def test_a_node_that_cannot_be_placed_says_why(smollm2: Path, tmp_path: Path, memory: str, message: str) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        argv = ["up", "--model", str(smollm2), "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "n")]
        argv += ["--tracker", f"http://127.0.0.1:{server.server_address[1]}", "--memory-limit", memory]
        done = subprocess.run([sys.executable, "-m", "noderuntime", *argv], capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 1, done.stderr[-2000:]
    assert message in done.stderr and "--layers" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_node_that_stops_before_it_registers_frees_its_range_at_once(smollm2: Path, tmp_path: Path) -> None:
    tracker = ManagedProcess("tracker", local_tracker_args(tmp_path / "t"))
    try:
        url = expect(tracker.start(), TrackerReady).url
        placed = []
        for name in ("first", "second"):
            # placed, then unable to start: its certificate files are not there
            argv = ["up", "--model", str(smollm2), "--listen", "127.0.0.1:0", "--tracker", url]
            argv += ["--data-dir", str(tmp_path / name), "--memory-limit", str(_limits(smollm2)[0])]
            argv += ["--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(tmp_path / "none.key")]
            done = subprocess.run(
                [sys.executable, "-m", "noderuntime", *argv], capture_output=True, text=True, timeout=60
            )
            assert done.returncode == 1, done.stderr[-2000:]
            placed.append(re.findall(r"placed this node on layers (\d+:\d+)", done.stderr))
        # the second was given the range the first gave up, not the gap after it
        assert placed[0] == placed[1] and len(placed[0]) == 1 and placed[0][0].startswith("0:")
    finally:
        tracker.stop()
