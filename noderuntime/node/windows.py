"""A hop's decode windows: what it takes, which rows its engine holds, which were kept.

A window is one decode step of ``1 + k`` rows whose last ``k`` inputs are drafted tokens
(:mod:`noderuntime.node.drafting`). Every hop runs all its rows; only the tokens that come
back from the tail say how many of them the session keeps. On a long route the head may
send windows that *follow* one in flight: their first row's input is the head's guess at
that window's last draw, so they are worth something only if it keeps every draft and
draws the guess. Every hop sees the same answers, and decides the same way which windows
are still live. :class:`HopWindows` is that bookkeeping for one route session on one hop,
plain data with no event loop:

- how many drafts a window may carry here, and how many windows may follow one in flight
  (the route's bounds, lowered to what this hop takes, and at the head to what the tail
  last said);
- the decode steps sent on and not answered yet, oldest first, and from an answer whether
  the windows after it are still live; a window that arrives once the one it follows was
  answered otherwise is stale, and not run;
- the positions the engine holds (rows not kept too, dropped before the next step) and of
  those the positions kept;
- a window's drafted rows, held out of the hop's commitments until the tokens back say
  they were kept, so that an audit recomputes exactly what was served;
- the checks a peer's window must pass: its drafts, and the tokens that answer it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from protocol import RemoteProtocolError, Span, StatusCode

# commits ``rows`` from position ``start`` (a Commitment's add_tokens or add_rows)
AddRows = Callable[[int, Any], None]


@attrs.frozen
class InFlight:
    """A decode step sent on and not answered yet."""

    start: int
    rows: int
    inputs: tuple[int, ...]  # the drafted inputs: of rows 1.. (of rows 0.. where it follows)
    follows: bool = False

    @property
    def end(self) -> int:
        """The position after its last row."""
        return self.start + self.rows

    @property
    def drafts(self) -> tuple[int, ...]:
        """The drafted inputs of its rows 1.., which its draws are checked against."""
        return self.inputs[1:] if self.follows else self.inputs


@attrs.define
class HopWindows:
    """One session's decode windows on one hop; see the module docstring."""

    takes: int  # the most drafts this hop takes: the route's bound, 0 where its engine is not exact
    window: int  # the most a window may carry now (the head: what the tail last said)
    takes_ahead: int = 0  # the most windows that may follow one in flight through this hop
    ahead: int = 0  # of those, what the route takes now (the head: what the tail last said)
    engine_end: int = 0  # positions the engine holds, rows a window did not keep too
    kept_end: int = 0  # of those, the positions the session kept
    last: int | None = None  # the token drawn last, the input at kept_end (where this hop saw it)
    flight: deque[InFlight] = attrs.field(factory=deque)
    _held: list[tuple[AddRows, int, Any]] = attrs.field(factory=list)

    @classmethod
    def open(
        cls, speculate: int, max_window: int, *, audit: bool, head_of_route: bool, max_ahead: int = 0
    ) -> HopWindows:
        """A session's windows: ``speculate`` drafts at most (its route's), ``max_window`` this hop's
        engine keeps exact, ``max_ahead`` windows following one in flight; none in an audit. A
        head before the tail answers sends none."""
        takes = 0 if audit else min(speculate, max_window)
        takes_ahead = max_ahead if takes else 0
        if head_of_route:
            return cls(takes, 0, takes_ahead, 0)
        return cls(takes, takes, takes_ahead, takes_ahead)

    def restored(self, positions: int) -> None:
        """The session's first ``positions`` came from the prefix cache."""
        self.engine_end = self.kept_end = positions

    def drop_from(self, start: int) -> None:
        """A step from ``start`` is about to run (before its rows are committed): the rows the engine
        holds from there (of windows not kept) go, their held rows and steps in flight with them."""
        if start < self.engine_end:
            self._held = [entry for entry in self._held if entry[1] < start]
            self.flight = deque(step for step in self.flight if step.start < start)

    def live(self, start: int, inputs: Sequence[int]) -> bool:
        """Whether a window that follows another, arriving now, is worth running: while the one
        before is in flight below, if it continues it; once that one was answered, if the answer
        kept every draft and drew the guess (the window starts where the kept rows end, with
        the token drawn last)."""
        if self.flight:
            return start == self.engine_end
        return start == self.kept_end == self.engine_end and self.last is not None and tuple(inputs[:1]) == (self.last,)

    def check_step(self, start: int, *, decode: bool, follows: bool) -> None:
        """A step from the previous hop about to run (a window that follows another: once found
        live): it may not leave a gap in the KV, nor run ahead of the answers beyond the bound.
        A head waits for every answer but those of the windows in flight it may send."""
        if start > self.engine_end:
            raise RemoteProtocolError(
                f"a step at position {start}, past the {self.engine_end} this hop holds",
                StatusCode.FAILED_PRECONDITION,
            )
        if follows and len(self.flight) > self.ahead:
            raise RemoteProtocolError(
                f"a window that follows {len(self.flight)} in flight where this session takes {self.ahead}",
                StatusCode.OUT_OF_RANGE,
            )
        if decode and not follows and self.flight:
            raise RemoteProtocolError(
                f"a decode step while {len(self.flight)} before it are unanswered", StatusCode.FAILED_PRECONDITION
            )

    def stepped(self, start: int, rows: int, inputs: tuple[int, ...], *, follows: bool, sent_on: bool) -> None:
        """A step of ``rows`` rows from ``start`` ran (``inputs``: its drafted inputs); a window's rows
        are not kept yet. ``sent_on``: a decode step that went on to the next hop, whose answer comes back."""
        self.engine_end = start + rows
        if not (inputs or follows):
            self.kept_end = start + rows
        elif not follows:
            self.kept_end = start + 1
        if sent_on:
            self.flight.append(InFlight(start, rows, inputs, follows))

    def commit(self, add: AddRows, start: int, rows: Any, window: bool, *, follows: bool = False) -> None:
        """Commit a step's rows; of a window only the first (none where it follows another), the rest
        once they are known to be kept."""
        if not window:
            add(start, rows)
            return
        if follows:
            self._held.append((add, start, rows))
            return
        add(start, rows[:1])
        self._held.append((add, start + 1, rows[1:]))

    def keep(self, end: int, last: int | None = None) -> None:
        """Tokens came back, ``last`` the token drawn last: the rows before ``end`` are kept, and enter
        the commitments; rows held from ``end`` on (a live window that follows) stay held."""
        held = []
        for add, first, rows in self._held:
            if end > first:
                add(first, rows[: end - first])
            else:
                held.append((add, first, rows))
        self._held = held
        self.kept_end = max(self.kept_end, min(end, self.engine_end))
        if last is not None:
            self.last = last

    def answer(self, token_ids: Sequence[int], positions: Span, *, finished: bool) -> None:
        """Tokens from the next hop: they answer the oldest step in flight. A window's must be the
        drafts the tail kept, then its own draw, from the row after the window's first. The
        windows after it stay live only if it kept every draft and drew the next one's guess."""
        if not token_ids:
            return
        oldest = self.flight.popleft() if self.flight else None
        n = len(token_ids)
        if oldest is not None and (oldest.inputs or oldest.follows):
            drafts = oldest.drafts
            if n > oldest.rows or tuple(token_ids[: n - 1]) != drafts[: n - 1]:
                raise RemoteProtocolError(
                    f"{n} tokens for a window of {oldest.rows} rows that do not follow its drafts"
                )
            if positions != Span(oldest.start + 1, oldest.start + 1 + n):
                raise RemoteProtocolError(
                    f"a window's tokens at positions {positions.start}:{positions.end}, "
                    f"not {oldest.start + 1}:{oldest.start + 1 + n}",
                    StatusCode.OUT_OF_RANGE,
                )
        self.keep(positions.end - 1, token_ids[-1])
        if self.flight and (finished or not chained(oldest, token_ids, self.flight[0])):
            self.flight.clear()  # stale: the next step goes back to where the kept rows end

    def answered(self, window: int, ahead: int = 0) -> None:
        """The head: the tail's tokens said how many drafts, and windows ahead, the route takes now."""
        self.window = min(window, self.takes)
        self.ahead = min(ahead, self.takes_ahead)

    def lowered(self, window: int) -> int:
        """What a window's bound from downstream becomes on its way up past this hop."""
        return min(window, self.takes)

    def lowered_ahead(self, ahead: int) -> int:
        """What the bound on windows ahead from downstream becomes on its way up past this hop."""
        return min(ahead, self.takes_ahead)

    def room(self, position: int, *, left: int, reserved: int) -> int:
        """The most drafts a window at ``position`` may carry: what the route takes, ``left`` tokens
        to generate and the ``reserved`` positions."""
        return max(0, min(self.window, left - 1, reserved - position - 1))

    def check_drafts(
        self, positions: Span, drafts: Sequence[int], *, decode: bool, n_vocab: int, follows: bool = False
    ) -> None:
        """A step from the previous hop: its drafts must fit its rows, this hop's bounds and the vocabulary."""
        if follows and not (decode and self.ahead):
            raise RemoteProtocolError(
                f"a window that follows another where this session takes {self.ahead} ahead (in decode steps only)",
                StatusCode.OUT_OF_RANGE,
            )
        guessed = 1 if follows else 0  # a window that follows lists its first row's input too
        if decode and len(positions) != 1 - guessed + len(drafts):
            raise RemoteProtocolError(f"a decode step of {len(positions)} positions with {len(drafts)} drafted tokens")
        if (drafts and not decode) or len(drafts) > self.window:
            raise RemoteProtocolError(
                f"a window of {len(drafts)} drafted tokens where this session takes {self.window} "
                "(in decode steps only)",
                StatusCode.OUT_OF_RANGE,
            )
        if any(not 0 <= t < n_vocab for t in drafts):
            raise RemoteProtocolError(f"drafted tokens outside the vocabulary of {n_vocab}")


def chained(answered: InFlight | None, token_ids: Sequence[int], following: InFlight) -> bool:
    """Whether ``following``, sent behind ``answered``, is live now that ``token_ids`` answered it:
    every row of ``answered`` was kept and its last draw is the guess ``following`` ran first."""
    return (
        answered is not None
        and following.follows
        and len(token_ids) == answered.rows
        and following.start == answered.end
        and token_ids[-1] == following.inputs[0]
    )
