"""The route runner: one request's route sessions, from the tracker's grant to the last token.

Below the gateway (which shapes HTTP/SSE) and above ``seams/`` (one route session's frames),
it holds what serving a request on an open network takes:

- a **grant**: a route and its ticket from the first tracker that answers, preferring the
  nodes that hold the prompt's prefix (:mod:`noderuntime.runner.affinity`);
- the **wait line**: when every route is full, a request waits for a slot, fairly between
  clients (:mod:`noderuntime.runner.line`);
- **retry and exclusion**: a route that fails before its first token is left for another,
  without the node the failure names (:mod:`noderuntime.runner.policy`);
- **repair**: a route that fails once tokens went out is replaced under the session's next
  epoch, the new route prefilling the prompt and the tokens so far, and the run goes on where
  it stopped (bit for bit on a route of the session's recipe);
- once a session ends, its hops' **commitments** checked and a share of sessions **audited**
  (:mod:`noderuntime.runner.audits`).

:meth:`RouteRunner.session` is the entry point: a :class:`RouteRun` whose :meth:`RouteRun.next`
gives the session's tokens as they come, across repairs, as one stream.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import attrs
import httpx
import trio

from noderuntime.access.identity import Identity
from noderuntime.control.ledger import CheckedRecord, check
from noderuntime.operations import timeline
from noderuntime.operations.telemetry import GatewayMetrics
from noderuntime.runner.affinity import PrefixAffinity
from noderuntime.runner.audits import Audits, Served, commitment_problems
from noderuntime.runner.line import LineFull, Waiter, WaitLine
from noderuntime.runner.opening import Issuers, open_granted
from noderuntime.runner.policy import (
    DEADLINE_GRACE_SECONDS,
    MAX_ATTEMPTS,
    MAX_REPAIRS,
    RunError,
    bad_route,
    describe_route,
    repairable,
    route_error,
    silent_route,
    time_left,
    to_exclude,
)
from noderuntime.seams.client import Generation, GenerationRequest, RouteError
from noderuntime.tracker.client import RequestSigner, RouteGrant, TrackerError, request_repair, request_route
from noderuntime.tracker.messages import RepairRequest
from noderuntime.tracker.trackers import Trackers, unanswered
from protocol import StatusCode, Tokens

log = logging.getLogger(__name__)


@attrs.frozen
class Target:
    """What a request's route must run, and what the runner checks of what comes back."""

    artifact: str  # the artifact's fingerprint, hex
    n_ctx: int  # the context a session may fill at most
    n_vocab: int  # token ids a route may send lie in [0, n_vocab)


@attrs.frozen
class Client:
    """Who asks: the line a request waits in when every route is full, and what ends its wait early."""

    key: str = ""  # turns in line go round the keys ("" for the anonymous)
    # returns once the client has gone (None: someone else watches): a wait in line ends then
    left: Callable[[], Awaitable[None]] | None = None


@attrs.frozen
class Opened:
    """A route session that produced its first tokens, and the request it runs."""

    generation: Generation
    first: Tokens
    grant: RouteGrant
    request: GenerationRequest


