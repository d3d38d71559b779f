"""A small model that drafts at the head (``up --draft MODEL``), where prompt lookup finds nothing.

Prompt lookup (:class:`~noderuntime.node.drafting.PromptLookup`) drafts only what the
session's text already holds; free chat holds little, so its windows carry few drafts. A
small model of the same vocabulary guesses the next tokens of any text. The head runs it
whole, greedily, on its engine thread between the shard's own steps: a draft costs the head
a few small steps and no trip, and the tail keeps of it only what the session's own sampler
would have drawn, so the reply is the same bits with or without it.

The draft engine holds one KV sequence per slot of its node (a session drafts in its
lease's sequence) and remembers which tokens each holds: the next draft feeds only the
tokens after what it still shares with the session (the reply's newest tokens), and drops
what it drafted past them that the tail did not keep. A sequence left by a session that
ended is reused as it is where the next one shares its prefix (a conversation's next
turn), truncated where not; its KV stays allocated as the node's own does.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from noderuntime.engine.base import Engine, EngineError, Rows

log = logging.getLogger(__name__)

# rows a call of read() runs: it stops between calls once the first token has come, so a
# piece is about what the head may be late by when it does (SmolLM2 whole, 2 threads: ~30 ms)
READ_PIECE = 32


class DraftModel:
    """A whole model that drafts for its node's head sessions; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        run: Callable[[Callable[[], Any]], Awaitable[Any]],
        *,
        n_seq: int,
        n_ctx_per_seq: int,
        n_batch: int,
        seconds_per_draft: float = 0.0,
    ) -> None:
        """``engine`` runs the draft model whole; ``run`` calls a function on the node's engine
        thread (the draft's steps take turns with the shard's); ``n_seq``, ``n_ctx_per_seq``
        and ``n_batch`` are the draft engine's sequences, positions a sequence and rows a call;
        ``seconds_per_draft``: what a step of one row took when the node measured the draft
        engine at start (a session's policy starts from it, before it times its own drafts)."""
        if not (engine.is_head and engine.is_tail):
            raise EngineError("a draft model runs whole: it takes tokens and gives logits")
        self.engine = engine
        self._run = run
        self.n_seq, self.n_ctx_per_seq, self.n_batch = n_seq, n_ctx_per_seq, n_batch
        self.seconds_per_draft = seconds_per_draft
        # what each sequence's KV holds: the tokens at positions 0, 1, ... (touched on the engine thread only)
        self._held: dict[int, list[int]] = {}
        self.drafted = 0  # tokens drafted, for the node's statistics
        self.failures = 0  # drafts the engine refused (no KV room): the session sent none

    async def draft(self, seq_id: int, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` greedy drafts that follow ``tokens`` (the session's prompt and reply so
        far), computed in sequence ``seq_id`` (none where it has no room for them), and how
        many of ``tokens`` the draft model had to run first (all of a new prompt, the few
        newest of a reply)."""
        if k <= 0 or not tokens or not 0 <= seq_id < self.n_seq or len(tokens) + k - 1 > self.n_ctx_per_seq:
            return [], 0
        # each draft is an engine call of its own, so that the node's ticks for other sessions
        # run between them rather than waiting for the whole window; the tokens go as a copy:
        # the session's list grows on the trio thread while the engine thread reads them
        first, fed = await self._run(functools.partial(self._start, seq_id, list(tokens)))
        drafts = [] if first is None else [first]
        while drafts and len(drafts) < k:
            following = await self._run(functools.partial(self._step, seq_id, drafts[-1:]))
            if following is None:
                break
            drafts.append(following)
        self.drafted += len(drafts)
        return drafts, fed

    async def read(self, seq_id: int, tokens: Sequence[int], stop: Callable[[], bool]) -> int | None:
        """Run ``tokens`` into ``seq_id`` as :meth:`draft` would before drafting, a piece of at
        most ``READ_PIECE`` a call, until ``stop()`` says to (checked between pieces); the
        greedy token after them where every piece was read, else None (the next draft reads
        the rest)."""
        if not tokens or not 0 <= seq_id < self.n_seq or len(tokens) > self.n_ctx_per_seq:
            return None
        copy = list(tokens)  # as in draft()
        while True:
            read: tuple[bool, int | None] = await self._run(functools.partial(self._read_piece, seq_id, copy))
            if read[0] or stop():
                return read[1]

    def _read_piece(self, seq_id: int, tokens: list[int]) -> tuple[bool, int | None]:
        held, shared = self._shared(seq_id, tokens)
        piece = tokens[shared : shared + min(READ_PIECE, self.n_batch)]
        if shared + len(piece) == len(tokens):
            guess = self._step(seq_id, piece)
            return guess is not None, guess
        try:
            self._run_rows(seq_id, held, piece, want=False)
        except EngineError as exc:
            self._refused(seq_id, held, exc)
            return True, None
        return False, None

    def _start(self, seq_id: int, tokens: list[int]) -> tuple[int | None, int]:
        """The first draft after ``tokens``, and how many of them the sequence did not hold."""
        _held, shared = self._shared(seq_id, tokens)
        return self._step(seq_id, tokens[shared:]), len(tokens) - shared

    def _shared(self, seq_id: int, tokens: list[int]) -> tuple[list[int], int]:
        """What ``seq_id`` holds, cut back to what it shares with ``tokens``, and its length.

        The last token is always run again (its logits are where the first draft comes
        from), so at most all but it are shared.
        """
        held = self._held.setdefault(seq_id, [])
        shared = _shared_prefix(held, tokens, len(tokens) - 1)
        if shared < len(held):
            try:
                self.engine.truncate_sequence(seq_id, shared)
            except EngineError as exc:  # a closed engine: the node is stopping
                self._refused(seq_id, held, exc)
                return held, 0
            del held[shared:]
        return held, shared

    def _step(self, seq_id: int, feed: list[int]) -> int | None:
        """Run ``feed`` after what ``seq_id`` holds: the greedy token after it (None: refused)."""
        held = self._held.setdefault(seq_id, [])
        try:
            return int(np.argmax(self._feed(seq_id, held, feed)))
        except EngineError as exc:
            self._refused(seq_id, held, exc)
            return None

    def _refused(self, seq_id: int, held: list[int], exc: EngineError) -> None:
        # what the sequence holds after a refused step is not known: start it afresh next time
        self.engine.remove_sequence(seq_id)
        held.clear()
        self.failures += 1
        log.debug("the draft model drafted nothing for sequence %d: %s", seq_id, exc)

    def _feed(self, seq_id: int, held: list[int], feed: list[int]) -> np.ndarray:
        """Run ``feed`` after what ``seq_id`` holds; the logits after its last token."""
        logits: np.ndarray | None = None
        for start in range(0, len(feed), self.n_batch):
            piece = feed[start : start + self.n_batch]
            logits = self._run_rows(seq_id, held, piece, want=start + len(piece) == len(feed))
        assert logits is not None  # the last piece asked for its last row's
        last: np.ndarray = logits[0]
        return last

    def _run_rows(self, seq_id: int, held: list[int], piece: list[int], *, want: bool) -> np.ndarray | None:
        """Run ``piece`` after what ``seq_id`` holds (``held``, extended); its last row's logits if ``want``."""
        n, first = len(piece), len(held)
        outputs = np.zeros(n, dtype=bool)
        outputs[-1] = want
        result = self.engine.run(
            Rows(
                seq_ids=np.full(n, seq_id, dtype=np.int32),
                positions=np.arange(first, first + n, dtype=np.int32),
                outputs=outputs,
                tokens=np.asarray(piece, dtype=np.int32),
            ),
            want_logits=want,
        )
        held.extend(piece)
        return result.logits


def _shared_prefix(held: list[int], tokens: list[int], most: int) -> int:
    """How many leading tokens ``held`` and ``tokens`` share, at most ``most``."""
    n = min(len(held), len(tokens), most)
    if held[:n] == tokens[:n]:  # the usual case, compared in C
        return n
    low, high = 0, n - 1  # the first low tokens agree; they differ somewhere before n
    while low < high:
        middle = (low + high + 1) // 2
        if held[:middle] == tokens[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
