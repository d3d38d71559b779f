"""What a route's tail sends back: the tokens its steps drew, where the generation stops.

The tail samples a step's last rows with the session's own chain (:mod:`noderuntime.node.batcher`)
and sends the draws upstream in a Tokens frame, stopping at the first stop token, at
``max_tokens`` or at the positions the session reserved. A window's draws come several at a
time; an audit's, teacher-forced through the whole reply, all at once at the end.
:class:`TailDraws` keeps that count for one session, plain data with no event loop.
"""

from __future__ import annotations

import attrs

from noderuntime.node.batcher import StepOutput
from noderuntime.node.ending import stop_reason
from protocol import Header, OpenRoute, Span, TokenLogprob, Tokens


@attrs.frozen
class Draws:
    """One Tokens frame's worth of draws, the first at position ``first``."""

    first: int
    tokens: tuple[int, ...]
    reason: str = ""  # "stop" or "length" when the generation ends here
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    drafted: int = 0  # the window's drafts, and how many of them the tail kept
    accepted: int = 0

    @property
    def span(self) -> Span:
        """The positions of the tokens."""
        return Span(self.first, self.first + len(self.tokens))

    @property
    def finished(self) -> bool:
        """Whether the generation ends with these tokens."""
        return bool(self.reason)

    def frame(self, header: Header, window: int, ahead: int = 0) -> Tokens:
        """The Tokens frame, saying ``window`` drafts at most for the next step and ``ahead`` windows
        that may follow one in flight."""
        return Tokens(
            header,
            self.tokens,
            self.finished,
            self.reason,
            self.logprobs,
            self.prompt_logprobs,
            window,
            self.drafted,
            self.accepted,
            ahead,
        )


class TailDraws:
    """The draws of one route session's tail; see the module docstring."""

    def __init__(self, route: OpenRoute, reserved: int) -> None:
        """``reserved``: the positions the session's lease holds."""
        self.route = route
        self.reserved = reserved
        self.generated = len(route.generated)  # a resumed session goes on counting
        self._scored: list[TokenLogprob] = []  # prompt rows scored, not yet sent
        self._drawn: list[int] = []  # an audit's draws, sent at the end

    @property
    def first_sampled_row(self) -> int:
        """The first row sampled: the prompt's last (an audit's: the first its route sampled)."""
        route = self.route
        return (route.prompt_length if route.audit else len(route.prompt_tokens)) - 1

    def rows_to_sample(self, start: int, n: int) -> int:
        """How many of a prompt step's last rows are sampled: the last prompt row's, or, in an
        audit, every row its route sampled."""
        end = start + n
        if self.route.audit:
            return max(0, end - max(start, self.first_sampled_row))
        return 1 if end >= len(self.route.prompt_tokens) else 0

    def stepped(self, output: StepOutput, sampled: bool) -> None:
        """A step ran: the prompt rows it scored, and (an audit) what it drew."""
        self._scored += output.scored
        if sampled and self.route.audit:
            self._drawn += output.drawn

    def take(self, output: StepOutput, first: int, drafted: int, *, guessed: bool = False) -> Draws:
        """The draws of a step, the first at position ``first``, up to where the generation stops;
        ``drafted``: the step's drafts (0 for a plain step), ``guessed``: the first of them its
        first row's input (a window that followed another, live: the guess was kept)."""
        route = self.route
        kept: list[int] = []
        reason = ""
        for token in output.drawn:
            kept.append(token)
            self.generated += 1
            reason = stop_reason(
                token,
                generated=self.generated,
                max_tokens=route.max_tokens,
                position=first + len(kept) - 1,
                reserved=self.reserved,
                stop_tokens=route.stop_token_ids,
            )
            if reason:
                break
        scored, self._scored = tuple(self._scored), []  # they travel in the first Tokens frame alone
        return Draws(
            first,
            tuple(kept),
            reason,
            output.drawn_logprobs[: len(kept)],
            scored,
            drafted,
            # of a window's drafts, those before its last draw were kept (the draws agreed with
            # them), and the guess its first row ran
            len(output.drawn) - 1 + guessed if drafted else 0,
        )

    def take_audit(self) -> Draws:
        """An audit's draws: every token, teacher-forced, in one last frame."""
        drawn, self._drawn = tuple(self._drawn), []
        self.generated += len(drawn)
        return Draws(self.first_sampled_row + 1, drawn, "length")
