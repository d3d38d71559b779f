"""The batch scheduler: pure and synchronous, never touches llama.cpp.

Given the steps that are ready and a token budget for one tick, :func:`schedule`
returns a plain-data :class:`BatchPlan`: every ready decode step first (one row
each), then prefill chunks while they fit, round-robin from a rotating start so no
session's prefill starves another's. A session has at most one ready step, and a
step is taken whole or not at all (sessions cut their prefill into chunks).
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


def schedule(ready: Sequence[ReadyStep], budget: int, rotation: int = 0) -> BatchPlan:
    """Plan one tick. ``rotation`` (e.g. the tick number) rotates who goes first among prefills.

    A prefill step larger than what is left of the budget waits, unless nothing else
    was planned: the batch is never empty while work is ready (steps never exceed the
    engine's batch size, so they always fit alone).
    """
    if budget <= 0:
        raise ValueError("budget must be positive")
    decode = [step for step in ready if step.decode]
    prefill = [step for step in ready if not step.decode]
    chosen: list[ReadyStep] = []
    left = budget
    for step in decode:
        if step.n_rows <= left:
            chosen.append(step)
            left -= step.n_rows
    if prefill:
        start = rotation % len(prefill)
        for step in prefill[start:] + prefill[:start]:
            if step.n_rows <= left or not chosen:
                chosen.append(step)
                left -= step.n_rows
    return BatchPlan(tuple(chosen))
