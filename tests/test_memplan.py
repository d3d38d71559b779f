"""Memory admission: llama.cpp's dry-run sizing, the refusal a node gives, sizes on the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from noderuntime.engine import memplan
from noderuntime.engine.llama import EngineError, Recipe, ShardEngine
from noderuntime.models.artifacts import LayerRange
from noderuntime.services.cgroups import MemoryCap, available
from noderuntime.services.cluster import ROOT
from tests.conftest import engine_threads

from .isolation import skip_unless_possible

THREADS = engine_threads()

RECIPE = Recipe(n_threads=1, n_ctx_per_seq=512, n_seq_max=2, n_batch=64, n_ubatch=64)


@pytest.mark.parametrize("layers", [LayerRange(0, 30), LayerRange(0, 12), LayerRange(12, 30)])
def test_the_dry_run_sizes_exactly_what_the_load_allocates(smollm2: Path, layers: LayerRange) -> None:
    planned = memplan.needs(smollm2, layers, RECIPE)
    with ShardEngine(smollm2, memplan.capped(RECIPE), layers) as engine:
        real = engine.memory()
    assert (planned.weights, planned.kv, planned.compute) == (real.weights, real.kv, real.compute)
    assert planned.total == real.total + memplan.RUNTIME_BYTES


def test_the_prefix_cache_takes_what_a_limit_leaves_unless_its_size_is_named(smollm2: Path) -> None:
    layers = LayerRange(0, 30)
    base = memplan.needs(smollm2, layers, RECIPE).host
    size = memplan.prefix_cache_size
    assert size(smollm2, layers, RECIPE, memplan.Budget(), None) == memplan.DEFAULT_PREFIX_CACHE
    assert size(smollm2, layers, RECIPE, memplan.Budget(host=base + (100 << 20)), None) == 100 << 20
    assert size(smollm2, layers, RECIPE, memplan.Budget(host=base + (1 << 40)), None) == memplan.DEFAULT_PREFIX_CACHE
    assert size(smollm2, layers, RECIPE, memplan.Budget(host=base - 1), None) == 0
    # a size the operator names is kept, and counted in full against the limit
    assert size(smollm2, layers, RECIPE, memplan.Budget(host=base), 64 << 20) == 64 << 20
    with pytest.raises(memplan.MemoryLimitError, match="prefix cache 64 MiB"):
        memplan.check(smollm2, layers, RECIPE, base, 64 << 20)


def test_a_dry_run_engine_cannot_run(smollm2: Path) -> None:
    with ShardEngine(smollm2, RECIPE, LayerRange(0, 4), dry_run=True) as engine, pytest.raises(EngineError):
        engine.run(None)  # type: ignore[arg-type]


def test_ranges_that_fit_pass_and_others_say_what_would(smollm2: Path) -> None:
    whole = memplan.needs(smollm2, LayerRange(0, 30), RECIPE)
    assert memplan.check(smollm2, LayerRange(0, 30), RECIPE, whole.total) == whole
    limit = memplan.needs(smollm2, LayerRange(0, 9), RECIPE).total
    with pytest.raises(memplan.MemoryLimitError) as caught:
        memplan.check(smollm2, LayerRange(0, 30), RECIPE, limit + 1)
    assert caught.value.fitting == LayerRange(0, 9)
    assert "9 layers would fit (0:9)" in str(caught.value)
    with pytest.raises(memplan.MemoryLimitError, match="not even layer 0 alone fits"):
        memplan.check(smollm2, LayerRange(0, 30), RECIPE, 64 << 20)


def test_a_shard_file_over_the_limit_is_told_to_cut_a_shorter_shard(tiny_model: Path, tmp_path: Path) -> None:
    """No shorter range of a shard file can be served, so none is tried (its load would refuse it)."""
    from noderuntime.models import artifacts

    (shard,) = artifacts.split(tiny_model, [LayerRange(0, 2)], tmp_path)
    needed = memplan.needs(shard, LayerRange(0, 2), RECIPE).total
    with pytest.raises(memplan.MemoryLimitError, match="cut a shorter shard") as caught:
        memplan.check(shard, LayerRange(0, 2), RECIPE, needed - 1)
    assert caught.value.fitting is None


@pytest.mark.parametrize(
    ("text", "value"),
    [("1000", 1000), ("2.5G", 2_500_000_000), ("1GiB", 1 << 30), ("1536 MiB", 1536 << 20), ("64k", 64_000)],
)
def test_sizes_parse(text: str, value: int) -> None:
    assert memplan.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1.5X", "-1G", "0", "1e9", "9" * 400, "2000000000G"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        memplan.parse_bytes(text)


def _up(model: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "noderuntime", "up", "--model", str(model), "--listen", "127.0.0.1:0"),
            *("--issuer-key", "00" * 32, "--data-dir", str(tmp_path), "--slots", "2", "--ctx", "512"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_a_node_over_its_limit_refuses_to_start_and_names_what_fits(smollm2: Path, tmp_path: Path) -> None:
    done = _up(smollm2, tmp_path, "--memory-limit", "300MiB")
    assert done.returncode == 1
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("noderuntime: error: layers 0:30 need ")
    assert "over the memory limit of 300 MiB" in error and "layers would fit (0:" in error


def test_a_placed_node_sizes_its_range_beside_its_draft_model(smollm2: Path, tmp_path: Path) -> None:
    """What ``services.joining`` plans with: the draft model's bytes come off the limit the shard is
    loaded, cached and moved within, and off the budget a placed node sizes its range by."""
    from noderuntime.services import joining
    from noderuntime.services.noderun import NodeOptions, node_recipe

    limit = 1 << 30
    node = NodeOptions(
        smollm2, None, None, tmp_path, (), memory_limit=limit, draft=smollm2, slots=2, ctx_per_session=512
    )
    sized = joining.with_draft_sized(joining.JoinOptions(node=node), placing=False).node
    held = memplan.draft_needs(smollm2, node_recipe(node)).total
    assert sized.draft_bytes == held and sized.shard_memory_limit == limit - held
    assert joining.budget(node_recipe(node), limit, sized.draft_bytes).host == limit - held
    assert joining.budget(node_recipe(node), held // 2, held).host == 0  # nothing left, not less than nothing
    unlimited = attrs.evolve(node, memory_limit=None)
    placed = joining.with_draft_sized(joining.JoinOptions(node=unlimited), placing=True).node
    assert placed.draft_bytes == held and placed.shard_memory_limit is None
    # a pinned node with no limit plans nothing with it: no dry run of the draft model at its start
    assert joining.with_draft_sized(joining.JoinOptions(node=unlimited), placing=False).node.draft_bytes == 0
    with pytest.raises(joining.OptionsError, match="alone holds"):
        joining.with_draft_sized(joining.JoinOptions(node=attrs.evolve(node, memory_limit=held)), placing=False)


def test_a_draft_model_is_planned_beside_the_shard(smollm2: Path, tmp_path: Path) -> None:
    """``up --draft`` under ``--memory-limit``: a limit the shard alone fits, but not the shard and the
    draft model together, refuses to start and says what the draft model holds; one the draft model
    alone fills says so before anything loads."""
    recipe = Recipe(n_threads=1, n_ctx_per_seq=512, n_seq_max=2, n_batch=512, n_ubatch=512)  # as _up's node
    shard = memplan.needs(smollm2, LayerRange(0, 30), recipe).total
    draft = memplan.draft_needs(smollm2, recipe)
    assert draft.runtime == 0 and draft.total == shard - memplan.RUNTIME_BYTES  # the same model, whole
    limit = shard + draft.total // 2
    done = _up(smollm2, tmp_path / "beside", "--memory-limit", str(limit), "--draft", str(smollm2))
    assert done.returncode == 1, done.stderr[-2000:]
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("noderuntime: error: layers 0:30 need ") and "layers would fit (0:" in error, error
    assert f"over the memory limit of {memplan.human(limit - draft.total)}" in error, error
    assert f"--draft {smollm2} holds {memplan.human(draft.total)} of --memory-limit {memplan.human(limit)}" in error
    done = _up(smollm2, tmp_path / "alone", "--memory-limit", str(draft.total), "--draft", str(smollm2))
    assert done.returncode == 1 and f"--draft {smollm2} alone holds" in done.stderr, done.stderr[-2000:]


def test_a_bad_limit_is_a_usage_error(smollm2: Path, tmp_path: Path) -> None:
    done = _up(smollm2, tmp_path, "--memory-limit", "lots")
    assert done.returncode == 2 and "not a size" in done.stderr


def test_a_cap_kills_a_process_that_outgrows_it() -> None:
    reason = available()
    skip_unless_possible(reason)
    cap = MemoryCap(64 << 20, "test")
    try:
        grow = "x = [bytearray(1 << 20) for _ in range(256)]"
        done = subprocess.run([sys.executable, "-c", grow], preexec_fn=cap.join, timeout=60)
        assert done.returncode == -9 and cap.oom_kills() >= 1
        done = subprocess.run([sys.executable, "-c", "x = bytearray(8 << 20)"], preexec_fn=cap.join, timeout=60)
        assert done.returncode == 0
    finally:
        cap.remove()


def test_the_planner_sizes_a_model_larger_than_the_disk_from_its_header_alone(tmp_path: Path) -> None:
    """``synth.write_model(weights=False)``: Llama-3.1-70B's shape in Q4_0 (40 GB) as a header and a hole,
    which the dry run sizes as it would the whole file (what ``benchmarks.full_size`` plans on paper)."""
    from benchmarks.full_size import PAPER_SHAPES, placed_ranges
    from noderuntime.models import artifacts, synth

    path = synth.write_model(tmp_path / "70b.gguf", PAPER_SHAPES["Llama-3.1-70B"], quant="Q4_0", weights=False)
    info = artifacts.inspect(path, verify=False)
    assert info.n_layer == 80 and path.stat().st_size > 39e9 and path.stat().st_blocks * 512 < 16 << 20
    recipe = Recipe(n_threads=THREADS, n_ctx_per_seq=512, n_seq_max=2, n_batch=64, n_ubatch=64)
    middle = memplan.needs(path, LayerRange(10, 20), recipe)
    # ten of its 80 blocks of Q4_0 weights: 8192 wide, FFN 28672, 64/8 heads of 128
    block = (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672) * 18 // 32 + 2 * 8192 * 4
    assert middle.weights == pytest.approx(10 * block, rel=0.001)
    # machines that hold 30 layers each, joining one at a time: three cover the 80
    assert placed_ranges(80, 30) == ["0:30", "30:60", "60:80"]
