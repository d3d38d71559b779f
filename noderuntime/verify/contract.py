"""Signed performance contracts: benchmark figures, the thresholds they must meet, and a signature.

A contract is one JSON object. Besides any descriptive keys (recipe, machine, versions) it has:

- ``"contract": 1`` — the format version;
- ``"benchmark"`` and ``"args"`` — the module and arguments that produced it, so it can be rerun;
- ``"inputs"`` — ``{name: {"path": ..., "sha256": ...}}`` of the files it read;
- ``"figures"`` — the measured numbers, nested dictionaries;
- ``"thresholds"`` — claims about the figures (see ``Threshold``);
- ``"signature"`` — ``{"algorithm": "ed25519", "public_key": hex, "value": hex}`` over
  ``b"noderuntime-contract-v1\\0" + canonical(everything but "signature")``.

Because the signature covers the canonical form, the file itself may be pretty-printed.
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from noderuntime.access import identity

FORMAT_VERSION = 1
SIGNATURE_DOMAIN = b"noderuntime-contract-v1"
_ROOT = Path(__file__).resolve().parents[2]  # the project, whose benchmarks/ a contract may rerun
REQUIRED_FIELDS = ("contract", "benchmark", "args", "inputs", "figures", "thresholds")

# The comparison a threshold makes between its left figure and its right-hand side.
OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le}

_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_THRESHOLD_KEYS = frozenset({"id", "left", "op", "value", "right", "factor", "text"})
_SIGNATURE_KEYS = frozenset({"algorithm", "public_key", "value"})


class ContractError(Exception):
    """The document is not a valid contract: unreadable, malformed, badly signed, or naming a missing figure."""


def canonical(obj: Any) -> bytes:
    """The canonical JSON bytes of ``obj``: sorted keys, no spaces, UTF-8; NaN and infinities refused."""
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise ContractError(f"not canonical JSON: {exc}") from None
    except TypeError as exc:
        raise ContractError(f"not JSON: {exc}") from None
    return text.encode("utf-8")


def _is_number(value: Any) -> bool:
    # bool is an int subclass, but `true` is never a measurement
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer of hundreds of digits: no measurement is that large
        return False


def _check_path(path: Any, what: str) -> str:
    if not isinstance(path, str) or not path or any(not segment for segment in path.split(".")):
        raise ContractError(f"{what} must be a dotted path into the figures like 'decode.tokens_per_s', got {path!r}")
    return path


def figure(figures: Mapping[str, Any], path: str) -> float:
    """The number at dotted ``path`` in ``figures``; ContractError if there is none or it is not a finite number."""
    node: Any = figures
    walked: list[str] = []
    for segment in path.split("."):
        if not isinstance(node, Mapping):
            raise ContractError(f"no figure {path!r}: {'.'.join(walked)!r} is a {type(node).__name__}, not a table")
        if segment not in node:
            where = ".".join(walked) or "figures"
            have = ", ".join(sorted(map(str, node))) or "nothing"
            raise ContractError(f"no figure {path!r}: {where!r} has no {segment!r} (it has: {have})")
        node = node[segment]
        walked.append(segment)
    if not _is_number(node):
        raise ContractError(f"figure {path!r} is {node!r}, not a finite number")
    return float(node)


@attrs.frozen(kw_only=True)
class Threshold:
    """A claim about the figures: ``left op value``, or ``left op factor * right``.

    ``left`` and ``right`` are dotted paths into the figures (``"decode.tokens_per_s"``);
    ``op`` is ``">="`` or ``"<="``; ``text`` is an optional sentence for people.
    """

    id: str
    left: str
    op: str
    value: float | None = None
    right: str | None = None
    factor: float | None = None
    text: str | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ContractError(f"a threshold id must be a non-empty string, got {self.id!r}")
        where = f"threshold {self.id!r}"
        _check_path(self.left, f"{where}: 'left'")
        if not isinstance(self.op, str) or self.op not in OPS:
            raise ContractError(f"{where}: 'op' must be one of {sorted(OPS)}, got {self.op!r}")
        if (self.value is None) == (self.right is None):
            raise ContractError(f"{where}: give exactly one of 'value' and 'right'")
        if self.value is not None and not _is_number(self.value):
            raise ContractError(f"{where}: 'value' must be a finite number, got {self.value!r}")
        if self.right is not None:
            _check_path(self.right, f"{where}: 'right'")
        if self.factor is not None:
            if self.right is None:
                raise ContractError(f"{where}: 'factor' only goes with 'right'")
            if not _is_number(self.factor):
                raise ContractError(f"{where}: 'factor' must be a finite number, got {self.factor!r}")
        if self.text is not None and not isinstance(self.text, str):
            raise ContractError(f"{where}: 'text' must be a string, got {self.text!r}")

    @classmethod
    def from_json(cls, data: Any) -> Threshold:
        """A threshold from its JSON object; ContractError if it is malformed."""
        if not isinstance(data, dict):
            raise ContractError(f"a threshold must be a JSON object, got {data!r}")
        # an unknown key is most likely a misspelt one, which would silently change the claim
        unknown = sorted(set(data) - _THRESHOLD_KEYS)
        if unknown:
            raise ContractError(f"threshold {data.get('id')!r}: unknown keys {unknown}")
        for key in ("id", "left", "op"):
            if key not in data:
                raise ContractError(f"threshold {data.get('id')!r}: missing {key!r}")
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        """The JSON object, with only the keys that are set."""
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}

    @property
    def right_side(self) -> str:
        """The right-hand side as written: ``"100"``, ``"prefill.tps"`` or ``"0.9 * prefill.tps"``."""
        if self.right is None:
            return _number(self.value)
        return self.right if self.factor is None else f"{_number(self.factor)} * {self.right}"

    def check(self, figures: Mapping[str, Any]) -> ThresholdResult:
        """Evaluate the claim on ``figures``; ContractError if a path names no number."""
        try:
            left = figure(figures, self.left)
            if self.right is None:
                assert self.value is not None  # guaranteed by __attrs_post_init__
                right = float(self.value)
            else:
                right = (1.0 if self.factor is None else self.factor) * figure(figures, self.right)
        except ContractError as exc:
            raise ContractError(f"threshold {self.id!r}: {exc}") from None
        return ThresholdResult(threshold=self, left=left, right=right, passed=OPS[self.op](left, right))


@attrs.frozen(kw_only=True)
class ThresholdResult:
    """A threshold evaluated: its left figure, its right-hand value, and whether ``left op right`` holds."""

    threshold: Threshold
    left: float
    right: float
    passed: bool


@attrs.frozen(kw_only=True)
class InputChange:
    """An input whose sha256 differs between two contracts (None: absent from that one)."""

    name: str
    old: str | None
    new: str | None


@attrs.frozen(kw_only=True)
class MetricChange:
    """One figure in two contracts; ``ratio`` is new/old, None where old is 0."""

    path: str
    old: float
    new: float
    ratio: float | None


@attrs.frozen(kw_only=True)
class Comparison:
    """A rerun against its original: changed inputs, the old thresholds on the new figures, and the figures."""

    inputs: tuple[InputChange, ...]
    thresholds: tuple[ThresholdResult, ...]
    metrics: tuple[MetricChange, ...]

    @property
    def passed(self) -> bool:
        """Same inputs, and every old threshold holds on the new figures."""
        return not self.inputs and all(result.passed for result in self.thresholds)


def thresholds(document: Mapping[str, Any]) -> list[Threshold]:
    """The document's thresholds, after checking it has every field a contract needs."""
    if not isinstance(document, Mapping):
        raise ContractError(f"a contract is a JSON object, not a {type(document).__name__}")
    missing = [name for name in REQUIRED_FIELDS if name not in document]
    if missing:
        raise ContractError(f"not a contract: missing {', '.join(map(repr, missing))}")
    version = document["contract"]
    if type(version) is not int or version != FORMAT_VERSION:
        raise ContractError(f"unsupported contract format {version!r} (this version reads {FORMAT_VERSION})")
    benchmark = document["benchmark"]
    if not isinstance(benchmark, str) or not _MODULE.fullmatch(benchmark):
        raise ContractError(f"'benchmark' must be a module name like 'benchmarks.gate_a', got {benchmark!r}")
    args = document["args"]
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ContractError(f"'args' must be a list of strings, got {args!r}")
    inputs = document["inputs"]
    if not isinstance(inputs, Mapping):
        raise ContractError(f"'inputs' must be an object, got {inputs!r}")
    for name, entry in inputs.items():
        if not (
            isinstance(entry, Mapping)
            and isinstance(entry.get("path"), str)
            and isinstance(entry.get("sha256"), str)
            and _SHA256.fullmatch(entry["sha256"])
        ):
            raise ContractError(f"input {name!r} must be {{'path': str, 'sha256': 64 lowercase hex}}, got {entry!r}")
    if not isinstance(document["figures"], Mapping):
        raise ContractError(f"'figures' must be an object, got {document['figures']!r}")
    if not isinstance(document["thresholds"], list):
        raise ContractError(f"'thresholds' must be a list, got {document['thresholds']!r}")
    parsed = [Threshold.from_json(item) for item in document["thresholds"]]
    ids = [t.id for t in parsed]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise ContractError(f"threshold ids must be unique; repeated: {duplicated}")
    return parsed


