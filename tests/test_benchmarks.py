"""Benchmarks keep running: each quick run writes JSON with figures, recipe and machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from .isolation import skip_unless_possible

ROOT = Path(__file__).resolve().parents[1]


def _run_quick(name: str, out: Path, timeout: float = 900, prefix: Sequence[str] = ()) -> dict[str, Any]:
    """``python -m benchmarks.NAME --quick --out OUT`` (after ``prefix``, e.g. taskset); its figures."""
    done = subprocess.run(
        [*prefix, sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    doc = json.loads(out.read_text())
    # (gate A names itself as a contract does: by its module)
    assert doc["benchmark"].removeprefix("benchmarks.") == name and doc["quick"] is True
    assert doc["machine"]["logical_cpus"]
    figures: dict[str, Any] = doc["figures"]
    return figures


@pytest.mark.slow
# (the benchmarks whose figures a test below checks are not run twice: _run_quick checks their JSON too)
@pytest.mark.parametrize("name", ["codec", "fuzz_frames", "engine", "fingerprint", "suite_cpu_share"])
def test_quick_benchmark_writes_json(name: str, tmp_path: Path) -> None:
    out = tmp_path / f"{name}.json"
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == name and doc["quick"] is True
    assert doc["figures"] and doc["machine"]["logical_cpus"]
    assert "wrote" in done.stdout


def test_a_simulated_swarm_placed_node_by_node_covers_its_model_near_the_best_plan(tmp_path: Path) -> None:
    figures = _run_quick("swarm", tmp_path / "swarm.json", timeout=300)["50"]
    joined = figures["after_joins"]
    assert joined["nodes"] == 50 and joined["coverage"] == 1.0
    # the hand plan places the same nodes, so neither beats the bound
    assert 0 < joined["bottleneck_tokens_per_s"] <= joined["bound_tokens_per_s"]
    assert joined["hand_plan"]["bottleneck_tokens_per_s"] <= joined["bound_tokens_per_s"]
    assert joined["ratio_to_hand_plan"] >= 0.8
    # a fifth left, as many joined: the newcomers covered whatever the leavers left bare
    assert figures["left"] == 10 and figures["after_new_joins"]["coverage"] == 1.0


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a team of one thread per core needs two cores")
def test_placement_times_a_free_and_a_pinned_team_alone_and_beside_a_busy_process(tmp_path: Path) -> None:
    # two cores of its own, whatever share of them this test worker was given
    figures = _run_quick("placement", tmp_path / "placement.json", prefix=["taskset", "-c", "0,1"])
    assert figures["cores"] == [0, 1]
    for lane in ("alone_free", "alone_pinned", "beside_busy_process_free", "beside_busy_process_pinned"):
        s = figures[lane]["decode1"]
        assert s["steps"] == 30 and 0 < s["p50_ms"] <= s["p90_ms"] <= s["p99_ms"]


@pytest.mark.slow
def test_a_soak_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    """The soak's ``make test`` version: every way of ending a request, for 15 s and at least 48 requests."""
    figures = _run_quick("soak", tmp_path / "soak.json", timeout=600)
    assert figures["requests"] >= 48 and figures["completed"] >= 10 and figures["cancelled_by_client"] >= 10
    assert all(figures["requests_by_ending"].values())  # every ending was tried
    assert figures["errors"] == 0, figures["errors_by_kind"]
    assert figures["mismatches"] == 0 and figures["checked_against_reference"] >= 5
    assert figures["idle_at_end"], figures["nodes_at_end"]  # no slot, no KV cell held anywhere
    # repeated prompts took their prefixes from the nodes' caches, which kept to their budgets
    assert figures["prefix_hits"] > 0 and figures["prefix_within_budget"], figures["prefix_cache"]
    assert figures["serves_after"]
    for process, leak in figures["leaks"].items():
        assert leak["tasks"] <= 0, (process, leak)
        assert leak["fds"] <= 8, (process, leak)  # a few pooled connections may stay open
        assert leak["rss_mib"] < 64, (process, leak)


