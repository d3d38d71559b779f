"""Route sessions: one generation on one route, as seen by one node.

A :class:`RouteSession` is one task in its node's nursery with its own cancel scope
(carrying the session's deadline). It owns the session's lease (sequence id and
KV), its sampler chain on the tail, and its two seams: upstream (toward the client)
and downstream (toward the tail). Whatever ends it — release, cancel, a peer gone,
the deadline, idleness, an error — it releases the lease exactly once, tells the
neighbours that still listen, and closes its seams.

Roles follow from the hop's place in the route plan:

- head (layer 0): takes the prompt tokens, runs chunked prefill and the decode steps,
  feeding each token the tail sends back into the next step (:mod:`noderuntime.node.head`);
- tail (last layer): samples the last position with a per-session llama.cpp sampler
  chain and sends the token upstream, ending on a stop token or max tokens;
- every hop: runs the Activations it receives and passes them on; passes Tokens and
  Usage upstream.

Speculative decoding: where the route takes windows, the head drafts tokens
(:mod:`noderuntime.node.drafting`) and sends them with the tail's last token as one decode step
of several rows; the tail samples them while they agree with the drafts, and every hop drops
the rows past what it drew (:mod:`noderuntime.node.windows`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import trio

from noderuntime.control.commitments import Commitment, as_received
from noderuntime.control.ledger import UsageBody
from noderuntime.engine.base import EngineError
from noderuntime.node.batcher import StepFailed, StepOutput, StepRequest
from noderuntime.node.context import SessionContext, SessionKey, SessionUsage
from noderuntime.node.ending import Blame, EndReason, SessionEnd, ending, idle_blame, seam_lost
from noderuntime.node.head import HeadDriver
from noderuntime.node.leases import Lease
from noderuntime.node.prefix import BLOCK
from noderuntime.node.tail import Draws, TailDraws
from noderuntime.node.windows import HopWindows
from noderuntime.operations.telemetry import SessionLog
from noderuntime.seams.connection import SeamConnection
from noderuntime.transport import TransportError
from protocol import (
    HEARTBEAT_MINOR,
    Activations,
    Cancel,
    Credit,
    Direction,
    Error,
    Event,
    Hop,
    NamedTensor,
    OpenRoute,
    Phase,
    Prefix,
    ProtocolError,
    Release,
    RemoteProtocolError,
    SeamEndpoint,
    Span,
    State,
    StatusCode,
    Tokens,
    Usage,
    UsageRecord,
)

log = logging.getLogger(__name__)


class RouteSession:
    """One route session on one node; see the module docstring."""

    def __init__(
        self,
        context: SessionContext,
        open_route: OpenRoute,
        index: int,
        upstream: SeamConnection,
        lease: Lease,
        sampler: Any,
        deadline: float,
        cached: tuple[int, bytes | None] = (0, None),
    ) -> None:
        """``cached``: what this node's prefix cache holds of the prompt (positions, the saved state)."""
        self.context = context
        self.open_route = open_route
        self.index = index
        self.hop: Hop = open_route.hops[index]
        self.next_hop: Hop | None = open_route.hops[index + 1] if index + 1 < len(open_route.hops) else None
        self.is_head = index == 0
        self.is_tail = self.next_hop is None
        theirs = open_route.header.identity
        self.key = SessionKey(theirs.session_id, theirs.epoch)
        self.identity = theirs.at(self.hop.layers)
        self.upstream = upstream
        self.downstream: SeamConnection | None = None
        self.lease = lease
        self.sampler = sampler
        self.usage = SessionUsage()
        self.log = SessionLog(log, str(self.key), theirs.request_id)
        self._decode_sent_at: float | None = None
        self.scope = trio.CancelScope(deadline=deadline)
        self.end: SessionEnd | None = None
        self.tail = TailDraws(open_route, lease.tokens)
        # set once a released session's KV is in the prefix cache: its usage goes up only then, so
        # that a client holding every hop's usage may count on the next turn finding it
        self._kept = trio.Event()
        self._inner: trio.CancelScope | None = None
        self._tokens_in: trio.MemorySendChannel[Tokens] | None = None
        self._last_activity = trio.current_time()
        self._last_sent_up = -math.inf  # when a frame last went to the previous hop
        self._heard_down = trio.current_time()  # when a frame (a heartbeat too) last came from the next hop
        self._down_beats = False  # the next hop speaks heartbeats (its frames' schema says)
        self._awaiting_downstream = False  # activations sent, their tokens not yet back
        self._sends_up = 0  # sends to the previous hop under way (one that lasts waits for it to read)
        self._released = False
        self._driver_scope = trio.CancelScope()
        self._driver_done = trio.Event()
        if not self.is_head:
            self._driver_done.set()
        # prefix reuse: the previous hop offered ``_offer_in`` positions; this node holds
        # ``cached[0]`` of them and offers the next hop the lesser; the route settles on the
        # tail's answer (``_agreed``), which every hop restores and passes up as a Prefix
        self._offer_in = open_route.prefix_offer
        self._cached, self._cached_state = cached if self._offer_in else (0, None)
        self._my_offer = min(self._offer_in, self._cached)
        self._agreed: int | None = None if self._offer_in else 0
        self._settled = trio.Event()
        self.seen: list[int] = []  # tokens generated so far, as they passed this node
        self.windows = HopWindows.open(
            open_route.speculate,
            context.max_window,
            audit=open_route.audit,
            head_of_route=self.is_head and not self.is_tail,  # until the tail says what the route takes
            max_ahead=context.max_ahead,
        )
        # what this hop took in and gave out, from the first row it computes (commitments.py);
        # made when the prefix is settled. An audit's from the row its audited route started at.
        self._in_commit: Commitment | None = None
        self._out_commit: Commitment | None = None
        if self._agreed == 0:
            self._commit_from(0)
            self._settled.set()

    # --- lifecycle

    def release(self) -> None:
        """Free the KV and the slot (through the batcher); idempotent, never blocks."""
        if self._released:
            return
        self._released = True
        if self.lease.release():
            self.context.retire(self.lease.seq_id, self.sampler)

    def cancel(self, reason: EndReason = EndReason.NODE_STOPPED, message: str = "") -> None:
        """End the session from outside (node shutdown)."""
        self._finish(ending(reason, message))

    def _finish(self, end: SessionEnd) -> None:
        if self.end is None:
            self.end = end
        if self._inner is not None:
            self._inner.cancel()

    def _touch(self) -> None:
        self._last_activity = trio.current_time()

    @property
    def kv_length(self) -> int:
        """Positions this session holds in KV, by the steps it ran and the prefix it restored
        (not the rows of a decode window that were not kept)."""
        return self.windows.kept_end

    async def run(self) -> SessionEnd:
        """Serve the session to its end; returns why it ended."""
        try:
            with self.scope, trio.CancelScope() as inner:
                self._inner = inner
                await self._serve()
            if self.end is None:
                if self.scope.cancelled_caught:
                    self.end = ending(EndReason.DEADLINE, "the session's deadline passed")
                else:
                    self.end = ending(EndReason.RELEASED)
        except BaseException as exc:
            if self.end is None:
                # a defect met while serving (the node logs it and serves on), or the node stopping
                defect = isinstance(exc, Exception)
                if defect:
                    self.end = ending(EndReason.DEFECT, "the node failed this session")
                else:
                    self.end = ending(EndReason.NODE_STOPPED, "the node is stopping")
            raise
        finally:
            self.release()
            with trio.CancelScope(shield=True):
                await self._notify_and_close()
        return self.end

    async def _notify_and_close(self) -> None:
        end = self.end
        assert end is not None
        if end.tell_downstream and self.downstream is not None and self.downstream.endpoint is not None:
            await self.downstream.notify(
                Cancel(self.downstream.endpoint.header(Phase.CANCEL), end.message or end.label)
            )
        if end.tell_upstream and self.upstream.endpoint is not None:
            error = Error(
                self.upstream.endpoint.header(Phase.CANCEL),
                end.code,
                end.message or end.label,
                end.node_id or self._blamed(end.blame),
            )
            await self.upstream.notify(error)
        if self.downstream is not None:
            await self.downstream.aclose()
        await self.upstream.aclose()

    def _blamed(self, blame: Blame) -> bytes:
        """The node id an Error frame names for ``blame``: whom a repair should avoid."""
        if blame is Blame.NEXT and self.next_hop is not None:
            return self.next_hop.node_id
        if blame is Blame.PREVIOUS and self.index > 0:
            return self.open_route.hops[self.index - 1].node_id
        return self.context.node_id

    # --- the commitments

    def _commit_from(self, agreed: int) -> None:
        route = self.open_route
        rows_from = route.audit_from if route.audit else agreed
        self._in_commit = Commitment(rows_from)
        # the tail commits to the tokens it draws, from the first row it samples
        self._out_commit = Commitment(self.tail.first_sampled_row if self.is_tail else rows_from)

    # --- the prefix

    async def _keep_prefix(self) -> None:
        """Save this finished session's KV and tokens in the node's prefix cache (between batches)."""
        cache, save = self.context.prefix_cache, self.context.save_state
        tokens = (*self.open_route.prompt_tokens, *self.seen)[: self.kv_length]
        if cache is None or save is None or cache.budget == 0 or len(tokens) < BLOCK:
            return
        try:
            state = await save(self.lease.seq_id, len(tokens))
        except EngineError as exc:
            self.log.warning("could not keep this session's prefix: %s", exc)
            return
        cache.store(tokens, state)

    async def _settle(self, agreed: int) -> bool:
        """Restore ``agreed`` positions from the prefix cache (when any) and say so upstream, first."""
        restore = self.context.restore_state
        if agreed and (self._cached_state is None or restore is None or agreed > self._cached):
            raise AssertionError("a prefix was agreed on that this node does not hold")  # the offers rule it out
        if agreed:
            assert self._cached_state is not None and restore is not None
            try:
                await restore(self.lease.seq_id, self._cached_state, agreed)
            except EngineError as exc:
                self._finish(ending(EndReason.ENGINE_ERROR, f"could not restore the session's prefix: {exc}"))
                return False
        self._cached_state = None  # held no longer than needed
        self._agreed = agreed
        self.windows.restored(agreed)
        self.usage.cached_tokens = agreed
        self._commit_from(agreed)
        self._settled.set()
        return await self._send_up(lambda: Prefix(self._up_header(Phase.PREFILL), agreed))

    # --- the work

    async def _serve(self) -> None:
        if not self.is_tail and not await self._open_downstream():
            return
        # nothing to wait for downstream: the answer is this node's own
        if self._agreed is None and (self.is_tail or self._my_offer == 0) and not await self._settle(self._my_offer):
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watchdog)
            nursery.start_soon(self._upstream_loop)
            if self.open_route.header.schema_minor >= HEARTBEAT_MINOR:
                nursery.start_soon(self._heartbeat)
            receive = None
            if not self.is_tail:
                # one answer for each step in flight: the loop from downstream never waits on the driver
                send, receive = trio.open_memory_channel[Tokens](1 + self.windows.takes_ahead)
                self._tokens_in = send
                nursery.start_soon(self._downstream_loop)
            if self.is_head:
                nursery.start_soon(self._drive_head, receive)

    async def _open_downstream(self) -> bool:
        assert self.next_hop is not None
        where = f"{self.next_hop.layers.start}:{self.next_hop.layers.end}"
        try:
            stream = await self.context.connect(self.next_hop, self.open_route)
        except (TransportError, OSError) as exc:
            self._finish(ending(EndReason.CONNECT_FAILED, f"cannot reach the next hop ({where}): {exc}"))
            return False
        endpoint = SeamEndpoint(self.identity, Direction.DOWNSTREAM, peer_shard=self.next_hop.layers)
        self.downstream = SeamConnection(
            stream, endpoint, self.context.limits, on_frame=self.context.count_frame, label="down"
        )
        forward = attrs.evolve(self.open_route, header=endpoint.header(Phase.PREFILL), prefix_offer=self._my_offer)
        try:
            await self.downstream.send(forward)
        except TransportError as exc:
            # a peer that refuses the seam's handshake may end it before the first frame is
            # sent, or after: either way the hop could not be reached, and says so alike
            self._finish(
                ending(EndReason.CONNECT_FAILED, f"cannot reach the next hop ({where}): it ended the seam: {exc}")
            )
            return False
        return True

    async def _watchdog(self) -> None:
        idle, hang = self.context.idle_timeout, self.context.hang_timeout
        while True:
            await trio.sleep(max(0.05, min(idle, hang) / 4))
            now = trio.current_time()
            # an older next hop says nothing until it has tokens: it reuses nothing
            if self._agreed is None and now - self._heard_down > hang and not await self._settle(0):
                return
            if self.downstream is not None and self._down_beats and now - self._heard_down > hang:
                self._finish(
                    ending(EndReason.DOWNSTREAM_SILENT, f"the next hop sent nothing, not a heartbeat, for {hang:.1f} s")
                )
                return
            if now - self._last_activity > idle:
                code, message, blame = idle_blame(
                    idle, sends_up=self._sends_up, awaiting_downstream=self._awaiting_downstream
                )
                self._finish(ending(EndReason.IDLE, message, code, blame=blame))
                return

    async def _heartbeat(self) -> None:
        """Tell the previous hop this node is alive, whenever nothing else has for a while.

        A Credit is not progress (the previous hop's idle watchdog still sees a hop that sends
        only these as idle); it only keeps a slow but living hop from being taken for a hung one.
        """
        every = self.context.hang_timeout / 4
        endpoint = self.upstream.endpoint
        await self._settled.wait()  # a Prefix the previous hop waits for goes first
        while True:
            wait = self._last_sent_up + every - trio.current_time()
            if wait > 0:
                await trio.sleep(wait)
                continue
            if self.end is not None or endpoint is None or endpoint.outbound_state is State.CLOSED:
                return  # the session is ending, or said its last (usage, an error) upstream
            self._last_sent_up = trio.current_time()
            with trio.move_on_after(every):  # a previous hop that does not read: its own watchdog sees to it
                try:
                    if not await self._send_up(lambda: Credit(self._up_header(Phase.DECODE), 0)):
                        return
                except ProtocolError:
                    return  # its last word (usage, an error) went up while this one waited its turn

    async def _upstream_loop(self) -> None:
        """Frames from upstream: Activations (non-head), Release, Cancel, Error."""
        while True:
            try:
                event = await self.upstream.receive()
            except RemoteProtocolError as exc:
                await self._protocol_failure_up(exc)
                return
            except TransportError as exc:
                self._finish(seam_lost(True, exc.code, str(exc)))
                return
            self._touch()
            if isinstance(event, Activations):
                if self.is_head:
                    await self._protocol_failure_up(RemoteProtocolError("the head takes no Activations"))
                    return
                if not await self._run_activations(event):
                    return
            elif isinstance(event, Release):
                await self._stop_driver()
                if self.downstream is not None:
                    await self._send_down(Release(self._down_endpoint().header(Phase.RELEASE), event.reason))
                try:
                    await self._keep_prefix()  # before the KV goes
                finally:
                    self._kept.set()
                self.release()
                if self.downstream is None:
                    await self._send_usage([])
                    self._finish(ending(EndReason.RELEASED))
                    return
            elif isinstance(event, Cancel | Error):
                reason = event.reason if isinstance(event, Cancel) else event.message
                self._finish(ending(EndReason.CANCELLED, reason))
                return
            else:
                await self._protocol_failure_up(RemoteProtocolError(f"unexpected {type(event).__name__}"))
                return

    async def _downstream_loop(self) -> None:
        """Frames from downstream: Tokens, Usage, Error, Cancel (a Credit, which no hop sends,
        is passed over: it is not progress, so a hop that sends only Credits is still idle)."""
        assert self.downstream is not None
        while True:
            try:
                event = await self.downstream.receive()
                if isinstance(event, Tokens):
                    self._check_tokens(event)
            except RemoteProtocolError as exc:
                await self.protocol_failure_down(exc)
                return
            except TransportError as exc:
                self._finish(seam_lost(False, exc.code, str(exc)))
                return
            self._heard_down = trio.current_time()
            self._down_beats = self._down_beats or event.header.schema_minor >= HEARTBEAT_MINOR
            if self._agreed is None:
                # the next hop's first frame: its Prefix, or (an older hop) anything else, which means none
                agreed = event.positions if isinstance(event, Prefix) else 0
                if not await self._settle(agreed):
                    return
                if isinstance(event, Prefix):
                    continue
            elif isinstance(event, Prefix):  # after this node gave up waiting and settled on none
                await self.protocol_failure_down(
                    RemoteProtocolError(
                        "a Prefix after the session's prefix was settled", StatusCode.FAILED_PRECONDITION
                    )
                )
                return
            if isinstance(event, Credit):
                continue
            self._touch()
            if isinstance(event, Tokens):
                try:
                    self.windows.answer(event.token_ids, event.header.positions, finished=event.finished)
                except RemoteProtocolError as exc:
                    await self.protocol_failure_down(exc)
                    return
                # until every step sent on is answered (windows in flight may be behind this one);
                # read after the answer took its own step off them
                self._awaiting_downstream = bool(self.windows.flight)
                self.seen += event.token_ids
                if event.finished:
                    self.context.last_step(self.lease.seq_id)
                if self._decode_sent_at is not None:
                    self.context.seam_round_trip(self.downstream.transport, time.perf_counter() - self._decode_sent_at)
                    self._decode_sent_at = None
                if self.is_head and self._tokens_in is not None:
                    # the next decode step first: it runs in the engine thread while the token
                    # travels on to the client
                    with contextlib.suppress(trio.BrokenResourceError):  # the driver stopped: nothing to feed
                        await self._tokens_in.send(event)
                # on up with our header, and with whatever else it carries (logprobs)
                await self._send_up(functools.partial(self._restamped_up, event))
            elif isinstance(event, Usage):
                await self._kept.wait()
                await self._send_usage(list(event.records))
                self._finish(ending(EndReason.RELEASED))
                return
            elif isinstance(event, Error):
                self._finish(ending(EndReason.DOWNSTREAM_ERROR, event.message, event.code, event.node_id))
                return
            elif isinstance(event, Cancel):
                self._finish(ending(EndReason.DOWNSTREAM_CANCELLED, event.reason))
                return

    async def _stop_driver(self) -> None:
        """Stop the head's prefill/decode driver between two sends, and wait until it has."""
        self._driver_scope.cancel()
        await self._driver_done.wait()

    async def _drive_head(self, tokens_in: trio.MemoryReceiveChannel[Tokens] | None) -> None:
        try:
            # the tail's answers are closed on exit: late tokens from downstream are then dropped
            answers = contextlib.nullcontext() if tokens_in is None else tokens_in
            with self._driver_scope, answers:
                await self._settled.wait()
                # from the positions every hop restored from its prefix cache
                await HeadDriver(self, self._agreed or 0).run(tokens_in)
        finally:
            self._driver_done.set()

    async def _run_activations(self, event: Activations) -> bool:
        """A non-head hop: run the rows, pass them on (or sample, on the tail)."""
        positions, decode, draft = event.header.positions, event.header.phase == Phase.DECODE, event.draft
        follows = event.follows
        try:
            hidden, into = self._checked_rows(event)
            self.windows.check_drafts(positions, draft, decode=decode, n_vocab=self.context.n_vocab, follows=follows)
        except RemoteProtocolError as exc:
            await self._protocol_failure_up(exc)
            return False
        if follows:
            live = self.windows.live(positions.start, draft)
            self.context.windows_ahead("run" if live else "stale")
            if not live:
                return True  # stale: the window it follows was not kept whole; every hop knows it
        window = bool(draft) or follows
        self.windows.drop_from(positions.start)
        try:
            self.windows.check_step(positions.start, decode=decode, follows=follows)
        except RemoteProtocolError as exc:
            await self._protocol_failure_up(exc)
            return False
        self.windows.commit(into.add_rows, positions.start, hidden, window, follows=follows)
        sample = len(positions) if window else self.tail.rows_to_sample(positions.start, len(positions))
        output = await self.step(
            positions.start,
            hidden=hidden,
            sample=sample if self.is_tail else 0,
            decode=decode,
            draft=draft,
            follows=follows,
        )
        if output is None:
            return False
        if self.is_tail and sample:
            if self.open_route.audit:
                if positions.end == len(self.open_route.prompt_tokens):
                    await self.emit(self.tail.take_audit())
                return True
            # a window's draws begin at its first row; a plain step's is its last row's
            first = positions.start + 1 if window else positions.end
            await self.emit(self.tail.take(output, first, len(draft), guessed=follows))
        return True

    def _checked_rows(self, event: Activations) -> tuple[np.ndarray, Commitment]:
        """The hidden states of a step from the previous hop, if its shape and positions fit this
        session, and the commitment they go into (made once the route agreed on its prefix)."""
        try:
            hidden = event.tensor("hidden_states")
        except KeyError:
            raise RemoteProtocolError("Activations without hidden_states") from None
        positions, n_embd = event.header.positions, self.context.n_embd
        if hidden.ndim != 2 or hidden.shape[0] != len(positions) or hidden.shape[1] != n_embd:
            raise RemoteProtocolError(
                f"hidden_states of shape {hidden.shape} for {len(positions)} positions, n_embd {n_embd}"
            )
        if positions.end > self.lease.tokens:
            raise RemoteProtocolError(
                f"position {positions.end} beyond the {self.lease.tokens} this session reserved",
                StatusCode.OUT_OF_RANGE,
            )
        if self._in_commit is None:
            # rows before the hops agreed on the prefix: nothing says where this hop's computing starts
            raise RemoteProtocolError("Activations before the route agreed on its prefix")
        return hidden, self._in_commit

    async def step(
        self,
        start: int,
        *,
        tokens: np.ndarray | None = None,
        hidden: np.ndarray | None = None,
        sample: int,
        decode: bool,
        draft: tuple[int, ...] = (),
        follows: bool = False,
    ) -> StepOutput | None:
        """One step through the batcher; forwards the rows downstream; returns what it drew (``None``:
        the session is ending).

        ``sample``: how many of the last rows the tail samples (0: none). ``draft``: a window's
        drafted tokens, the inputs of its rows 1.. (of its rows 0.. where it ``follows`` another).
        """
        window = bool(draft) or follows
        request = StepRequest(
            self.lease.seq_id,
            start,
            tokens=tokens,
            hidden=hidden,
            sampler=self.sampler if sample else None,
            decode=decode,
            sample_rows=max(1, sample),
            draft=draft[1:] if follows else draft,
            truncate=start < self.windows.engine_end,  # the rows of windows that were not kept
        )
        if tokens is not None:
            assert self._in_commit is not None
            self.windows.drop_from(start)
            self.windows.commit(self._in_commit.add_tokens, start, tokens, window, follows=follows)
        sampling = self.open_route.sampling
        if self.is_tail and not decode and sampling.prompt_logprobs:
            # each prompt row scores the prompt token after it; the last one's is the sampled token
            prompt = self.open_route.prompt_tokens
            after = np.arange(start + 1, start + request.n_rows + 1)
            request.score = np.array([prompt[p] if p < len(prompt) else -1 for p in after.tolist()], np.int32)
            request.score_top = sampling.top_logprobs
        try:
            output = await self.context.step(request)
        except StepFailed as exc:
            self._finish(ending(EndReason.ENGINE_ERROR, f"the shard failed: {exc}"))
            return None
        self._touch()
        self.tail.stepped(output, sampled=bool(sample))
        n = request.n_rows
        self.windows.stepped(start, n, draft, follows=follows, sent_on=decode and self.downstream is not None)
        if decode:
            self.usage.decode_tokens += n
        else:
            self.usage.prefill_tokens += n
        self.usage.compute_seconds += output.seconds * n / max(1, output.batch_rows)
        if self.downstream is not None:
            assert output.hidden is not None and self._out_commit is not None
            sent = as_received(output.hidden, self.context.encoding)
            self.windows.commit(self._out_commit.add_rows, start, sent, window, follows=follows)
            header = self._down_endpoint().header(Phase.DECODE if decode else Phase.PREFILL, Span(start, start + n))
            tensor = NamedTensor("hidden_states", output.hidden, self.context.encoding)
            if not await self._send_down(Activations(header, (tensor,), draft, follows)):
                return None
            if decode and self._decode_sent_at is None:  # a seam's round trip: from a step with none before it
                self._decode_sent_at = time.perf_counter()
        return output

    async def emit(self, draws: Draws) -> bool:
        """The tail: send ``draws`` upstream, in the commitments first; whether the generation is finished."""
        self.seen += draws.tokens
        assert self._out_commit is not None
        self._out_commit.add_tokens(draws.first - 1, draws.tokens)
        self.windows.keep(draws.span.end - 1, draws.tokens[-1] if draws.tokens else None)
        if draws.finished:
            self.context.last_step(self.lease.seq_id)
        bounds = self.windows.window, self.windows.ahead
        await self._send_up(lambda: draws.frame(self._up_header(Phase.DECODE, draws.span), *bounds))
        return draws.finished

    async def _send_usage(self, records: list[UsageRecord]) -> None:
        body = UsageBody(
            node_id=self.context.node_id.hex(),
            layers=(self.hop.layers.start, self.hop.layers.end),
            request_id=self.identity.request_id,
            session_id=self.key.session_id.hex(),
            epoch=self.key.epoch,
            artifact=self.identity.artifact_fingerprint.hex(),
            prefill_tokens=self.usage.prefill_tokens,
            decode_tokens=self.usage.decode_tokens,
            compute_ms=round(self.usage.compute_seconds * 1e3, 3),
            bytes_in=self.upstream.bytes_received + (self.downstream.bytes_received if self.downstream else 0),
            bytes_out=self.upstream.bytes_sent + (self.downstream.bytes_sent if self.downstream else 0),
            started=round(self.usage.started, 3),
            ended=round(time.time(), 3),
            audit=self.open_route.audit,
            digest_from=self._in_commit.start if self._in_commit else 0,
            input_rows=self._in_commit.rows if self._in_commit else 0,
            input_digest=self._in_commit.hexdigest() if self._in_commit else "",
            output_from=self._out_commit.start if self._out_commit else 0,
            output_rows=self._out_commit.rows if self._out_commit else 0,
            output_digest=self._out_commit.hexdigest() if self._out_commit else "",
        ).encode()
        own = UsageRecord(body, self.context.node_id, self.context.sign(body))
        await self._send_up(lambda: Usage(self._up_header(Phase.RELEASE), (*records, own)))

    # --- sending helpers

    def _restamped_up(self, event: Tokens) -> Tokens:
        """``event`` from downstream, with our header (the next step id upstream) and what else it
        carries; the drafts a window may carry lowered to what this hop takes."""
        header = self._up_header(Phase.DECODE, event.header.positions)
        return attrs.evolve(
            event,
            header=header,
            window=self.windows.lowered(event.window),
            ahead=self.windows.lowered_ahead(event.ahead),
        )

    def _up_header(self, phase: Phase, positions: Span = Span()) -> Any:
        assert self.upstream.endpoint is not None
        return self.upstream.endpoint.header(phase, positions)

    def _down_endpoint(self) -> SeamEndpoint:
        assert self.downstream is not None and self.downstream.endpoint is not None
        return self.downstream.endpoint

    async def _send_up(self, build: Callable[[], Event]) -> bool:
        """Send upstream the event ``build`` makes when its turn comes (its header takes the next step id)."""
        self._sends_up += 1
        self._last_sent_up = trio.current_time()
        try:
            await self.upstream.send_next(build)
            return True
        except ProtocolError:
            if self.end is None:
                raise  # our own misuse of the seam: a defect, not a peer that left
            return False  # the seam closed under a failure meanwhile; the session is ending
        except TransportError as exc:
            self._finish(seam_lost(True, exc.code, str(exc)))
            return False
        finally:
            self._sends_up -= 1

    async def _send_down(self, event: Event) -> bool:
        assert self.downstream is not None
        if isinstance(event, Activations):
            self._awaiting_downstream = True  # from now: a send that blocks is the next hop's stall too
        try:
            await self.downstream.send(event)
            return True
        except ProtocolError:
            if self.end is None:
                raise
            return False
        except TransportError as exc:
            self._finish(seam_lost(False, exc.code, str(exc)))
            return False

    def _check_tokens(self, event: Tokens) -> None:
        """Tokens from downstream must be in the vocabulary (llama.cpp would fail the
        head's whole batch) and must not take the session past its reservation."""
        n_vocab = self.context.n_vocab
        if not all(0 <= t < n_vocab for t in event.token_ids):
            raise RemoteProtocolError(f"token ids outside the vocabulary of {n_vocab}", StatusCode.OUT_OF_RANGE)
        if event.token_ids and not event.finished and event.header.positions.end >= self.lease.tokens:
            raise RemoteProtocolError(
                f"an unfinished generation at position {event.header.positions.end}, past the "
                f"{self.lease.tokens} this session reserved",
                StatusCode.OUT_OF_RANGE,
            )

    # Both failures end the session before telling the peer: the notice is sent shielded,
    # and meanwhile no other task of the session may send on a seam that is closing.

    async def protocol_failure_down(self, error: ProtocolError) -> None:
        """End the session on the next hop's breach of the protocol, and tell it why."""
        assert self.downstream is not None
        self._finish(ending(EndReason.DOWNSTREAM_PROTOCOL_ERROR, f"the next hop broke the protocol: {error.message}"))
        await self.downstream.fail(error, self.context.node_id)

    async def _protocol_failure_up(self, error: ProtocolError) -> None:
        self._finish(ending(EndReason.UPSTREAM_PROTOCOL_ERROR, error.message, error.code))
        await self.upstream.fail(error, self.context.node_id)
