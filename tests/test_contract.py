"""Signed performance contracts: canonical form, signatures, thresholds, the ``bench verify`` command."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from noderuntime.access.identity import public_bytes
from noderuntime.cli import main
from noderuntime.verify import contract
from noderuntime.verify.contract import ContractError, Threshold

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
OTHER_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
FIGURES = {"decode": {"tokens_per_s": 120.0, "p99-ms": 40}, "baseline": {"tokens_per_s": 100.0}}
THRESHOLDS = [
    {"id": "floor", "left": "decode.tokens_per_s", "op": ">=", "value": 100, "text": "at least 100 tokens/s"},
    {"id": "vs-baseline", "left": "decode.tokens_per_s", "op": ">=", "right": "baseline.tokens_per_s", "factor": 1.1},
    {"id": "latency", "left": "decode.p99-ms", "op": "<=", "value": 50},
]


def document(**changes: Any) -> dict[str, Any]:
    """An unsigned contract whose thresholds all hold."""
    doc: dict[str, Any] = {
        "contract": 1,
        "benchmark": "benchmarks.gate_a",
        "args": ["--quick"],
        "inputs": {"model": {"path": "m.gguf", "sha256": hashlib.sha256(b"model").hexdigest()}},
        "figures": copy.deepcopy(FIGURES),
        "thresholds": copy.deepcopy(THRESHOLDS),
        "recipe": {"threads": 2},
        "machine": {"cpu": "test"},
    }
    doc.update(changes)
    return doc


def test_canonical_is_sorted_and_compact() -> None:
    assert contract.canonical({"b": [1, 2.5], "a": "é"}) == '{"a":"é","b":[1,2.5]}'.encode()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused(bad: float, tmp_path: Path) -> None:
    with pytest.raises(ContractError, match="canonical"):
        contract.canonical({"x": bad})
    with pytest.raises(ContractError):
        contract.sign(document(figures={**FIGURES, "extra": bad}), KEY)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(document(figures={**FIGURES, "extra": bad})))
    with pytest.raises(ContractError, match="not a number"):
        contract.load(path)


def test_sign_then_verify(tmp_path: Path) -> None:
    signed = contract.sign(document(), KEY)
    assert contract.verify_signature(signed) == public_bytes(KEY.public_key())
    assert contract.verify_signature(signed, key=public_bytes(KEY.public_key()))
    # the pretty file form verifies too: the signature covers the canonical form
    path = tmp_path / "c.json"
    contract.write(path, signed)
    assert path.read_text().endswith("}\n")
    assert contract.verify_signature(contract.load(path)) == public_bytes(KEY.public_key())
    # signing again replaces the signature
    resigned = contract.sign(signed, OTHER_KEY)
    assert contract.verify_signature(resigned) == public_bytes(OTHER_KEY.public_key())


def _set_figure(doc: dict[str, Any]) -> None:
    doc["figures"]["decode"]["tokens_per_s"] = 1000.0


def _set_threshold_value(doc: dict[str, Any]) -> None:
    doc["thresholds"][0]["value"] = 1


def _set_input_hash(doc: dict[str, Any]) -> None:
    doc["inputs"]["model"]["sha256"] = hashlib.sha256(b"other model").hexdigest()


def _set_public_key(doc: dict[str, Any]) -> None:
    doc["signature"]["public_key"] = public_bytes(OTHER_KEY.public_key()).hex()


def _set_recipe(doc: dict[str, Any]) -> None:
    doc["recipe"]["threads"] = 16


def _add_signature_key(doc: dict[str, Any]) -> None:
    doc["signature"]["note"] = "unsigned words"


def _drop_signature(doc: dict[str, Any]) -> None:
    del doc["signature"]


@pytest.mark.parametrize(
    "tamper",
    [
        _set_figure,
        _set_threshold_value,
        _set_input_hash,
        _set_public_key,
        _set_recipe,
        _add_signature_key,
        _drop_signature,
    ],
)
def test_tampering_breaks_the_signature(tamper: Any) -> None:
    signed = contract.sign(document(), KEY)
    tamper(signed)
    with pytest.raises(ContractError):
        contract.verify_signature(signed)


def test_expected_key_must_match() -> None:
    signed = contract.sign(document(), KEY)
    with pytest.raises(ContractError, match="not by the expected key"):
        contract.verify_signature(signed, key=public_bytes(OTHER_KEY.public_key()))


def test_thresholds_pass_and_fail() -> None:
    results = {r.threshold.id: r for r in contract.check(document())}
    assert all(r.passed for r in results.values())
    assert results["floor"].left == 120.0 and results["floor"].right == 100.0
    assert results["vs-baseline"].right == pytest.approx(110.0)

    slow = document(figures={"decode": {"tokens_per_s": 105.0, "p99-ms": 60}, "baseline": {"tokens_per_s": 100.0}})
    results = {r.threshold.id: r for r in contract.check(slow)}
    assert results["floor"].passed
    assert not results["vs-baseline"].passed  # 105 < 1.1 * 100
    assert not results["latency"].passed  # 60 > 50


def test_threshold_json_roundtrip() -> None:
    for data in THRESHOLDS:
        assert Threshold.from_json(data).to_json() == data
    assert Threshold.from_json(THRESHOLDS[1]).right_side == "1.1 * baseline.tokens_per_s"


@pytest.mark.parametrize(
    ("threshold", "message"),
    [
        ({"id": "t", "left": "decode.missing", "op": ">=", "value": 1}, "has no 'missing'"),
        ({"id": "t", "left": "decode.tokens_per_s.deeper", "op": ">=", "value": 1}, "not a table"),
        ({"id": "t", "left": "decode", "op": ">=", "value": 1}, "not a finite number"),
        ({"id": "t", "left": "decode.tokens_per_s", "op": ">=", "right": "nowhere"}, "has no 'nowhere'"),
    ],
)
def test_unknown_or_non_numeric_path(threshold: dict[str, Any], message: str) -> None:
    doc = document(thresholds=[threshold])
    with pytest.raises(ContractError, match=message):
        contract.check(doc)
    # and a contract naming a missing figure cannot be signed in the first place
    with pytest.raises(ContractError, match=message):
        contract.sign(doc, KEY)


@pytest.mark.parametrize(
    "threshold",
    [
        {"id": "t", "left": "a", "op": ">", "value": 1},
        {"id": "t", "left": "a", "op": ">=", "value": 1, "right": "b"},
        {"id": "t", "left": "a", "op": ">="},
        {"id": "t", "left": "a", "op": ">=", "value": 1, "factor": 2},
        {"id": "t", "left": "a..b", "op": ">=", "value": 1},
        {"id": "t", "left": "a", "op": ">=", "value": True},
        {"id": "t", "left": "a", "op": ">=", "value": 1, "vaule": 2},
        {"id": "", "left": "a", "op": ">=", "value": 1},
        {"left": "a", "op": ">=", "value": 1},
    ],
)
def test_malformed_thresholds(threshold: dict[str, Any]) -> None:
    with pytest.raises(ContractError):
        Threshold.from_json(threshold)


def test_load_refuses_non_contracts(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    with pytest.raises(ContractError, match="cannot read"):
        contract.load(path)
    path.write_text("{not json")
    with pytest.raises(ContractError, match="not JSON"):
        contract.load(path)
    path.write_text('{"contract": 1}')
    with pytest.raises(ContractError, match="missing 'benchmark'"):
        contract.load(path)
    path.write_text('{"contract": 1, "contract": 1}')
    with pytest.raises(ContractError, match="appears twice"):
        contract.load(path)
    contract.write(path, document(contract=2))
    with pytest.raises(ContractError, match="unsupported contract format"):
        contract.load(path)


def test_load_refuses_json_that_breaks_parsers(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text("[" * 100_000)  # RecursionError
    with pytest.raises(ContractError, match="not JSON"):
        contract.load(path)
    path.write_text("9" * 5000)  # an integer past Python's digit limit: a ValueError of its own
    with pytest.raises(ContractError, match="not JSON"):
        contract.load(path)
    huge = [{"id": "floor", "left": "decode.tokens_per_s", "op": ">=", "value": int("9" * 400)}]
    path.write_text(json.dumps(document(thresholds=huge)))  # math.isfinite raises OverflowError on it
    with pytest.raises(ContractError):
        contract.load(path)


@pytest.mark.parametrize("benchmark", ["pip", "os", "fake_bench"])
def test_a_rerun_from_an_unnamed_signer_runs_only_this_projects_benchmarks(benchmark: str, tmp_path: Path) -> None:
    """The file names the module: without this, a contract file could run anything installed."""
    with pytest.raises(ContractError, match="reruns one of this project's benchmarks"):
        contract.rerun(document(benchmark=benchmark), tmp_path / "out.json")


def test_signing_key_is_made_once(tmp_path: Path) -> None:
    first = contract.signing_key(tmp_path / "bench")
    again = contract.signing_key(tmp_path / "bench")
    assert public_bytes(first.public_key()) == public_bytes(again.public_key())


def test_compare() -> None:
    old = contract.sign(document(), KEY)
    assert contract.compare(old, old).passed
    new = document(figures={"decode": {"tokens_per_s": 90.0, "p99-ms": 40}, "baseline": {"tokens_per_s": 100.0}})
    new["inputs"]["model"]["sha256"] = hashlib.sha256(b"other").hexdigest()
    comparison = contract.compare(old, new)
    assert not comparison.passed
    assert [c.name for c in comparison.inputs] == ["model"]
    assert [r.threshold.id for r in comparison.thresholds if not r.passed] == ["floor", "vs-baseline"]
    metrics = {m.path: m for m in comparison.metrics}
    assert list(metrics) == ["decode.tokens_per_s", "baseline.tokens_per_s", "decode.p99-ms"]
    assert metrics["decode.tokens_per_s"].ratio == pytest.approx(0.75)
    assert "0.75" in contract.comparison_table(comparison)


# -- the command ------------------------------------------------------------------------------------------------------


def write_signed(path: Path, doc: dict[str, Any], key: Ed25519PrivateKey = KEY) -> Path:
    contract.write(path, contract.sign(doc, key))
    return path


def test_cli_verify_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_signed(tmp_path / "c.json", document())
    assert main(["bench", "verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"signed by {public_bytes(KEY.public_key()).hex()}" in out
    assert "all 3 thresholds hold" in out
    assert "FAIL" not in out
    key = public_bytes(KEY.public_key()).hex()
    assert main(["bench", "verify", str(path), "--key", key]) == 0


def test_cli_verify_fails_on_a_threshold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slow = document(figures={"decode": {"tokens_per_s": 90.0, "p99-ms": 40}, "baseline": {"tokens_per_s": 100.0}})
    path = write_signed(tmp_path / "c.json", slow)
    assert main(["bench", "verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL: 2 of 3 thresholds do not hold" in out
    floor_line = next(line for line in out.splitlines() if line.startswith("floor"))
    assert floor_line.split() == ["floor", "90", ">=", "100", "FAIL"]


def test_cli_verify_fails_on_a_bad_signature(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_signed(tmp_path / "c.json", document())
    doc = json.loads(path.read_text())
    doc["figures"]["decode"]["tokens_per_s"] = 1e6
    path.write_text(json.dumps(doc))
    assert main(["bench", "verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert "does not match" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_verify_key_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_signed(tmp_path / "c.json", document())
    assert main(["bench", "verify", str(path), "--key", public_bytes(OTHER_KEY.public_key()).hex()]) == 1
    assert "not by the expected key" in capsys.readouterr().err


def test_cli_verify_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "verify", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "bad.json").write_text("[1, 2")
    assert main(["bench", "verify", str(tmp_path / "bad.json")]) == 2
    assert "Traceback" not in capsys.readouterr().err


# A benchmark as small as can be: its figures come from a JSON file, its one input is hashed.
FAKE_BENCHMARK = """
import argparse
import json
import sys
from pathlib import Path

