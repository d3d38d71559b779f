"""Gate B: shards in separate OS processes equal the whole model exactly."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from noderuntime.verify.parity import check_parity

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
