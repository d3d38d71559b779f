"""The head's driver: chunked prefill of the prompt, then a decode step (or window) for each
answer from the tail.

The head of a route (layer 0) is the one hop that computes without a frame asking it to: it
takes the prompt, and after it each token the tail sends back, and feeds them to its shard.
A :class:`HeadDriver` is that loop, run by its :class:`~noderuntime.node.sessions.RouteSession`
as one task of the session's nursery; the session owns the seams, the lease and the steps, and
the driver decides which step comes next: a prefill chunk, the next decode step with the
drafts that pay (:mod:`noderuntime.node.drafting`), or a window ahead of those in flight.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np
import trio

from noderuntime.node.batcher import StepOutput
from noderuntime.node.context import SessionContext
from noderuntime.node.drafting import HeadDrafts
from noderuntime.node.leases import Lease
from noderuntime.node.tail import Draws, TailDraws
from noderuntime.node.windows import HopWindows
from protocol import OpenRoute, ProtocolError, RemoteProtocolError, StatusCode, Tokens


class HeadSession(Protocol):
    """What the driver needs of the route session it drives."""

    open_route: OpenRoute
    context: SessionContext
    lease: Lease
    tail: TailDraws
    windows: HopWindows
    is_tail: bool
    seen: list[int]

    async def step(
        self,
        start: int,
        *,
        tokens: np.ndarray | None = None,
        sample: int,
        decode: bool,
        draft: tuple[int, ...] = (),
        follows: bool = False,
    ) -> StepOutput | None:
        """One step through the batcher, its rows sent on (``None``: the session is ending)."""
        ...

    async def emit(self, draws: Draws) -> bool:
        """The tail's draws sent upstream; whether the generation is finished."""
        ...

    async def protocol_failure_down(self, error: ProtocolError) -> None:
        """End the session on the next hop's breach of the protocol, and tell it."""
        ...


class HeadDriver:
    """The head's prefill and decode loop for one session, from ``position`` (the prompt's
    positions every hop restored from its prefix cache)."""

    def __init__(self, session: HeadSession, position: int) -> None:
        self.session = session
        self.position = position

    async def run(self, tokens_in: trio.MemoryReceiveChannel[Tokens] | None) -> None:
        """Prefill the prompt, then decode until the generation ends (``tokens_in``: the tail's
        answers, where the head is not its route's tail)."""
        s = self.session
        prompt = np.asarray(s.open_route.prompt_tokens, dtype=np.int32)
        chunk = s.context.prefill_chunk
        position = self.position
        output: StepOutput | None = None
        for start in range(position, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            sample = s.tail.rows_to_sample(start, len(piece)) if s.is_tail else 0
            output = await s.step(position, tokens=piece, sample=sample, decode=False)
            if output is None:
                return
            if s.open_route.audit and s.is_tail:
                if position + len(piece) == len(prompt) and await s.emit(s.tail.take_audit()):
                    return
                output = None
            position += len(piece)
        drafts = HeadDrafts(
            s.open_route.prompt_tokens,
            s.open_route.speculate,
            eager=s.context.eager_windows,
            model=s.context.draft_model,
            seq_id=s.lease.seq_id,
        )
        if tokens_in is not None:
            arrived = tokens_in  # the first tokens from the tail wait there
            await drafts.prepare(s.context.draft_rows(), lambda: arrived.statistics().current_buffer_used > 0)
        if s.is_tail:
            assert output is not None
            await self._alone(drafts, output, position)
        else:
            assert tokens_in is not None
            await self._route(drafts, tokens_in, position)

    async def _alone(self, drafts: HeadDrafts, output: StepOutput, first: int) -> None:
        """The head that is its route's tail: each step's draws, then the next step (or window)."""
        s = self.session
        sent: tuple[int, ...] = ()  # the drafts of the step that drew ``output``
        while True:
            draws = s.tail.take(output, first, len(sent))
            if await s.emit(draws):
                return
            # the step's round trip and its drafts judged; the next step: the last token, at its position
            drafts.answered(draws.tokens, time.perf_counter())
            position = first + len(draws.tokens) - 1  # the tail's own draws stop at the reservation
            room = s.windows.room(position, left=self._left(), reserved=s.lease.tokens)
            sent = await drafts.draft(room, s.context.draft_rows())
            rows = np.array([draws.tokens[-1], *sent], np.int32)
            drafts.sending(position, sent, time.perf_counter())
            stepped = await s.step(position, tokens=rows, sample=len(rows), decode=True, draft=sent)
            if stepped is None:
                return
            output, first = stepped, position + 1

    async def _route(self, drafts: HeadDrafts, tokens_in: trio.MemoryReceiveChannel[Tokens], first: int) -> None:
        """The head of a longer route: a step (or window) for each answer from the tail, and
        behind the steps in flight the windows that follow them, where they pay."""
        s = self.session
        while True:
            received = await tokens_in.receive()
            if received.finished or not received.token_ids:
                return  # wait for Release from the client in the upstream loop
            tokens = received.token_ids
            s.windows.answered(received.window, received.ahead)
            # the step's round trip and its drafts judged; the windows behind it live or stale
            answered = drafts.answered(tokens, time.perf_counter())
            position = (first if answered is None else answered.start + 1) + len(tokens) - 1
            if await self._past_reservation(position):
                return
            if not drafts.flight:  # none in flight still live: the next step, the last token at its position
                room = s.windows.room(position, left=self._left(), reserved=s.lease.tokens)
                sent = await drafts.draft(room, s.context.draft_rows())
                rows = np.array([tokens[-1], *sent], np.int32)
                drafts.sending(position, sent, time.perf_counter())
                if await s.step(position, tokens=rows, sample=0, decode=True, draft=sent) is None:
                    return
            while drafts.flight:
                start = drafts.flight[-1].step.end
                # every row of the steps in flight kept would bring the tokens up to ``start``
                left = self._left() - (start - position)
                most = min(s.windows.window, left, s.lease.tokens - start)
                inputs = drafts.ahead(most, s.context.draft_rows(), s.windows.ahead)
                if not inputs:
                    break
                drafts.sending(start, inputs, time.perf_counter(), follows=True)
                s.context.windows_ahead("sent")
                rows = np.array(inputs, np.int32)
                if await s.step(start, tokens=rows, sample=0, decode=True, draft=inputs, follows=True) is None:
                    return

    def _left(self) -> int:
        """Tokens the session may still generate."""
        route = self.session.open_route
        return route.max_tokens - len(route.generated) - len(self.session.seen)

    async def _past_reservation(self, position: int) -> bool:
        """Whether the tail sent a token for ``position``, past the session's reservation (it should
        have finished the generation): then the next hop broke the protocol."""
        reserved = self.session.lease.tokens
        if position < reserved:
            return False
        await self.session.protocol_failure_down(
            RemoteProtocolError(
                f"a token for position {position}, past the {reserved} this session reserved",
                StatusCode.OUT_OF_RANGE,
            )
        )
        return True