class RouteRunner:
    """Runs requests on the routes the trackers grant (see the module's docstring)."""

    def __init__(
        self,
        trackers: Trackers,
        connector: Any,
        *,
        http: httpx.AsyncClient,
        identity: Identity,
        metrics: GatewayMetrics,
        issuers: Issuers,
        tracker_api_key: str | None = None,
        request_timeout: float = 600.0,
        queue_timeout: float = 10.0,
        queue_limit: int = 256,
        queue_per_key: int = 64,
        audit_rate: float = 0.0,
        on_dispute: Callable[[str, bytes, str], Awaitable[None]] | None = None,
    ) -> None:
        """``identity``: the key ``connector`` proves on relayed seams, which tickets name and which
        signs repairs and audits. ``issuers``: the key each tracker signs tickets with, under which
        every grant's ticket is checked before its head is dialled (:func:`checked`).
        ``tracker_api_key``: the bearer key route requests carry. ``request_timeout``: a
        repaired session's ticket lives as long.
        ``queue_*``: the wait line's bounds (:class:`WaitLine`). ``audit_rate``: the share of
        sessions audited (:class:`Audits`, whose :meth:`Audits.run` the caller starts)."""
        self.trackers = trackers
        self.connector = connector
        self.http = http
        self.identity = identity
        self.signer = RequestSigner(identity)
        self.metrics = metrics
        self.issuers = issuers
        self.tracker_api_key = tracker_api_key
        self.request_timeout = request_timeout
        self.queue_timeout = queue_timeout
        self.line = WaitLine(limit=queue_limit, per_key=queue_per_key)
        self.affinity = PrefixAffinity()
        self.audits = Audits(
            audit_rate,
            connector=connector,
            http=http,
            trackers=trackers,
            signer=self.signer,
            issuers=issuers,
            on_dispute=on_dispute,
        )
        self.counters: dict[str, int] = {"retries": 0, "repairs": 0, "repairs_failed": 0}

    @contextlib.asynccontextmanager
    async def session(
        self, target: Target, request: GenerationRequest, *, open_ended: bool = False, client: Client | None = None
    ) -> AsyncIterator[RouteRun]:
        """``request`` running on a route that produced its first tokens; repaired as it runs.

        ``open_ended`` (the client gave no max_tokens): the reply may fill the context the
        granted route holds, not only the tokens asked of the tracker. ``client``: whose line
        the request waits in when every route is full, and what ends that wait.

        Leaving the block ends the session on its route (released, or cancelled when the
        block raised). A run whose every token was read (:meth:`RouteRun.next` gave None) has
        its hops' commitments checked and may be audited; its usage records are then in
        :attr:`RouteRun.records`.
        """
        run = RouteRun(self, target, request, open_ended=open_ended, client=client or Client())
        await run._start()
        try:
            yield run
        except BaseException as exc:
            await run._leave(exc)
            raise
        await run._leave(None)
        run.records = self._finished(target, run)

    @contextlib.asynccontextmanager
    async def open(
        self,
        target: Target,
        request: GenerationRequest,
        *,
        open_ended: bool = False,
        repairing: RouteGrant | None = None,
        exclude: Sequence[bytes] = (),
        client: Client | None = None,
    ) -> AsyncIterator[Opened]:
        """A route session that produced its first tokens (one route; :meth:`session` repairs).

        A route that fails before its first token is left for another one (up to
        ``MAX_ATTEMPTS``). When every route is full (the tracker says so, or a node refuses
        for want of slots), the request waits in line for a slot, up to ``queue_timeout``;
        a new request also waits behind those already in line.

        ``repairing``: the grant of a session whose route failed mid-generation; ``request``
        then resumes it (:meth:`GenerationRequest.resumed`), on a whole new route under the
        session's next epoch, which the tracker grants to this runner alone (it signs).
        """
        exclude = [*exclude, *self.audits.avoided()]  # nodes this gateway's audits found against
        failures = 0
        queue_until = trio.current_time() + self.queue_timeout
        positions = (request.prompt_length or len(request.prompt_tokens)) + request.max_tokens
        client = client or Client()
        waiter: Waiter | None = None
        if self.line.waiting and repairing is None:
            waiter = self._join_line(client)  # others wait already: behind them, not ahead
        try:
            while True:
                if waiter is not None:
                    await self._wait_turn(waiter, client, queue_until)
                try:
                    timeline.mark("gateway.granting")
                    if repairing is None:
                        prompt = request.prompt_tokens if request.reuse_prefix else ()
                        grant = await self.grant(target, positions, exclude, prompt)
                    else:
                        grant = await self.repair_grant(target, repairing, positions, exclude)
                    timeline.mark("gateway.granted")
                except RunError as exc:
                    if exc.code != "routes_full":
                        raise
                    waiter = waiter or self._join_line(client)
                    continue
                session_request = request
                if open_ended and grant.ctx_per_session and repairing is None:
                    room = min(target.n_ctx, grant.ctx_per_session) - len(request.prompt_tokens)
                    session_request = attrs.evolve(request, max_tokens=max(request.max_tokens, room))
                opened = False
                try:
                    async with contextlib.AsyncExitStack() as stack:
                        try:
                            gen = await stack.enter_async_context(
                                open_granted(
                                    self.connector,
                                    grant,
                                    session_request,
                                    artifact=bytes.fromhex(target.artifact),
                                    issuers=self.issuers,
                                )
                            )
                            timeline.mark("gateway.opened")
                            with trio.fail_after(time_left(request)):
                                first = await gen.next()
                            opened = True  # it holds a slot on every hop (a full node refuses before this)
                            timeline.mark("gateway.first_tokens")
                        except trio.TooSlowError:
                            raise silent_route() from None
                        except RouteError as exc:
                            error = route_error(exc)
                            if (
                                exc.code == StatusCode.DEADLINE_EXCEEDED
                                and time_left(request) <= DEADLINE_GRACE_SECONDS + 1
                            ):
                                # the request's own time is (all but) up, by this clock or a node's running ahead
                                raise error from None
                            self.counters["retries"] += 1
                            self.metrics.route_retries.labels(exc.code.name).inc()
                            if exc.code == StatusCode.RESOURCE_EXHAUSTED:
                                # a full node is busy, not broken: wait in line for a slot; excluding
                                # it would turn "busy" into "no route" (503)
                                log.info("a node on the route is full; waiting in line for a slot")
                                waiter = waiter or self._join_line(client)
                                continue
                            failures += 1
                            if failures >= MAX_ATTEMPTS:
                                raise error from None
                            exclude += to_exclude(grant, exc)
                            if repairing is not None:
                                repairing = grant  # its ticket is the session's newest: the next epoch follows it
                            log.info("route attempt failed before the first token (%s); trying another", exc)
                            continue
                        assert first is not None  # Generation.next gives None only after a finished event
                        if waiter is not None:
                            self.line.leave(waiter, served=True)
                            waiter = None
                        yield Opened(gen, first, grant, session_request)
                        return
                finally:
                    if opened:
                        # the session has ended (its slot released or its seam closed): the
                        # request heading the line may take that slot now
                        self.line.slot_freed()
        finally:
            if waiter is not None:
                self.line.leave(waiter, served=False)

    async def grant(
        self,
        target: Target,
        tokens: int,
        exclude: Sequence[bytes],
        prompt: Sequence[int] = (),
        among: Sequence[str] | None = None,
    ) -> RouteGrant:
        """A route from the first tracker (of ``among``, default all) that answers; :class:`RunError` if none
        grants one."""
        prefer = [n for n in self.affinity.holders(prompt) if n not in exclude]
        route = functools.partial(
            request_route,
            self.http,
            artifact=target.artifact,
            tokens=tokens,
            exclude=list(exclude),
            api_key=self.tracker_api_key,
            client_id=self.identity.node_id,
            prefer=prefer,
        )
        try:
            return await self.trackers.ask(lambda url: route(url=url), among=among)
        except TrackerError as exc:
            raise _tracker_refusal(exc) from None

    async def repair_grant(
        self, target: Target, failed: RouteGrant, positions: int, exclude: Sequence[bytes]
    ) -> RouteGrant:
        """A whole new route for a session whose route ``failed``, under its next epoch.

        Only the tracker that issued the session's ticket can read it, so the repair is asked
        of that one. When it does not answer (it is gone) or knows no route, another tracker
        grants a route to go on under a new session of its own: the reply still goes on where
        it stopped, bit-exact when that route runs the session's recipe (``exact`` says so).
        """
        repair = RepairRequest(
            ticket=failed.ticket.hex(),
            keep=0,
            tokens=positions,
            recipe=failed.recipe.hex(),
            exclude=[n.hex() for n in exclude],
            ttl_seconds=self.request_timeout,
        )
        issuer = failed.tracker or self.trackers.first
        others = [url for url in self.trackers.urls if url != issuer]
        try:
            return await self.trackers.ask(
                lambda url: request_repair(self.http, url, self.signer, repair), among=[issuer], past_no_route=False
            )
        except TrackerError as exc:
            if not others or not (unanswered(exc) or exc.status == 503):
                self.counters["repairs_failed"] += 1
                if exc.status == 429:
                    raise RunError("routes_full", f"every route is busy: {exc}") from None
                raise RunError("no_route", f"the route failed and none can take the session over: {exc}") from None
            log.warning("the tracker %s cannot repair the session (%s): another grants a new one", issuer, exc)
        try:
            grant = await self.grant(target, positions, exclude, among=others)
        except RunError:
            self.counters["repairs_failed"] += 1
            raise
        return attrs.evolve(grant, exact=grant.recipe == failed.recipe)

    def _join_line(self, client: Client) -> Waiter:
        """A place in line for a request that found every route full; refused at once if the line is full."""
        try:
            return self.line.join_nowait(client.key)
        except LineFull as exc:
            raise RunError("queue_full", f"every route is busy and the line is full: {exc}") from None

    async def _wait_turn(self, waiter: Waiter, client: Client, until: float) -> None:
        """Wait for ``waiter``'s turn to try for a slot, until ``until`` or its client leaves."""
        gone = False

        async def watch(left: Callable[[], Awaitable[None]], scope: trio.CancelScope) -> None:
            nonlocal gone
            await left()
            gone = True
            scope.cancel()

        with trio.move_on_at(until) as timer:
            async with trio.open_nursery() as nursery:
                if client.left is not None:
                    nursery.start_soon(watch, client.left, nursery.cancel_scope)
                await self.line.wait_turn(waiter)
                nursery.cancel_scope.cancel()
        if gone:
            raise RunError("client_closed", "the client left while its request waited for a slot")
        if timer.cancelled_caught:
            raise RunError(
                "routes_full",
                f"every route is busy: no slot freed in the {self.queue_timeout:g} s the request waited in line",
            )

    def _finished(self, target: Target, run: RouteRun) -> list[CheckedRecord]:
        """A run that ended on its route: its usage records checked, its prefix remembered, maybe audited."""
        opened, request = run.opened, run.request
        usage = opened.generation.usage
        records = [check(r, request_id=request.request_id, hops=opened.grant.hops) for r in usage or ()]
        if usage is not None:
            self.affinity.served((*request.prompt_tokens, *run.generated), opened.grant)
            if run.complete:
                records = self._check_commitments(target, opened, run.generated, records)
                if not run.repairs and all(r.valid for r in records):
                    served = Served(
                        request.request_id,
                        bytes.fromhex(target.artifact),
                        opened.grant,
                        opened.request,
                        tuple(run.generated),
                        tuple(r.record for r in records),
                    )
                    self.audits.consider(served)
        for record in records:
            self.metrics.usage_records.labels(str(record.valid).lower()).inc()
            if not record.valid:
                log.warning(
                    "request %s: usage record of node %s flagged: %s",
                    request.request_id,
                    record.record.node_id.hex()[:16],
                    record.problem,
                )
        return records

    def _check_commitments(
        self, target: Target, opened: Opened, generated: Sequence[int], records: list[CheckedRecord]
    ) -> list[CheckedRecord]:
        """``records``, those whose commitments break the route's chain flagged (and not counted).

        Only a session whose every drawn token was read can be checked end to end; one stopped
        early (a stop string) is not, and the caller does not ask.
        """
        hops = [(h.node_id, h.layers.start, h.layers.end) for h in opened.grant.hops]
        served = Served("", bytes.fromhex(target.artifact), opened.grant, opened.request, tuple(generated), ())
        problems = commitment_problems(records, hops, served)
        if not problems:
            return records
        for node, why in problems.items():
            self.metrics.commitment_mismatches.inc()
            log.error("request %s: node %s: %s", opened.request.request_id, node.hex()[:16], why)
        return [
            attrs.evolve(r, valid=False, problem=problems[r.record.node_id]) if r.record.node_id in problems else r
            for r in records
        ]


