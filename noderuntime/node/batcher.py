"""The central batcher: the one task that owns a node's engine.

Sessions hand it one step at a time (:meth:`Batcher.step`) and wait for the result.
Each tick the batcher takes every ready step, asks the scheduler for a plan, runs the
plan as one batch in the engine's thread (one at a time: llama.cpp calls on a context
must not overlap) and hands each session its rows. When nothing is ready it sleeps
until the first step arrives, so an idle node adds no latency; steps that arrive
during a run are taken at the next tick.

Everything else that touches the engine is queued and done by the loop between runs:
removing a finished session's KV and freeing its sampler chain (:meth:`Batcher.retire`;
only then is the sequence slot handed back to the lease manager), a known-answer probe
(:meth:`Batcher.exclusive`) and reads of the engine's state (:meth:`Batcher.between_runs`).
So the batcher is the only caller of what runs on the engine's context or changes it; the
node makes sampler chains at admission, and they read only the vocabulary.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import attrs
import numpy as np
import trio

from noderuntime.engine.base import Engine, Rows, StepResult
from noderuntime.engine.thread import EngineThread
from noderuntime.node.leases import LeaseManager, SlotState
from noderuntime.node.scheduler import ReadyStep, schedule
from noderuntime.operations import timeline
from protocol import TokenLogprob

log = logging.getLogger(__name__)

# Scheduler passes the batcher yields before planning a tick (microseconds each).
GATHER_PASSES = 2
# How long a decode tick may wait for decode steps that are due, as a share of a decode
# tick's recent duration (see Batcher._await_due_steps). benchmarks.serving, 2-shard
# routes at 8 clients, as a share of llama-server's tok/s (local system, gRPC route):
# 0.5 -> 0.68 / 0.65, 1.0 -> 0.81 / 0.75, 2.0 -> 0.70 / 0.72.
DUE_WAIT_SHARE = 1.0


class Closable(Protocol):
    """A per-session resource the engine uses during runs (a sampler chain)."""

    def close(self) -> None:
        """Free it."""
        ...


class StepFailed(RuntimeError):
    """The engine failed the batch this step was in."""


@attrs.define(eq=False)
class StepRequest:
    """One session's rows for the next tick."""

    seq_id: int
    start: int  # position of the first row; rows are consecutive
    tokens: np.ndarray | None = None  # head: int32 [n]
    hidden: np.ndarray | None = None  # others: float32 [n, n_embd]
    sampler: Any = None  # tail: sample the last row with this chain
    decode: bool = False
    # tail: sample the last this many rows with the chain, in order (an audit checks every
    # token a route drew, teacher-forced, in one prefill); 1 otherwise
    sample_rows: int = 1
    # tail: per row, the token whose log-probability is wanted there (-1: none), and how
    # many of the most likely tokens beside it (a prompt's logprobs, for OpenAI's echo)
    score: np.ndarray | None = None
    score_top: int = 0
    # a decode window (speculative decoding): the input tokens of rows 1.. were drafted; the
    # tail samples every row in order and stops at the first draw that differs from the
    # draft the next row was given
    draft: tuple[int, ...] = ()
    # drop the sequence's KV from ``start`` on before running (the rows of the last window
    # that were not kept)
    truncate: bool = False

    @property
    def single_decode(self) -> bool:
        """A decode step of one row: what the scheduler counts against the budget, and what has a cadence."""
        return self.decode and self.n_rows == 1

    @property
    def n_rows(self) -> int:
        """Rows in the step."""
        data = self.tokens if self.tokens is not None else self.hidden
        assert data is not None
        return len(data)


@attrs.frozen(eq=False)
class StepOutput:
    """What a session gets back."""

    hidden: np.ndarray | None
    token: int | None
    batch_rows: int  # how many rows the batch it ran in had
    seconds: float  # engine time of that batch
    logprob: TokenLogprob | None = None  # of the sampled token, when its chain asks
    scored: tuple[TokenLogprob, ...] = ()  # of the scored rows, in row order
    # every sampled row's token, in row order (``token`` is the last; by default ``token`` alone)
    drawn: tuple[int, ...] = attrs.field(
        default=attrs.Factory(lambda self: () if self.token is None else (self.token,), takes_self=True)
    )
    drawn_logprobs: tuple[TokenLogprob, ...] = attrs.field(  # theirs, when the chain asks
        default=attrs.Factory(lambda self: () if self.logprob is None else (self.logprob,), takes_self=True)
    )


