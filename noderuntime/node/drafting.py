"""Speculative decoding at the head: drafts from the session's own tokens, and how many to send.

A route's single session is capped by its round trips: a token travels the whole ring before
the next one can start. A *window* sends the token the tail drew last together with ``k``
tokens drafted here, as ``k + 1`` rows of one step; the tail samples them in order with the
session's own chain while they agree with the drafts, so one round trip can bring back up
to ``k + 1`` tokens. The rows' bits are those of single steps (the engine's rows are
independent of their batch-mates and of how positions are cut into steps), so what comes
back is exactly what plain decoding would have produced.

Drafts come from one of two sources, and a policy sizes the windows:

- :class:`PromptLookup` drafts with no model: the longest recent n-gram that ends the
  session's tokens, found earlier in the prompt or the reply, and what followed it there.
  Replies that quote, edit or reformat their prompt repeat long runs of it. On by default.
- :class:`~noderuntime.node.draftmodel.DraftModel`, where the node was given one (``up
  --draft MODEL``): a small model of the same vocabulary drafts greedily where prompt
  lookup has nothing to offer, for text that repeats nothing as well.
- On a long route a window may *follow* one in flight: the head drafts on as if the window
  in flight were kept whole, its first row's input a guess at that window's last draw, and
  sends it before the answer comes. It is worth its rows only if every window before it is
  kept whole and each guess drawn; the policy sends one where that chance, measured for each
  window as it is answered, makes its tokens come faster than plain steps bring them.
- :class:`WindowPolicy` sizes each window from what it measures: how often a drafted token
  is kept (from real windows, and from the drafts it could have sent when it sent none), the
  time a step's round trip takes, and what each further row adds to it. It sends the ``k``
  that maximises the expected tokens a second, 0 when none beats a plain step: a session
  whose drafts miss costs what it cost without speculation. A draft model's drafts cost the
  head time too, measured and counted against them.

:class:`HeadDrafts` is one session's drafting, plain data but for the draft model's steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from noderuntime.node.windows import InFlight, chained

if TYPE_CHECKING:
    from noderuntime.node.draftmodel import DraftModel

# n-gram lengths tried, longest first: a longer match predicts better; one token of context
# matches almost anywhere and predicts little
MAX_NGRAM = 4
MIN_NGRAM = 2
# with a draft model and no window worth sending, one plain step in this many (at least) has
# the model draft a token anyway, kept out of the window and judged against the token that
# comes: a session whose acceptance fell measures it again. Fewer where a draft is dear
# against a step: such a draft costs at most SHADOW_SHARE of the steps it comes after
SHADOW_EVERY = 8
SHADOW_SHARE = 0.02
EXPLORE = 2  # drafts in the window that measures a row's cost where a model drafts (HeadDrafts.draft)
# a model drafts (windows, shadows, the window that measures a row) only where a plain step
# takes this many drafts' time at least: a window of drafts kept half the time, each row
# costing what a draft does, pays from there, and a first draft may have to read the rest of
# the prompt. SmolLM2 drafting for itself on a 3-shard route of one machine: a step is 1.6
# drafts' time at d = 0 (its model's drafts cost free chat 13 %), 10 at 20 ms
STEP_IN_DRAFTS = 4.0


class PromptLookup:
    """Drafts the tokens that followed the latest earlier occurrence of the session's last n-gram."""

    def __init__(self, tokens: Sequence[int] = (), *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # n-gram -> the position just after its latest occurrence that has a token after it
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Take the session's next tokens."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here now have a token after them
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self._after[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(token))

    def draft(self, k: int, assumed: Sequence[int] = ()) -> list[int]:
        """Up to ``k`` tokens that would follow the session's tokens, and after them the ``assumed``
        ones (drafts in flight, as if kept), or none."""
        if k <= 0:
            return []
        tokens = [*self.tokens, *assumed] if assumed else self.tokens
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            at = self._after.get(tuple(tokens[len(tokens) - n :]))
            if at is not None:
                return tokens[at : at + k]
        return []


@attrs.define
class WindowPolicy:
    """How many drafted tokens the next window of one session carries; see the module docstring.

    The model: a draft is kept with probability ``a`` when every draft before it was, so a
    window of ``k`` drafts brings back ``1 + a + ... + a**k`` tokens in expectation, and takes
    ``step + k * row`` seconds, where ``step`` is a plain step's round trip and ``row`` what
    each further row adds along the route.
    """

    max_window: int
    # send every draft the drafter offers, up to the cap, whatever it costs: to measure a
    # fixed window against the adaptive one, and to make tests roll windows back often
    eager: bool = False
    # rate estimates decay so that a session whose text changes character is followed
    decay: float = 0.9
    kept: float = 0.0  # drafts kept, decayed
    tried: float = 0.0  # drafts the tail judged, decayed
    step: float | None = None  # seconds: a plain step's round trip (smoothed)
    row: float | None = None  # seconds each further row of a window adds (smoothed)
    draft: float = 0.0  # seconds the head takes to draft a token (a draft model's steps; smoothed)
    chained: float = 0.0  # steps kept whole whose next draw was the drafter's guess, decayed
    chains: float = 0.0  # steps judged so, decayed
    # seconds a window that follows one in flight adds besides its rows, from the answer before
    # its own to its own (smoothed): what a step costs the route but for the seams' delay
    fixed: float | None = None
    drafted_total: int = 0
    accepted_total: int = 0

    @property
    def acceptance(self) -> float:
        """The chance a draft is kept once the drafts before it were (a prior of one half)."""
        return (self.kept + 1.0) / (self.tried + 2.0)

    @property
    def chain(self) -> float:
        """The chance a step is kept whole and draws what the drafter guessed after it: that a
        window following it is live. Its prior, worth two steps, is what the acceptance says of
        a whole window and a guess, as if each draft were kept alike."""
        prior = self.acceptance ** (self.max_window + 1)
        return (self.chained + 2.0 * prior) / (self.chains + 2.0)

    def size(self, offered: int, budget: int, *, drafted: bool = False) -> int:
        """Drafts to send, of the ``offered`` the drafter has, within ``budget`` rows (``drafted``:
        each costs a draft model's step too)."""
        cap = min(offered, budget, self.max_window)
        if self.eager:
            return max(0, cap)
        if cap <= 0 or self.step is None:
            return 0  # nothing to send, or no plain step measured yet to weigh a window against
        # before a window was measured, assume each row costs half a plain step: a guess that
        # makes the first windows wait for drafts that are often kept
        row = (self.row if self.row is not None else 0.5 * self.step) + (self.draft if drafted else 0.0)
        a = self.acceptance
        best, best_rate = 0, 1.0 / self.step
        expected = 1.0
        for k in range(1, cap + 1):
            expected += a**k
            rate = expected / (self.step + k * row)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def ahead(self, offered: int, budget: int, depth: int) -> int:
        """Rows of a window to send behind ``depth`` steps in flight, of the ``offered`` inputs the
        drafter has (its guess first), within ``budget`` rows: 0 unless it pays.

        It is live with the chance every step in flight chains into the next; then its first row
        brings a token, and each further one another while its drafts are kept. It needs no round
        trip of its own, but it holds the route for ``fixed + rows * row`` seconds, live or not:
        time in which the session's own steps would have brought ``rate()`` tokens a second.
        The rows that bring the most beyond that go, if any do. Where the route spends its
        round trip computing rather than waiting on its seams (one machine), ``fixed`` is
        most of a step, and none pays.
        """
        cap = min(offered, budget, self.max_window + 1)
        if cap <= 0 or self.step is None or depth <= 0:
            return 0
        if self.eager:
            return cap
        row = self.row if self.row is not None else 0.5 * self.step
        # before a window that follows was measured, a guess that lets one go where chains hold
        # and the seams' delay is most of a step (the window then measures it)
        fixed = self.fixed if self.fixed is not None else 0.25 * self.step
        live, a, rate = self.chain**depth, self.acceptance, self.rate()
        best, rows, expected = 0.0, 0, 0.0
        for r in range(1, cap + 1):
            expected += a ** (r - 1)
            surplus = live * expected - rate * (fixed + r * row)
            if surplus > best:
                best, rows = surplus, r
        return rows

    def followed(self, rows: int, seconds: float) -> None:
        """A window of ``rows`` rows that followed one in flight was answered ``seconds`` after it."""
        extra = max(0.0, seconds - rows * (self.row or 0.0))
        self.fixed = extra if self.fixed is None else 0.8 * self.fixed + 0.2 * extra

    def rate(self) -> float:
        """Tokens a second the session's own windows bring (a plain step's where none pays)."""
        if self.step is None:
            return 0.0
        row = self.row if self.row is not None else 0.5 * self.step
        a = self.acceptance
        best, expected = 1.0 / self.step, 1.0
        for k in range(1, self.max_window + 1):
            expected += a**k
            best = max(best, expected / (self.step + k * row))
        return best

    def judged(self, drafted: int, accepted: int) -> None:
        """A window's verdict: of ``drafted`` drafts, the first ``accepted`` were kept."""
        self.drafted_total += drafted
        self.accepted_total += accepted
        # the draft after the last kept one was judged too, unless every draft was kept
        self._count(accepted, accepted + (1 if accepted < drafted else 0))

    def shadow(self, kept: bool) -> None:
        """A draft this session could have sent and did not, judged against the token that came."""
        self._count(int(kept), 1)

    def chain_judged(self, kept: bool) -> None:
        """A step's answer against the guess a window following it would carry."""
        self.chained = self.decay * self.chained + kept
        self.chains = self.decay * self.chains + 1

    def _count(self, kept: int, tried: int) -> None:
        if tried:
            self.kept = self.decay * self.kept + kept
            self.tried = self.decay * self.tried + tried

    def drafting(self, drafts: int, seconds: float) -> None:
        """The head took ``seconds`` to draft ``drafts`` tokens."""
        if drafts:
            per = seconds / drafts
            self.draft = per if not self.draft else 0.8 * self.draft + 0.2 * per

    def timed(self, rows: int, seconds: float) -> None:
        """A step of ``rows`` rows took ``seconds`` from its send to its tokens' return."""
        if rows <= 1:
            self.step = seconds if self.step is None else 0.8 * self.step + 0.2 * seconds
        elif self.step is not None:
            extra = max(0.0, (seconds - self.step) / (rows - 1))
            self.row = extra if self.row is None else 0.8 * self.row + 0.2 * extra


@attrs.define
class _Sent:
    """A step the head sent and has no answer for yet, and what its answer will teach."""

    step: InFlight
    sent_at: float | None  # None: it left behind others, and its answer times no round trip
    shadow: int | None = None  # a draft it could have carried and did not
    guess: int | None = None  # the drafter's guess at its last draw, a window following it would run first


class HeadDrafts:
    """One session's drafting at the head: the drafts each step carries, the windows that follow
    steps in flight, and what each answer teaches the policy (a step's round trip, how many of
    its drafts were kept, whether it chained into the next)."""

    def __init__(
        self,
        prompt: Sequence[int],
        speculate: int,
        *,
        eager: bool = False,
        model: DraftModel | None = None,
        seq_id: int = 0,
    ) -> None:
        """``speculate``: the most drafts a window carries on this route (0: none, ever);
        ``model``: the node's draft model, which drafts in sequence ``seq_id`` (none: prompt lookup)."""
        # the session's tokens so far, and the drafter where there is no model
        self.lookup = PromptLookup(prompt) if speculate else None
        self.model = model if speculate else None
        self.seq_id = seq_id
        self.policy = WindowPolicy(speculate, eager=eager)
        if self.model is not None:
            self.policy.draft = self.model.seconds_per_draft
        self._plain = 0  # plain steps since the draft model last drafted
        self.sent: tuple[int, ...] = ()  # the drafts of the next step, once drafted
        self._shadow: int | None = None  # the draft that step could have carried and did not
        # steps sent, oldest first: the driver's own view, answer by answer. The hop's
        # (HopWindows.flight) is not it: the loop from downstream updates that one as answers
        # arrive, ahead of the driver by the answers queued for it
        self.flight: deque[_Sent] = deque()
        self._answered_at: float | None = None  # when the last answer came

    def answered(self, tokens: Sequence[int], now: float) -> InFlight | None:
        """The tokens that came back for the oldest step in flight (none: the prompt's); that step.
        The steps behind it stay in flight only if it chained into them."""
        sent = self.flight.popleft() if self.flight else None
        if sent is None:
            if self._shadow is not None:  # the first token, against the guess the model made reading the prompt
                self.policy.shadow(tokens[0] == self._shadow)
                self._shadow = None
        else:
            step = sent.step
            if sent.sent_at is not None:
                self.policy.timed(step.rows, now - sent.sent_at)
            elif step.follows and self._answered_at is not None:  # live: the one before it chained into it
                self.policy.followed(step.rows, now - self._answered_at)
            if step.drafts:
                self.policy.judged(len(step.drafts), len(tokens) - 1)
            elif sent.shadow is not None:
                self.policy.shadow(tokens[0] == sent.shadow)
            if sent.guess is not None:
                self.policy.chain_judged(len(tokens) == step.rows and tokens[-1] == sent.guess)
            if self.flight and not chained(step, tokens, self.flight[0].step):
                self.flight.clear()  # stale: every hop drops them
        if self.lookup is not None:
            self.lookup.extend(tokens)
        self._answered_at = now
        return None if sent is None else sent.step

    async def draft(self, room: int, budget: int) -> tuple[int, ...]:
        """The drafts of the next step: at most ``room`` (what the session and the route allow)
        and ``budget`` (the node's draft rows left this tick), as many as pay for themselves."""
        self.sent, self._shadow = (), None
        if self.lookup is None:
            return ()
        offered = self.lookup.draft(room)
        if self.model is None or offered:
            # prompt lookup's drafts go first where it has any: they cost nothing to make, and
            # where a reply repeats its prompt they are kept as often as a small model's
            self.sent = tuple(offered[: self.policy.size(len(offered), budget)])
            if not self.sent and offered:
                self._shadow = offered[0]
            return self.sent
        step = self.policy.step
        if step is None or (step <= STEP_IN_DRAFTS * self.policy.draft and not self.policy.eager):
            return ()  # no plain step measured yet, or one too short for a model's drafts to pay
        # a model offers as many as it is asked for: the policy says how many, first
        k = self.policy.size(room, budget, drafted=True)
        shadow = False
        if not k and room > 0 and budget > 0:
            if self.policy.row is None:
                # no window measured yet, and the policy's guess at a row's cost said none pays:
                # one short window measures it (a model's drafts are not free to judge unsent)
                k = min(EXPLORE, room, budget, self.policy.max_window)
            else:
                self._plain += 1
                every = max(SHADOW_EVERY, self.policy.draft / (SHADOW_SHARE * step))
                shadow = self._plain >= every
        if not k and not shadow:
            return ()
        self._plain = 0
        drafts = await self._model_drafts(k or 1)
        if shadow:
            self._shadow = drafts[0] if drafts else None
            return ()
        self.sent = tuple(drafts)
        return self.sent

    def ahead(self, rows: int, budget: int, limit: int) -> tuple[int, ...]:
        """The inputs of a window to send behind the steps in flight, its guess first: at most
        ``rows`` (what the session and the route allow), ``budget`` rows and ``limit`` windows
        following one in flight; none unless it pays (prompt lookup's drafts only: a draft
        model's would cost the head time while the answers wait)."""
        depth = len(self.flight)
        if self.lookup is None or not depth or depth > limit or rows <= 0:
            return ()
        offered = self.lookup.draft(rows, self._assumed())
        return tuple(offered[: self.policy.ahead(len(offered), budget, depth)])

    def _assumed(self) -> list[int]:
        """The tokens the steps in flight would make known if each were kept whole."""
        assumed: list[int] = []
        for i, sent in enumerate(self.flight):
            assumed += sent.step.inputs if i and sent.step.follows else sent.step.drafts
        return assumed

    def sending(self, start: int, inputs: tuple[int, ...], now: float, *, follows: bool = False, rows: int = 0) -> None:
        """The next step leaves now: ``rows`` rows from ``start`` (a window's: one more than its
        drafted ``inputs``, as many where it ``follows`` the steps in flight)."""
        step = InFlight(start, rows or len(inputs) + (0 if follows else 1), inputs, follows)
        sent = _Sent(step, None if self.flight else now, None if follows else self._shadow)
        self.flight.append(sent)
        if self.lookup is not None:
            guess = self.lookup.draft(1, self._assumed())
            sent.guess = guess[0] if guess else None
        self.sent, self._shadow = (), None

    async def prepare(self, budget: int, answered: Callable[[], bool]) -> None:
        """The prompt is in the route: the draft model reads it now, while the route computes
        the first token and the head waits, a piece at a time until that token has come
        (``answered``), so that it takes no time the head would not have waited anyway; the
        first draft reads what is left. Its guess at the first token, where it read the whole
        prompt, is judged when that comes. Nothing without a model, nor where the node's draft
        ``budget`` leaves this session less than half a window (a node heading many sessions
        sends few windows: reading each prompt would cost them all and bring little)."""
        if self.model is not None and self.lookup is not None and 2 * budget >= self.policy.max_window:
            self._shadow = await self.model.read(self.seq_id, self.lookup.tokens, answered)

    async def _model_drafts(self, k: int) -> list[int]:
        assert self.model is not None and self.lookup is not None
        started = time.perf_counter()
        drafts, fed = await self.model.draft(self.seq_id, self.lookup.tokens, k)
        if fed <= self.policy.max_window + 1:  # a prompt's reading is not what a draft costs
            self.policy.drafting(len(drafts), time.perf_counter() - started)
        return drafts