def check(document: Mapping[str, Any]) -> list[ThresholdResult]:
    """Every threshold of the document evaluated on its own figures (the signature is not looked at)."""
    return [t.check(document["figures"]) for t in thresholds(document)]


def sign(document: Mapping[str, Any], private_key: Ed25519PrivateKey) -> dict[str, Any]:
    """A copy of ``document`` with a ``"signature"`` by ``private_key`` (replacing any it had).

    The document must be a valid contract whose thresholds all evaluate (they need not hold),
    so that a misspelt path fails where the contract is made, not where it is checked.
    """
    check(document)
    body = {key: value for key, value in document.items() if key != "signature"}
    value = private_key.sign(SIGNATURE_DOMAIN + b"\0" + canonical(body))
    signature = {
        "algorithm": "ed25519",
        "public_key": identity.public_bytes(private_key.public_key()).hex(),
        "value": value.hex(),
    }
    return {**body, "signature": signature}


def _hex_field(signature: Mapping[str, Any], name: str, size: int) -> bytes:
    text = signature.get(name)
    if isinstance(text, str) and len(text) == 2 * size:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    raise ContractError(f"signature {name!r} must be {2 * size} hex digits, got {text!r}")


def verify_signature(document: Mapping[str, Any], key: bytes | None = None) -> bytes:
    """The signer's raw 32-byte public key, once the signature checks out (and, with ``key``, is by ``key``).

    ContractError if the document is malformed, unsigned, signed by another key, or altered since signing.
    """
    thresholds(document)
    signature = document.get("signature")
    if signature is None:
        raise ContractError("the contract is not signed (no 'signature')")
    if not isinstance(signature, Mapping):
        raise ContractError(f"'signature' must be an object, got {signature!r}")
    # keys outside the signed body could be changed unnoticed, so only the known three are allowed
    unknown = sorted(set(signature) - _SIGNATURE_KEYS)
    if unknown:
        raise ContractError(f"signature: unknown keys {unknown}")
    if signature.get("algorithm") != "ed25519":
        raise ContractError(f"signature algorithm must be 'ed25519', got {signature.get('algorithm')!r}")
    public_key = _hex_field(signature, "public_key", 32)
    value = _hex_field(signature, "value", 64)
    if key is not None and public_key != key:
        raise ContractError(f"signed by {public_key.hex()}, not by the expected key {key.hex()}")
    body = {name: field for name, field in document.items() if name != "signature"}
    if not identity.verify(public_key, SIGNATURE_DOMAIN, canonical(body), value):
        raise ContractError(f"the signature by {public_key.hex()} does not match the contract (altered since signing)")
    return public_key


