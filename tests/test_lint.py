"""The project stays ruff- and mypy-clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import platformdirs
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CACHE = Path(platformdirs.user_cache_dir("noderuntime"))


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_clean(command: list[str]) -> None:
    if command[0] == "mypy":
        # a cold mypy run takes a minute; its cache outside the clone makes a fresh clone's run
        # take seconds (mypy checks each cached module against its source's hash)
        command = [*command, "--cache-dir", str(CACHE / "mypy")]
    done = subprocess.run([str(BIN / command[0]), *command[1:]], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
