"""Shared fixtures: the demo model (pulled through the same code path users take) and
tiny random-weight models written with the ``gguf`` package."""

from __future__ import annotations

import itertools
import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from noderuntime.engine import backends
from noderuntime.engine.backends import BackendRuntime
from noderuntime.engine.cores import machine_cores
from noderuntime.models import catalogue as models
from noderuntime.models import synth
from noderuntime.services import cluster, localsystem
from noderuntime.services.cluster import ManagedProcess, ProcessError
from noderuntime.services.ready import GatewayReady, SystemReady

TINY_SHAPE = synth.ModelShape(n_layer=4, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=320, context_length=1024)
TINY_SHAPES = synth.TINY_SHAPES


def pytest_configure(config: pytest.Config) -> None:
    """Give each pytest-xdist worker cores of its own, before any test starts a thread or a process.

    Every engine and node sizes its OpenMP team to the cores its process may run on, and
    co-located nodes take turns on shared cores (``noderuntime.engine.cores``). Two
    workers on the same cores would either take turns (one worker's engines idle while
    the other's compute) or stall each other's barriers. A worker on its own cores
    computes alone there, and the processes it starts inherit them; the other worker's
    waits on deadlines, process starts and imports fill the remaining cores.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    if not worker:  # the controller, or a serial run
        count = getattr(config.option, "numprocesses", None) or 0
        if count >= 2:
            # numpy's OpenBLAS sizes its pool when the worker imports numpy, before this
            # hook can pin it: a pool of two spinning threads on a worker's one core took
            # a float64 matmul from 1 s to 60 s. The workers inherit this.
            share = max(1, len(os.sched_getaffinity(0)) // count)
            os.environ.setdefault("OPENBLAS_NUM_THREADS", str(share))
        return
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if count < 2:
        return
    cores = sorted(os.sched_getaffinity(0))
    # every count-th core from the worker's own; with more workers than cores, one core each
    mine = set(cores[int(worker[2:]) % len(cores) :: count])
    # every thread the imports started (a BLAS pool) too: a thread's affinity is its own
    for task in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(task), mine)


def engine_threads() -> int:
    """The threads an engine a test runs in its own process computes with: one per core the
    process may run on, as a node sizes its team. Under pytest-xdist that is the worker's own
    cores (:func:`pytest_configure`): two threads on one core wait for each other at every
    barrier. Call it from a test module's body, which is imported after the pinning."""
    return len(machine_cores())


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


@pytest.fixture(scope="session")
def vulkan() -> BackendRuntime:
    """The Vulkan build, built on first use, with llvmpipe allowed; skips when this machine cannot have it."""
    found = backends.locate("vulkan")
    if found["site"] is None and found["missing"]:
        _skip_unless_vulkan_required("the Vulkan backend cannot be built here: " + "; ".join(found["missing"]))
    try:
        return backends.runtime("vulkan", build=True, software=True)
    except backends.NoDeviceError as exc:
        _skip_unless_vulkan_required(f"no Vulkan device: {exc}")
        raise  # not reached: the call above skips or fails


def _skip_unless_vulkan_required(reason: str) -> None:
    # .ci/run installs the build tools and Mesa's software driver and sets this: there a
    # Vulkan lane that cannot run is a failure, not a skip nobody reads
    if os.environ.get("NODERUNTIME_REQUIRE_VULKAN") == "1":
        pytest.fail(f"{reason}; NODERUNTIME_REQUIRE_VULKAN=1 says this machine must run it")
    pytest.skip(reason)


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


