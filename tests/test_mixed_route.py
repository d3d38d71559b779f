"""The mixed-route certificate: a CPU shard, a Vulkan shard and a CPU shard against the whole model on the CPU.

``python -m benchmarks.backends --quick`` on a tiny random model: Gate B on the device, the
mixed route teacher-forced over 512 tokens, a signed contract of the figures and of the pair
of recipes they cover; a changed figure, or a changed pair, no longer verifies.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio

from noderuntime.cli import main as cli
from noderuntime.engine.backends import BackendRuntime
from noderuntime.engine.llama import Recipe
from noderuntime.models.artifacts import LayerRange, inspect
from noderuntime.seams.client import GenerationRequest, open_route_generation
from noderuntime.seams.dialer import open_dialer
from noderuntime.services.cluster import ROOT, ManagedProcess
from noderuntime.services.ready import NodeReady, TrackerReady, expect
from noderuntime.testing.clusters import local_tracker_args
from noderuntime.tracker.client import RouteGrant, request_route
from noderuntime.verify import contract
from noderuntime.verify.certificates import covered_pair
from noderuntime.verify.procchain import ProcessChain
from protocol import route_recipe

from .test_devices import _get, greedy, status_table


@pytest.fixture(scope="module")
def certificate(vulkan: BackendRuntime, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The quick certificate (on conftest's tiny model) and what its run printed."""
    out = tmp_path_factory.mktemp("certificate") / "backends.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.backends", "--quick", "--device", "vulkan:0", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out, done.stdout


def test_the_quick_mixed_route_certificate_verifies_and_a_changed_figure_does_not(
    certificate: tuple[Path, str], tiny_model: Path, tmp_path: Path
) -> None:
    out, printed = certificate
    assert "mixed route" in printed and "wrote" in printed
    doc = contract.load(out)
    contract.verify_signature(doc)
    assert all(result.passed for result in contract.check(doc))
    figures = doc["figures"]
    assert figures["gate_b"]["max_abs_diff_logits"] == 0.0 and figures["gate_b"]["greedy_tokens_equal"] == 1
    assert figures["mixed_route"]["tokens"] >= 512 and figures["mixed_route"]["top1_agreement"] > 0.9
    assert figures["decode"]["route_tokens_per_s"] > 0 and len(figures["decode"]["shards"]) == 3
    # the certificate names what it covers: the quick run's tiny model is conftest's, byte for byte
    pair = covered_pair(doc)
    assert pair.artifact == inspect(tiny_model).fingerprint and pair.cpu_recipe != pair.gpu_recipe
    cpu = Recipe(n_threads=2, n_ctx_per_seq=256, n_seq_max=1, n_batch=512, n_ubatch=512)
    assert pair.cpu_recipe == cpu.fingerprint(inspect(tiny_model).quant)  # a node's defaults on the CPU
    assert cli(["bench", "verify", str(out)]) == 0

    for path, value in ((("figures", "mixed_route", "top1_agreement"), 0.123456), (("covers", "gpu_recipe"), "0" * 16)):
        tampered = json.loads(out.read_text())
        *parents, last = path
        node = tampered
        for key in parents:
            node = node[key]
        node[last] = value
        changed = tmp_path / "tampered.json"
        contract.write(changed, tampered)
        with pytest.raises(contract.ContractError, match="altered since signing"):
            contract.verify_signature(contract.load(changed))
        assert cli(["bench", "verify", str(changed)]) == 1


# --- a tracker given the certificate routes across devices, and the route serves


CUTS, DEVICES = ("0:1", "1:3", "3:4"), ("cpu", "vulkan:0", "cpu")


def _chain_greedy(model: Path, runtime: BackendRuntime, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the same shards on the same devices, each in a process of its own, as the nodes run them."""
    recipes = [Recipe(n_threads=2, n_ctx_per_seq=256, n_seq_max=2, device=device) for device in DEVICES]
    cpu = recipes[0]
    ranges = [LayerRange(int(a), int(b)) for a, b in (cut.split(":") for cut in CUTS)]
    runtimes = [runtime if device != "cpu" else None for device in DEVICES]
    with ProcessChain(model, ranges, cpu, recipes=recipes, runtimes=runtimes) as chain:
        return greedy(chain, prompt, n)


async def _serve_one(url: str, artifact: str, prompt: list[int], n: int) -> tuple[RouteGrant, list[int]]:
    async with httpx.AsyncClient() as client, open_dialer() as dialer:
        grant = await request_route(client, url, artifact, len(prompt) + n, client_id=dialer.node_id)
        request = GenerationRequest(tuple(prompt), n)
        async with open_route_generation(
            dialer,
            grant.hops,
            request,
            artifact=bytes.fromhex(artifact),
            recipe=grant.recipe,
            ticket=grant.ticket,
            session_id=grant.session_id,
        ) as generation:
            while await generation.next() is not None:
                pass
        return grant, list(generation.tokens)


def test_a_tracker_given_the_certificate_serves_a_route_across_devices(
    certificate: tuple[Path, str], vulkan: BackendRuntime, tiny_model: Path, tmp_path: Path
) -> None:
    pair = covered_pair(contract.load(certificate[0]))
    tracker = ManagedProcess("tracker", local_tracker_args(tmp_path / "t", "--certificate", str(certificate[0])))
    url = expect(tracker.start(), TrackerReady).url
    nodes: list[ManagedProcess] = []
    try:
        for i, (layers, device) in enumerate(zip(CUTS, DEVICES, strict=True)):
            up = ["up", "--model", str(tiny_model), "--layers", layers, "--data-dir", str(tmp_path / f"n{i}")]
            up += ["--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--tracker", url, "--slots", "2"]
            up += ["--ctx", "256", "--threads", "2", "--device", device]
            nodes.append(ManagedProcess(f"node{i}", [*up, *(["--allow-software-gpu"] if device != "cpu" else [])]))
            nodes[-1].launch()
        infos = [expect(node.wait_ready(120), NodeReady) for node in nodes]
        # nodes started with `up`'s defaults run the recipes the certificate covers
        assert [info.recipe for info in infos] == [pair.cpu_recipe, pair.gpu_recipe, pair.cpu_recipe]
        deadline = time.monotonic() + 30
        while len(_get(url + "/v1/nodes")["nodes"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)

        prompt = [5, 17, 42, 99, 7]
        grant, tokens = trio.run(_serve_one, url, pair.artifact, prompt, 6)
        assert [hop.recipe_fingerprint.hex() for hop in grant.hops] == [info.recipe for info in infos]
        assert grant.recipe == route_recipe([hop.recipe_fingerprint for hop in grant.hops])
        # served over real seams, bit for bit what the same shards on the same devices compute
        assert tokens == _chain_greedy(tiny_model, vulkan, prompt, 6)

        shown = status_table(url)
        assert "mixed: cpu / vulkan:0 / cpu" in shown and "not mixed" not in shown
    finally:
        for node in nodes:
            node.stop()
        tracker.stop()


def test_a_tracker_refuses_a_certificate_it_cannot_trust(certificate: tuple[Path, str], tmp_path: Path) -> None:
    tampered = json.loads(certificate[0].read_text())
    tampered["covers"]["gpu_recipe"] = "0" * 16
    contract.write(tmp_path / "tampered.json", tampered)
    missing = tmp_path / "absent.json"
    for path, says in ((tmp_path / "tampered.json", "altered since signing"), (missing, "cannot read")):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "noderuntime",
                "tracker",
                "--local-swarm",
                "--listen",
                "127.0.0.1:0",
                "--certificate",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert done.returncode == 1 and says in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
