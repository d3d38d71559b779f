"""Gate B: shards in separate OS processes equal the whole model exactly."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from noderuntime.engine.llama import Recipe
from noderuntime.models.artifacts import LayerRange
from noderuntime.verify.parity import check_parity
from noderuntime.verify.procchain import ChainError, ProcessChain

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("cuts", [[0, 15, 30], [0, 10, 20, 30], [0, 1, 29, 30]], ids=lambda c: "-".join(map(str, c)))
def test_smollm2_shards_equal_whole_model(smollm2: Path, cuts: list[int]) -> None:
    report = check_parity(smollm2, cuts, n_tokens=32, prompt_lengths=(23, 41))
    assert report["max_abs_diff_logits"] == 0.0
    assert report["max_abs_diff_hidden"] == 0.0
    assert report["logits_and_hidden_equal"]
    assert report["greedy_tokens_equal"]
    assert all(len(tokens) == 32 for tokens in report["generated_chain"])
    # the two sequences are different prompts: their continuations differ
    assert report["generated_whole"][0] != report["generated_whole"][1]


def test_tiny_random_model_shards_equal_whole_model(tiny_model: Path) -> None:
    report = check_parity(tiny_model, [0, 1, 3, 4], n_tokens=32, prompt_lengths=(5, 17))
    assert report["parity"], report


def test_check_parity_cli_prints_json(tiny_model: Path, python: str, cli_env: dict[str, str]) -> None:
    done = subprocess.run(
        [
            python,
            "-m",
            "noderuntime",
            "check",
            "parity",
            "--model",
            str(tiny_model),
            "--cuts",
            "0,2,4",
            "--tokens",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["cuts"] == [0, 2, 4]
    assert report["greedy_tokens_equal"] is True
    assert report["max_abs_diff_logits"] == 0.0


def test_check_parity_cli_rejects_bad_cuts(tiny_model: Path, python: str, cli_env: dict[str, str]) -> None:
    # cuts that miss the model's ends are the check's refusal (1); cuts out of order, the parser's (2)
    for cuts, status, said in (("0,9", 1, "cuts must start at 0 and end at 4"), ("3,1", 2, "increasing")):
        done = subprocess.run(
            [python, "-m", "noderuntime", "check", "parity", "--model", str(tiny_model), "--cuts", cuts],
            capture_output=True,
            text=True,
            env=cli_env,
            timeout=60,
        )
        assert done.returncode == status, done.stderr
        assert said in done.stderr


def test_a_teacher_forced_pass_is_the_steps_logits_and_a_failed_write_is_the_drivers_error(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The tail writes a pass's logits into a file at each step's offset, and they are what
    the same steps return through the pipe; a tail that cannot write answers an error, and
    the chain serves on."""
    recipe = Recipe(n_threads=1, n_ctx_per_seq=256, n_seq_max=1, n_batch=64, n_ubatch=64)
    tokens = np.random.default_rng(3).integers(1, 200, 19).astype(np.int32)
    with ProcessChain(tiny_model, [LayerRange(0, 1), LayerRange(1, 4)], recipe) as chain:
        piped = []
        for first in range(0, len(tokens), 8):
            rows = np.arange(first, min(len(tokens), first + 8), dtype=np.int32)
            output = chain.step(np.zeros(len(rows), np.int32), rows, np.ones(len(rows), bool), tokens[rows])
            assert output.logits is not None
            piped.append(output.logits)
        chain.remove_sequence(0)
        written = chain.teacher_forced(tokens, 8)
        chain.remove_sequence(0)
        rows = np.arange(4, dtype=np.int32)
        with pytest.raises(ChainError, match="cannot write the logits"):
            gone = (str(tmp_path / "gone" / "logits"), 0)
            chain.step(np.zeros(4, np.int32), rows, np.ones(4, bool), tokens[rows], into=gone)
        chain.remove_sequence(0)
        again = chain.teacher_forced(tokens, 8)
    assert written.shape == (len(tokens), chain.info[-1]["n_vocab"])
    assert np.array_equal(written, np.concatenate(piped)) and np.array_equal(again, written)