@pytest.mark.slow
def test_fuzzing_every_network_entry_crashes_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    """gRPC seams, relay, relayed seams' channel, tracker and gateway bodies (schemathesis too): typed answers only."""
    figures: dict[str, Any] = _run_quick("fuzz_network", tmp_path / "fuzz.json")
    assert figures["passed"]
    assert figures["crashes"] == {
        "processes_died": [],
        "tracker_5xx_or_dropped": 0,
        "gateway_5xx_or_dropped": 0,
        "grpc_undecodable_replies": 0,
        "relayed_seam_untyped": 0,
    }
    assert not figures["leaks"]["nodes_not_idle"] and figures["same_answer_after"]
    for entry in ("grpc_seam", "relay", "tracker_api", "gateway_http"):
        assert figures["entries"][entry]["inputs"] >= 100, entry
    relayed = figures["entries"]["relayed_seam"]["outcomes"]
    # every broken handshake got a status close, every broken record the tail's sealed DATA_LOSS
    assert relayed.get("sealed_close:DATA_LOSS", 0) >= 1 and sum(relayed.values()) >= 30, relayed


@pytest.mark.slow
def test_a_model_twice_a_nodes_cap_is_served_by_capped_nodes(tmp_path: Path) -> None:
    """The fit lane's CI size: ~1.5 GB model, 1 GiB cgroup caps."""
    from noderuntime.services.cgroups import available

    reason = available()
    skip_unless_possible(reason)
    figures: dict[str, Any] = _run_quick("fit", tmp_path / "fit.json")
    cap = figures["cap_bytes"]
    assert figures["model_bytes"] > 1.4 * cap
    refused = figures["admission_refused"]
    assert refused["exit_status"] == 1 and "layers would fit" in refused["message"]
    forced = figures["forced_whole_capped"]
    assert forced["exit_status"] == -9 and forced["oom_kills"] >= 1
    route = figures["route"]
    assert len(route["nodes"]) >= 2 and figures["every_node_under_cap"]
    for node in route["nodes"]:
        assert node["alive"] and node["oom_kills"] == 0 and node["peak_rss_bytes"] < cap, node
    assert all(run["tokens"] >= 2 for run in route["runs"]) and route["decode_tokens_per_s"] > 0
    assert figures["whole"]["decode_tokens_per_s"] > 0


@pytest.mark.slow
def test_gate_a_writes_a_contract_that_verifies(tmp_path: Path) -> None:
    """Seven lanes from one source of weights; the contract verifies, and a changed figure does not."""
    from noderuntime.cli import main as cli
    from noderuntime.verify import contract

    out = tmp_path / "gate_a.json"
    figures: dict[str, Any] = _run_quick("gate_a", out)
    doc = contract.load(out)
    assert set(figures["lanes"]) == {
        "hf-f32",
        "hf-bf16",
        "gguf-f32",
        "gguf-f16",
        "gguf-q8_0",
        "gguf-q4_k_m",
        "gguf-q4_1",
    }
    for name, lane in figures["lanes"].items():
        assert lane["c1"]["decode_tok_s"] > 0 and lane["c8"]["decode_tok_s"] > 0 and lane["peak_rss_bytes"] > 0, name
        assert 0.5 < figures["quality"][name]["top1_agreement"] <= 1.0, name
    # float lanes of the same numbers agree almost everywhere; the reference with itself exactly
    assert figures["quality"]["hf-f32"]["kl_mean"] == 0.0
    assert figures["quality"]["gguf-f32"]["top1_agreement"] >= 0.97
    assert {"prompts", "text", "gguf-q4_1"} <= set(doc["inputs"]) and len(doc["thresholds"]) >= 10
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").exists()
    assert cli(["bench", "verify", str(out)]) == 0
    doc["figures"]["lanes"]["gguf-q4_k_m"]["c1"]["decode_tok_s"] *= 2
    contract.write(tmp_path / "tampered.json", doc)
    assert cli(["bench", "verify", str(tmp_path / "tampered.json")]) == 1


