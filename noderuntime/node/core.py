"""A shard node: one engine, its batcher and leases, and the route sessions it serves.

:meth:`Node.run` opens the node's nursery and starts the batcher; every incoming seam
stream that :meth:`Node.accept` takes is served by a task in that nursery: it reads the
first frame (an ``OpenRoute``), checks that the route names this node with its range,
artifact and recipe, admits the session (or refuses at once, ``RESOURCE_EXHAUSTED``
when full) and serves it as a :class:`~noderuntime.node.sessions.RouteSession` to its end.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from noderuntime.control import admission
from noderuntime.control.admission import ProbeAnswer
from noderuntime.engine.base import Engine, EngineError, GrammarError, SavesSequences
from noderuntime.engine.thread import EngineThread
from noderuntime.node.batcher import Batcher, BatcherStatistics
from noderuntime.node.context import SessionContext, SessionKey, deadline_from_unix_ms
from noderuntime.node.draftmodel import DraftModel
from noderuntime.node.ending import EndReason
from noderuntime.node.leases import LeaseManager, LeaseStatistics
from noderuntime.node.prefix import PrefixCache
from noderuntime.node.sessions import RouteSession
from noderuntime.operations import timeline
from noderuntime.operations.telemetry import NodeMetrics, SessionLog, exposition
from noderuntime.seams.client import Connector
from noderuntime.seams.connection import NOTICE_TIMEOUT, SeamConnection
from noderuntime.transport import FrameStream, TransportError
from protocol import (
    Direction,
    Encoding,
    Error,
    Hop,
    Identity,
    Limits,
    OpenRoute,
    Phase,
    ProtocolError,
    RemoteProtocolError,
    SeamEndpoint,
    Span,
    StatusCode,
)

log = logging.getLogger(__name__)


# (the OpenRoute, this node's index in its plan, the dialer its seam proved or None)
TicketCheck = Callable[[OpenRoute, int, bytes | None], Awaitable[None]]


@attrs.frozen
class NodeConfig:
    """How a node serves sessions."""

    layers: Span
    n_layer: int
    artifact_fingerprint: bytes
    recipe_fingerprint: bytes
    n_slots: int
    ctx_per_seq: int
    max_batch_tokens: int = 512
    prefill_chunk: int = 256
    idle_timeout: float = 60.0
    # a next hop that sends nothing, not even a heartbeat, this long is hung (sessions/HEARTBEAT_MINOR)
    hang_timeout: float = 2.0
    # bytes of finished sessions' KV kept for new sessions that begin alike (0: none)
    prefix_cache_bytes: int = 0
    max_session_seconds: float = 3600.0
    encoding: Encoding = Encoding.F32
    limits: Limits = Limits()
    # speculative decoding: the most drafted tokens a decode window may carry through this
    # node (where its engine's rows are exact in a window), and the draft rows a tick may
    # take at a head, shared by its sessions: under load, windows shrink first
    max_window: int = 8
    draft_rows: int = 8
    # windows that may follow one in flight through this node (node/windows.py): where a route's
    # round trip is long against its rows, the head sends the next before the answer comes
    max_ahead: int = 3
    # every draft the head's drafter offers goes, whatever it costs (a fixed window: for
    # benchmarks to measure against the adaptive one, and tests that roll windows back often)
    eager_windows: bool = False

    max_opening: int = 64  # streams that have not yet opened a session
    # of them, what one address (a direct seam's peer; relayed seams are counted by their
    # relay, per dialer) may hold once half of them are taken: one address that held every
    # one refused every other session here, and below half a gateway's burst goes through
    max_opening_per_source: int = 16
    open_timeout: float = 10.0  # for a new stream's OpenRoute

    def __attrs_post_init__(self) -> None:
        if not 0 < self.prefill_chunk <= self.max_batch_tokens:
            raise ValueError("prefill_chunk must lie in 1..max_batch_tokens")
        for name in ("idle_timeout", "hang_timeout", "max_session_seconds", "open_timeout"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds")
        if not 1 <= self.max_opening_per_source <= self.max_opening:
            raise ValueError("max_opening and max_opening_per_source must be at least 1, the second at most the first")
        if not 0 <= self.max_window <= self.limits.max_window or self.draft_rows < 0:
            raise ValueError(f"max_window must lie in 0..{self.limits.max_window}, draft_rows be at least 0")
        if not 0 <= self.max_ahead <= self.limits.max_ahead:
            raise ValueError(f"max_ahead must lie in 0..{self.limits.max_ahead}")


@attrs.frozen
class NodeStatistics:
    """A snapshot of a node."""

    active_sessions: int
    leases: LeaseStatistics
    batcher: BatcherStatistics
    sessions_opened: int
    sessions_ended: dict[str, int]
    admissions_refused: int


class Node:
    """See the module docstring."""

    def __init__(
        self,
        engine: Engine,
        config: NodeConfig,
        node_id: bytes,
        connector: Connector | None = None,
        *,
        ticket_check: TicketCheck | None = None,
        signer: Callable[[bytes], bytes] | None = None,
        engine_thread: EngineThread | None = None,
        draft_model: DraftModel | None = None,
    ) -> None:
        """``engine_thread`` is the thread that loaded ``engine``; its batches run there too.
        ``draft_model`` drafts for the sessions this node heads (its owner closes it)."""
        self.engine = engine
        self.draft_model = draft_model
        self.engine_n_embd = engine.n_embd
        self.config = config
        self.node_id = node_id
        self.connector = connector
        self.ticket_check = ticket_check
        self._signer = signer
        self.leases = LeaseManager(config.n_slots, config.ctx_per_seq)
        self.metrics = NodeMetrics()
        self.batcher = Batcher(
            engine,
            self.leases,
            max_batch_tokens=config.max_batch_tokens,
            on_tick=self.metrics.on_tick,
            runner=engine_thread.run if engine_thread is not None else None,
        )
        self.sessions: dict[SessionKey, RouteSession] = {}
        self._nursery: trio.Nursery | None = None
        self._opened = 0
        self._ended: collections.Counter[str] = collections.Counter()
        self._refused = 0
        self._opening = 0  # accepted streams that have not yet opened a session
        self._opening_from: collections.Counter[str] = collections.Counter()  # of them, by source address
        self._stopping = False
        self.ready = trio.Event()
        self._probe_lock = trio.Lock()
        self.capability: dict[str, Any] | None = None  # measured at start (noderun), shown in /status
        # what a leaving node does first (telling its tracker), before it hands its sessions over
        self.on_leave: list[Callable[[], Awaitable[None]]] = []
        self._emptied = trio.Event()  # set when a stopping node's last session has ended
        # finished sessions' KV, where the engine can save and restore a sequence's
        self.prefix_cache = (
            PrefixCache(config.prefix_cache_bytes)
            if config.prefix_cache_bytes and isinstance(engine, SavesSequences)
            else None
        )
        self._evictions_counted = 0
        self._session_context = SessionContext(
            node_id=node_id,
            step=self.batcher.step,
            retire=self.batcher.retire,
            last_step=self.batcher.last_step,
            connect=self.connect,
            sign=self.sign,
            count_frame=self.count_frame,
            seam_round_trip=lambda transport, seconds: self.metrics.seam_round_trip.labels(transport).observe(seconds),
            limits=config.limits,
            encoding=config.encoding,
            prefill_chunk=config.prefill_chunk,
            idle_timeout=config.idle_timeout,
            hang_timeout=config.hang_timeout,
            n_embd=engine.n_embd,
            n_vocab=engine.n_vocab,
            prefix_cache=self.prefix_cache,
            save_state=self._save_state,
            restore_state=self._restore_state,
            max_window=config.max_window if getattr(engine, "exact_windows", False) else 0,
            max_ahead=config.max_ahead,
            windows_ahead=lambda outcome: self.metrics.windows_ahead.labels(outcome).inc(),
            draft_rows=self._draft_rows,
            eager_windows=config.eager_windows,
            draft_model=draft_model,
        )

    # --- running

    async def run(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; sessions still running are ended and their KV released."""
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.batcher.run)
                self._nursery = nursery
                self.ready.set()
                task_status.started(self)
                try:
                    await trio.sleep_forever()
                finally:
                    self._stopping = True
                    for session in list(self.sessions.values()):
                        session.cancel(EndReason.NODE_STOPPED, "the node is stopping")
        finally:
            self._nursery = None

    def accept(self, stream: FrameStream) -> None:
        """Serve an incoming seam stream in the node's nursery (synchronous).

        Never raises: transports call it from callbacks that must not fail. A stream that
        arrives while the node stops, or while too many streams have yet to open a
        session, is refused with UNAVAILABLE; one that arrives before the node runs or
        after it stopped is dropped, and its transport closes it.
        """
        source = stream.source
        if self._stopping:
            refusal = "the node is stopping"
        elif self._opening >= self.config.max_opening:
            refusal = f"{self._opening} streams are already opening sessions here"
        elif (
            source
            and self._opening_from[source] >= self.config.max_opening_per_source
            and self._opening >= self.config.max_opening // 2
        ):
            refusal = f"{self._opening_from[source]} streams from {source} are already opening sessions here"
        else:
            if self._spawn(self._handle_accepted, stream, source):
                self._opening += 1
                if source:
                    self._opening_from[source] += 1
            return
        self.metrics.admissions_refused.labels(StatusCode.UNAVAILABLE.name).inc()
        log.info("refused a seam: %s", refusal)
        self._spawn(self._refuse_stream, stream, refusal)

    def _draft_rows(self) -> int:
        """The draft rows one session at this head may add to a tick: the budget, shared."""
        return self.config.draft_rows // max(1, self.leases.leased)

    async def _save_state(self, seq_id: int, positions: int) -> bytes:
        assert isinstance(self.engine, SavesSequences)
        engine = self.engine

        def save() -> bytes:
            # the KV must be what the session's steps say, or the cache would file it under wrong tokens
            held = engine.positions(seq_id)
            if held is not None and held[0] == 0 and held[1] >= positions:
                # the rows of the session's last decode window that were not kept
                engine.truncate_sequence(seq_id, positions)
                held = engine.positions(seq_id)
            if held != (0, positions - 1):
                raise EngineError(f"sequence {seq_id} holds positions {held}, not the session's {positions}")
            return engine.save_sequence(seq_id)

        state: bytes = await self.batcher.exclusive(save)
        return state

    async def _restore_state(self, seq_id: int, state: bytes, keep: int) -> None:
        assert isinstance(self.engine, SavesSequences)
        engine = self.engine
        await self.batcher.exclusive(lambda: engine.restore_sequence(seq_id, state, keep))

    async def drain(self) -> None:
        """Leave politely: take no more sessions, say so (:attr:`on_leave`), hand each live one over.

        Every session ends as the node's own leaving (NODE_STOPPED, naming this node): its
        previous hop, or the client at the head, repairs the route around it. Returns once
        they all ended (bound it with a cancel scope).
        """
        self._stopping = True
        for hook in self.on_leave:
            await hook()
        handed = len(self.sessions)
        for session in list(self.sessions.values()):
            session.cancel(EndReason.NODE_STOPPED, "the node is leaving: go on without it")
        if self.sessions:
            await self._emptied.wait()
        log.info("drained: %d sessions handed over", handed)

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> bool:
        try:
            if self._nursery is not None:
                self._nursery.start_soon(fn, *args)
                return True
        except RuntimeError:  # the nursery closed an instant before ``_nursery`` was cleared
            pass
        # not started, or stopped: its transports close what they still hold
        log.info("dropped a seam that arrived while the node was not running")
        return False

    @staticmethod
    async def _refuse_stream(stream: FrameStream, refusal: str) -> None:
        # shielded: a stopping node's nursery is cancelled, and the peer should still hear why
        with trio.CancelScope(shield=True), trio.move_on_after(NOTICE_TIMEOUT):
            await stream.abort(StatusCode.UNAVAILABLE, refusal)

    async def connect(self, hop: Hop, open_route: OpenRoute) -> FrameStream:
        """A stream to the next hop, through this node's connector."""
        if self.connector is None:
            raise TransportError("this node has no connector to reach other nodes")
        return await self.connector.connect(hop, open_route)

    async def probe(self, seed: int, *, patience: float = 30.0) -> ProbeAnswer:
        """Answer a known-answer probe on a free sequence slot (waiting up to ``patience`` s for one).

        :class:`~noderuntime.control.admission.AdmissionError` if no slot came free or the seed is bad.
        """
        async with self._probe_lock:
            lease = self.leases.acquire(admission.PROBE_ROWS)
            for _ in range(int(patience / 0.2)):  # slots free as sessions end; polling is cheap here
                if lease is not None:
                    break
                await trio.sleep(0.2)
                lease = self.leases.acquire(admission.PROBE_ROWS)
            if lease is None:
                raise admission.AdmissionError("no sequence slot came free for the probe")
            try:
                engine: Any = self.engine
                answer: ProbeAnswer = await self.batcher.exclusive(
                    functools.partial(admission.probe, engine, seed, lease.seq_id)
                )
            finally:
                lease.release()
                self.batcher.retire(lease.seq_id)
            self.metrics.probes.inc()
            return answer

    def sign(self, body: bytes) -> bytes:
        """This node's signature over ``body`` (empty when the node has no key)."""
        return self._signer(body) if self._signer is not None else b""

    # --- one incoming stream

    async def _handle_accepted(self, stream: FrameStream, source: str) -> None:
        try:
            session = await self._open_session(stream)
        finally:
            self._opening -= 1
            if source:
                self._opening_from[source] -= 1
                if not self._opening_from[source]:
                    del self._opening_from[source]
        if session is not None:
            await self._serve_session(session)

    async def _open_session(self, stream: FrameStream) -> RouteSession | None:
        """The session ``stream`` opens, admitted; ``None`` when it was refused or went away.

        Until a session is admitted the stream may hold one frame of one tensor at a time:
        a chunked step that would have the node buffer megabytes for nobody is refused.
        """
        limits = self.config.limits
        opening = attrs.evolve(limits, max_chunks=1, max_tensors=1)
        conn = SeamConnection(stream, limits=opening, on_frame=self.count_frame, label="up")
        try:
            with trio.fail_after(self.config.open_timeout):
                first = await conn.receive()
        except ProtocolError as exc:
            # no session yet, so no identity to address an Error frame to: the status goes in the stream's end
            log.info("refused a seam before it opened a session: %s", exc)
            self.metrics.admissions_refused.labels(exc.code.name).inc()
            await conn.abort(exc)
            return None
        except (TransportError, trio.TooSlowError) as exc:
            log.info("dropped a seam before it opened a session: %s", exc)
            await conn.aclose()
            return None
        if not isinstance(first, OpenRoute):
            await self._refuse(
                conn,
                first.header.identity,
                RemoteProtocolError(
                    f"the first frame of a seam must be OpenRoute, not {type(first).__name__}",
                    StatusCode.FAILED_PRECONDITION,
                ),
            )
            return None
        try:
            index = self._check_route(first)
            proven = stream.authenticated
            if proven is not None:
                ident = first.header.identity
                if (proven.session_id, proven.epoch) != (ident.session_id, ident.epoch):
                    raise RemoteProtocolError(
                        "the seam's handshake was bound to another session", StatusCode.PERMISSION_DENIED
                    )
            if self.ticket_check is not None:
                await self.ticket_check(first, index, proven.node_id if proven is not None else None)
            # after the ticket: a second opening of a session is a replayed ticket, and is told so
            ident = first.header.identity
            if SessionKey(ident.session_id, ident.epoch) in self.sessions:
                raise RemoteProtocolError("this session is already open here", StatusCode.ALREADY_EXISTS)
        except ProtocolError as exc:
            await self._refuse(conn, first.header.identity, exc)
            return None
        session = self._admit(first, index, conn)
        if isinstance(session, ProtocolError):
            await self._refuse(conn, first.header.identity, session)
            return None
        timeline.mark("node.admitted")
        # a step holds at most a batch of hidden states: no tensor need be larger
        widest = self.config.max_batch_tokens * self.engine_n_embd * 4
        conn.set_limits(attrs.evolve(limits, max_tensor_bytes=min(limits.max_tensor_bytes, widest)))
        return session

    async def _serve_session(self, session: RouteSession) -> None:
        self.sessions[session.key] = session
        self._opened += 1
        self.metrics.sessions_opened.inc()
        session.log.info("opened: layers %s, sequence %d", self.config.layers, session.lease.seq_id)
        end = None
        try:
            end = await session.run()
        except Exception:
            # a defect met in one session: run() has released its KV and told its peers the
            # node failed it, and the node serves on; the traceback goes to the log
            session.log.exception("failed on a defect")
            end = session.end
        finally:
            self.sessions.pop(session.key, None)
            if self._stopping and not self.sessions:
                self._emptied.set()
            reason = (end.reason if end is not None else EndReason.NODE_STOPPED).value
            self._ended[reason] += 1
            self.metrics.sessions_ended.labels(reason).inc()
            if end is not None and end.code not in (StatusCode.OK, StatusCode.CANCELLED):
                self.metrics.errors.labels(reason).inc()
            session.log.info("ended: %s %s", reason, end.message if end else "")

    def _check_route(self, open_route: OpenRoute) -> int:
        config = self.config
        hops = open_route.hops
        ident = open_route.header.identity
        if ident.artifact_fingerprint != config.artifact_fingerprint:
            raise RemoteProtocolError("the route is for another model artifact", StatusCode.FAILED_PRECONDITION)
        mine = [i for i, hop in enumerate(hops) if hop.node_id == self.node_id]
        if len(mine) != 1:
            raise RemoteProtocolError("the route plan does not name this node once", StatusCode.PERMISSION_DENIED)
        index = mine[0]
        # a plan across devices names each hop's recipe (the codec checked they add up to the
        # session's); any other plan runs the session's recipe on every hop
        if (hops[index].recipe_fingerprint or ident.recipe_fingerprint) != config.recipe_fingerprint:
            raise RemoteProtocolError("the route expects another recipe", StatusCode.FAILED_PRECONDITION)
        if hops[index].layers != config.layers:
            raise RemoteProtocolError(
                f"the route gives this node layers {hops[index].layers.start}:{hops[index].layers.end}; it serves "
                f"{config.layers.start}:{config.layers.end}",
                StatusCode.FAILED_PRECONDITION,
            )
        if (
            hops[0].layers.start != 0
            or hops[-1].layers.end != config.n_layer
            or any(a.layers.end != b.layers.start for a, b in itertools.pairwise(hops))
        ):
            raise RemoteProtocolError(
                "the route plan is not a contiguous cover of the model", StatusCode.INVALID_ARGUMENT
            )
        expected_peer = hops[index - 1].layers if index > 0 else Span()
        if ident.shard != expected_peer:
            raise RemoteProtocolError(
                "OpenRoute from a hop the plan does not put before this node", StatusCode.PERMISSION_DENIED
            )
        prompt = open_route.prompt_tokens
        if not prompt:
            raise RemoteProtocolError("empty prompt", StatusCode.INVALID_ARGUMENT)
        if open_route.max_tokens <= 0:
            raise RemoteProtocolError("max_tokens must be positive", StatusCode.INVALID_ARGUMENT)
        if any(not 0 <= token < self.engine.n_vocab for token, _ in open_route.sampling.logit_bias):
            raise RemoteProtocolError("logit_bias names a token outside the vocabulary", StatusCode.INVALID_ARGUMENT)
        if index == 0 and max(prompt) >= self.engine.n_vocab:
            raise RemoteProtocolError(
                f"prompt token id {max(prompt)} outside the vocabulary", StatusCode.INVALID_ARGUMENT
            )
        # a resumed session's generated tokens count against its max_tokens, as they did
        if len(open_route.prompt) + open_route.max_tokens > config.ctx_per_seq:
            raise RemoteProtocolError(
                f"prompt ({len(open_route.prompt)}) + max_tokens ({open_route.max_tokens}) exceeds the context of "
                f"{config.ctx_per_seq} per session",
                StatusCode.OUT_OF_RANGE,
            )
        return index

    def _admit(self, open_route: OpenRoute, index: int, conn: SeamConnection) -> RouteSession | ProtocolError:
        deadline = deadline_from_unix_ms(open_route.deadline_unix_ms, self.config.max_session_seconds)
        if deadline <= trio.current_time():
            return RemoteProtocolError("the session's deadline has passed", StatusCode.DEADLINE_EXCEEDED)
        lease = self.leases.acquire(len(open_route.prompt) + open_route.max_tokens)
        if lease is None:
            self._refused += 1
            stats = self.leases.statistics()
            return RemoteProtocolError(
                f"node full: {stats.slots_leased + stats.slots_draining} of {stats.slots_total} sequence slots in use",
                StatusCode.RESOURCE_EXHAUSTED,
            )
        ident = open_route.header.identity
        mine = ident.at(self.config.layers)
        endpoint = SeamEndpoint(mine, Direction.UPSTREAM, peer_shard=ident.shard)
        endpoint.receive(open_route)
        conn.endpoint = endpoint
        sampler = None
        if index == len(open_route.hops) - 1:
            try:
                sampler = self.engine.new_sampler(
                    open_route.sampling, history=open_route.prompt, generated=open_route.generated
                )
            except GrammarError as exc:  # the peer's grammar, or a backend without grammar sampling
                lease.release()
                self.batcher.retire(lease.seq_id)
                return RemoteProtocolError(str(exc), StatusCode.INVALID_ARGUMENT)
        cached: tuple[int, bytes | None] = (0, None)
        if self.prefix_cache is not None and open_route.prefix_offer and not open_route.sampling.prompt_logprobs:
            # a session that scores its prompt must compute every row of it
            cached = self.prefix_cache.lookup(open_route.prompt_tokens, limit=open_route.prefix_offer)
            self.metrics.prefix_lookups.labels("hit" if cached[0] else "miss").inc()
            self.metrics.prefix_tokens.inc(cached[0])
        return RouteSession(self._session_context, open_route, index, conn, lease, sampler, deadline, cached)

    async def _refuse(self, conn: SeamConnection, theirs: Identity, error: ProtocolError) -> None:
        self.metrics.admissions_refused.labels(error.code.name).inc()
        SessionLog(log, f"{theirs.session_id.hex()[:12]}/{theirs.epoch}", theirs.request_id).info(
            "refused: %s (%s)", error.message, error.code.name
        )
        mine = theirs.at(self.config.layers)
        endpoint = SeamEndpoint(mine, Direction.UPSTREAM)
        await conn.notify(Error(endpoint.header(Phase.CANCEL), error.code, error.message, self.node_id))
        await conn.aclose()

    # --- observing

    def statistics(self) -> NodeStatistics:
        """An immutable snapshot."""
        return NodeStatistics(
            active_sessions=len(self.sessions),
            leases=self.leases.statistics(),
            batcher=self.batcher.statistics(),
            sessions_opened=self._opened,
            sessions_ended=dict(self._ended),
            admissions_refused=self._refused,
        )

    def count_frame(self, transport: str, direction: str, size: int) -> None:
        """Per-frame seam accounting (every seam of every session on this node)."""
        self.metrics.seam_bytes.labels(transport, direction).inc(size)
        self.metrics.seam_frames.labels(transport, direction).inc()

    async def metrics_exposition(self) -> tuple[int, str, bytes]:
        """The ``/metrics`` response, with the gauges read now."""
        stats = self.statistics()
        self.metrics.queue_depth.set(stats.batcher.waiting)
        self.metrics.slots_total.set(stats.leases.slots_total)
        self.metrics.slots_in_use.set(stats.leases.slots_leased + stats.leases.slots_draining)
        self.metrics.kv_cells.set(await self.kv_cells_used())
        if self.prefix_cache is not None:
            cache = self.prefix_cache.statistics()
            self.metrics.prefix_bytes.set(cache.bytes)
            self.metrics.prefix_evictions.inc(cache.evictions - self._evictions_counted)
            self._evictions_counted = cache.evictions
        return exposition(self.metrics.registry)

    async def kv_cells_used(self) -> int:
        """KV cells in use, by llama.cpp's own count (read between batches)."""
        cells: int = await self.batcher.between_runs(self.engine.kv_cells_used)
        return cells
