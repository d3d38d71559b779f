"""Nodes on a device: ``noderuntime up --device vulkan:N`` serves, and says so; what it refuses, and how.

The node starts in the environment's CPU build and re-executes itself with the Vulkan
build's folder first on its path (``noderuntime.cli.serve``); on a machine without a GPU
the device is Mesa's llvmpipe, which ``--allow-software-gpu`` lets serve. Tiny models and
few tokens: llvmpipe runs each of ggml's dispatches as a job on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from noderuntime.engine import backends
from noderuntime.engine.backends import BackendRuntime
from noderuntime.engine.llama import Recipe
from noderuntime.models.artifacts import LayerRange, inspect
from noderuntime.seams.client import GenerationRequest
from noderuntime.seams.dialer import open_dialer
from noderuntime.services.cluster import ROOT, ManagedProcess
from noderuntime.services.ready import TrackerReady, expect
from noderuntime.testing.clusters import Cluster, local_tracker_args, running_cluster
from noderuntime.verify.mixed import greedy_decode
from noderuntime.verify.procchain import ProcessChain

from .test_memplan import _up

SLOTS, CTX, BATCH = 2, 256, 64
ON_VULKAN = ("--device", "vulkan:0", "--allow-software-gpu", "--batch", str(BATCH))


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def greedy(chain: ProcessChain, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` (sequence 0, from position 0) through ``chain``."""
    positions = np.arange(len(prompt), dtype=np.int32)
    rows = np.array(prompt, np.int32)
    result = chain.step(np.zeros(len(prompt), np.int32), positions, positions == positions[-1], rows)
    assert result.logits is not None
    first = int(np.argmax(result.logits[-1]))
    return [first, *greedy_decode(chain, len(prompt), first, n - 1)["tokens"]]


def status_table(url: str) -> str:
    """What ``noderuntime status --tracker URL`` prints."""
    shown = subprocess.run(
        [sys.executable, "-m", "noderuntime", "status", "--tracker", url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def _vulkan_greedy(vulkan: BackendRuntime, model: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the whole model on Vulkan, in a process of its own, as the node's recipe runs it."""
    recipe = Recipe(n_threads=2, n_ctx_per_seq=CTX, n_seq_max=SLOTS, n_batch=BATCH, n_ubatch=BATCH, device="vulkan:0")
    with ProcessChain(model, [LayerRange(0, inspect(model).n_layer)], recipe, runtime=vulkan) as chain:
        return greedy(chain, prompt, n)


async def _generate(cluster: Cluster, prompt: list[int], n: int) -> list[int]:
    async with open_dialer() as dialer:
        return list(await cluster.generate(dialer, GenerationRequest(tuple(prompt), n)))


def test_a_node_on_vulkan_serves_and_reports_its_device(
    vulkan: BackendRuntime, tiny_model: Path, tmp_path: Path
) -> None:
    tracker = ManagedProcess("tracker", local_tracker_args(tmp_path / "t"))
    url = expect(tracker.start(), TrackerReady).url
    try:
        extra = (*ON_VULKAN, "--tracker", url)
        with running_cluster(tiny_model, [0, 4], tmp_path, slots=SLOTS, ctx=CTX, extra=extra) as cluster:
            node = cluster.infos[0]
            assert node.device == "vulkan:0"
            assert _get(node.http + "/status")["device"] == "vulkan:0"
            # the node checked its build and its device before loading (and named the device)
            assert "on vulkan:0: " in cluster.nodes[0].tail(400)
            cpu = Recipe(n_threads=2, n_ctx_per_seq=CTX, n_seq_max=SLOTS, n_batch=BATCH, n_ubatch=BATCH)
            assert node.recipe != cpu.fingerprint(inspect(tiny_model).quant)

            prompt = [5, 17, 42, 99, 7]
            assert trio.run(_generate, cluster, prompt, 6) == _vulkan_greedy(vulkan, tiny_model, prompt, 6)

            deadline = time.monotonic() + 30
            while not (listed := _get(url + "/v1/nodes")["nodes"]) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert [n["device"] for n in listed] == ["vulkan:0"]
            row = next(line for line in status_table(url).splitlines() if line.startswith(node.node_id[:12]))
            assert "vulkan:0" in row.split()
    finally:
        tracker.stop()


def _error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("noderuntime: error: "), done.stderr[-2000:]
    return line


@pytest.mark.parametrize("device", ["gpu", "vulkan", "vulkan:x", "Vulkan:0", "opencl:0", "cuda:-1"])
def test_a_malformed_device_is_refused(device: str, tiny_model: Path, tmp_path: Path) -> None:
    line = _error(_up(tiny_model, tmp_path, "--device", device))
    assert line.startswith(f"noderuntime: error: --device {device!r}: device must be 'cpu' or '<backend>:<index>'")


def test_gpu_layers_on_the_cpu_are_refused(tiny_model: Path, tmp_path: Path) -> None:
    assert "--gpu-layers counts layers on a GPU" in _error(_up(tiny_model, tmp_path, "--gpu-layers", "2"))


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        # 16 sessions of 8192 tokens: 2.8 GiB of KV, and llvmpipe reports 2 GiB
        (("--slots", "16", "--ctx", "8192"), "over the 2.00 GiB vulkan:0 has free: "),
        # the host keeps the process, the token embeddings and its side of the compute buffers
        (("--memory-limit", "200MiB"), "over the memory limit of 200 MiB: not even layer 0 alone fits"),
    ],
)
def test_a_shard_too_big_for_its_device_or_its_host_limit_is_refused_naming_what_fits(
    flags: tuple[str, ...], says: str, vulkan: BackendRuntime, smollm2: Path, tmp_path: Path
) -> None:
    line = _error(_up(smollm2, tmp_path, "--device", "vulkan:0", "--allow-software-gpu", *flags))
    assert line.startswith("noderuntime: error: layers 0:30 need ") and " on vulkan:0 and " in line, line
    assert says in line, line
    if "slots" in flags:
        assert "layers would fit (0:" in line, line


def test_a_device_that_is_not_there_is_refused(vulkan: BackendRuntime, tiny_model: Path, tmp_path: Path) -> None:
    seen = len([d for d in vulkan.devices() if d["registry"] == "Vulkan"])
    line = _error(_up(tiny_model, tmp_path, "--device", f"vulkan:{seen}", "--allow-software-gpu"))
    assert f"device vulkan:{seen} is not here: the vulkan build sees {seen} vulkan device(s)" in line


def test_a_software_renderer_serves_only_when_allowed(vulkan: BackendRuntime, tiny_model: Path, tmp_path: Path) -> None:
    if any(d["type"] != "PHYSICAL_DEVICE_TYPE_CPU" for d in backends.vulkan_devices()):
        pytest.skip("this machine has a Vulkan device that is not a software renderer")
    line = _error(_up(tiny_model, tmp_path, "--device", "vulkan:0"))
    assert "the vulkan build sees no vulkan device" in line and "--allow-software-gpu" in line


def test_a_backend_that_is_not_built_names_the_build_command(tiny_model: Path, tmp_path: Path) -> None:
    if backends.locate("cuda")["site"] is not None:
        pytest.skip("the CUDA build is in this machine's cache")
    line = _error(_up(tiny_model, tmp_path, "--device", "cuda:0"))
    assert "the cuda build is not in the cache" in line
    assert "kernels_patch/build.py --python" in line and "--backend cuda --install" in line
