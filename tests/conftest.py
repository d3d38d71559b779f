"""Shared fixtures: the demo model (pulled through the same code path users take) and
tiny random-weight models written with the ``gguf`` package."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from noderuntime import models, synth

TINY_SHAPE = synth.ModelShape(n_layer=4, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=320, context_length=1024)
TINY_SHAPES = synth.TINY_SHAPES


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1, pulled and verified once per machine."""
    return models.pull(models.DEMO_MODEL, progress=False)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama in Q8_0 (about 200 KB)."""
    return synth.write_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TINY_SHAPE, quant="Q8_0", seed=1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Qwen3 and Qwen3-MoE in Q8_0, by architecture name."""
    folder = tmp_path_factory.mktemp("tiny-qwen")
    return {
        arch: synth.write_model(folder / f"{arch}.gguf", shape, quant="Q8_0", seed=5)
        for arch, shape in TINY_SHAPES.items()
    }


@pytest.fixture(scope="session")
def gemma3() -> Path:
    """Gemma 3 270M pretrained Q4_K_M (real weights), pulled and verified once per machine."""
    return models.pull("gemma3-270m", progress=False)


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for running ``python -m noderuntime`` in a subprocess."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    return env


@pytest.fixture
def python() -> str:
    """The interpreter running the tests."""
    return sys.executable


@pytest.fixture(autouse=True)
def _no_session_defects(request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail a test whose in-process node ended a session on a defect of ours, unless it expects one.

    A node serves on after a defect (the session is failed, typed, to its peers), so a test
    that only looks at what its client got would pass over one.
    """
    yield
    if request.node.get_closest_marker("defects_expected") is not None:
        return
    defects = [r.getMessage() for r in caplog.get_records("call") if "failed on a defect" in r.getMessage()]
    if defects:
        pytest.fail(f"a node met a defect: {defects[0]} (mark the test defects_expected if that is the point)")
