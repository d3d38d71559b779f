"""A hop's decode windows: what it takes, which rows its engine holds, which were kept.

A window is one decode step of ``1 + k`` rows whose last ``k`` inputs are drafted tokens
(:mod:`noderuntime.node.drafting`). Every hop runs all its rows; only the tokens that come
back from the tail say how many of them the session keeps. :class:`HopWindows` is that
bookkeeping for one route session on one hop, plain data with no event loop:

- how many drafts a window may carry here (the route's bound, lowered to what this hop's
  engine keeps exact, and at the head to what the tail last said);
- the positions the engine holds (the last window's rows that were not kept too, dropped
  before the next step) and of those the positions kept;
- a window's drafted rows, held out of the hop's commitments until the tokens back say
  they were kept, so that an audit recomputes exactly what was served;
- the checks a peer's window must pass: its drafts, and the tokens that answer it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from protocol import RemoteProtocolError, Span, StatusCode

# commits ``rows`` from position ``start`` (a Commitment's add_tokens or add_rows)
AddRows = Callable[[int, Any], None]


@attrs.define
class HopWindows:
    """One session's decode windows on one hop; see the module docstring."""

    takes: int  # the most drafts this hop takes: the route's bound, 0 where its engine is not exact
    window: int  # the most a window may carry now (the head: what the tail last said)
    start: int = 0  # the last step's first position, its rows and its drafts
    rows: int = 0
    drafts: tuple[int, ...] = ()
    engine_end: int = 0  # positions the engine holds, rows a window did not keep too
    kept_end: int = 0  # of those, the positions the session kept
    _held: list[tuple[AddRows, int, Any]] = attrs.field(factory=list)

    @classmethod
    def open(cls, speculate: int, max_window: int, *, audit: bool, head_of_route: bool) -> HopWindows:
        """A session's windows: ``speculate`` drafts at most (its route's), ``max_window`` this hop's
        engine keeps exact; none in an audit. A head before the tail answers sends none."""
        takes = 0 if audit else min(speculate, max_window)
        return cls(takes, 0 if head_of_route else takes)

    def restored(self, positions: int) -> None:
        """The session's first ``positions`` came from the prefix cache."""
        self.engine_end = self.kept_end = positions

    def stepped(self, start: int, rows: int, drafts: tuple[int, ...]) -> None:
        """A step of ``rows`` rows from ``start`` ran; a window's rows past its first are not kept yet."""
        self.start, self.rows, self.drafts = start, rows, drafts
        self.engine_end = start + rows
        self.kept_end = start + 1 if drafts else start + rows

    def commit(self, add: AddRows, start: int, rows: Any, window: bool) -> None:
        """Commit a step's rows; of a window only the first, the rest once they are known to be kept."""
        if not window:
            add(start, rows)
            return
        add(start, rows[:1])
        self._held.append((add, start + 1, rows[1:]))

    def keep(self, end: int) -> None:
        """Tokens came back: the rows before ``end`` are kept, and enter the commitments."""
        for add, first, rows in self._held:
            if end > first:
                add(first, rows[: end - first])
        self._held = []
        self.kept_end = max(self.kept_end, min(end, self.engine_end))

    def answered(self, window: int) -> None:
        """The head: the tail's tokens said how many drafts the route takes now."""
        self.window = min(window, self.takes)

    def lowered(self, window: int) -> int:
        """What a window's bound from downstream becomes on its way up past this hop."""
        return min(window, self.takes)

    def room(self, position: int, *, left: int, reserved: int) -> int:
        """The most drafts a window at ``position`` may carry: what the route takes, ``left`` tokens
        to generate and the ``reserved`` positions."""
        return max(0, min(self.window, left - 1, reserved - position - 1))

    def check_drafts(self, positions: Span, drafts: Sequence[int], *, decode: bool, n_vocab: int) -> None:
        """A step from the previous hop: its drafts must fit its rows, this hop's bound and the vocabulary."""
        if decode and len(positions) != 1 + len(drafts):
            raise RemoteProtocolError(f"a decode step of {len(positions)} positions with {len(drafts)} drafted tokens")
        if (drafts and not decode) or len(drafts) > self.window:
            raise RemoteProtocolError(
                f"a window of {len(drafts)} drafted tokens where this session takes {self.window} "
                "(in decode steps only)",
                StatusCode.OUT_OF_RANGE,
            )
        if any(not 0 <= t < n_vocab for t in drafts):
            raise RemoteProtocolError(f"drafted tokens outside the vocabulary of {n_vocab}")

    def check_answer(self, token_ids: Sequence[int], positions: Span) -> None:
        """Tokens from the next hop after a window: the drafts the tail kept, then its own draw,
        from the row after the window's first; one answer per window."""
        if not self.drafts or not token_ids:
            return
        n, start = len(token_ids), self.start
        if n > self.rows or tuple(token_ids[: n - 1]) != self.drafts[: n - 1]:
            raise RemoteProtocolError(f"{n} tokens for a window of {self.rows} rows that do not follow its drafts")
        if positions != Span(start + 1, start + 1 + n):
            raise RemoteProtocolError(
                f"a window's tokens at positions {positions.start}:{positions.end}, not {start + 1}:{start + 1 + n}",
                StatusCode.OUT_OF_RANGE,
            )
        self.drafts = ()
