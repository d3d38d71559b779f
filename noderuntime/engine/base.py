"""Plain data that crosses between the batcher and an engine, and the engine interface itself (no llama.cpp here)."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

from protocol import Sampling, TokenLogprob


class EngineError(RuntimeError):
    """The shard could not be loaded or a batch could not be run."""


class GrammarError(EngineError):
    """A grammar (or a JSON schema made into one) that cannot be compiled, or an engine without grammars."""


@attrs.frozen(eq=False)
class Rows:
    """One batch of rows to run. Arrays are parallel; exactly one of tokens / hidden is set."""

    seq_ids: np.ndarray  # int32 [n]
    positions: np.ndarray  # int32 [n]
    outputs: np.ndarray  # bool [n]: rows whose logits the tail should produce
    tokens: np.ndarray | None = None  # int32 [n], head shard
    hidden: np.ndarray | None = None  # float32 [n, n_embd], other shards
    # int32 [n] or None: per row, the drafted token its sequence's next row was given (-1: none).
    # A sampled row whose draw differs ends its sequence's draws: its later rows were computed
    # on a draft the model did not pick (speculative decoding), so they draw nothing
    drafts: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.seq_ids)


@attrs.frozen(eq=False)
class StepResult:
    """What one run produced."""

    hidden: np.ndarray | None  # float32 [n, n_embd]: every row's residual (non-tail) or normed state
    logits: np.ndarray | None  # float32 [n_outputs, n_vocab], in row order of the outputs
    sampled: dict[int, int]  # row index -> sampled token, for rows given a sampler
    seconds: float
    # row index -> log-probability of its sampled token (chains whose params ask) or of its scored token
    logprobs: Mapping[int, TokenLogprob] = attrs.field(factory=dict)


@attrs.frozen
class MemoryReport:
    """Bytes a loaded shard holds, by its engine's own accounting: all of it, and of that the
    part in host memory (all of it on the CPU; on a GPU, what stays behind, such as the token
    embeddings and the host's side of the compute buffers)."""

    weights: int
    kv: int
    compute: int
    host_weights: int
    host_kv: int
    host_compute: int

    @property
    def total(self) -> int:
        """All three together."""
        return self.weights + self.kv + self.compute

    @property
    def host(self) -> int:
        """What of the total lives in host memory."""
        return self.host_weights + self.host_kv + self.host_compute

    @property
    def device(self) -> int:
        """What of the total lives in a device's own memory."""
        return self.total - self.host


# OpenAI's stand-in for the log-probability of a token the model rules out (-inf)
LOGPROB_FLOOR = -9999.0


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under ``logits`` (one row, before any sampler's transforms).

    With the ``top`` most likely tokens and theirs, most likely first, ties in id order. Of
    tokens tied at the cut-off, which make the list is numpy's partition's choice (the same
    for the same logits), not always the lowest ids.
    """
    row = logits.astype(np.float64, copy=False)
    peak = float(row.max())
    total = peak + float(np.log(np.exp(row - peak).sum()))

    def of(t: int) -> float:
        # a float32 rounding may put the most likely token a hair above 0
        return max(LOGPROB_FLOOR, min(0.0, float(row[t]) - total))

    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        candidates = np.argpartition(-row, min(top, row.size - 1))[:top]
        ordered = sorted(candidates.tolist(), key=lambda t: (-row[t], t))
        best = tuple((int(t), of(int(t))) for t in ordered)
    return TokenLogprob(int(token), of(int(token)), best)


class Engine(Protocol):
    """What the node and its batcher need of an engine: the llama.cpp one, the Transformers one, or a test's fake.

    Once the node serves, its batcher alone calls :meth:`run` and :meth:`remove_sequence`
    (a probe's too, through ``Batcher.exclusive``); the node makes a tail session's sampler
    chain with :meth:`new_sampler` when it admits the session.
    """

    is_head: bool
    is_tail: bool
    n_embd: int
    n_vocab: int

    def run(
        self,
        rows: Rows,
        *,
        samplers: Mapping[int, Any] | None = None,
        want_logits: bool = False,
        scores: Mapping[int, tuple[int, int]] | None = None,
    ) -> StepResult:
        """Run one batch (``scores``: output rows -> (token, top) whose log-probability is wanted)."""
        ...

    def remove_sequence(self, seq_id: int) -> None:
        """Drop a sequence's KV."""
        ...

    def truncate_sequence(self, seq_id: int, keep: int) -> None:
        """Drop a sequence's KV from position ``keep`` on (a decode window's rows that were not kept)."""
        ...

    def new_sampler(self, params: Sampling, history: Sequence[int] = (), generated: Sequence[int] = ()) -> Any:
        """A sampler chain for a session, primed with ``history`` (the prompt) for penalties.

        ``generated``: tokens this session already sampled (a session resumed on a new
        route): the chain takes them as it took them then, grammar and penalties alike, so
        it picks next what the first chain would have. Every seeded draw depends on the
        seed and the position alone (:func:`draw_seed`), not on how many came before.
        """
        ...

    def kv_cells_used(self) -> int:
        """KV cells held by all sequences."""
        ...

    @property
    def live_samplers(self) -> int:
        """Sampler chains not yet closed."""
        ...


@runtime_checkable
class SavesSequences(Protocol):
    """An engine that can save a sequence's KV and put it back (for a node's prefix cache)."""

    def save_sequence(self, seq_id: int) -> bytes:
        """The KV ``seq_id`` holds, as bytes."""
        ...

    def restore_sequence(self, seq_id: int, state: bytes, keep: int) -> None:
        """Put saved KV into the empty ``seq_id``, keeping its first ``keep`` positions."""
        ...

    def truncate_sequence(self, seq_id: int, keep: int) -> None:
        """Drop a sequence's KV from position ``keep`` on."""
        ...

    def positions(self, seq_id: int) -> tuple[int, int] | None:
        """(first, last) position ``seq_id`` holds in KV, or ``None`` when empty."""
        ...


def draws_to_keep(rows: Rows, row: int, token: int) -> bool:
    """Whether ``row``'s sequence draws on after ``token`` was drawn there: yes unless the
    next row was given a draft that differs from it."""
    return rows.drafts is None or rows.drafts[row] < 0 or int(rows.drafts[row]) == token


def draw_seed(seed: int, position: int) -> int:
    """The 32-bit seed of the draw that picks the token after ``position`` in a session seeded ``seed``.

    Counter-based: a draw depends on (seed, position) only, so a sampler rebuilt on another
    node after a route repair draws what the lost one would have. SplitMix64's finalizer
    over both, so that neighbouring positions get unrelated generators.
    """
    z = (seed ^ (position * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def transformers_versions() -> dict[str, str]:
    """Versions of the libraries the Transformers engine runs on, read without importing them
    (torch alone takes seconds to import)."""
    return {name: importlib.metadata.version(name) for name in ("torch", "transformers", "safetensors")}
