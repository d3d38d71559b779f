"""A node that cheats, for the audit tests alone: ``python -m tests.cheating_node CHEAT up ARGS...``.

It registers and serves as ``noderuntime up ARGS`` would, then computes something else
than its recipe for the sessions it serves:

- ``quant=PATH``: the same weights in another quantization (``PATH``), while it registers
  the model it was given (say Q4_0 for a Q8_0);
- ``skip``: its range but the last layer (a head that runs 0:1 of 0:2 passes on layer 0's output);
- ``noise``: 1e-3 of noise added to the output of one decode step in a hundred, the tenth
  first. Decode steps alone: an audit this node runs for others is a prefill, and a rare
  cheat spent on one (it is outvoted there, not caught) left the next for a hundred steps
  later, which a cheater that routes seldom take may not reach in the test's requests;
- ``replay``: a prefill chunk's output taken from an earlier session's chunk of the same
  length at the same positions, in place of its own;
- ``share=R``: 1e-3 of noise on every output of a share ``R`` of its sessions, decided when
  a session's first row comes (``benchmarks.audit`` measures detection against it).

The cheats are on the engine, under the node: the node's sessions, commitments and usage
records are the honest code's, signed with its key, as a cheater's would be.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from noderuntime import cli
from noderuntime.engine.base import Rows, StepResult
from noderuntime.engine.llama import ShardEngine
from noderuntime.models.artifacts import LayerRange
from noderuntime.services import noderun


class CheatingEngine:
    """An engine that answers for ``honest`` and computes with ``cheat`` (or alters what ``honest`` computes)."""

    def __init__(self, honest: ShardEngine, cheat: ShardEngine | None, how: str) -> None:
        self._honest = honest
        self._cheat = cheat
        self._how = how
        self._decode_steps = 0  # steps of one row a session (``noise``)
        self._noise = np.random.default_rng(7)
        self._chunks: dict[tuple[int, int], np.ndarray] = {}  # (rows, first position) -> an output seen
        self._share = float(how.partition("=")[2]) if how.startswith("share=") else 0.0
        self._cheating: set[int] = set()  # sequences whose sessions it cheats on (``share``)
        self._decide = np.random.default_rng(11)

    def __getattr__(self, name: str) -> Any:
        # everything a session touches (KV, samplers, sequences) lives in the engine that computes
        return getattr(self._cheat if self._cheat is not None else self._honest, name)

    def run(self, rows: Rows, **kwargs: Any) -> StepResult:
        """One batch, computed the cheater's way."""
        engine = self._cheat if self._cheat is not None else self._honest
        result = engine.run(rows, **kwargs)
        if result.hidden is None:
            return result
        if self._share:
            for seq in set(rows.seq_ids[rows.positions == 0].tolist()):  # a session's first row: decide
                if self._decide.random() < self._share:
                    self._cheating.add(seq)
                else:
                    self._cheating.discard(seq)
            mask = np.isin(rows.seq_ids, list(self._cheating))
            if mask.any():
                noise = self._noise.standard_normal(result.hidden.shape).astype(np.float32) * 1e-3
                return attrs.evolve(result, hidden=result.hidden + noise * mask[:, None])
            return result
        if self._how == "noise" and len(np.unique(rows.seq_ids)) == len(rows):
            self._decode_steps += 1
            if self._decode_steps % 100 != 10:
                return result
            noise = self._noise.standard_normal(result.hidden.shape).astype(np.float32) * 1e-3
            return attrs.evolve(result, hidden=result.hidden + noise)
        if self._how == "replay" and len(set(rows.seq_ids.tolist())) == 1 and len(rows) > 1:
            key = (len(rows), int(rows.positions[0]))
            seen = self._chunks.setdefault(key, result.hidden.copy())
            return attrs.evolve(result, hidden=seen.copy())
        return result

    def close(self) -> None:
        """Free both engines."""
        if self._cheat is not None:
            self._cheat.close()
        self._honest.close()


def main(argv: list[str]) -> int:
    """Patch the node's engine loading with ``argv[0]``'s cheat, then run the command line in ``argv[1:]``."""
    how, _, path = argv[0].partition("=")
    load = noderun._load_engine

    async def cheating_load(opts: Any, engine_thread: Any) -> Any:
        info, recipe, layers, engine, prefix = await load(opts, engine_thread)
        cheat = None
        if how == "quant":
            cheat = await engine_thread.run(lambda: ShardEngine(Path(path), recipe, layers))
        elif how == "skip":
            short = LayerRange(layers.start, layers.end - 1)
            cheat = await engine_thread.run(lambda: ShardEngine(opts.model, recipe, short))
        elif how not in ("noise", "replay", "share"):
            raise SystemExit(f"no such cheat: {how}")
        return info, recipe, layers, CheatingEngine(engine, cheat, argv[0]), prefix

    noderun._load_engine = cheating_load
    return cli.main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
