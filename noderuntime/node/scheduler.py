"""The batch scheduler: pure and synchronous, never touches llama.cpp.

Given the steps that are ready and a token budget for one tick, :func:`schedule`
returns a plain-data :class:`BatchPlan`: either every ready decode step (one row
each, up to the budget) or prefill chunks of one length, never both. A session has at
most one ready step, and a step is taken whole (sessions cut their prefill into chunks).

Why a prefill chunk runs alone: with one KV stream per sequence, llama.cpp splits a
batch that mixes sequences into ubatches holding the same number of tokens of each, so
a chunk batched with other steps is computed in other shapes than alone, and its
results differ in the last bits (measured: about one step in ten once the KV passes a
few hundred cells) — enough to flip a greedy choice, so a session's output would
depend on who else was served. (On the CPU, patches 0008 and 0009 since made those
shapes compute alike, and mixed batches were measured exact there too; a device's
kernels need not be.) Decode steps are one token each, never split: batched,
each computes exactly what it would alone. Chunks of the same length are not split
either (each sequence keeps all its tokens in one ubatch, as alone), so they run
together while they fit one ubatch: a burst of same-length prompts (or the full-size
chunks of long ones) prefills in one tick, not one tick per session. When both kinds
are ready, ticks alternate.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class ReadyStep:
    """One session's next step: ``n_rows`` rows for sequence ``seq_id``."""

    seq_id: int
    n_rows: int
    decode: bool  # a single-token decode step (latency-critical)


@attrs.frozen
class BatchPlan:
    """Which ready steps run together this tick, in row order."""

    steps: tuple[ReadyStep, ...]

    @property
    def n_rows(self) -> int:
        """Rows in the batch."""
        return sum(step.n_rows for step in self.steps)

    @property
    def n_decode(self) -> int:
        """Decode rows in the batch."""
        return sum(step.n_rows for step in self.steps if step.decode)

    def __bool__(self) -> bool:
        return bool(self.steps)


def schedule(ready: Sequence[ReadyStep], budget: int, rotation: int = 0, *, group_rows: int | None = None) -> BatchPlan:
    """Plan one tick. ``rotation`` (e.g. the tick number) alternates decode and prefill
    ticks when both are waiting, and rotates which session's prefill goes first.

    Decode rows beyond the budget wait for the next decode tick. The first prefill chunk
    runs whatever its size (steps never exceed the engine's batch size); other ready
    chunks of exactly its length join it while the tick stays within ``group_rows``
    (the engine's ubatch; ``budget`` when not given).
    """
    if budget <= 0:
        raise ValueError("budget must be positive")
    decode = [step for step in ready if step.decode]
    prefill = [step for step in ready if not step.decode]
    if decode and (not prefill or rotation % 2 == 0):
        return BatchPlan(tuple(decode[:budget]))  # one row each
    if prefill:
        start = (rotation // 2) % len(prefill)
        first = prefill[start]
        chosen = [first]
        left = min(budget, group_rows or budget) - first.n_rows
        for step in prefill[start + 1 :] + prefill[:start]:
            if step.n_rows == first.n_rows <= left:
                chosen.append(step)
                left -= step.n_rows
        return BatchPlan(tuple(chosen))
    return BatchPlan(())
