"""Plain data that crosses between the batcher and an engine (no llama.cpp here)."""

from __future__ import annotations

import attrs
import numpy as np


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

    def __len__(self) -> int:
        return len(self.seq_ids)


@attrs.frozen(eq=False)
class StepResult:
    """What one run produced."""

    hidden: np.ndarray | None  # float32 [n, n_embd]: every row's residual (non-tail) or normed state
    logits: np.ndarray | None  # float32 [n_outputs, n_vocab], in row order of the outputs
    sampled: dict[int, int]  # row index -> sampled token, for rows given a sampler
    seconds: float


@attrs.frozen
class SamplingParams:
    """Sampling of one session; temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    grammar: str = ""  # GBNF with a "root" rule: only text it accepts is sampled; empty for none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) before sampling
