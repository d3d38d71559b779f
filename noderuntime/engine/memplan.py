"""Memory admission: what a shard will hold, known before it is loaded.

A node given ``--memory-limit`` asks llama.cpp to size its shard without allocating it
(a dry run reads the GGUF index and sizes every buffer the real load would make: the
weights of its layers, KV for its slots, compute buffers), adds what the process itself
holds, and refuses to start when the sum exceeds the limit, saying how many layers
would fit. Such a node loads its weights without mmap, so that what it holds is its
own layers in anonymous memory: a limit on resident memory means what it says.
"""

from __future__ import annotations

import os
import re

import attrs

from noderuntime.engine.llama import EngineError, Recipe, ShardEngine
from noderuntime.models.artifacts import LayerRange, inspect

# What a node process holds besides llama.cpp's buffers: the interpreter, numpy,
# llama.cpp's code, grpclib, hypercorn, trio and their heaps. Measured on the fit
# lane's nodes (benchmarks/results/fit.quick.json): peak RSS minus llama.cpp's own
# totals was 118-125 MiB. The rest is headroom for what a busy node holds in flight
# (prompt-sized activations, connection buffers).
RUNTIME_BYTES = 224 << 20

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KIB": 1 << 10,
    "M": 1000**2,
    "MB": 1000**2,
    "MIB": 1 << 20,
    "G": 1000**3,
    "GB": 1000**3,
    "GIB": 1 << 30,
    "T": 1000**4,
    "TB": 1000**4,
    "TIB": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """``"2.5G"``, ``"1536MiB"``, ``"1000000"``: a byte count (decimal and binary units)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 2500000000, 2.5G or 2400MiB)")
    scaled = float(match.group(1)) * _UNITS[match.group(2).upper()]
    if not 0 < scaled < 1 << 60:  # float() of 400 digits is inf, and int(inf) raises OverflowError
        raise ValueError(f"a size must be positive and below an exbibyte, not {text!r:.40}")
    return int(scaled)


def human(n: int) -> str:
    """Bytes as MiB or GiB, for messages."""
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


@attrs.frozen
class ShardNeeds:
    """What a shard will hold once loaded, by llama.cpp's sizing plus the process."""

    layers: LayerRange
    weights: int
    kv: int
    compute: int
    runtime: int = RUNTIME_BYTES

    @property
    def total(self) -> int:
        """Everything together: what the node's resident memory will reach."""
        return self.weights + self.kv + self.compute + self.runtime

    def describe(self) -> str:
        """One line: the total and its parts."""
        return (
            f"{human(self.total)} (weights {human(self.weights)}, KV {human(self.kv)}, "
            f"compute {human(self.compute)}, runtime {human(self.runtime)})"
        )


class MemoryLimitError(EngineError):
    """The shard does not fit the node's memory limit."""

    def __init__(self, message: str, needs: ShardNeeds, fitting: LayerRange | None) -> None:
        super().__init__(message)
        self.needs = needs
        self.fitting = fitting


def capped(recipe: Recipe) -> Recipe:
    """The recipe a memory-limited node runs: weights read into memory, not mapped.

    A mapped file's pages are shared page cache that the kernel may evict and fault back at
    any time; read weights are the node's own, and its limit covers exactly them.
    """
    return attrs.evolve(recipe, use_mmap=False)


def needs(model: str | os.PathLike[str], layers: LayerRange, recipe: Recipe) -> ShardNeeds:
    """What serving ``layers`` of ``model`` with ``recipe`` will hold (a dry run: seconds, no allocation)."""
    engine = ShardEngine(model, capped(recipe), layers, dry_run=True)
    try:
        report = engine.memory()
    finally:
        engine.close()
    return ShardNeeds(layers, report.weights, report.kv, report.compute)


def widest_fit(model: str | os.PathLike[str], start: int, end: int, recipe: Recipe, limit: int) -> LayerRange | None:
    """The longest range ``start:k`` (k <= ``end``) that fits ``limit``; ``None`` if not even one layer does."""
    lo, hi = start, end  # start:lo is known to fit (trivially, when empty); start:hi+1 does not
    best: LayerRange | None = None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        candidate = LayerRange(start, mid)
        if needs(model, candidate, recipe).total <= limit:
            best, lo = candidate, mid
        else:
            hi = mid - 1
    return best


def check(model: str | os.PathLike[str], layers: LayerRange, recipe: Recipe, limit: int) -> ShardNeeds:
    """The shard's needs when they fit ``limit``; otherwise a :class:`MemoryLimitError` that says what would."""
    wanted = needs(model, layers, recipe)
    if wanted.total <= limit:
        return wanted
    info = inspect(model, verify=False)
    if info.layer_range != LayerRange(0, info.n_layer):
        # a shard file holds its range only: no shorter range of it can be tried, or served
        message = f"layers {layers} need {wanted.describe()}, over the memory limit of {human(limit)}"
        advice = "lower --slots or --ctx, or cut a shorter shard from the whole model"
        raise MemoryLimitError(f"{message}: {advice}", wanted, None)
    fitting = widest_fit(model, layers.start, layers.end - 1, recipe, limit)
    if fitting is None:
        advice = (
            f"not even layer {layers.start} alone fits with {recipe.n_seq_max} slots of {recipe.n_ctx_per_seq} "
            "tokens; lower --slots or --ctx, or raise the limit"
        )
    else:
        advice = f"{len(fitting)} layers would fit ({fitting.start}:{fitting.end}); serve those with --layers"
    message = f"layers {layers} need {wanted.describe()}, over the memory limit of {human(limit)}: {advice}"
    raise MemoryLimitError(message, wanted, fitting)


__all__ = ["RUNTIME_BYTES", "MemoryLimitError", "ShardNeeds", "capped", "check", "human", "needs", "parse_bytes"]
