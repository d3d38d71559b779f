"""The light install: ``pip install noderuntime`` runs a public relay and a tracker, without llama.cpp or torch.

A virtual environment holding only the project's base dependencies and the project
itself, built from this checkout (not the editable copy the tests run from), runs the
relay and the tracker with the command lines of their systemd units (``deploy/``, their
settings from the example files); nodes of the full install pair through that relay
and serve a session end to end. The environment's dependencies are installed once per
dependency list (keyed by it, kept outside the clone beside the other caches); the
project is installed into it afresh on every run, so what runs is this checkout's code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
import urllib.request
from pathlib import Path

import platformdirs
import pytest
import trio

from noderuntime.access.identity import Identity, self_signed
from noderuntime.models.catalogue import make_once
from noderuntime.seams.client import GenerationRequest
from noderuntime.seams.dialer import open_dialer
from noderuntime.services import ready
from noderuntime.services.cluster import defects_in
from noderuntime.services.ready import RelayReady, TrackerReady, expect
from noderuntime.testing.clusters import running_cluster

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _light_venv(tmp: Path) -> Path:
    """A venv with the base dependencies (made once per dependency list), this checkout installed in it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    key = hashlib.sha256(json.dumps([sys.version, project["dependencies"]]).encode()).hexdigest()[:16]
    folder = Path(platformdirs.user_cache_dir("noderuntime")) / "light-install"
    venv = folder / key
    python = venv / "bin" / "python"

    def make() -> None:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", *project["dependencies"]], check=True, timeout=900
        )
        (venv / ".complete").touch()

    make_once(folder, lambda: (venv / ".complete").exists(), make)
    # the checkout's packages, not the editable copy; built from a copy, since a build
    # writes its build/ folder beside the sources
    source = tmp / "source"
    for package in ("noderuntime", "protocol", "relay"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall", str(source)],
        check=True,
        timeout=600,
        cwd=tmp,
    )
    return venv


def _env() -> dict[str, str]:
    # nothing of the checkout on the path: the installed package answers
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _unit_command(unit: Path, settings: dict[str, str]) -> list[str]:
    """A unit's ExecStart as systemd runs it: ``${VAR}`` as one word, ``$VAR`` split on spaces."""
    text = unit.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    words = []
    for word in line.removeprefix("ExecStart=").split():
        if word.startswith("$") and not word.startswith("${"):
            words += settings.get(word[1:], "").split()
        else:
            words.append(re.sub(r"\$\{(\w+)\}", lambda m: settings[m.group(1)], word))
    return words


def _settings(example: Path, **overrides: str) -> dict[str, str]:
    """An example env file's settings, with ``overrides``."""
    lines = [line.partition("=") for line in example.read_text().splitlines() if line and not line.startswith("#")]
    return {key: value for key, _, value in lines} | overrides