class RouteRun:
    """One request's session as it runs, across the routes that repair it (:meth:`RouteRunner.session`)."""

    def __init__(
        self, runner: RouteRunner, target: Target, request: GenerationRequest, *, open_ended: bool, client: Client
    ) -> None:
        self._runner = runner
        self.target = target
        self.request = request  # as the client asked it (its id, its prompt)
        self._open_ended = open_ended
        self._client = client
        self._route: contextlib.AsyncExitStack | None = None
        self._opened: Opened | None = None
        self._pending: Tokens | None = None  # a new route's first tokens, not yet given out
        self.drafted = self.accepted = 0  # speculative decoding's drafts, and those the tail kept
        self._first: Tokens | None = None
        self._cached = 0
        self._finished = False  # the tail said the session is done
        self.complete = False  # every token the tail drew was read
        self.generated: list[int] = []  # every token read, in order
        # each time the route failed mid-generation and the session went on on another: where,
        # why, the new route, the stall, and whether the continuation stayed bit-exact
        self.repairs: list[dict[str, Any]] = []
        self.records: list[CheckedRecord] = []  # the hops' usage records, once the run ended on its route

    @property
    def opened(self) -> Opened:
        """The route session running now."""
        assert self._opened is not None, "a run has a route from its start"
        return self._opened

    @property
    def grant(self) -> RouteGrant:
        """The route serving now (another after a repair)."""
        return self.opened.grant

    @property
    def first(self) -> Tokens:
        """The first route's first tokens: with the prompt's logprobs, when asked."""
        assert self._first is not None, "a run has its first tokens from its start"
        return self._first

    @property
    def cached_tokens(self) -> int:
        """Prompt positions the first route took from its nodes' prefix caches."""
        return self._cached

    @property
    def finish_reason(self) -> str:
        """Why the route's tail stopped: ``stop`` (a stop token) or ``length``."""
        return self.opened.generation.finish_reason

    @property
    def route(self) -> list[dict[str, Any]]:
        """The route serving now, as a client is shown it."""
        return describe_route(self.grant)

    async def next(self) -> Tokens | None:
        """The next tokens the route sent (token ids checked against the vocabulary); None once the
        session is done. A route that fails on the way is repaired, up to ``MAX_REPAIRS`` times:
        what follows comes from the new route, as if nothing happened but a stall."""
        event: Tokens | None
        if self._pending is not None:
            event, self._pending = self._pending, None
        elif self._finished:
            self.complete = True
            return None
        else:
            try:
                with trio.fail_after(time_left(self.request)):
                    event = await self.opened.generation.next()
            except trio.TooSlowError:
                raise silent_route() from None
            except RouteError as exc:
                if not repairable(exc) or len(self.repairs) >= MAX_REPAIRS:
                    raise route_error(exc) from None
                await self._repair(exc)
                event, self._pending = self._pending, None
        if event is None:  # Generation.next gives None only once finished, which _finished marks first
            self._finished = self.complete = True
            return None
        for token in event.token_ids:
            if not 0 <= token < self.target.n_vocab:  # the route's word, not a known piece
                raise bad_route(f"it sent token id {token}, outside the vocabulary")
        self.generated += event.token_ids
        self.drafted += event.drafted
        self.accepted += event.accepted
        self._finished = event.finished
        return event

    async def _start(self) -> None:
        await self._enter(
            self._runner.open(self.target, self.request, open_ended=self._open_ended, client=self._client)
        )
        self._first = self.opened.first
        self._cached = self.opened.generation.cached_tokens

    async def _enter(self, opening: contextlib.AbstractAsyncContextManager[Opened]) -> None:
        stack = contextlib.AsyncExitStack()
        self._opened = await stack.enter_async_context(opening)
        self._route = stack
        self._pending = self._opened.first

    async def _leave(self, exc: BaseException | None) -> None:
        """End the session on the route serving it: released, or cancelled when ``exc`` ended the run."""
        route, self._route = self._route, None
        if route is not None:
            if exc is None:
                await route.aclose()
            else:
                await route.__aexit__(type(exc), exc, exc.__traceback__)

    async def _repair(self, failure: RouteError) -> None:
        """Go on on a new route after ``failure`` ended the one serving (it left the session: nothing to release)."""
        runner, failed = self._runner, self.opened
        failed_at = trio.current_time()
        runner.counters["repairs"] += 1
        runner.metrics.route_repairs.labels(failure.code.name).inc()
        log.info(
            "request %s: route failed after %d tokens (%s); repairing",
            self.request.request_id,
            len(self.generated),
            failure,
        )
        await self._leave(None)
        avoid = to_exclude(failed.grant, failure)
        resumed = failed.request.resumed(self.generated)
        repair: dict[str, Any] = {
            "after_tokens": len(self.generated),
            "failed": str(failure)[:200],
            "failed_node": avoid[0].hex()[:16] if avoid else "",
            # what the new route prefills: the prompt and the reply so far
            "replayed_tokens": len(resumed.prompt_tokens),
        }
        self.repairs.append(repair)
        # the client's wait ended with its first tokens: the reply's reader watches its connection
        client = attrs.evolve(self._client, left=None)
        await self._enter(runner.open(self.target, resumed, repairing=failed.grant, exclude=avoid, client=client))
        repair["stall_ms"] = round((trio.current_time() - failed_at) * 1e3, 1)
        repair["bit_exact"] = self.grant.exact
        repair["route"] = describe_route(self.grant)


def _tracker_refusal(exc: TrackerError) -> RunError:
    """A tracker's refusal to grant a route, in the runner's words."""
    if exc.status == 429:
        return RunError("routes_full", f"every route is busy: {exc}")
    if exc.status == 503:
        return RunError("no_route", f"no route can serve this model now: {exc}")
    return RunError("tracker", f"the tracker is unavailable: {exc}")