def _no_constants(name: str) -> Any:
    raise ContractError(f"{name} is not a number a contract may hold")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # with a repeated key a reader and the verifier could each see a different value
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ContractError(f"key {key!r} appears twice in one object")
        result[key] = value
    return result


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The contract in the file at ``path``, checked for form (not for signature or thresholds)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ContractError(f"cannot read {os.fspath(path)}: {exc}") from None
    try:
        document = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_no_duplicate_keys)
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:  # ValueError: an integer of 4,300+ digits
        raise ContractError(f"{os.fspath(path)} is not JSON this reads: {exc}") from None
    except ContractError as exc:
        raise ContractError(f"{os.fspath(path)}: {exc}") from None
    try:
        thresholds(document)
    except ContractError as exc:
        raise ContractError(f"{os.fspath(path)}: {exc}") from None
    result: dict[str, Any] = document
    return result


def write(path: str | os.PathLike[str], document: Mapping[str, Any]) -> None:
    """Write ``document`` as indented JSON with sorted keys (atomically: a reader never sees half a file)."""
    try:
        text = json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
    except ValueError as exc:
        raise ContractError(f"not canonical JSON: {exc}") from None
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)


def input_record(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``inputs`` entry of a file: its path and sha256."""
    from noderuntime.models.catalogue import sha256_file

    return {"path": os.fspath(path), "sha256": sha256_file(Path(path))}


def signing_key(data_dir: Path | None = None) -> Ed25519PrivateKey:
    """The key that signs benchmark contracts on this machine (made on first use in ``data_dir``)."""
    if data_dir is None:
        import platformdirs

        data_dir = Path(platformdirs.user_data_dir("noderuntime")) / "bench"
    return identity.load_or_create(data_dir).private_key


def compare(old: Mapping[str, Any], new: Mapping[str, Any]) -> Comparison:
    """A rerun (``new``) against its original (``old``): inputs, the old thresholds, and their figures."""
    old_thresholds = thresholds(old)
    thresholds(new)
    if old["benchmark"] != new["benchmark"]:
        raise ContractError(f"cannot compare {old['benchmark']!r} with a run of {new['benchmark']!r}")
    changed = []
    for name in sorted(set(old["inputs"]) | set(new["inputs"])):
        old_sha = old["inputs"].get(name, {}).get("sha256")
        new_sha = new["inputs"].get(name, {}).get("sha256")
        if old_sha != new_sha:
            changed.append(InputChange(name=name, old=old_sha, new=new_sha))
    results = tuple(t.check(new["figures"]) for t in old_thresholds)
    # each named figure once, in the order the thresholds name them
    paths = dict.fromkeys(p for t in old_thresholds for p in (t.left, t.right) if p is not None)
    metrics = []
    for path in paths:
        before, after = figure(old["figures"], path), figure(new["figures"], path)
        metrics.append(MetricChange(path=path, old=before, new=after, ratio=after / before if before else None))
    return Comparison(inputs=tuple(changed), thresholds=results, metrics=tuple(metrics))


def rerun(document: Mapping[str, Any], out: Path, *, trusted_signer: bool = False) -> dict[str, Any]:
    """Run the document's benchmark again with its arguments, writing to ``out``, and load what it wrote.

    The command is ``python -m <benchmark> <args...> --out <out>``; output goes to this process's
    stdout and stderr. ContractError if the benchmark fails or writes no contract.

    The file names the module to run, so a module outside this project's ``benchmarks``
    runs only when the caller vouched for the signer (``trusted_signer``: it checked the
    signature against a key it trusts): otherwise any file could run any installed module.
    """
    thresholds(document)  # checks the module name and the args too
    module = document["benchmark"]
    # the child must import the benchmark from wherever this process could
    path, cwd = sys.path, None
    if not trusted_signer:
        name = re.fullmatch(r"benchmarks\.([a-z_][a-z0-9_]*)", module)
        if name is None or not (_ROOT / "benchmarks" / f"{name.group(1)}.py").is_file():
            raise ContractError(
                f"a contract from an unnamed signer reruns one of this project's benchmarks, not {module!r:.60} "
                "(give the signer's key to run it)"
            )
        # python -m puts its working directory first on the path: there, it finds this project's
        path, cwd = [str(_ROOT), *sys.path], _ROOT
    command = [sys.executable, "-m", module, *document["args"], "--out", os.fspath(out.resolve())]
    # a stale file from an earlier run must not pass for this run's result
    out.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    try:
        code = subprocess.run(command, env=env, cwd=cwd, check=False).returncode
    except OSError as exc:
        raise ContractError(f"cannot run {document['benchmark']}: {exc}") from None
    if code != 0:
        raise ContractError(f"rerun of {document['benchmark']} failed with exit code {code}")
    if not out.exists():
        raise ContractError(f"rerun of {document['benchmark']} exited 0 but wrote no contract to {out}")
    return load(out)


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    lines = [headers, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def results_table(results: Sequence[ThresholdResult]) -> str:
    """One line per threshold: id, left figure, op, right-hand side (as written and its value), pass/FAIL."""
    rows = [
        (
            r.threshold.id,
            _number(r.left),
            r.threshold.op,
            r.threshold.right_side if r.threshold.right is None else f"{_number(r.right)} ({r.threshold.right_side})",
            "pass" if r.passed else "FAIL",
        )
        for r in results
    ]
    return _table(("id", "left", "op", "right", "result"), rows)


def comparison_table(comparison: Comparison) -> str:
    """One line per figure the thresholds name: path, old, new, new/old."""
    rows = [(m.path, _number(m.old), _number(m.new), _number(m.ratio)) for m in comparison.metrics]
    return _table(("metric", "old", "new", "new/old"), rows)