from noderuntime.verify import contract


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--figures", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--key-dir", required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    figures = json.loads(Path(args.figures).read_text())
    if figures.get("crash"):
        return 3
    doc = {
        "contract": 1,
        "benchmark": "fake_bench",
        "args": ["--figures", args.figures, "--input", args.input, "--key-dir", args.key_dir],
        "inputs": {"data": contract.input_record(args.input)},
        "figures": figures,
        "thresholds": [{"id": "floor", "left": "speed", "op": ">=", "value": 100}],
    }
    contract.write(args.out, contract.sign(doc, contract.signing_key(Path(args.key_dir))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
"""


@pytest.fixture
def fake_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The fake benchmark, importable here and (through PYTHONPATH) in the rerun's process."""
    (tmp_path / "fake_bench.py").write_text(FAKE_BENCHMARK)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location("fake_bench", tmp_path / "fake_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def original(tmp_path: Path, fake_bench: ModuleType) -> Path:
    (tmp_path / "figures.json").write_text('{"speed": 150}')
    (tmp_path / "input.bin").write_bytes(b"data")
    path = tmp_path / "result.json"
    argv = ["--figures", str(tmp_path / "figures.json"), "--input", str(tmp_path / "input.bin")]
    assert fake_bench.main([*argv, "--key-dir", str(tmp_path / "key"), "--out", str(path)]) == 0
    return path


def _signer(tmp_path: Path) -> str:
    """The fake benchmark's public key: a rerun of a module outside ``benchmarks`` needs it named."""
    return public_bytes(contract.signing_key(tmp_path / "key").public_key()).hex()


def test_a_rerun_of_another_module_needs_its_signer_named(
    tmp_path: Path, fake_bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    path = original(tmp_path, fake_bench)
    assert main(["bench", "verify", str(path), "--rerun"]) == 1
    assert "give the signer's key to run it" in capsys.readouterr().err
    assert not (tmp_path / "result.rerun.json").exists()


def test_cli_rerun_reproduces(tmp_path: Path, fake_bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    path = original(tmp_path, fake_bench)
    (tmp_path / "figures.json").write_text('{"speed": 140}')
    assert main(["bench", "verify", str(path), "--rerun", "--key", _signer(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "result.rerun.json").exists()
    speed_line = next(line for line in out.splitlines() if line.startswith("speed"))
    assert speed_line.split() == ["speed", "150", "140", "0.933333"]
    assert out.rstrip().endswith("rerun: PASS")


def test_cli_rerun_detects_regressions(
    tmp_path: Path, fake_bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    path = original(tmp_path, fake_bench)
    (tmp_path / "figures.json").write_text('{"speed": 80}')
    (tmp_path / "input.bin").write_bytes(b"other data")
    assert main(["bench", "verify", str(path), "--rerun", "--key", _signer(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "input data differs" in out
    assert out.rstrip().endswith("rerun: FAIL")

    (tmp_path / "figures.json").write_text('{"crash": true}')
    assert main(["bench", "verify", str(path), "--rerun", "--key", _signer(tmp_path)]) == 1
    assert "failed with exit code 3" in capsys.readouterr().err
