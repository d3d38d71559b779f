"""Capability admission: what a node measures of itself, and the known-answer probe.

*Capability.* At start a node times its own shard — prefill per token, one decode
step at batch 1 and at batch 8 — and reads llama.cpp's memory breakdown, then signs
the figures together with its artifact, layer range and recipe fingerprint. The
tracker checks the signature and the claims against the registration and routes by
these measurements (step cost under load, how many sessions a node gets), never by
what a node merely declares.

*Probe.* A fixed input, derived from a seed, run through one shard: token ids for a
head shard, hidden rows for the others, on a sequence slot of its own. The answer is
a sha256 of the output (exact match) and a random projection of it (a *sketch*,
compared with a relative tolerance, for CPUs whose kernels round differently). A
tracker holding references for (artifact, layers, recipe) — written by ``noderuntime
probe reference`` from a trusted copy — challenges each node with a seed it picks at
random and keeps a node whose answer does not match out of every route. Whoever holds
the weights can compute an answer; whoever does not (or holds damaged or different
weights under the same fingerprint) cannot.

The engine functions here are synchronous and must run where the engine is owned: on
the engine's thread, through ``Batcher.exclusive`` once the node serves, or before it does.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from noderuntime.access import untrusted
from noderuntime.access.identity import Identity, verify
from noderuntime.engine.base import Rows

if TYPE_CHECKING:
    from noderuntime.engine.llama import ShardEngine

CAPABILITY_DOMAIN = b"noderuntime-capability-v1"
PROBE_ROWS = 8
SKETCH_DIM = 32
SKETCH_BOUND = 1e30  # what a sketch entry may be, as the tracker bounds it (tracker.messages.ProbeReply)
DEFAULT_TOLERANCE = 1e-3
MEASURE_BATCH = 8
MAX_MEMORY_BYTES = 1 << 50  # a measured figure past a pebibyte is a lie, and too large for float arithmetic
MAX_THREADS = 1 << 16


class AdmissionError(ValueError):
    """A capability record or probe answer that cannot be accepted."""


# --- capability


@attrs.frozen
class Capability:
    """A shard's measured speed and memory."""

    prefill_ms_per_token: float
    decode_ms: tuple[tuple[int, float], ...]  # (batch, milliseconds per decode step), increasing batch
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    threads: int

    def step_ms(self, batch: int) -> float:
        """Decode step time at ``batch`` sequences: linear between (and beyond) the measured points."""
        (b0, t0), (b1, t1) = self.decode_ms[0], self.decode_ms[-1]
        if b1 == b0:
            return t0 * max(1, batch) / b0
        slope = max(0.0, (t1 - t0) / (b1 - b0))
        return t0 + slope * (max(1, batch) - b0)

    def to_json(self) -> dict[str, Any]:
        """The measured figures as published."""
        return {
            "prefill_ms_per_token": self.prefill_ms_per_token,
            "decode_ms": {str(b): t for b, t in self.decode_ms},
            "memory_bytes": {"weights": self.weights_bytes, "kv": self.kv_bytes, "compute": self.compute_bytes},
            "threads": self.threads,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Capability:
        """Parse and sanity-check published figures; :class:`AdmissionError` if they make no sense."""
        try:
            decode = sorted((int(b), float(t)) for b, t in dict(data["decode_ms"]).items())
            memory = dict(data["memory_bytes"])
            capability = cls(
                prefill_ms_per_token=float(data["prefill_ms_per_token"]),
                decode_ms=tuple(decode),
                weights_bytes=int(memory["weights"]),
                kv_bytes=int(memory["kv"]),
                compute_bytes=int(memory["compute"]),
                threads=int(data["threads"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # int(1e999) overflows
            raise AdmissionError(f"capability figures are malformed: {exc}") from None
        times = [capability.prefill_ms_per_token, *(t for _, t in decode)]
        if not decode or len(decode) > 16 or any(b < 1 or b > 4096 for b, _ in decode):
            raise AdmissionError("capability needs decode times for 1 to 16 batch sizes in 1..4096")
        if not all(math.isfinite(t) and 0 < t < 1e7 for t in times):
            raise AdmissionError("capability times must be positive milliseconds")
        sizes = (capability.weights_bytes, capability.kv_bytes, capability.compute_bytes)
        if not all(0 <= b < MAX_MEMORY_BYTES for b in sizes) or not 0 <= capability.threads <= MAX_THREADS:
            raise AdmissionError("capability memory must be 0 to 1 PiB and threads 0 to 65536")
        return capability


def _input_rows(engine: ShardEngine, rng: np.random.Generator, seq_ids: np.ndarray, positions: np.ndarray) -> Rows:
    n = len(seq_ids)
    outputs = np.ones(n, dtype=bool)
    if engine.is_head:
        tokens = rng.integers(0, engine.n_vocab, size=n, dtype=np.int32)
        return Rows(seq_ids.astype(np.int32), positions.astype(np.int32), outputs, tokens=tokens)
    hidden = rng.standard_normal((n, engine.n_embd), dtype=np.float32)
    return Rows(seq_ids.astype(np.int32), positions.astype(np.int32), outputs, hidden=hidden)


# positions each measuring sequence is prefilled with before its decode steps. Every node
# measures at start and after each move, and rows cost about what a decode row costs
# (kernels that compute each row as alone): SmolLM2's halves on one thread took 440-560 ms
# to measure with 16, 180-240 ms with 4, their per-token and step times the same to within
# 5 % (AMD EPYC). A decode step's attention over 4 or 16 positions costs alike
MEASURE_CONTEXT = 4


def measure(engine: ShardEngine, *, context: int = MEASURE_CONTEXT, reps: int = 3) -> Capability:
    """Time this shard: prefill, then decode at batch 1 and at batch ``min(8, slots)``.

    Uses sequences ``0..batch-1`` and removes their KV afterwards, so it must run before
    the node admits sessions.
    """
    recipe = engine.recipe
    batch = max(1, min(MEASURE_BATCH, recipe.n_seq_max))
    context = max(1, min(context, recipe.n_ctx_per_seq - 2 * reps - 1, recipe.n_batch))
    rng = np.random.default_rng(0)
    next_pos = np.zeros(batch, dtype=np.int64)
    try:
        # prefill `context` rows into each sequence, as many sequences per batch as fit
        per_batch = max(1, recipe.n_batch // context)
        prefill_seconds = 0.0
        for first in range(0, batch, per_batch):
            seqs = np.arange(first, min(batch, first + per_batch))
            seq_ids = np.repeat(seqs, context)
            positions = np.tile(np.arange(context), len(seqs))
            prefill_seconds += engine.run(_input_rows(engine, rng, seq_ids, positions)).seconds
        next_pos[:] = context

        def decode(seqs: np.ndarray) -> float:
            times = []
            for _ in range(reps):
                rows = _input_rows(engine, rng, seqs, next_pos[seqs])
                times.append(engine.run(rows).seconds)
                next_pos[seqs] += 1
            return statistics.median(times) * 1e3

        points = [(1, decode(np.arange(1)))]
        if batch > 1:
            points.append((batch, decode(np.arange(batch))))
    finally:
        for seq in range(batch):
            engine.remove_sequence(seq)
    memory = engine.memory()
    return Capability(
        prefill_ms_per_token=prefill_seconds * 1e3 / (batch * context),
        decode_ms=tuple((b, round(t, 4)) for b, t in points),
        weights_bytes=memory.weights,
        kv_bytes=memory.kv,
        compute_bytes=memory.compute,
        threads=recipe.n_threads,
    )


def capability_record(
    me: Identity, *, artifact: str, layers: tuple[int, int], recipe: str, capability: Capability
) -> dict[str, str]:
    """The signed record a node sends in its registration."""
    body = json.dumps(
        {
            "node_id": me.node_id.hex(),
            "artifact": artifact,
            "layers": list(layers),
            "recipe": recipe,
            "measured": capability.to_json(),
            "measured_at": round(time.time(), 3),
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return {"body": body, "signature": me.sign(CAPABILITY_DOMAIN, body.encode()).hex()}


def check_capability(
    record: Mapping[str, Any], *, node_id: bytes, artifact: str, layers: tuple[int, int], recipe: str
) -> Capability:
    """Verify a registration's capability record against the node's key and its other claims."""
    try:
        body = str(record["body"])
        signature = bytes.fromhex(str(record["signature"]))
    except (KeyError, TypeError, ValueError):
        raise AdmissionError("capability must be {'body': JSON text, 'signature': hex}") from None
    try:
        fields = untrusted.json_object(body, "capability body")
    except ValueError as exc:
        raise AdmissionError(str(exc)) from None
    if not verify(node_id, CAPABILITY_DOMAIN, body.encode(), signature):
        raise AdmissionError("capability signature does not verify with the node's key")
    claims = {"node_id": node_id.hex(), "artifact": artifact, "layers": list(layers), "recipe": recipe}
    for key, value in claims.items():
        if fields.get(key) != value:
            raise AdmissionError(f"capability was measured for another {key.replace('_', ' ')}")
    return Capability.from_json(fields.get("measured") or {})


# --- the known-answer probe


@attrs.frozen
class ProbeAnswer:
    """A shard's output for one probe seed."""

    seed: int
    digest: str  # sha256 of the output rows, float32 little-endian
    sketch: tuple[float, ...]  # PROBE_ROWS x SKETCH_DIM projection of the output, row-major

    def to_json(self) -> dict[str, Any]:
        """As sent to the tracker and stored in reference files."""
        return {"seed": self.seed, "digest": self.digest, "sketch": list(self.sketch)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProbeAnswer:
        """Parse an answer; :class:`AdmissionError` if malformed."""
        try:
            answer = cls(int(data["seed"]), str(data["digest"]), tuple(float(x) for x in data["sketch"]))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise AdmissionError(f"probe answer is malformed: {exc}") from None
        if len(answer.sketch) != PROBE_ROWS * SKETCH_DIM or len(answer.digest) != 64:
            raise AdmissionError("probe answer has the wrong shape")
        return answer


def probe(engine: ShardEngine, seed: int, seq_id: int) -> ProbeAnswer:
    """Run the probe input of ``seed`` on sequence ``seq_id`` (which must be empty) and remove it again."""
    if not 0 <= seed < 2**63:
        raise AdmissionError("probe seeds are 63-bit non-negative integers")
    rng = np.random.default_rng(seed)
    rows = _input_rows(engine, rng, np.full(PROBE_ROWS, seq_id), np.arange(PROBE_ROWS))
    try:
        result = engine.run(rows, want_logits=engine.is_tail)
    finally:
        engine.remove_sequence(seq_id)
    output = result.logits if engine.is_tail else result.hidden
    assert output is not None and output.shape[0] == PROBE_ROWS
    return answer_for(seed, np.ascontiguousarray(output, dtype=np.float32))


def answer_for(seed: int, output: np.ndarray) -> ProbeAnswer:
    """The answer for a shard output (rows x width, float32)."""
    digest = hashlib.sha256(output.astype("<f4").tobytes()).hexdigest()
    # a projection the node cannot know before it has the seed
    projection = np.random.default_rng([seed, 1]).standard_normal((output.shape[1], SKETCH_DIM), dtype=np.float32)
    sketch = (output.astype(np.float64) @ projection.astype(np.float64)) / math.sqrt(output.shape[1])
    # a shard whose output is not finite (damaged weights) still answers, as far off as a sketch
    # may be: JSON and the tracker's bounds take no NaN, and its probe must fail, not its node
    sketch = np.nan_to_num(np.clip(sketch, -SKETCH_BOUND, SKETCH_BOUND), nan=SKETCH_BOUND)
    return ProbeAnswer(seed, digest, tuple(float(x) for x in sketch.ravel()))


@attrs.frozen
class Verdict:
    """How an answer compares with the reference."""

    passed: bool
    exact: bool
    relative_error: float

    def describe(self) -> str:
        """One line for logs and status."""
        if self.exact:
            return "exact"
        return f"{'within' if self.passed else 'outside'} tolerance (relative error {self.relative_error:.2e})"


def compare(reference: ProbeAnswer, answer: ProbeAnswer, tolerance: float = DEFAULT_TOLERANCE) -> Verdict:
    """Exact digest match passes; otherwise the sketches must agree to ``tolerance`` (relative L2)."""
    if reference.seed != answer.seed:
        return Verdict(False, False, math.inf)
    if reference.digest == answer.digest:
        return Verdict(True, True, 0.0)
    ref = np.asarray(reference.sketch)
    got = np.asarray(answer.sketch)
    denominator = float(np.linalg.norm(ref)) or 1.0
    error = float(np.linalg.norm(got - ref)) / denominator
    if not math.isfinite(error):
        error = math.inf
    return Verdict(error <= tolerance, False, error)


ReferenceKey = tuple[str, tuple[int, int], str]  # (artifact, layers, recipe)


class ProbeReferences:
    """Reference answers by (artifact, layers, recipe), from ``noderuntime probe reference`` files."""

    def __init__(self, entries: Iterable[tuple[ReferenceKey, ProbeAnswer]] = ()) -> None:
        self._by_key: dict[ReferenceKey, dict[int, ProbeAnswer]] = {}
        for key, answer in entries:
            self._by_key.setdefault(key, {})[answer.seed] = answer

    @classmethod
    def load(cls, paths: Iterable[str | Path]) -> ProbeReferences:
        """Read reference files; :class:`AdmissionError` names the first bad one."""
        entries = []
        for path in paths:
            try:
                data = untrusted.json_object(Path(path).read_bytes(), "the file")
                for item in data["references"]:
                    key = (str(item["artifact"]), (int(item["layers"][0]), int(item["layers"][1])), str(item["recipe"]))
                    entries.append((key, ProbeAnswer.from_json(item)))
            except (OSError, KeyError, TypeError, ValueError, IndexError) as exc:
                raise AdmissionError(f"cannot read probe references {path}: {exc}") from None
        return cls(entries)

    def seeds(self, key: ReferenceKey) -> list[int]:
        """Seeds with a reference for this shard (empty: it cannot be probed)."""
        return sorted(self._by_key.get(key, {}))

    def get(self, key: ReferenceKey, seed: int) -> ProbeAnswer | None:
        """The reference answer, if any."""
        return self._by_key.get(key, {}).get(seed)

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_key.values())


def reference_entry(artifact: str, layers: tuple[int, int], recipe: str, answer: ProbeAnswer) -> dict[str, Any]:
    """One entry of a reference file."""
    return {"artifact": artifact, "layers": list(layers), "recipe": recipe, **answer.to_json()}


def make_references(
    model: str | Path, ranges: Iterable[tuple[int, int]], *, seeds: int, recipe_options: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Reference answers for ``seeds`` random seeds on each layer range of ``model`` (a trusted copy).

    ``recipe_options`` are :class:`~noderuntime.engine.llama.Recipe` fields; the recipe
    fingerprint they give must be the one the probed nodes run.
    """
    import secrets

    from noderuntime.engine.llama import Recipe, ShardEngine

    recipe = Recipe(**{"n_seq_max": 1, **recipe_options})
    chosen = [secrets.randbelow(2**63) for _ in range(seeds)]
    entries = []
    for start, end in ranges:
        from noderuntime.models.artifacts import LayerRange

        with ShardEngine(model, recipe, LayerRange(start, end)) as engine:
            fingerprint = recipe.fingerprint(engine.info.quant)
            for seed in chosen:
                answer = probe(engine, seed, 0)
                entries.append(reference_entry(engine.info.fingerprint, (start, end), fingerprint, answer))
    return entries
