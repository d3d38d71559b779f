"""The OpenAI-compatible gateway: HTTP/SSE in front of the routes the tracker picks.

For each request: render the model's chat template, tokenize, ask the tracker for a
route and a ticket, open the route session on its head (direct or through its relay),
turn the tokens that come back into text (holding back possible stop strings), and
answer in OpenAI's format. A route that refuses the session or fails before its first
token is left for another one. A client that disconnects mid-stream cancels the
session on every shard.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs
import httpx
import trio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from noderuntime.access.identity import Identity
from noderuntime.control.ledger import CheckedRecord, Ledger, check
from noderuntime.gateway.audits import Audits, Served, commitment_problems
from noderuntime.gateway.auth import ApiKeys
from noderuntime.gateway.errors import RETRY_AFTER_SECONDS, ApiError, error_response
from noderuntime.gateway.line import LineFull, Waiter, WaitLine
from noderuntime.gateway.routing import (
    DEADLINE_GRACE_SECONDS,
    MAX_ATTEMPTS,
    MAX_REPAIRS,
    bad_route,
    describe_route,
    repairable,
    route_error,
    silent_route,
    time_left,
    to_exclude,
)
from noderuntime.gateway.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    Constraint,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from noderuntime.gateway.served import ServedModel, constraint_grammar, system_fingerprint
from noderuntime.gateway.shaping import Emitted, Generated, ReplyShape, check_logprobs, usage_counts
from noderuntime.gateway.textstream import TextStream
from noderuntime.gateway.tools import (
    THINK_OPEN,
    ChatOutput,
    hermes_history,
)
from noderuntime.node.prefix import block_hashes
from noderuntime.operations import timeline
from noderuntime.operations.httpserve import BodyLimit
from noderuntime.operations.telemetry import GatewayMetrics, exposition, trio_tasks
from noderuntime.seams.client import GenerationRequest, RouteError, open_route_generation
from noderuntime.tracker.client import RequestSigner, RouteGrant, TrackerError, request_repair, request_route
from noderuntime.tracker.messages import RepairRequest
from noderuntime.tracker.trackers import Trackers, unanswered
from noderuntime.web import add_pages
from protocol import Sampling, StatusCode, TokenLogprob, Tokens

log = logging.getLogger(__name__)

MAX_SERVED_PREFIXES = 100_000  # block hashes of served prefixes remembered for affinity (16 B each, and nodes)

_UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|list|dict|.*\[.*\])$")
MAX_BODY = 8 << 20  # a request body: far above any prompt that fits a context
# A request without max_tokens asks for a route with room for at least this many tokens
# after its prompt, then may run to the end of the context that route holds (as OpenAI's
# API does: the reply ends at a stop, or when the context is full).
DEFAULT_MAX_TOKENS = 256
# a prompt whose logprobs are echoed: they travel back in one frame (about 70 bytes a token)
MAX_SCORED_PROMPT = 32768


@attrs.frozen
class Client:
    """Who asks: the line a request waits in when every route is full, and what ends its wait early."""

    key: str = ""  # a digest of its API key ("" without one): turns in line go round the keys
    watch: Request | None = None  # the connection to watch while it waits (None: someone else does)

    @staticmethod
    def of(request: Request, *, watch: bool) -> Client:
        """The client of ``request``; ``watch``: its wait in line ends when its connection closes."""
        auth = request.headers.get("authorization", "")
        # a digest, not the key itself: the line's bookkeeping holds no secrets
        key = hashlib.sha256(auth.encode()).hexdigest()[:16] if auth else ""
        return Client(key, request if watch else None)


class Gateway:
    """Serves OpenAI requests for its models over the network of nodes."""

    def __init__(
        self,
        models: Sequence[ServedModel],
        trackers: str | Sequence[str] | Trackers,
        connector: Any,
        *,
        api_keys: Sequence[str] = (),
        cors_origins: Sequence[str] = (),
        tracker_key: str | None = None,
        request_timeout: float = 600.0,
        queue_timeout: float = 10.0,
        queue_limit: int = 256,
        queue_per_key: int = 64,
        ledger: Ledger | None = None,
        identity: Identity | None = None,
        audit_rate: float = 0.0,
    ) -> None:
        """``trackers``: the tracker's URL, or several in order of preference (each request goes
        to the first that answers: :class:`Trackers`). ``identity``: the key ``connector`` proves
        on relayed seams, which route tickets name and which signs the gateway's route repairs
        and audits (a fresh one when None). ``audit_rate``:
        the share of sessions audited after they end (:mod:`noderuntime.gateway.audits`; run by
        :meth:`Audits.run`, which the caller starts).

        When every route is full a request waits in line (:mod:`noderuntime.gateway.line`) up to
        ``queue_timeout`` seconds; at most ``queue_limit`` requests wait, ``queue_per_key`` of them
        under one API key."""
        if any(not key for key in api_keys):
            raise ValueError("an API key must not be empty: it would let in every request that sends none")
        self.models = {m.model_id: m for m in models}
        self.trackers = trackers if isinstance(trackers, Trackers) else Trackers(trackers)
        self.connector = connector
        self.api_keys = set(api_keys)
        self.cors_origins = tuple(cors_origins)
        self.tracker_key = tracker_key
        self.request_timeout = request_timeout
        self.queue_timeout = queue_timeout
        self.line = WaitLine(limit=queue_limit, per_key=queue_per_key)
        self.ledger = ledger
        self.identity = identity or Identity.generate()
        self.signer = RequestSigner(self.identity)
        # prefix affinity: the block hash of a prefix a route served -> that route's nodes
        # (they keep its KV in their prefix caches); a request that begins alike asks for them
        self._served_prefixes: collections.OrderedDict[bytes, tuple[bytes, ...]] = collections.OrderedDict()
        self.metrics = GatewayMetrics()
        self.http = httpx.AsyncClient()
        self.audits = Audits(
            audit_rate,
            connector=connector,
            http=self.http,
            trackers=self.trackers,
            signer=self.signer,
            on_dispute=self._dispute,
        )
        # its own threads: a burst of huge prompts must not hold those of name lookups and the ledger
        self._tokenizing = trio.CapacityLimiter(max(2, os.cpu_count() or 2))
        self.app = self._build()
        self.counters: dict[str, int] = {
            "requests": 0,
            "completed": 0,
            "errors": 0,
            "cancelled": 0,
            "retries": 0,
            "repairs": 0,
            "repairs_failed": 0,
        }

    # --- helpers

    def _model(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise ApiError(
                404,
                f"the model {name!r} does not exist; see GET /v1/models",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return model

    def _only_model(self) -> ServedModel:
        """The model a request that names none means: the one served, if there is one."""
        if len(self.models) != 1:
            raise ApiError(400, "this gateway serves several models: name one", param="model")
        return next(iter(self.models.values()))

    def _prepare(
        self, model: ServedModel, body: SamplingFields, prompt: list[int], max_tokens: int | None, grammar: str
    ) -> GenerationRequest:
        if not prompt:
            where = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            raise ApiError(400, "the prompt is empty after tokenization", param=where)
        room = model.n_ctx - len(prompt)
        if room <= 0:
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens; the context is {model.n_ctx}",
                code="context_length_exceeded",
            )
        wanted = max_tokens if max_tokens is not None else min(DEFAULT_MAX_TOKENS, room)
        if wanted > room:
            raise ApiError(
                400,
                f"prompt ({len(prompt)}) + max_tokens ({wanted}) exceeds the context of {model.n_ctx}",
                code="context_length_exceeded",
                param="max_tokens",
            )
        _, stop_ids = body.stop_lists()
        if any(not 0 <= t < model.vocab.n_vocab for t in stop_ids):
            raise ApiError(400, "stop token ids must lie inside the vocabulary", param="stop")
        biases = body.logit_biases()
        if any(token >= model.vocab.n_vocab for token, _ in biases):
            raise ApiError(400, f"logit_bias token ids must lie in [0, {model.vocab.n_vocab})", param="logit_bias")
        temperature = 1.0 if body.temperature is None else body.temperature
        if body.top_p == 0.0:
            temperature = 0.0  # the nucleus of p = 0 is the most likely token alone: greedy
        seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(8), "little")
        logprobs, top_logprobs, prompt_logprobs = body.logprob_request()
        if prompt_logprobs and len(prompt) > MAX_SCORED_PROMPT:
            # they come back in one frame: a bound keeps it inside the frame limit
            raise ApiError(400, f"echo with logprobs takes prompts of at most {MAX_SCORED_PROMPT} tokens", param="echo")
        sampling = Sampling(
            temperature=temperature,
            top_k=body.top_k or 0,
            top_p=body.top_p or 1.0,
            min_p=body.min_p or 0.0,
            seed=seed & 0xFFFFFFFFFFFFFFFF,
            repeat_penalty=body.repeat_penalty or 1.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            grammar=grammar,
            logit_bias=biases,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        deadline = int((time.time() + self.request_timeout) * 1000)
        return GenerationRequest(
            tuple(prompt),
            wanted,
            sampling,
            tuple(sorted(set(model.stop_tokens()) | set(stop_ids))),
            deadline,
            f"req-{uuid.uuid4().hex[:16]}",
            reuse_prefix=body.cache_prompt is not False,
        )

    def _prefix_holders(self, prompt: Sequence[int]) -> list[bytes]:
        """The nodes of the route that last served the longest prefix of ``prompt`` this gateway saw."""
        for digest in reversed(block_hashes(prompt)):
            nodes = self._served_prefixes.get(digest)
            if nodes is not None:
                self._served_prefixes.move_to_end(digest)
                return list(nodes)
        return []

    def _served(self, tokens: Sequence[int], grant: RouteGrant) -> None:
        """Remember that ``grant``'s nodes now hold ``tokens`` (a finished session's prompt and reply)."""
        nodes = tuple(h.node_id for h in grant.hops)
        for digest in block_hashes(tokens):
            self._served_prefixes[digest] = nodes
            self._served_prefixes.move_to_end(digest)
        while len(self._served_prefixes) > MAX_SERVED_PREFIXES:
            self._served_prefixes.popitem(last=False)

    async def _grant(
        self,
        model: ServedModel,
        tokens: int,
        exclude: Sequence[bytes],
        prompt: Sequence[int] = (),
        among: Sequence[str] | None = None,
    ) -> RouteGrant:
        """A route from the first tracker (of ``among``, default all) that answers; :class:`ApiError` if none
        grants one."""
        prefer = [n for n in self._prefix_holders(prompt) if n not in exclude]
        route = functools.partial(
            request_route,
            self.http,
            artifact=model.artifact,
            tokens=tokens,
            exclude=list(exclude),
            api_key=self.tracker_key,
            client_id=self.identity.node_id,
            prefer=prefer,
        )
        try:
            return await self.trackers.ask(lambda url: route(url=url), among=among)
        except TrackerError as exc:
            if exc.status == 429:
                raise ApiError(429, f"every route is busy: {exc}", "rate_limit_error", "routes_full") from None
            if exc.status == 503:
                raise ApiError(
                    503, f"no route can serve this model now: {exc}", "service_unavailable", "no_route"
                ) from None
            raise ApiError(503, f"the tracker is unavailable: {exc}", "service_unavailable", "tracker") from None

    @contextlib.asynccontextmanager
    async def _route_session(
        self,
        model: ServedModel,
        request: GenerationRequest,
        *,
        open_ended: bool = False,
        repairing: RouteGrant | None = None,
        exclude: Sequence[bytes] = (),
        client: Client | None = None,
    ) -> AsyncIterator[tuple[Any, Tokens, RouteGrant, GenerationRequest]]:
        """A route session that produced its first tokens, and the request it runs.

        ``open_ended`` (the client gave no max_tokens): the reply may fill the context the
        granted route holds, not only the tokens asked of the tracker.

        A route that fails before its first token is left for another one (up to
        ``MAX_ATTEMPTS``). When every route is full (the tracker says so, or a node refuses
        for want of slots), the request waits in line for a slot, up to ``queue_timeout``
        (:mod:`noderuntime.gateway.line`); a new request also waits behind those already in
        line. ``client``: whose line it waits in, and, where no one else watches, the
        connection whose close ends the wait.

        ``repairing``: the grant of a session whose route failed mid-generation; ``request``
        then resumes it (:meth:`GenerationRequest.resumed`), on a whole new route under the
        session's next epoch, which the tracker grants to this gateway alone (it signs).
        """
        exclude = list(exclude)
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
                        grant = await self._grant(model, positions, exclude, prompt)
                    else:
                        grant = await self._repair_grant(model, repairing, positions, exclude)
                    timeline.mark("gateway.granted")
                except ApiError as exc:
                    if exc.status != 429:
                        raise
                    waiter = waiter or self._join_line(client)
                    continue
                session_request = request
                if open_ended and grant.ctx_per_session and repairing is None:
                    room = min(model.n_ctx, grant.ctx_per_session) - len(request.prompt_tokens)
                    session_request = attrs.evolve(request, max_tokens=max(request.max_tokens, room))
                opened = False
                try:
                    async with contextlib.AsyncExitStack() as stack:
                        try:
                            gen = await stack.enter_async_context(
                                open_route_generation(
                                    self.connector,
                                    grant.hops,
                                    session_request,
                                    artifact=bytes.fromhex(model.artifact),
                                    recipe=grant.recipe,
                                    ticket=grant.ticket,
                                    session_id=grant.session_id,
                                    epoch=grant.epoch,
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
                        assert first is not None
                        if waiter is not None:
                            self.line.leave(waiter, served=True)
                            waiter = None
                        yield gen, first, grant, session_request
                        return
                finally:
                    if opened:
                        # the session has ended (its slot released or its seam closed): the
                        # request heading the line may take that slot now
                        self.line.slot_freed()
        finally:
            if waiter is not None:
                self.line.leave(waiter, served=False)

    def _join_line(self, client: Client) -> Waiter:
        """A place in line for a request that found every route full; 429 at once if the line is full."""
        try:
            return self.line.join_nowait(client.key)
        except LineFull as exc:
            raise ApiError(
                429, f"every route is busy and the line is full: {exc}", "rate_limit_error", "queue_full"
            ) from None

    async def _wait_turn(self, waiter: Waiter, client: Client, until: float) -> None:
        """Wait for ``waiter``'s turn to try for a slot; a 429 at ``until``, a 499 if its client leaves first."""
        gone = False

        async def watch(request: Request, scope: trio.CancelScope) -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            scope.cancel()

        with trio.move_on_at(until) as timer:
            async with trio.open_nursery() as nursery:
                if client.watch is not None:
                    nursery.start_soon(watch, client.watch, nursery.cancel_scope)
                await self.line.wait_turn(waiter)
                nursery.cancel_scope.cancel()
        if gone:
            raise ApiError(499, "the client left while its request waited for a slot", "client_closed", "client_closed")
        if timer.cancelled_caught:
            raise ApiError(
                429,
                f"every route is busy: no slot freed in the {self.queue_timeout:g} s the request waited in line",
                "rate_limit_error",
                "routes_full",
            )

    async def _repair_grant(
        self, model: ServedModel, failed: RouteGrant, positions: int, exclude: Sequence[bytes]
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
                    raise ApiError(429, f"every route is busy: {exc}", "rate_limit_error", "routes_full") from None
                raise ApiError(
                    503,
                    f"the route failed and none can take the session over: {exc}",
                    "service_unavailable",
                    "no_route",
                ) from None
            log.warning("the tracker %s cannot repair the session (%s): another grants a new one", issuer, exc)
        try:
            grant = await self._grant(model, positions, exclude, among=others)
        except ApiError:
            self.counters["repairs_failed"] += 1
            raise
        return attrs.evolve(grant, exact=grant.recipe == failed.recipe)

    async def _artifacts(self, url: str) -> dict[str, Any]:
        """What the tracker at ``url`` can route (its ``/v1/artifacts``); :class:`TrackerError` if it does not
        answer."""
        try:
            response = await self.http.get(url + "/v1/artifacts", timeout=5.0)
        except httpx.HTTPError as exc:
            raise TrackerError(f"the tracker {url} is unreachable: {exc}") from None
        if response.status_code != 200:
            raise TrackerError(f"the tracker {url} answered {response.status_code}", response.status_code)
        try:
            known = response.json()["artifacts"]
        except (ValueError, KeyError, TypeError):
            known = None
        if not isinstance(known, dict):
            raise TrackerError(f"the tracker {url} sent a malformed artifact list", response.status_code)
        return known

    async def _generate(
        self,
        model: ServedModel,
        request: GenerationRequest,
        stop: Sequence[str],
        *,
        open_ended: bool,
        client: Client | None = None,
    ) -> AsyncIterator[Emitted]:
        """What may be shown while generating, then an item with ``done`` set once finished.

        The fingerprint is OpenAI's ``system_fingerprint``: of the artifact and the recipe of the
        route that serves, known once the route is granted.

        A route that fails once tokens went out is repaired (up to ``MAX_REPAIRS`` times): the
        session goes on, under its next epoch, on a whole new route that prefills the prompt and
        the tokens so far, its sampler rebuilt over them, and the reply goes on where it
        stopped. On a route of the session's recipe the continuation is what the first route
        would have sent, bit for bit; on another, it is not, and the final item says so.
        """
        text = TextStream(stop)
        produced = 0
        generated: list[int] = []
        logprobs: list[TokenLogprob] = []
        repairs: list[dict[str, Any]] = []
        prompt_logprobs: tuple[TokenLogprob, ...] = ()
        cached = 0
        tail_done = False
        client = client or Client()
        opening = self._route_session(model, request, open_ended=open_ended, client=client)
        failed_at: float | None = None
        while True:
            failure: RouteError | None = None
            async with opening as (gen, first, grant, session_request):
                if failed_at is not None:
                    repairs[-1]["stall_ms"] = round((trio.current_time() - failed_at) * 1e3, 1)
                    repairs[-1]["bit_exact"] = grant.exact
                    repairs[-1]["route"] = describe_route(grant)
                route = describe_route(grant)
                fingerprint = system_fingerprint(model.artifact, grant.recipe)
                if not repairs:
                    cached = gen.cached_tokens
                    prompt_logprobs = first.prompt_logprobs
                    check_logprobs(model, request, first, prompt=True)
                    if prompt_logprobs:
                        yield Emitted("", fingerprint=fingerprint, prompt_logprobs=prompt_logprobs)
                event: Tokens | None = first
                while event is not None:
                    if event is not first or repairs:
                        check_logprobs(model, request, event, prompt=False)
                    for k, token in enumerate(event.token_ids):
                        if not 0 <= token < model.vocab.n_vocab:  # the route's word, not a known piece
                            raise bad_route(f"it sent token id {token}, outside the vocabulary")
                        produced += 1
                        generated.append(token)
                        if token in request.stop_token_ids and event.finished:
                            continue  # the end-of-turn token itself is not text
                        delta = text.push(model.vocab.piece(token))
                        mine = (event.logprobs[k],) if event.logprobs else ()
                        logprobs += mine
                        if delta or mine:
                            yield Emitted(delta, mine, fingerprint=fingerprint)
                        if text.stopped:
                            break
                    tail_done = event.finished and not text.stopped  # every token the tail drew came here
                    if text.stopped or event.finished:
                        break
                    try:
                        with trio.fail_after(time_left(request)):
                            event = await gen.next()
                    except trio.TooSlowError:
                        raise silent_route() from None
                    except RouteError as exc:
                        if not repairable(exc) or len(repairs) >= MAX_REPAIRS:
                            # tokens already went out: a typed error in their place
                            raise route_error(exc) from None
                        failure = exc
                        break
                reason = "stop" if text.stopped or gen.finish_reason == "stop" else "length"
            if failure is None:
                break
            # the failed session left its block (its seam closed, nothing to release): resume it
            failed_at = trio.current_time()
            self.counters["repairs"] += 1
            self.metrics.route_repairs.labels(failure.code.name).inc()
            log.info("request %s: route failed after %d tokens (%s); repairing", request.request_id, produced, failure)
            avoid = to_exclude(grant, failure)
            resumed = session_request.resumed(generated)
            repairs.append(
                {
                    "after_tokens": produced,
                    "failed": str(failure)[:200],
                    "failed_node": avoid[0].hex()[:16] if avoid else "",
                    # what the new route prefills: the prompt and the reply so far
                    "replayed_tokens": len(resumed.prompt_tokens),
                }
            )
            # its own client has left once tokens flow, and the reply's reader watches the connection
            opening = self._route_session(
                model, resumed, repairing=grant, exclude=avoid, client=attrs.evolve(client, watch=None)
            )
        # the session was released on leaving the block: every hop's signed usage is here, and
        # its nodes keep its prefix
        records = [check(r, request_id=request.request_id, hops=grant.hops) for r in gen.usage or ()]
        if gen.usage is not None:
            self._served((*request.prompt_tokens, *generated), grant)
            records = self._check_commitments(model, grant, session_request, generated, records, complete=tail_done)
            if tail_done and not repairs and all(r.valid for r in records):
                self.audits.consider(
                    Served(
                        request.request_id,
                        bytes.fromhex(model.artifact),
                        grant,
                        session_request,
                        tuple(generated),
                        tuple(r.record for r in records),
                    )
                )
        for record in records:
            self.metrics.usage_records.labels(str(record.valid).lower()).inc()
            if not record.valid:
                log.warning(
                    "request %s: usage record of node %s flagged: %s",
                    request.request_id,
                    record.record.node_id.hex()[:16],
                    record.problem,
                )
        tail = text.finish()
        if tail:
            yield Emitted(tail, fingerprint=fingerprint)
        done = Generated(text.text, produced, reason, route, records, logprobs, prompt_logprobs, repairs, cached)
        yield Emitted("", done=done, fingerprint=fingerprint)

    def _check_commitments(
        self,
        model: ServedModel,
        grant: RouteGrant,
        request: GenerationRequest,
        generated: Sequence[int],
        records: list[CheckedRecord],
        *,
        complete: bool,
    ) -> list[CheckedRecord]:
        """``records``, those whose commitments break the route's chain flagged (and not counted).

        Only a session whose every drawn token came here can be checked end to end; one the
        gateway stopped early (a stop string) is not.
        """
        if not complete:
            return records
        hops = [(h.node_id, h.layers.start, h.layers.end) for h in grant.hops]
        served = Served("", bytes.fromhex(model.artifact), grant, request, tuple(generated), ())
        problems = commitment_problems(records, hops, served)
        if not problems:
            return records
        for node, why in problems.items():
            self.metrics.commitment_mismatches.inc()
            log.error("request %s: node %s: %s", request.request_id, node.hex()[:16], why)
        return [
            attrs.evolve(r, valid=False, problem=problems[r.record.node_id]) if r.record.node_id in problems else r
            for r in records
        ]

    async def _dispute(self, request_id: str, node_id: bytes, why: str) -> None:
        """An audit found ``node_id``'s work on ``request_id`` false: its records there are disputed."""
        if self.ledger is not None:
            await trio.to_thread.run_sync(self.ledger.dispute, request_id, node_id, why)

    # --- the app

    def _build(self) -> FastAPI:
        app = FastAPI(
            title="noderuntime gateway",
            version="1",
            description="OpenAI-compatible chat and text completions over a network of shard nodes.",
        )
        app.add_middleware(BodyLimit, limit=MAX_BODY)
        app.add_middleware(ApiKeys, keys=self.api_keys)  # outside BodyLimit: no key, no body read
        if self.cors_origins:
            # outermost: a preflight is answered here, and every answer (errors too) carries the headers
            app.add_middleware(
                CORSMiddleware,
                allow_origins=list(self.cors_origins),
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["authorization", "content-type"],
                max_age=600,
            )

        @app.exception_handler(ApiError)
        async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
            return error_response(exc)

        @app.exception_handler(Exception)
        async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
            # a bug, not the client's fault: typed for the client, the traceback for the operator
            log.error("unexpected error answering a request", exc_info=exc)
            return error_response(ApiError(500, "internal error (see the gateway log)", "server_error", "internal"))

        @app.exception_handler(RequestValidationError)
        async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0] if exc.errors() else {}
            # the field's path, without "body" and the union branches pydantic tried ("str", "list[int]")
            where = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not _UNION_BRANCH.match(str(p)))
            message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", exc))
            # checks across fields name the field they refuse in their context
            param = where or (first.get("ctx") or {}).get("param")
            return error_response(ApiError(400, message, param=param))

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
            kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
            return error_response(ApiError(exc.status_code, str(exc.detail), kind))

        # outermost, so refusals by the layers inside count too; the router has put the route
        # that matched into the (shared) scope by the time the answer starts. A plain ASGI
        # wrapper, not Starlette's BaseHTTPMiddleware: that one passes every chunk of a
        # streamed reply through a channel to another task.
        app.add_middleware(CountRequests, metrics=self.metrics)

        self._routes(app)
        return app

    def _routes(self, app: FastAPI) -> None:
        """The endpoints: the chat page, operations (metrics, status, health), llama-server's tokenizer,
        then OpenAI's API."""

        # at /, as llama-server's; it calls the API below from the page, with the key typed into it
        add_pages(app, "chat.html", ("chat.js", "dom.js", "pages.css"))

        @app.get("/metrics", include_in_schema=False)
        async def metrics() -> Any:
            status, content_type, payload = exposition(self.metrics.registry)
            return Response(payload, status_code=status, media_type=content_type)

        @app.get("/status", include_in_schema=False)
        async def status() -> dict[str, Any]:
            return {
                "counters": dict(self.counters),
                "line": attrs.asdict(self.line.statistics()),
                "audits": {**self.audits.counters, "rate": self.audits.rate, "excluded": self.audits.failed_nodes},
                "trackers": [attrs.asdict(standing) for standing in self.trackers.statistics()],
                "models": list(self.models),
                "tasks": trio_tasks(),
            }

        @app.get("/health", include_in_schema=False)
        async def health() -> JSONResponse:
            # 200 only while the tracker knows a complete route for every model served here
            try:
                known = await self.trackers.ask(self._artifacts)
                routable = {m.model_id: bool(known.get(m.artifact, {}).get("routable")) for m in self.models.values()}
            except (TrackerError, ValueError, KeyError, TypeError, AttributeError):
                body = {"status": "tracker_unavailable", "models": dict.fromkeys(self.models, False)}
                return JSONResponse(body, 503, headers={"retry-after": str(RETRY_AFTER_SECONDS)})
            if all(routable.values()):
                return JSONResponse({"status": "ok", "models": routable})
            body = {"status": "no_route", "models": routable}
            return JSONResponse(body, 503, headers={"retry-after": str(RETRY_AFTER_SECONDS)})

        @app.post("/tokenize")
        async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
            model = self._model(body.model) if body.model else self._only_model()
            try:
                tokens = await trio.to_thread.run_sync(
                    functools.partial(model.vocab.tokenize, body.content, add_special=body.add_special),
                    limiter=self._tokenizing,
                )
            except UnicodeEncodeError:
                raise ApiError(400, "content is not valid Unicode (a lone surrogate?)", param="content") from None
            if not body.with_pieces:
                return {"tokens": tokens}
            pieces = [{"id": t, "piece": model.vocab.piece(t).decode("utf-8", "replace")} for t in tokens]
            return {"tokens": pieces}

        @app.post("/detokenize")
        async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
            model = self._model(body.model) if body.model else self._only_model()
            if any(not 0 <= t < model.vocab.n_vocab for t in body.tokens):
                raise ApiError(400, f"token ids must lie in [0, {model.vocab.n_vocab})", param="tokens")
            return {"content": model.vocab.detokenize(body.tokens)}

        self._openai_routes(app)

    def _openai_routes(self, app: FastAPI) -> None:
        """OpenAI's API: models, chat completions, text completions."""

        @app.get("/v1/models")
        async def list_models() -> dict[str, Any]:
            return {"object": "list", "data": [m.card() for m in self.models.values()]}

        @app.get("/v1/models/{model_id:path}")
        async def one_model(model_id: str) -> dict[str, Any]:
            return self._model(model_id).card()

        @app.post("/v1/chat/completions", response_model=None)
        async def chat(body: ChatCompletionRequest, request: Request) -> Any:
            timeline.mark("gateway.received")
            model = self._model(body.model)
            if model.template is None:
                raise ApiError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")
            traits = model.traits
            offered = body.offered_tools()
            messages = [m.for_template() for m in body.messages]
            context: dict[str, Any] = {"variables": body.chat_template_kwargs}
            if traits.native_tools:
                context["tools"] = [{"type": "function", "function": f} for f in offered]
            elif offered or any(m.role == "tool" or m.tool_calls for m in body.messages):
                messages = hermes_history(messages, offered)  # the template knows no tools: written as text
            # rendering and tokenizing a long conversation takes a while: not on the event loop
            render = functools.partial(model.chat_prompt, messages, **context)
            prompt = await trio.to_thread.run_sync(render, limiter=self._tokenizing)
            timeline.mark("gateway.tokenized")
            max_tokens = body.max_completion_tokens or body.max_tokens
            # a large schema's grammar takes milliseconds to build and compile: not on the event loop
            constraint = body.constraint()
            forced = body.forced_tools()
            if forced is not None:
                several = body.tool_choice == "required" and body.parallel_tool_calls is not False
                constraint = Constraint("tools", (forced, traits.syntax, several), "tools")
            grammar = await trio.to_thread.run_sync(
                constraint_grammar, model.vocab, constraint, limiter=self._tokenizing
            )
            generation = self._prepare(model, body, prompt, max_tokens, grammar)
            # the prompt opened a think block (a template that always thinks): the reply starts in it
            opened = model.vocab.detokenize(prompt[-3:], special=True).endswith(THINK_OPEN + "\n")
            output = functools.partial(
                ChatOutput,
                tool_names=[f["name"] for f in offered],
                syntax=traits.syntax,
                reasoning=traits.thinks,
                thinking=opened,
            )
            return await self._answer(
                model, body, generation, request, chat=True, open_ended=max_tokens is None, output=output
            )

        @app.post("/v1/completions", response_model=None)
        async def complete(body: CompletionRequest, request: Request) -> Any:
            model = self._model(body.model)
            prompt = body.prompt_tokens()
            if prompt is None:
                prompt = await trio.to_thread.run_sync(model.text_prompt, body.prompt_text(), limiter=self._tokenizing)
            elif any(not 0 <= t < model.vocab.n_vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must lie in [0, {model.vocab.n_vocab})", param="prompt")
            # a large schema's grammar takes milliseconds to build and compile: not on the event loop
            grammar = await trio.to_thread.run_sync(
                constraint_grammar, model.vocab, body.constraint(), limiter=self._tokenizing
            )
            generation = self._prepare(model, body, prompt, body.max_tokens, grammar)
            echo = None
            if body.echo:
                echo = body.prompt_text() if body.prompt_tokens() is None else model.vocab.detokenize(prompt)
            open_ended = body.max_tokens is None
            return await self._answer(model, body, generation, request, chat=False, open_ended=open_ended, echo=echo)

    async def _answer(
        self,
        model: ServedModel,
        body: SamplingFields,
        generation: GenerationRequest,
        request: Request,
        *,
        chat: bool,
        open_ended: bool,
        echo: str | None = None,
        output: Callable[[], ChatOutput] | None = None,
    ) -> Any:
        """The reply: whole, or streamed. ``echo``: the prompt's text, when the reply leads with it;
        ``output``: makes the reader of a chat reply's content, reasoning and tool calls.

        ``n`` choices are ``n`` route sessions, each with its own seed (the request's + its index).
        """
        self.counters["requests"] += 1
        started = time.perf_counter()
        stop_strings, _ = body.stop_lists()
        wants_logprobs, top, _ = body.logprob_request()
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        generations = [
            generation
            if i == 0
            else attrs.evolve(
                generation,
                request_id=f"{generation.request_id}-{i}",
                sampling=attrs.evolve(generation.sampling, seed=(generation.sampling.seed + i) & 0xFFFFFFFFFFFFFFFF),
            )
            for i in range(body.n or 1)
        ]
        shapes = [
            ReplyShape(
                ident,
                created,
                model,
                chat,
                generation.prompt_tokens,
                top,
                wants_logprobs,
                echo,
                (output or ChatOutput)(),
                i,
            )
            for i in range(len(generations))
        ]
        if not body.stream:
            return await self._whole(model, generations, shapes, request, stop_strings, open_ended, started)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await self._streamed(
            model, generations, shapes, stop_strings, open_ended, started, include_usage, Client.of(request, watch=True)
        )

    async def _whole(
        self,
        model: ServedModel,
        generations: list[GenerationRequest],
        shapes: list[ReplyShape],
        request: Request,
        stop_strings: list[str],
        open_ended: bool,
        started: float,
    ) -> Any:
        """A whole reply: every choice generated at once, each in its own task."""
        generation, created = generations[0], shapes[0].created
        kind = "chat.completion" if shapes[0].chat else "text_completion"
        results: list[Generated | None] = [None] * len(generations)
        fingerprint = ""
        failed: ApiError | None = None

        async def collect(i: int, scope: trio.CancelScope) -> None:
            nonlocal fingerprint, failed
            awaiting_first = i == 0  # the first choice's first token is the request's
            try:
                # the watcher below ends a wait in line too, when the client leaves
                client = Client.of(request, watch=False)
                async for item in self._generate(
                    model, generations[i], stop_strings, open_ended=open_ended, client=client
                ):
                    fingerprint = item.fingerprint
                    if awaiting_first:
                        self.metrics.ttft.observe(time.perf_counter() - started)
                        awaiting_first = False
                    results[i] = item.done or results[i]
            except ApiError as exc:
                failed = failed or exc
                scope.cancel()  # one choice failed: the reply has failed

        # hypercorn does not cancel a handler whose client left: watch for it, so that a
        # client that gave up does not keep a route generating for nobody
        async with trio.open_nursery() as nursery:
            watcher = trio.CancelScope()
            nursery.start_soon(_watch_disconnect, request, nursery.cancel_scope, watcher)
            async with trio.open_nursery() as choices:
                for i in range(len(generations)):
                    choices.start_soon(collect, i, choices.cancel_scope)
            watcher.cancel()
        if failed is not None:
            self.counters["errors"] += 1
            self.metrics.errors.labels(failed.code or failed.kind).inc()
            raise failed
        if any(r is None for r in results):
            self.counters["cancelled"] += 1
            self.metrics.cancelled.inc()
            log.info("request %s: the client left before the answer; generation cancelled", generation.request_id)
            return Response(status_code=499)  # nobody reads it
        done = [r for r in results if r is not None]
        self.counters["completed"] += 1
        for g, r in zip(generations, done, strict=True):
            await self._record(model, g, created, r)
        return {
            **shapes[0].envelope(kind, fingerprint),
            "choices": [shape.whole_choice(r) for shape, r in zip(shapes, done, strict=True)],
            "usage": usage_counts(
                len(generation.prompt_tokens), sum(r.completion_tokens for r in done), done[0].cached_tokens
            ),
            "route": done[0].route,
            # a route that failed mid-reply and the ones that took over, per choice (bit_exact
            # false: the continuation ran on other kernels, and may differ from an undisturbed run)
            **({"repairs": [r.repairs for r in done]} if any(r.repairs for r in done) else {}),
        }

    async def _streamed(
        self,
        model: ServedModel,
        generations: list[GenerationRequest],
        shapes: list[ReplyShape],
        stop_strings: list[str],
        open_ended: bool,
        started: float,
        include_usage: bool,
        client: Client,
    ) -> Any:
        """A streamed reply, once every choice has its route and first tokens.

        Found before answering 200, so that "no route" and "all full" are still proper
        HTTP errors. ``client``: whose connection, closed while a choice waits in line, ends the wait.
        """
        streams = [self._generate(model, g, stop_strings, open_ended=open_ended, client=client) for g in generations]
        firsts = []
        try:
            # one after another: each generator's route session must live in this one task
            for stream in streams:
                firsts.append(await stream.__anext__())
        except ApiError as exc:
            if exc.status == 499:  # its client left while it waited in line
                self.counters["cancelled"] += 1
                self.metrics.cancelled.inc()
            else:
                self.counters["errors"] += 1
                self.metrics.errors.labels(exc.code or exc.kind).inc()
            for stream in streams:
                await _aclose(stream)
            raise
        self.metrics.ttft.observe(time.perf_counter() - started)
        return StreamingResponse(
            self._sse(streams, firsts, shapes, generations, include_usage),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
        )

    async def _record(self, model: ServedModel, generation: GenerationRequest, created: int, result: Generated) -> None:
        """Tokens into the metrics, the request and its usage records into the ledger."""
        self.metrics.prompt_tokens.inc(len(generation.prompt_tokens))
        self.metrics.completion_tokens.inc(result.completion_tokens)
        if self.ledger is not None:
            ledger = self.ledger
            await trio.to_thread.run_sync(
                functools.partial(
                    ledger.append,
                    request_id=generation.request_id,
                    model=model.model_id,
                    artifact=model.artifact,
                    created=created,
                    prompt_tokens=len(generation.prompt_tokens),
                    completion_tokens=result.completion_tokens,
                    finish_reason=result.finish_reason,
                    records=result.records,
                )
            )

    async def _sse(
        self,
        streams: list[AsyncIterator[Emitted]],
        firsts: list[Emitted],
        shapes: list[ReplyShape],
        generations: list[GenerationRequest],
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """The chunks of every choice, in turns: each choice's next item, for each unfinished one."""
        kind = "chat.completion.chunk" if shapes[0].chat else "text_completion"
        fingerprint = firsts[0].fingerprint  # the route is granted before the first item
        last_delta = time.perf_counter()
        envelope = shapes[0].envelope(kind, fingerprint)

        def event(doc: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(doc).encode() + b"\n\n"

        def chunk(choice: dict[str, Any], **extra: Any) -> bytes:
            return event({**envelope, "choices": [choice], **extra})

        pending: dict[int, Emitted | None] = dict(enumerate(firsts))
        tokens = 0
        cached = 0
        finished = False
        try:
            for shape, first in zip(shapes, firsts, strict=True):
                if shape.chat:
                    yield chunk(shape.chunk_choice(role=True))
                elif shape.echo is not None and not first.prompt_logprobs:
                    yield chunk(shape.chunk_choice(text=shape.echo))
            while pending:
                for i in list(pending):
                    item, shape = pending[i], shapes[i]
                    if item is None:
                        try:
                            item = await streams[i].__anext__()
                        except StopAsyncIteration:
                            del pending[i]
                            continue
                    pending[i] = None
                    done = item.done
                    if done is not None:
                        await self._record(shape.model, generations[i], shape.created, done)
                        tokens += done.completion_tokens
                        cached = cached or done.cached_tokens
                        repaired = {"repairs": done.repairs} if done.repairs else {}
                        yield chunk(shape.chunk_choice(finish=done.finish_reason), route=done.route, **repaired)
                        del pending[i]
                    elif item.prompt_logprobs:
                        yield chunk(shape.chunk_choice(text=shape.echo or "", prompt_logprobs=item.prompt_logprobs))
                    elif item.text or item.logprobs:
                        choice = shape.chunk_choice(text=item.text, logprobs=item.logprobs)
                        if choice.get("delta", True) or choice["logprobs"] is not None:  # chat holds a marker back
                            now = time.perf_counter()
                            self.metrics.inter_token.observe(now - last_delta)
                            last_delta = now
                            timeline.mark("gateway.chunk")
                            yield chunk(choice)
            if include_usage:
                yield event(
                    {
                        **envelope,
                        "choices": [],
                        "usage": usage_counts(len(generations[0].prompt_tokens), tokens, cached),
                    }
                )
            finished = True
            yield b"data: [DONE]\n\n"
            self.counters["completed"] += 1
        except ApiError as exc:
            # headers are gone: report in the stream, as OpenAI does
            self.counters["errors"] += 1
            self.metrics.errors.labels(exc.code or exc.kind).inc()
            finished = True  # ended by the route, counted as an error: the client did not leave
            yield event(exc.body())
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                self.counters["cancelled"] += 1
                self.metrics.cancelled.inc()
            with trio.CancelScope(shield=True):
                for stream in streams:
                    await _aclose(stream)


class CountRequests:
    """ASGI middleware: counts every ``/v1/`` answer by the route that matched and its status."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                # by the route that matched, never the raw path: anyone may send any path,
                # and each label value is a series the process keeps for good
                route = getattr(scope.get("route"), "path", "")
                self.metrics.requests.labels(route or "unmatched", str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


async def _aclose(stream: AsyncIterator[Any]) -> None:
    closer = getattr(stream, "aclose", None)
    if closer is not None:
        await closer()  # runs the generator's cleanup: Release or Cancel of the route session


async def _watch_disconnect(request: Request, scope: trio.CancelScope, watcher: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client closes its connection (the request body is already read).

    Cancelling ``watcher`` ends the watch.
    """
    with watcher:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()