def local_system(data_root: Path, **options: Any) -> Iterator[localsystem.LocalSystem]:
    """A real local system on loopback (tracker, relay, shard nodes, gateway), stopped after use.

    For module fixtures: ``yield from local_system(tmp_path_factory.mktemp(NAME), slots=...)``.
    """
    running = localsystem.start(listen="127.0.0.1:0", data_root=data_root, quiet=True, **options)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def smol_system(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[localsystem.LocalSystem]:
    """The demo model's default local system with 16 slots, shared by the modules that only ask it things.

    Starting a local system costs about 15 s (five processes, probe references); the
    modules that neither stop its processes nor change its options share this one.
    """
    yield from local_system(tmp_path_factory.mktemp("smol-system"), slots=16, ctx=1024)


class _Watch:
    """Every process the tests launch through :class:`ManagedProcess`: the defects each printed, and the
    route repairs each gateway counted (read from its ``/status`` while it runs, and before it is stopped).

    A node serves on after a defect: it fails the session, typed, and the gateway repairs the
    route on other nodes, so a test that only reads replies passes over both.
    """

    def __init__(self) -> None:
        self.processes: dict[int, ManagedProcess] = {}  # by id(), launched and not yet seen to have exited
        self._stopped_repairs: dict[int, int] = {}  # by id(): what each stopped gateway had counted
        self.seen: dict[int, int] = {}  # by id(): the defects of each already reported or forgiven

    def launched(self, process: ManagedProcess) -> None:
        self.processes[id(process)] = process

    def stopping(self, process: ManagedProcess) -> None:
        counted = _gateway_repairs(process)
        if counted is not None:
            self._stopped_repairs[id(process)] = self._stopped_repairs.get(id(process), 0) + counted

    def repairs(self) -> dict[int, tuple[str, int]]:
        """Every watched gateway's name and repairs so far (over each time it ran), by id()."""
        counts = {}
        for key, process in self.processes.items():
            counted = _gateway_repairs(process) if process.alive() else None
            if counted is not None or key in self._stopped_repairs:
                counts[key] = (process.name, self._stopped_repairs.get(key, 0) + (counted or 0))
        return counts

    def new_defects(self) -> list[tuple[str, list[str]]]:
        """The defects printed since the last call: (process name, its lines); forgets processes that exited."""
        found = []
        for key, process in list(self.processes.items()):
            defects = process.defects
            found += [(process.name, lines) for lines in defects[self.seen.get(key, 0) :]]
            self.seen[key] = len(defects)
            if process.proc is not None and process.proc.poll() is not None:
                del self.processes[key]  # launched again, it is watched again
                self.seen.pop(key, None)
                self._stopped_repairs.pop(key, None)
        return found


def _gateway_repairs(process: ManagedProcess) -> int | None:
    """The route repairs a running gateway (or local system) counted, by its ``/status``; None for any other."""
    try:
        info = process.info
    except ProcessError:
        return None
    if not isinstance(info, GatewayReady | SystemReady) or not process.alive():
        return None
    try:
        with urllib.request.urlopen(info.url + "/status", timeout=10) as response:
            return int(json.loads(response.read())["counters"]["repairs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not answering (hung on purpose, or stopping): nothing to read


_WATCH = _Watch()
cluster.on_launch.append(_WATCH.launched)
cluster.on_stop.append(_WATCH.stopping)


def _report(defects: list[tuple[str, list[str]]], when: str) -> str:
    name, lines = defects[0]
    more = f" (and {len(defects) - 1} more)" if len(defects) > 1 else ""
    return f"{name} logged a defect {when}{more}:\n" + "\n".join(lines)


@pytest.fixture(scope="session", autouse=True)
def _no_defects_after_the_last_test() -> Iterator[None]:
    """The processes of the last module's fixtures print their last lines as they stop: read them too."""
    yield
    defects = _WATCH.new_defects()
    if defects:
        pytest.fail(_report(defects, "after the last test, as the processes stopped"))


@pytest.fixture(autouse=True)
def _no_defects(request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail a test whose nodes, in its process or in processes it started, met a defect of ours, or whose
    gateways repaired a route, unless it expects that (``defects_expected``, ``repairs_expected``).

    Defects printed between tests (a module's processes starting or stopping) fail the next test.
    """
    between = _WATCH.new_defects()
    if between:
        pytest.fail(_report(between, "before this test began (a fixture's processes starting or stopping)"))
    repairs_before = _WATCH.repairs()
    yield
    repairs_after = _WATCH.repairs()  # before new_defects() forgets the gateways that stopped
    defects = _WATCH.new_defects()
    if request.node.get_closest_marker("defects_expected") is None:
        # a node in this process logs the same line when it fails a session on a defect
        here = [r.getMessage() for r in caplog.get_records("call") if "failed on a defect" in r.getMessage()]
        if here:
            pytest.fail(f"a node met a defect: {here[0]} (mark the test defects_expected if that is the point)")
        if defects:
            pytest.fail(_report(defects, "during the test") + "\n(mark the test defects_expected if that is the point)")
    if request.node.get_closest_marker("repairs_expected") is None:
        repaired = {
            name: count - repairs_before.get(key, (name, 0))[1]
            for key, (name, count) in repairs_after.items()
            if count > repairs_before.get(key, (name, 0))[1]
        }
        if repaired:
            pytest.fail(
                f"gateways repaired routes during the test: {repaired}; a node failed sessions it was serving "
                "(mark the test repairs_expected if it stops, hangs or kills nodes mid-reply on purpose)"
            )


# Test tiers, from the cheapest: each module is in one (a module that mixes takes its
# heaviest), and `pytest -m TIER` runs one; `make test` runs them all.
TIERS = {
    "pure": (  # no I/O: codecs, schemas, tables, the import graph
        "test_claims_pure",
        "test_commitments",
        "test_contract",
        "test_grpclib_private",
        "test_isolation",
        "test_layers",
        "test_node_pure",
        "test_noise",
        "test_protocol_chunks",
        "test_protocol_codec",
        "test_protocol_encodings",
        "test_protocol_fuzz",
        "test_protocol_seam",
        "test_route_choice",
        "test_untrusted",
    ),
    "memory": (  # trio tasks over memory streams, fakes in place of the engine, often the autojump clock
        "test_api_properties",
        "test_batcher",
        "test_claims_links",
        "test_claims_memory",
        "test_enginethread",
        "test_line",
        "test_placement",
        "test_sessions",
        "test_swarm",
        "test_swarm_bounds",
        "test_tracker",
        "test_trackers",
    ),
    "engine": (  # real llama.cpp in this process, on real GGUF files
        "test_batch_invariance",
        "test_engine",
        "test_gateway_in_process",
        "test_hostile_peers",
        "test_node_core",
        "test_prefix",
        "test_speculative",
    ),
    "processes": (  # real processes and sockets on loopback
        "test_access",
        "test_adversaries",
        "test_audit",
        "test_admission",
        "test_artifacts",
        "test_benchmarks",
        "test_cli",
        "test_clients",
        "test_cores",
        "test_devices",
        "test_faults",
        "test_fetch",
        "test_gate_f",
        "test_gate_f_served",
        "test_gateway",
        "test_httpserve",
        "test_joining",
        "test_light_install",
        "test_lint",
        "test_logprobs",
        "test_memplan",
        "test_mixed_route",
        "test_network_route",
        "test_observability",
        "test_pages",
        "test_parity",
        "test_prefix_route",
        "test_queueing",
        "test_rebalancing",
        "test_relay_e2e",
        "test_relay_links",
        "test_repair",
        "test_structured_output",
        "test_sybil_votes",
        "test_timeline",
        "test_tools",
        "test_torchengine",
        "test_tracker_failover",
        "test_transports",
        "test_vulkan",
    ),
    "isolation": ("test_gate_d",),  # network namespaces (root); memory caps are in processes' modules
}
_TIER_OF = {module: tier for tier, modules in TIERS.items() for module in modules}


# Tests that start processes or run the engine are heavy (1,511 of 1,550 worker-seconds at
# 6701b3e); the memory and pure tiers are 560 tests of milliseconds. pytest-xdist's work
# stealing gives each worker a contiguous share of the collection and lets an idle worker take
# the back half of another's queue, so the tests run last are those at the end of the shares.
# Where those are long tests that start processes, one worker idles while the other finishes
# them (at 6701b3e: 1,550 s of tests in 816 s of wall on two workers, 82 worker-seconds in no
# test, the workers' start included). So each share is its part of the heavy tests, then its
# part of the light ones.
_LIGHT = ("memory", "pure")


def _by_module(items: list[pytest.Item], parts: int) -> list[list[pytest.Item]]:
    """``items`` cut into ``parts`` runs of about equal length, between modules (for their fixtures)."""
    cuts = [0]
    for k in range(1, parts):
        i = max(cuts[-1], round(len(items) * k / parts))
        while 0 < i < len(items) and getattr(items[i], "module", None) is getattr(items[i - 1], "module", None):
            i += 1
        cuts.append(i)
    cuts.append(len(items))
    return [items[a:b] for a, b in itertools.pairwise(cuts)]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its module's tier (a module in no tier is a usage error); order the
    collection so that each worker's share ends in light tests."""
    heavy, light = [], []
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if isinstance(item, pytest.Function) else ""
        tier = _TIER_OF.get(module)
        if tier is None:
            raise pytest.UsageError(f"{module or item.nodeid} is in no test tier: add it to TIERS in tests/conftest.py")
        item.add_marker(tier)
        (light if tier in _LIGHT else heavy).append(item)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    items[:] = [
        item
        for share in zip(_by_module(heavy, workers), _by_module(light, workers), strict=True)
        for part in share
        for item in part
    ]
