"""Capability admission: signed capability records, known-answer probes, and a tracker
that keeps a shard with damaged weights out of every route."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import attrs
import pytest

from noderuntime.access.identity import Identity
from noderuntime.control import admission
from noderuntime.control.admission import AdmissionError, Capability, ProbeAnswer, ProbeReferences
from noderuntime.engine.llama import Recipe, ShardEngine
from noderuntime.models import artifacts
from noderuntime.models import gguf as ggufio
from noderuntime.models.artifacts import LayerRange
from noderuntime.services import ready
from noderuntime.services.cluster import ManagedProcess, start_all, stop_all
from noderuntime.testing.clusters import local_tracker_args
from noderuntime.tracker.messages import RouteReply
from noderuntime.tracker.records import NodeRecord

CAPABILITY = Capability(
    prefill_ms_per_token=2.0,
    decode_ms=((1, 5.0), (8, 26.0)),
    weights_bytes=100,
    kv_bytes=200,
    compute_bytes=50,
    threads=2,
)


def damaged_copy(model: Path, dst: Path, tensor: str = "blk.20.ffn_down.weight") -> Path:
    """The model with the middle of one tensor overwritten: other weights, and so another fingerprint.

    The fingerprint covers every byte, so a node that runs these weights under the real
    artifact's name (``tests/cheating_node.py``'s ``quant=PATH``, or a key of the real
    artifact in a probe's references) is what only running the weights can reveal.
    Everything but each end's first and last 4 KiB is overwritten: on a small stacked-expert
    tensor a narrower band hit one expert's rows only, and 1 probe seed in 100 routed around it.
    """
    shutil.copyfile(model, dst)
    entry = next(t for t in ggufio.read(dst).tensors if t.name == tensor)
    margin = 4096
    with open(dst, "r+b") as f:
        f.seek(entry.offset + margin)
        f.write(os.urandom(entry.n_bytes - 2 * margin))
    assert artifacts.inspect(dst).fingerprint != artifacts.inspect(model).fingerprint
    return dst


# --- capability records


def test_a_capability_record_verifies_only_for_its_node_and_shard() -> None:
    me, other = Identity.generate(), Identity.generate()
    claims: dict[str, Any] = {"artifact": "ab" * 32, "layers": (0, 15), "recipe": "0123456789abcdef"}
    record = admission.capability_record(me, capability=CAPABILITY, **claims)
    assert admission.check_capability(record, node_id=me.node_id, **claims) == CAPABILITY

    with pytest.raises(AdmissionError, match="signature"):
        admission.check_capability(record, node_id=other.node_id, **claims)
    for key, value in (("layers", (0, 16)), ("recipe", "f" * 16), ("artifact", "cd" * 32)):
        with pytest.raises(AdmissionError, match="another"):
            admission.check_capability(record, node_id=me.node_id, **{**claims, key: value})
    # a faster figure written into the body breaks the signature
    boasted = dict(record, body=record["body"].replace('"1":5.0', '"1":0.5'))
    assert boasted["body"] != record["body"]
    with pytest.raises(AdmissionError, match="signature"):
        admission.check_capability(boasted, node_id=me.node_id, **claims)
    for bad in ({}, {"body": "[]", "signature": "00"}, {"body": "{", "signature": "zz"}):
        with pytest.raises(AdmissionError):
            admission.check_capability(bad, node_id=me.node_id, **claims)


@pytest.mark.parametrize(
    "figures",
    [
        {},
        {
            "prefill_ms_per_token": 1,
            "decode_ms": {},
            "memory_bytes": {"weights": 1, "kv": 1, "compute": 1},
            "threads": 1,
        },
        {
            "prefill_ms_per_token": -1,
            "decode_ms": {"1": 2},
            "memory_bytes": {"weights": 1, "kv": 1, "compute": 1},
            "threads": 1,
        },
        {
            "prefill_ms_per_token": 1,
            "decode_ms": {"1": "nan"},
            "memory_bytes": {"weights": 1, "kv": 1, "compute": 1},
            "threads": 1,
        },
        {
            "prefill_ms_per_token": 1,
            "decode_ms": {"0": 2},
            "memory_bytes": {"weights": 1, "kv": 1, "compute": 1},
            "threads": 1,
        },
        {
            "prefill_ms_per_token": 1,
            "decode_ms": {"1": 2},
            "memory_bytes": {"weights": -1, "kv": 1, "compute": 1},
            "threads": 1,
        },
        {"prefill_ms_per_token": 1, "decode_ms": [1, 2], "memory_bytes": {}, "threads": 1},
        # JSON's 1e999 parses as infinity, which int() cannot take
        json.loads(
            '{"prefill_ms_per_token": 1, "decode_ms": {"1": 2}, "threads": 1e999,'
            ' "memory_bytes": {"weights": 1, "kv": 1, "compute": 1}}'
        ),
    ],
)
def test_nonsense_figures_are_refused(figures: dict[str, Any]) -> None:
    with pytest.raises(AdmissionError):
        Capability.from_json(figures)


@pytest.mark.parametrize("body", ["[" * 20_000, "1e999", '{"node_id": 1e999'])
def test_a_capability_body_that_breaks_parsers_is_refused(body: str) -> None:
    me = Identity.generate()
    record = {"body": body, "signature": me.sign(admission.CAPABILITY_DOMAIN, body.encode()).hex()}
    with pytest.raises(AdmissionError):
        admission.check_capability(record, node_id=me.node_id, artifact="ab" * 32, layers=(0, 30), recipe="0" * 16)
    with pytest.raises(AdmissionError):
        ProbeAnswer.from_json(json.loads('{"seed": 1e999, "digest": "", "sketch": []}'))


def test_the_tracker_costs_and_caps_nodes_by_what_they_measured() -> None:
    node = NodeRecord(
        node_id=b"n" * 32,
        artifact="ab" * 32,
        n_layer=30,
        layers=(0, 30),
        recipe="r" * 16,
        address="n:1",
        relay="",
        tls_cert_sha256=b"",
        slots=16,
        ctx_per_session=2048,
        free_slots=16,
        measured=CAPABILITY,
    )
    assert CAPABILITY.step_ms(1) == 5.0 and CAPABILITY.step_ms(8) == 26.0 and CAPABILITY.step_ms(15) == 47.0
    assert node.estimated_step_ms() == 5.0
    # a node slower in its heartbeats than it measured is costed at what it shows
    assert attrs.evolve(node, step_ms=40.0).estimated_step_ms() == 40.0
    # a budget of 30 ms per step admits batches up to 9 (5 + 3 * 8 = 29 ms)
    assert node.capacity(30.0) == 9 and node.capacity(1000.0) == 16 and node.capacity(1.0) == 1
    busy = attrs.evolve(node, active_sessions=9, free_slots=7)
    assert not busy.has_room(30.0) and busy.has_room(1000.0)


# --- probes on real shards


def test_probe_answers_are_reproducible_and_catch_damaged_weights(smollm2: Path, tmp_path: Path) -> None:
    references = admission.make_references(smollm2, [(0, 15), (15, 30)], seeds=2, recipe_options={"n_threads": 2})
    refs = ProbeReferences(
        ((r["artifact"], tuple(r["layers"]), r["recipe"]), ProbeAnswer.from_json(r)) for r in references
    )
    damaged = damaged_copy(smollm2, tmp_path / "damaged.gguf")
    claimed = artifacts.inspect(smollm2).fingerprint  # what a node running the damaged weights says it runs
    for path, layers, expect in (
        (smollm2, (0, 15), True),
        (smollm2, (15, 30), True),
        (damaged, (0, 15), True),  # the damage lies in layer 20
        (damaged, (15, 30), False),
    ):
        # another thread count, another slot count, another sequence slot than the reference
        recipe = Recipe(n_threads=1, n_seq_max=4)
        with ShardEngine(path, recipe, LayerRange(*layers)) as engine:
            key = (claimed, layers, recipe.fingerprint(engine.info.quant))
            seeds = refs.seeds(key)
            assert len(seeds) == 2
            for seed in seeds:
                answer = admission.probe(engine, seed, 3)
                verdict = admission.compare(refs.get(key, seed), answer)  # type: ignore[arg-type]
                assert verdict.passed is expect, (path.name, layers, verdict)
                if expect:
                    assert verdict.exact  # same kernels on one machine: bit-identical
            assert engine.kv_cells_used() == 0  # the probe leaves nothing behind
            other = admission.probe(engine, seeds[0] + 1, 0)
            assert not admission.compare(refs.get(key, seeds[0]), other).passed  # type: ignore[arg-type]


# --- the tracker keeps a damaged shard out


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_the_tracker_routes_only_shards_that_pass_their_probe(smollm2: Path, tmp_path: Path) -> None:
    references = tmp_path / "references.json"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "noderuntime",
            "probe",
            "reference",
            "--model",
            str(smollm2),
            "--ranges",
            "0:15,15:30",
            "--seeds",
            "4",
            "--out",
            str(references),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    assert len(json.loads(references.read_text())["references"]) == 8
    damaged = damaged_copy(smollm2, tmp_path / "damaged.gguf")
    processes: list[ManagedProcess] = []
    try:
        tracker = ManagedProcess(
            "tracker",
            local_tracker_args(tmp_path / "tracker", "--probe-references", str(references)),
        )
        processes.append(tracker)
        url = ready.expect(tracker.start(), ready.TrackerReady).url
        infos: dict[str, ready.NodeReady] = {}
        for name, path, layers in (
            ("head", smollm2, "0:15"),
            ("tail", smollm2, "15:30"),
            ("damaged", smollm2, "15:30"),  # registers the model, computes with the damaged copy
            ("odd", smollm2, "15:29"),  # no reference covers it: routed (not --require-probe) but never probed
        ):
            cheat = [f"quant={damaged}"] if name == "damaged" else []
            node = ManagedProcess(
                name,
                [
                    *cheat,
                    "up",
                    "--model",
                    str(path),
                    "--layers",
                    layers,
                    "--listen",
                    "127.0.0.1:0",
                    "--tracker",
                    url,
                    "--data-dir",
                    str(tmp_path / name),
                    "--threads",
                    "1",
                    "--slots",
                    "2",
                    "--ctx",
                    "512",
                ],
                module="tests.cheating_node" if cheat else "noderuntime",
            )
            processes.append(node)
        for node, line in zip(processes[1:], start_all(processes[1:]), strict=True):  # the four start together
            infos[node.name] = ready.expect(line, ready.NodeReady)
        ids = {name: info.node_id for name, info in infos.items()}
        deadline = time.monotonic() + 30
        while True:
            nodes = {n["node_id"]: n for n in _get(url + "/v1/nodes")["nodes"]}
            verdicts = {name: nodes.get(ids[name], {}).get("probe_passed") for name in ("head", "tail", "damaged")}
            if None not in verdicts.values() or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert verdicts == {"head": True, "tail": True, "damaged": False}
        assert "exact" in nodes[ids["head"]]["probe_detail"]
        assert nodes[ids["odd"]]["probe_passed"] is None and nodes[ids["odd"]]["admitted"]
        assert not nodes[ids["damaged"]]["admitted"]
        for name in ids:  # every node measured itself, and the tracker shows it
            capability = nodes[ids[name]]["capability"]
            assert set(capability["decode_ms"]) == {"1", "2"} and capability["memory_bytes"]["weights"] > 0

        chosen = set()
        for _ in range(40):
            try:
                route = RouteReply.model_validate(
                    _post(url + "/v1/routes", {"artifact": infos["head"].artifact, "tokens": 64})
                )
            except urllib.error.HTTPError as exc:
                # each route takes a slot off its nodes until their next heartbeat: the admitted
                # ones are full, and the damaged one, all its slots free, is still no way round
                assert exc.code == 429
                break
            chosen.update(h.node_id for h in route.hops)
        assert ids["damaged"] not in chosen and ids["tail"] in chosen

        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        assert 'noderuntime_tracker_probes_total{result="failed"} 1.0' in metrics
        assert 'noderuntime_tracker_probes_total{result="passed"} 2.0' in metrics

        shown = subprocess.run(
            [sys.executable, "-m", "noderuntime", "status", "--tracker", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stderr
        lines = {
            line.split()[0]: line for line in shown.stdout.splitlines() if line[:12] in {i[:12] for i in ids.values()}
        }
        assert "FAIL" in lines[ids["damaged"][:12]] and " ok " in lines[ids["head"][:12]]

        # any peer can probe a node itself, given the references
        for name, expect in (("tail", 0), ("damaged", 2)):
            checked = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "noderuntime",
                    "probe",
                    "check",
                    "--node",
                    infos[name].http,
                    "--references",
                    str(references),
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert checked.returncode == expect, checked.stdout + checked.stderr
    finally:
        stop_all(processes)


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_a_shard_whose_output_is_not_finite_answers_its_probe_and_fails_it() -> None:
    """Damaged weights give NaN or inf: the node still sends an answer the tracker's bounds take,
    and it fails against an honest reference (it used to stop the node at start)."""
    import numpy as np

    from noderuntime.tracker.messages import ProbeReply

    honest = np.random.default_rng(0).standard_normal((admission.PROBE_ROWS, 64)).astype(np.float32)
    damaged = honest.copy()
    damaged[3, :5] = (np.nan, np.inf, -np.inf, np.nan, np.nan)
    answer = admission.answer_for(7, damaged)
    ProbeReply(node_id="ab" * 32, **answer.to_json())  # within the bounds a tracker parses
    assert not admission.compare(admission.answer_for(7, honest), answer).passed
