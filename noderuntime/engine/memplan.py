"""Memory admission: what a shard will hold, known before it is loaded.

A node given ``--memory-limit`` asks llama.cpp to size its shard without allocating it
(a dry run reads the GGUF index and sizes every buffer the real load would make: the
weights of its layers, KV for its slots, compute buffers), adds what the process itself
holds, and refuses to start when the sum exceeds the limit, saying how many layers
would fit. Such a node loads its weights without mmap, so that what it holds is its
own layers in anonymous memory: a limit on resident memory means what it says.

A shard on a GPU is planned on both sides: what stays in host memory (token embeddings,
the host's side of the compute buffers, the process) against ``--memory-limit`` when one
is given, and what the device holds (its layers, their KV, its compute buffers) against
the memory the device reports free. Either side too small refuses the shard before it
loads, naming how many layers would fit.
"""

from __future__ import annotations

import os
import re

import attrs

from noderuntime.engine.base import EngineError
from noderuntime.engine.llama import Recipe, ShardEngine, device_memory
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
    """What a shard will hold once loaded, by llama.cpp's sizing plus the process.

    ``on_device`` is the part of weights, KV and compute in ``device``'s own memory (none
    on the CPU); the rest, and the runtime, is host memory.
    """

    layers: LayerRange
    weights: int
    kv: int
    compute: int
    runtime: int = RUNTIME_BYTES
    device: str = "cpu"
    on_device: int = 0
    prefix_cache: int = 0  # finished sessions' KV it may keep (host memory, --prefix-cache)

    @property
    def total(self) -> int:
        """Everything together, on the host and on the device."""
        return self.weights + self.kv + self.compute + self.runtime + self.prefix_cache

    @property
    def host(self) -> int:
        """What the node's resident memory will reach."""
        return self.total - self.on_device

    def describe(self) -> str:
        """One line: the total and its parts."""
        parts = (
            f"weights {human(self.weights)}, KV {human(self.kv)}, "
            f"compute {human(self.compute)}, runtime {human(self.runtime)}"
        )
        if self.prefix_cache:
            parts += f", prefix cache {human(self.prefix_cache)}"
        if self.device == "cpu":
            return f"{human(self.total)} ({parts})"
        return f"{human(self.on_device)} on {self.device} and {human(self.host)} of host memory ({parts})"


class MemoryLimitError(EngineError):
    """The shard does not fit the node's memory limit."""

    def __init__(self, message: str, needs: ShardNeeds, fitting: LayerRange | None) -> None:
        super().__init__(message)
        self.needs = needs
        self.fitting = fitting


@attrs.frozen
class Budget:
    """What a shard may hold: host memory (``--memory-limit``) and, on a GPU, device memory."""

    host: int | None = None
    device: int | None = None

    def admits(self, wanted: ShardNeeds) -> bool:
        """Whether ``wanted`` fits on both sides."""
        return (self.host is None or wanted.host <= self.host) and (
            self.device is None or wanted.on_device <= self.device
        )

    def describe(self, wanted: ShardNeeds) -> str:
        """Which side, or sides, ``wanted`` is over."""
        over = []
        if self.host is not None and wanted.host > self.host:
            over.append(f"the memory limit of {human(self.host)}")
        if self.device is not None and wanted.on_device > self.device:
            over.append(f"the {human(self.device)} {wanted.device} has free")
        return " and ".join(over)


def device_budget(recipe: Recipe, host_limit: int | None) -> Budget:
    """The budget of a shard with ``recipe``: ``host_limit``, and on a GPU the memory it reports free."""
    if recipe.device == "cpu":
        return Budget(host=host_limit)
    free, _total = device_memory(recipe.device)
    return Budget(host=host_limit, device=free)


def capped(recipe: Recipe) -> Recipe:
    """The recipe a memory-limited node runs: weights read into memory, not mapped.

    A mapped file's pages are shared page cache that the kernel may evict and fault back at
    any time; read weights are the node's own, and its limit covers exactly them.
    """
    return attrs.evolve(recipe, use_mmap=False)


