"""``noderuntime up`` with no arguments (or ``up --local --model M``): the whole system on this machine.

A tracker, a relay, two shard nodes of the model (the demo model by default; any known
model or GGUF file; the second node reachable only through the relay, as a node behind
NAT would be) and the gateway, each its own process. Prints the base URL and a ``curl``
example; Ctrl-C stops everything.
"""

from __future__ import annotations

import itertools
import json
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import attrs
import platformdirs

from noderuntime.control import admission
from noderuntime.engine.cores import machine_cores
from noderuntime.models import artifacts
from noderuntime.models import catalogue as models
from noderuntime.services import ready
from noderuntime.services.cluster import ManagedProcess, ProcessError, stop_all
from noderuntime.services.ready import GatewayReady, NodeReady, R, RelayReady, SystemReady, TrackerReady, expect


@attrs.define
class LocalSystem:
    """The processes of a running local system."""

    processes: list[ManagedProcess]
    gateway_url: str
    tracker_url: str
    model_id: str
    ledger: Path

    def stop(self) -> None:
        """Stop every process: the gateway and the nodes together, then the relay and the
        tracker, which the nodes may still be telling that they leave."""
        stop_all(self.processes)


def _wait_routable(tracker_url: str, artifact: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(tracker_url + "/v1/artifacts", timeout=5) as response:
                known = json.loads(response.read())["artifacts"]
            if known.get(artifact, {}).get("routable"):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise ProcessError("the nodes did not register a complete route with the tracker in time")


def _model_path(model: str, *, quiet: bool) -> tuple[Path, str]:
    """A known model's pulled file and name, or a GGUF file and its stem as the served id."""
    if model in models.KNOWN_MODELS:
        return models.pull(model, progress=not quiet), model
    path = Path(model)
    if not path.is_file():
        known = ", ".join(sorted(models.KNOWN_MODELS))
        raise ProcessError(f"model {model!r} is neither a GGUF file nor a known model ({known})")
    return path.resolve(), path.stem


def start(
    *,
    model_name: str = models.DEMO_MODEL,
    listen: str = "127.0.0.1:8080",
    data_root: Path | None = None,
    cuts: tuple[int, ...] | None = None,
    slots: int = 8,
    ctx: int = 2048,
    quiet: bool = False,
    relay_last: bool = True,
    replicas: int = 1,
    node_options: tuple[str, ...] = (),
    tracker_options: tuple[str, ...] = (),
    gateway_options: tuple[str, ...] = (),
) -> LocalSystem:
    """Start the processes and wait until a route serves; the caller stops them.

    ``model_name`` is a known model's name or a GGUF file's path. With two shards or more,
    the last is reachable only through the relay, unless ``relay_last`` is False.
    ``replicas``: nodes per range (``node{i}``, then ``node{i}.1``, ...), so that a route
    whose node leaves has another to go on; ``node_options``, ``tracker_options`` and
    ``gateway_options``: more flags for every node, the tracker and the gateway.
    """
    path, model_id = _model_path(model_name, quiet=quiet)
    info = artifacts.inspect(path)
    cuts = cuts or (0, info.n_layer // 2, info.n_layer)
    # every node's OpenMP team uses every core, and the nodes take turns on them (engine.cores):
    # a token goes through the shards one after the other, so a shard with all the cores
    # computes its part twice as fast as one with half of them, and turns keep two teams
    # from ever sharing a core (which stalls both at every barrier)
    threads = len(machine_cores())
    root = data_root or Path(platformdirs.user_data_dir("noderuntime")) / "local-system"
    processes: list[ManagedProcess] = []

    def launch(name: str, args: list[str], kind: type[R]) -> R:
        return wait(begin(name, args), kind)

    def begin(name: str, args: list[str]) -> ManagedProcess:
        process = ManagedProcess(name, args)
        processes.append(process)
        process.launch()
        return process

    def wait(process: ManagedProcess, kind: type[R]) -> R:
        served = expect(process.wait_ready(120), kind)
        if not quiet:
            print(f"  {process.name:<8} ready (pid {process.pid})", flush=True)
        return served

    try:
        # the tracker probes every shard against answers computed here, from the same file
        references = root / "tracker" / "probe-references.json"
        references.parent.mkdir(parents=True, exist_ok=True)
        entries = admission.make_references(
            path, itertools.pairwise(cuts), seeds=8, recipe_options={"n_threads": threads}
        )
        references.write_text(json.dumps({"references": entries}) + "\n")
        tracker = launch(
            "tracker",
            [
                "tracker",
                "--listen",
                "127.0.0.1:0",
                "--data-dir",
                str(root / "tracker"),
                "--probe-references",
                str(references),
                "--require-probe",
                # every process listens on loopback: a swarm declared local may name those addresses
                "--local-swarm",
                *tracker_options,
            ],
            TrackerReady,
        )
        relay = launch("relay", ["relay", "--listen", "127.0.0.1:0", "--issuer-key", tracker.issuer_key], RelayReady)
        # the nodes and the gateway need only the tracker and the relay: they start together
        # (a node loads and measures its shard in about a second, most of it importing)
        nodes = []
        for (i, (a, b)), copy in itertools.product(enumerate(itertools.pairwise(cuts)), range(replicas)):
            behind_relay = relay_last and i == len(cuts) - 2 and len(cuts) > 2
            reach = ["--relay", relay.url] if behind_relay else ["--listen", "127.0.0.1:0"]
            name = f"node{i}" if copy == 0 else f"node{i}.{copy}"
            nodes.append(
                begin(
                    name,
                    [
                        "up",
                        "--model",
                        str(path),
                        "--layers",
                        f"{a}:{b}",
                        "--tracker",
                        tracker.url,
                        "--data-dir",
                        str(root / name),
                        "--slots",
                        str(slots),
                        "--ctx",
                        str(ctx),
                        "--threads",
                        str(threads),
                        *reach,
                        *node_options,
                    ],
                )
            )
        starting_gateway = begin(
            "gateway",
            [
                "gateway",
                "--tracker",
                tracker.url,
                "--listen",
                listen,
                "--model",
                f"{model_id}={path}",
                "--ctx",
                str(ctx),
                "--ledger",
                str(root / "gateway" / "ledger.sqlite"),
                "--data-dir",
                str(root / "gateway"),
                *gateway_options,
            ],
        )
        for node in nodes:
            wait(node, NodeReady)
        gateway = wait(starting_gateway, GatewayReady)
        _wait_routable(tracker.url, info.fingerprint)
    except BaseException:
        stop_all(processes)
        raise
    return LocalSystem(processes, gateway.url, tracker.url, model_id, root / "gateway" / "ledger.sqlite")


def pages(system: LocalSystem) -> str:
    """The two pages a browser opens, a line each: the tracker's swarm map and the gateway's chat."""
    return f"  swarm map  {system.tracker_url}/\n  chat       {system.gateway_url}/"


def main(listen: str, model_name: str) -> int:
    """Run the local system until Ctrl-C (or SIGTERM)."""
    print("starting the local system: tracker, relay, 2 shard nodes, gateway", flush=True)
    system = start(model_name=model_name, listen=listen)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # also when started in the background (SIGINT ignored)
        signal.signal(signum, lambda *_: stop.set())
    print(
        f"\nOpenAI-compatible API at {system.gateway_url}/v1  (tracker {system.tracker_url})\n"
        f"{pages(system)}\n\n"
        f"  curl {system.gateway_url}/v1/chat/completions -H 'content-type: application/json' \\\n"
        f'    -d \'{{"model": "{system.model_id}", "messages": [{{"role": "user", "content": "Hello!"}}]}}\'\n\n'
        f"  noderuntime status --tracker {system.tracker_url}\n\nCtrl-C stops everything.",
        flush=True,
    )
    print(
        ready.dump(SystemReady(url=system.gateway_url, tracker=system.tracker_url, model=system.model_id)), flush=True
    )
    try:
        while not stop.wait(0.5):
            for process in system.processes:
                if not process.alive():
                    print(f"{process.name} exited:\n{process.tail()}", file=sys.stderr)
                    stop.set()
    except KeyboardInterrupt:
        pass
    print("stopping...", flush=True)
    system.stop()
    return 0
