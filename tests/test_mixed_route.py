"""The mixed-route certificate: a CPU shard, a Vulkan shard and a CPU shard against the whole model on the CPU.

``python -m benchmarks.backends --quick`` on a tiny random model: Gate B on the device, the
mixed route teacher-forced over 512 tokens, a signed contract of the figures and of the pair
of recipes they cover; a changed figure, or a changed pair, no longer verifies.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from noderuntime.cli import main as cli
from noderuntime.engine.backends import BackendRuntime
from noderuntime.engine.llama import Recipe
from noderuntime.models.artifacts import inspect
from noderuntime.services.cluster import ROOT
from noderuntime.verify import contract
from noderuntime.verify.mixed import covered_pair


def test_the_quick_mixed_route_certificate_verifies_and_a_changed_figure_does_not(
    vulkan: BackendRuntime, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "backends.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.backends", "--quick", "--device", "vulkan:0", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "mixed route" in done.stdout and "wrote" in done.stdout
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