def needs(model: str | os.PathLike[str], layers: LayerRange, recipe: Recipe, prefix_cache: int = 0) -> ShardNeeds:
    """What serving ``layers`` of ``model`` with ``recipe`` will hold (a dry run: seconds, no allocation),
    with a prefix cache of ``prefix_cache`` bytes."""
    engine = ShardEngine(model, capped(recipe), layers, dry_run=True)
    try:
        report = engine.memory()
    finally:
        engine.close()
    return ShardNeeds(
        layers,
        report.weights,
        report.kv,
        report.compute,
        device=recipe.device,
        on_device=report.device,
        prefix_cache=prefix_cache,
    )


def draft_needs(model: str | os.PathLike[str], recipe: Recipe) -> ShardNeeds:
    """What a draft model (``up --draft``, :mod:`noderuntime.node.draftmodel`) holds beside the node's
    shard: the whole model with the node's recipe, a sequence for each of its slots. The process's
    runtime is counted once, with the shard."""
    return attrs.evolve(needs(model, inspect(model, verify=False).layer_range, recipe), runtime=0)


def widest_fit(
    model: str | os.PathLike[str], start: int, end: int, recipe: Recipe, limit: int | Budget, prefix_cache: int = 0
) -> LayerRange | None:
    """The longest range ``start:k`` (k <= ``end``) that fits ``limit`` (host bytes, or a budget);
    ``None`` if not even one layer does."""
    budget = limit if isinstance(limit, Budget) else Budget(host=limit)
    lo, hi = start, end  # start:lo is known to fit (trivially, when empty); start:hi+1 does not
    best: LayerRange | None = None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        candidate = LayerRange(start, mid)
        if budget.admits(needs(model, candidate, recipe, prefix_cache)):
            best, lo = candidate, mid
        else:
            hi = mid - 1
    return best


DEFAULT_PREFIX_CACHE = 256 << 20


def prefix_cache_size(
    model: str | os.PathLike[str], layers: LayerRange, recipe: Recipe, budget: Budget, asked: int | None
) -> int:
    """The prefix cache a node keeps: ``asked`` when its operator named a size (counted in full
    against the limit by :func:`check`); otherwise :data:`DEFAULT_PREFIX_CACHE`, or, under a
    host memory limit, what the shard leaves of it up to that (0 when it leaves nothing), so
    that a node that fits its limit without a cache still starts."""
    if asked is not None:
        return asked
    if budget.host is None:
        return DEFAULT_PREFIX_CACHE
    left = budget.host - needs(model, layers, recipe).host
    return max(0, min(DEFAULT_PREFIX_CACHE, left))


def check(
    model: str | os.PathLike[str], layers: LayerRange, recipe: Recipe, limit: int | Budget, prefix_cache: int = 0
) -> ShardNeeds:
    """The shard's needs when they fit ``limit`` (host bytes, or a budget of host and device memory);
    otherwise a :class:`MemoryLimitError` that says what would."""
    budget = limit if isinstance(limit, Budget) else Budget(host=limit)
    wanted = needs(model, layers, recipe, prefix_cache)
    if budget.admits(wanted):
        return wanted
    info = inspect(model, verify=False)
    message = f"layers {layers} need {wanted.describe()}, over {budget.describe(wanted)}"
    if info.layer_range != LayerRange(0, info.n_layer):
        # a shard file holds its range only: no shorter range of it can be tried, or served
        advice = "lower --slots or --ctx, or cut a shorter shard from the whole model"
        raise MemoryLimitError(f"{message}: {advice}", wanted, None)
    fitting = widest_fit(model, layers.start, layers.end - 1, recipe, budget, prefix_cache)
    if fitting is None:
        advice = (
            f"not even layer {layers.start} alone fits with {recipe.n_seq_max} slots of {recipe.n_ctx_per_seq} "
            "tokens; lower --slots or --ctx, or raise the limit"
        )
    else:
        advice = f"{len(fitting)} layers would fit ({fitting.start}:{fitting.end}); serve those with --layers"
    raise MemoryLimitError(f"{message}: {advice}", wanted, fitting)


__all__ = [
    "DEFAULT_PREFIX_CACHE",
    "RUNTIME_BYTES",
    "Budget",
    "MemoryLimitError",
    "ShardNeeds",
    "capped",
    "check",
    "device_budget",
    "draft_needs",
    "human",
    "needs",
    "parse_bytes",
    "prefix_cache_size",
]