@pytest.mark.slow
def test_gate_e_runs_gguf_and_safetensors_routes(tmp_path: Path) -> None:
    figures: dict[str, Any] = _run_quick("gate_e", tmp_path / "gate_e.json")
    routes = figures["routes"]
    assert set(routes) == {"gguf-q4_1", "hf-f32"}  # the quick run: one route of each backend
    for name, route in routes.items():
        assert route["c1"]["decode_tok_s"] > 0 and route["c8"]["tok_s"] > 0, name
        assert len(route["peak_rss_bytes"]) == 2 and min(route["peak_rss_bytes"]) > 0, name
        assert route["c8_outputs_equal"], name  # eight identical sessions, one answer
    # the safetensors F32 route is the whole F32 model, split: its greedy tokens are the reference's
    assert all(m == len(routes["hf-f32"]["outputs"][k]) for k, m in routes["hf-f32"]["greedy_prefix_match"].items())


def test_a_results_command_names_every_option_the_run_was_given() -> None:
    import argparse

    from benchmarks import _common

    args = argparse.Namespace(quick=True, out="x.json", lanes="one_node,grpc_route", levels=None, tag="a b")
    expected = "python -m benchmarks.serving --quick --lanes one_node,grpc_route --tag 'a b'"
    assert _common.command("serving", args) == expected


def test_what_a_benchmark_keeps_lies_beside_the_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import platformdirs

    from benchmarks import _common

    monkeypatch.delenv("NODERUNTIME_MODELS", raising=False)
    assert _common.cache_dir("fit") == Path(platformdirs.user_cache_dir("noderuntime")) / "benchmarks" / "fit"
    # a disk of its own for models takes the benchmarks' large files too, as it takes Gate A's lanes
    monkeypatch.setenv("NODERUNTIME_MODELS", str(tmp_path / "models"))
    assert _common.cache_dir("fit") == tmp_path / "benchmarks" / "fit"


# the serving results whose ratios docs/performance.md shows as a table
SERVING_TABLES = ("serving.json", "serving-epyc.json")


@pytest.mark.parametrize("result", SERVING_TABLES)
def test_the_docs_serving_tables_are_their_results_ratios(result: str) -> None:
    from benchmarks.serving import ratio_table

    doc = json.loads((ROOT / "benchmarks" / "results" / result).read_text())
    docs = (ROOT / "docs" / "performance.md").read_text()
    assert f"(../benchmarks/results/{result})" in docs, f"docs/performance.md links no {result}"
    assert ratio_table(doc) in docs, f"the table from {result} is not in docs/performance.md as generated"


def test_the_readmes_serving_figures_are_the_epyc_runs_range() -> None:
    doc = json.loads((ROOT / "benchmarks" / "results" / "serving-epyc.json").read_text())
    ratios = doc["figures"]["ratios_over_llama_server"]
    readme = (ROOT / "README.md").read_text()
    for lane, said in (("one_node", "one node"), ("local_system", "the 2-shard local system")):
        shares = [ratios[w][lane][str(n)]["tokens_per_s"] for w in ratios for n in doc["settings"]["levels"]]
        assert f"{said} {min(shares):.2f}–{max(shares):.2f}×" in readme, lane


def test_a_table_asked_of_a_file_that_is_no_serving_result_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.serving import main

    assert main(["--table", str(ROOT / "benchmarks" / "results" / "serving-epyc.json")]) == 0
    assert capsys.readouterr().out.startswith("| clients | workload | one node + gateway |")
    junk = tmp_path / "junk.json"
    for text in ("not json", "[]", '{"benchmark": "serving", "figures": []}'):
        junk.write_text(text)
        with pytest.raises(SystemExit) as exited:
            main(["--table", str(junk)])
        assert exited.value.code == 2, text
    # an older result, whose ratios are by lane alone (one workload), has no such table
    with pytest.raises(SystemExit):
        main(["--table", str(ROOT / "benchmarks" / "results" / "serving-intel.json")])
    assert "not a serving result with ratios by workload" in capsys.readouterr().err