class _Unit:
    """A process of the light install started as its unit starts it; what it prints is kept, for its defects."""

    def __init__(self, venv: Path, args: list[str], cwd: Path) -> None:
        if args[0].startswith("/"):  # a unit's command: its installed path, here the light venv's
            args = args[1:]
        self.process = subprocess.Popen(
            [str(venv / "bin" / "noderuntime"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
            cwd=cwd,
        )
        assert self.process.stdout is not None
        self.printed: list[str] = []
        for line in self.process.stdout:
            self.printed.append(line)
            if line.startswith(ready.PREFIX):
                self.ready = ready.parse(line)
                break
        else:
            raise AssertionError(f"{args[0]} exited {self.process.wait()} without a ready line")
        # the rest as it comes: a pipe nobody reads would stall the process once full
        self._reader = threading.Thread(target=self.printed.extend, args=(self.process.stdout,), daemon=True)
        self._reader.start()

    def stop(self) -> list[list[str]]:
        """Stop it as systemd does (SIGTERM): a clean exit; the defects it printed (see ``cluster.DEFECT_MARKS``)."""
        self.process.terminate()
        assert self.process.wait(timeout=15) == 0, "".join(self.printed[-40:])
        self._reader.join(5)
        return defects_in(self.printed)


def test_a_light_install_runs_a_relay_and_a_tracker_that_full_nodes_use(smollm2: Path, tmp_path: Path) -> None:
    venv = _light_venv(tmp_path)
    python = str(venv / "bin" / "python")
    probe = "import importlib.util as u, noderuntime, relay; print(u.find_spec('llama_cpp'), u.find_spec('torch'))"
    found = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=_env(), cwd=tmp_path)
    assert found.stdout.split() == ["None", "None"], found.stdout + found.stderr
    # a shard needs the engine: the command says what to install
    up = subprocess.run(
        [str(venv / "bin" / "noderuntime"), "up", "--model", str(smollm2), "--layers", "0:15", "--relay", "ws://r:1"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
    )
    assert up.returncode != 0 and "this install has no engine" in up.stderr and "make bootstrap" in up.stderr
    issuer = Identity.generate()
    deploy = ROOT / "deploy"
    # a certificate for the relay's host, as a public relay's names its own
    credentials = self_signed(tmp_path / "credentials", "127.0.0.1", addresses=["127.0.0.1"]).cert
    relay_settings = _settings(
        deploy / "relay.env.example",
        RELAY_LISTEN="127.0.0.1:0",
        RELAY_ISSUER_KEY=issuer.node_id.hex(),
        RELAY_STATUS="127.0.0.1:0",
        CREDENTIALS_DIRECTORY=str(credentials.parent),
    )
    relay = _Unit(venv, _unit_command(deploy / "noderuntime-relay.service", relay_settings), tmp_path)
    tracker_settings = _settings(
        deploy / "tracker.env.example", TRACKER_LISTEN="127.0.0.1:0", STATE_DIRECTORY=str(tmp_path / "tracker")
    )
    tracker = _Unit(venv, _unit_command(deploy / "noderuntime-tracker.service", tracker_settings), tmp_path)
    try:
        # the swarm map's files are package data: the installed package serves them
        tracker_url = expect(tracker.ready, TrackerReady).url
        for path, kind in (("/", "text/html"), ("/web/swarm.js", "text/javascript"), ("/web/pages.css", "text/css")):
            with urllib.request.urlopen(tracker_url + path, timeout=10) as response:
                assert response.headers["content-type"].startswith(kind), path
        url = expect(relay.ready, RelayReady).url
        assert url.startswith("wss://")  # the unit serves TLS
        with running_cluster(
            smollm2,
            [0, 15, 30],
            tmp_path / "nodes",
            relay_only=[1],
            relay_url=url,
            issuer=issuer,
            env={"SSL_CERT_FILE": str(credentials)},  # the nodes trust the relay's certificate
        ) as cluster:

            async def generate() -> tuple[int, ...]:
                async with open_dialer() as dialer:
                    return await cluster.generate(dialer, GenerationRequest((1, 504, 3937, 260, 2), 8))

            assert len(trio.run(generate)) == 8
    finally:
        defects = {unit.process.args[1]: unit.stop() for unit in (relay, tracker)}
    assert defects == {"relay": [], "tracker": []}, defects


def test_the_units_pass_systemds_own_check(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        # .ci/run installs systemd and sets this: there a check that cannot run fails, not skips
        if os.environ.get("NODERUNTIME_REQUIRE_SYSTEMD") == "1":
            pytest.fail("systemd-analyze is not installed; NODERUNTIME_REQUIRE_SYSTEMD=1 says this machine must run it")
        pytest.skip("systemd-analyze is not installed here")
    for unit in sorted((ROOT / "deploy").glob("*.service")):
        # as installed: the command where the light install puts it, the settings file optional here
        text = unit.read_text().replace("/opt/noderuntime/bin/noderuntime", sys.executable)
        text = text.replace("EnvironmentFile=/", "EnvironmentFile=-/")
        (tmp_path / unit.name).write_text(text)
        done = subprocess.run(["systemd-analyze", "verify", str(tmp_path / unit.name)], capture_output=True, text=True)
        assert done.returncode == 0 and not done.stderr.strip(), done.stderr