@attrs.define(eq=False)
class _Work:
    request: StepRequest
    done: trio.Event = attrs.Factory(trio.Event)
    output: StepOutput | None = None
    error: BaseException | None = None


@attrs.define(eq=False)
class _Call:
    """Engine work that is not a session's step, queued for the loop."""

    fn: Callable[[], Any]
    in_thread: bool  # on the engine's thread (a probe), or on the loop's (a quick read)
    done: trio.Event = attrs.Factory(trio.Event)
    result: Any = None
    error: BaseException | None = None


@attrs.frozen
class BatcherStatistics:
    """A snapshot of the batcher's work."""

    ticks: int
    rows: int
    decode_rows: int
    prefill_rows: int
    waiting: int
    running: bool
    last_batch_rows: int
    largest_batch_rows: int  # the most rows one batch held: what the engine's buffers were paged in for
    last_tick_seconds: float
    recent_tick_seconds: float
    busy_seconds: float
    engine_seconds: float  # inside the engine's own call: busy_seconds less the thread hop and batch assembly
    failed_batches: int


class Batcher:
    """Owns an engine; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        leases: LeaseManager,
        *,
        max_batch_tokens: int,
        on_tick: Callable[[int, int, float], None] | None = None,
        runner: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None,
    ) -> None:
        """``on_tick(rows, decode_rows, seconds)`` is called after every batch (telemetry).

        ``runner`` runs a call that touches the engine (a batch, or an :meth:`exclusive`
        call) off the event loop: pass the :class:`EngineThread` that loaded the engine;
        by default the batcher starts one of its own. Timing tests pass one that advances
        a fake clock instead.
        """
        self.engine = engine
        self._own_thread: EngineThread | None = None
        if runner is None:
            self._own_thread = EngineThread()
            runner = self._own_thread.run
        self._runner = runner
        self.leases = leases
        self.max_batch_tokens = max_batch_tokens
        # equal prefill chunks share a tick only within one ubatch (see scheduler)
        recipe = getattr(engine, "recipe", None)
        self._group_rows = min(max_batch_tokens, getattr(recipe, "n_ubatch", max_batch_tokens))
        self._on_tick = on_tick
        self._waiting: list[_Work] = []
        self._retiring: list[tuple[int, Closable | None]] = []
        self._calls: collections.deque[_Call] = collections.deque()  # engine work that is not a step
        self._wake = trio.Event()
        self._running = False  # a batch or a call is on the engine: retirements wait for it
        self._tick = 0
        self._rows = self._decode_rows = 0
        self._last_rows = 0
        self._largest_rows = 0
        self._last_seconds = 0.0
        self._recent = 0.0
        self._busy = 0.0
        self._engine_seconds = 0.0
        self._failed = 0
        # per sequence: when its last decode step came, and how long before that the one
        # before it (its cadence: the round trip its token makes through the route)
        self._cadence: dict[int, tuple[float, float | None]] = {}
        self._recent_decode = 0.0  # smoothed duration of ticks that ran decode rows

    # --- called by sessions

    async def step(self, request: StepRequest) -> StepOutput:
        """Run ``request`` in the next batch that has room for it; wait for its rows."""
        if any(w.request.seq_id == request.seq_id for w in self._waiting):
            raise RuntimeError(f"sequence {request.seq_id} already has a step waiting")
        if not 0 < request.n_rows <= self.max_batch_tokens:
            raise ValueError(f"a step has 1 to {self.max_batch_tokens} rows, not {request.n_rows}")
        if not 0 < request.sample_rows <= request.n_rows:
            raise ValueError(f"a step samples 1 to {request.n_rows} rows, not {request.sample_rows}")
        if request.draft and len(request.draft) != request.n_rows - 1:
            n = request.n_rows
            raise ValueError(f"a window of {n} rows takes {n - 1} drafts, not {len(request.draft)}")
        work = _Work(request)
        timeline.mark("step.submitted")
        if request.single_decode:
            now = trio.current_time()
            last = self._cadence.get(request.seq_id)
            self._cadence[request.seq_id] = (now, now - last[0] if last is not None else None)
        self._waiting.append(work)
        self._wake.set()
        try:
            await work.done.wait()
        except BaseException:
            # cancelled: a step not yet taken is withdrawn; one already running finishes
            # in the engine and its rows are dropped
            if work in self._waiting:
                self._waiting.remove(work)
            raise
        if work.error is not None:
            raise StepFailed(str(work.error)) from work.error
        assert work.output is not None
        return work.output

    def last_step(self, seq_id: int) -> None:
        """``seq_id`` hands in no more steps (its generation is over): no tick waits for it.

        A session stays leased until its client's Release comes back round the route; a
        cadence kept that long would hold a decode tick of every other session for a whole
        tick (``_await_due_steps``) waiting for a step that never comes.
        """
        self._cadence.pop(seq_id, None)

    def retire(self, seq_id: int, resource: Closable | None = None) -> None:
        """Remove a finished session's KV (and free ``resource``) as soon as no batch runs.

        Synchronous; the slot returns to the lease manager only after the KV is gone.
        """
        self._waiting = [w for w in self._waiting if w.request.seq_id != seq_id]
        self._retiring.append((seq_id, resource))
        if not self._running:
            self._apply_retirements()

    async def between_runs(self, fn: Callable[[], Any]) -> Any:
        """Call ``fn`` (a quick read of the engine, such as its KV cells) between two batches."""
        return await self._queue(_Call(fn, in_thread=False))

    async def exclusive(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (which may run the engine) on the engine's thread, in place of a batch.

        For work that is not a session's step (a known-answer probe): queued, and run by
        the batcher's loop between two batches, as vLLM runs its utility calls in its step loop.
        """
        return await self._queue(_Call(fn, in_thread=True))

    async def _queue(self, call: _Call) -> Any:
        self._calls.append(call)
        self._wake.set()
        try:
            await call.done.wait()
        except BaseException:
            # cancelled: a call not yet started is withdrawn; one under way runs to its end
            # (the engine's thread cannot be interrupted), and its result is dropped
            if call in self._calls:
                self._calls.remove(call)
            raise
        if call.error is not None:
            raise call.error
        return call.result

    def statistics(self) -> BatcherStatistics:
        """An immutable snapshot."""
        return BatcherStatistics(
            ticks=self._tick,
            rows=self._rows,
            decode_rows=self._decode_rows,
            prefill_rows=self._rows - self._decode_rows,
            waiting=len(self._waiting),
            running=self._running,
            last_batch_rows=self._last_rows,
            largest_batch_rows=self._largest_rows,
            last_tick_seconds=self._last_seconds,
            recent_tick_seconds=self._recent,
            busy_seconds=self._busy,
            engine_seconds=self._engine_seconds,
            failed_batches=self._failed,
        )

    # --- the batcher task

    def _apply_retirements(self) -> None:
        if self._running:
            return  # the engine is busy in a worker thread; applied once it is done
        retiring, self._retiring = self._retiring, []
        for seq_id, resource in retiring:
            self._cadence.pop(seq_id, None)
            self.engine.remove_sequence(seq_id)
            if resource is not None:
                resource.close()
            self.leases.free(seq_id)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The batcher loop; runs until cancelled."""
        try:
            task_status.started()
            await self._loop()
        finally:
            if self._own_thread is not None:
                self._own_thread.close()

    async def _loop(self) -> None:
        while True:
            await self._run_calls()
            self._apply_retirements()
            if not self._waiting and not self._calls:
                self._wake = trio.Event()
                await self._wake.wait()
            # Let every session that is already runnable hand in its step before we plan:
            # sessions woken by the last batch resubmit within two scheduler passes, and
            # without this they would drift into alternating batches of one. When every
            # leased sequence has handed in its step there is nobody to wait for (a lone
            # session's decode step: each pass is tens of microseconds of its token).
            if not self._all_steps_in():
                for _ in range(GATHER_PASSES):
                    await trio.lowlevel.checkpoint()
                await self._await_due_steps()
            await self._run_calls()
            self._apply_retirements()
            if self._waiting:
                await self._run_one_batch()

    async def _run_calls(self) -> None:
        """Run the queued calls, one after another, with no batch on the engine."""
        while self._calls:
            call = self._calls.popleft()
            self._running = True
            try:
                call.result = await self._runner(call.fn) if call.in_thread else call.fn()
            except Exception as exc:  # noqa: BLE001 - the caller's to handle: it gets it back
                call.error = exc
            except BaseException:
                call.error = StepFailed("the batcher stopped")
                raise
            finally:
                self._running = False
                call.done.set()
                self._apply_retirements()

    async def _await_due_steps(self) -> None:
        """Hold a decode tick briefly for the decode steps that are due.

        On a route a session's next decode step comes back after a round trip through the
        other shards, and steps that missed a tick by a moment would run in a tick of
        their own, each reading every weight again: once split, a node's sessions stay
        split into groups that take turns (2-shard route, 8 clients: most ticks held one
        row). A session's step is due when its cadence (the time between its last two
        decode steps) says it comes within this wait; the wait is a share of a decode
        tick's recent duration, and ends as soon as every due step is in.
        """
        if not self._recent_decode or not any(w.request.single_decode for w in self._waiting):
            return
        window = DUE_WAIT_SHARE * self._recent_decode
        now = trio.current_time()
        deadline = now + window
        waiting = {w.request.seq_id for w in self._waiting}
        due = {
            seq_id
            for seq_id, (last, period) in self._cadence.items()
            if seq_id not in waiting
            and period is not None
            and self.leases.state(seq_id) is SlotState.LEASED
            and now - window <= last + period <= deadline
        }
        if not due:
            return
        while due - {w.request.seq_id for w in self._waiting}:
            self._wake = trio.Event()
            with trio.move_on_at(deadline):
                await self._wake.wait()
            if trio.current_time() >= deadline:
                return

    def _all_steps_in(self) -> bool:
        """Whether every leased sequence has a step waiting (False with none leased)."""
        leased = self.leases.leased
        if leased == 0 or len(self._waiting) < leased:
            return False
        return sum(self.leases.state(w.request.seq_id) is SlotState.LEASED for w in self._waiting) == leased

    async def _run_one_batch(self) -> None:
        by_seq = {w.request.seq_id: w for w in self._waiting}
        # a "decode" step is one row: the scheduler counts decode steps, not rows, against the budget
        ready = [ReadyStep(w.request.seq_id, w.request.n_rows, w.request.single_decode) for w in self._waiting]
        plan = schedule(ready, self.max_batch_tokens, self._tick, group_rows=self._group_rows)
        # Rows in increasing sequence order: with one KV stream per sequence, llama.cpp puts
        # only consecutive increasing sequence ids into one ubatch (split_equal, sequential),
        # so any other order would run the batch as several graphs.
        works = sorted((by_seq[step.seq_id] for step in plan.steps), key=lambda w: w.request.seq_id)
        taken = {id(w) for w in works}
        self._waiting = [w for w in self._waiting if id(w) not in taken]
        for work in works:
            if work.request.truncate:
                # between runs, on the loop: llama.cpp's seq_rm only marks cells free
                self.engine.truncate_sequence(work.request.seq_id, work.request.start)
        rows, samplers, scores = self._assemble(works)
        self._running = True
        started = time.perf_counter()
        started_at = trio.current_time()  # the clock cadences are read on
        timeline.mark("tick.started")
        try:
            result = await self._runner(functools.partial(_marked, self.engine.run, rows, samplers, scores))
            timeline.mark("tick.finished")
        except Exception as exc:  # noqa: BLE001 - an engine failure fails this batch's sessions, not the node
            self._failed += 1
            log.error("batch of %d rows failed: %s", len(rows), exc)
            for work in works:
                work.error = exc
                work.done.set()
            return
        finally:
            self._running = False
            elapsed = time.perf_counter() - started
            self._busy += elapsed
        self._tick += 1
        self._engine_seconds += result.seconds
        self._rows += len(rows)
        self._decode_rows += plan.n_decode
        self._last_rows = len(rows)
        self._largest_rows = max(self._largest_rows, len(rows))
        self._last_seconds = elapsed
        # a smoothed step time, for the tracker's route costs
        self._recent = elapsed if self._tick == 1 else 0.8 * self._recent + 0.2 * elapsed
        if plan.n_decode:
            took = trio.current_time() - started_at
            self._recent_decode = took if not self._recent_decode else 0.8 * self._recent_decode + 0.2 * took
        if self._on_tick is not None:
            self._on_tick(len(rows), plan.n_decode, elapsed)
        offset = 0
        for work in works:
            n = work.request.n_rows
            hidden = result.hidden[offset : offset + n] if result.hidden is not None else None
            scored: tuple[TokenLogprob, ...] = ()
            if work.request.score is not None:
                scored = tuple(result.logprobs[offset + int(i)] for i in np.flatnonzero(work.request.score >= 0))
            drawn: tuple[int, ...] = ()
            drawn_logprobs: tuple[TokenLogprob, ...] = ()
            token = logprob = None
            if work.request.sampler is not None:
                # a window's draws end at the first that left its drafts: the rows after drew nothing
                sampled_rows = [offset + n - k for k in range(work.request.sample_rows, 0, -1)]
                sampled_rows = [r for r in sampled_rows if r in result.sampled]
                drawn = tuple(result.sampled[r] for r in sampled_rows)
                drawn_logprobs = tuple(result.logprobs[r] for r in sampled_rows if r in result.logprobs)
                token = drawn[-1]
                logprob = drawn_logprobs[-1] if drawn_logprobs else None
            work.output = StepOutput(hidden, token, len(rows), result.seconds, logprob, scored, drawn, drawn_logprobs)
            work.done.set()
            offset += n

    def _assemble(self, works: list[_Work]) -> tuple[Rows, dict[int, Any], dict[int, tuple[int, int]]]:
        seq_ids, positions, outputs, drafts = [], [], [], []
        samplers: dict[int, Any] = {}
        scores: dict[int, tuple[int, int]] = {}
        offset = 0
        for work in works:
            request = work.request
            n = request.n_rows
            seq_ids.append(np.full(n, request.seq_id, np.int32))
            positions.append(np.arange(request.start, request.start + n, dtype=np.int32))
            out = np.zeros(n, bool)
            if request.sampler is not None:
                # in row order: the chain takes each draw as the one before the next
                for k in range(request.sample_rows, 0, -1):
                    out[n - k] = True
                    samplers[offset + n - k] = request.sampler
            if request.score is not None:
                for i in np.flatnonzero(request.score >= 0).tolist():
                    out[i] = True
                    scores[offset + i] = (int(request.score[i]), request.score_top)
            outputs.append(out)
            drafted = np.full(n, -1, np.int32)
            if request.draft:
                drafted[: n - 1] = request.draft
            drafts.append(drafted)
            offset += n
        tokens = hidden = None
        if self.engine.is_head:
            tokens = np.concatenate([w.request.tokens for w in works if w.request.tokens is not None])
        else:
            hidden = np.concatenate([w.request.hidden for w in works if w.request.hidden is not None])
        windows = any(w.request.draft for w in works)
        rows = Rows(
            np.concatenate(seq_ids),
            np.concatenate(positions),
            np.concatenate(outputs),
            tokens,
            hidden,
            np.concatenate(drafts) if windows else None,
        )
        return rows, samplers, scores


def _marked(
    run: Callable[..., StepResult], rows: Rows, samplers: Mapping[int, Any], scores: Mapping[int, tuple[int, int]]
) -> StepResult:
    timeline.mark("engine.started")
    try:
        # scores only when there are some: engines (and fakes) that never score need not know them
        return run(rows, samplers=samplers or None, **({"scores": scores} if scores else {}))
    finally:
        timeline.mark("engine.finished")
