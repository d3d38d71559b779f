"""The OpenAI-compatible gateway: HTTP/SSE in front of the routes the tracker picks.

For each request: render the model's chat template, tokenize, run the tokens on a route
(:mod:`noderuntime.runner`: the grant, the wait line, retries and repairs), turn the tokens
that come back into text (holding back possible stop strings), and answer in OpenAI's
format. A client that disconnects mid-stream cancels the session on every shard.
"""

from __future__ import annotations

import contextlib
import functools
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
from noderuntime.access.known_trackers import KnownTrackers
from noderuntime.control.ledger import Ledger
from noderuntime.gateway.auth import ApiKeys, client_identity
from noderuntime.gateway.errors import RETRY_AFTER_SECONDS, ApiError, error_response, run_error
from noderuntime.gateway.requests import generation_request
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
from noderuntime.operations import timeline
from noderuntime.operations.httpserve import BodyLimit
from noderuntime.operations.telemetry import GatewayMetrics, exposition, trio_tasks
from noderuntime.runner.line import LineFull, RunningSessions
from noderuntime.runner.policy import RunError
from noderuntime.runner.runner import Client, RouteRunner
from noderuntime.seams.client import GenerationRequest
from noderuntime.tracker.client import TrackerError
from noderuntime.tracker.trackers import IssuerKeys, Trackers
from noderuntime.web import add_pages
from protocol import TokenLogprob

log = logging.getLogger(__name__)

_UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|list|dict|.*\[.*\])$")
MAX_BODY = 8 << 20  # a request body: far above any prompt that fits a context


def client_of(request: Request, *, watch: bool) -> Client:
    """Who sent ``request``; ``watch``: its wait in line ends when its connection closes."""
    # the key it proved, normalised, or its address: not the header as spelled, which one key
    # could vary (scheme case, spaces) to take many shares of the line
    key = client_identity(request.scope)

    async def left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return Client(key, left if watch else None)


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
        tracker_api_key: str | None = None,
        tracker_pins: KnownTrackers | None = None,
        request_timeout: float = 600.0,
        queue_timeout: float = 10.0,
        queue_limit: int = 256,
        queue_per_key: int = 64,
        ledger: Ledger | None = None,
        identity: Identity | None = None,
        audit_rate: float = 0.0,
        max_running_per_key: int = 256,
        speculate: int = 8,
    ) -> None:
        """``trackers``: the tracker's URL, or several in order of preference (each request goes
        to the first that answers: :class:`Trackers`). ``identity``: the key ``connector`` proves
        on relayed seams, which route tickets name and which signs the gateway's route repairs
        and audits (a fresh one when None). ``audit_rate``: the share of sessions audited after
        they end (:mod:`noderuntime.runner.audits`; run by ``runner.audits.run``, which the
        caller starts). ``tracker_api_key``: the bearer key route requests carry;
        ``tracker_pins``: the key each tracker must show, pinned at first contact (in memory
        when None), under which every route's ticket is checked before a prompt leaves.

        When every route is full a request waits in line (:mod:`noderuntime.runner.line`) up to
        ``queue_timeout`` seconds; at most ``queue_limit`` requests wait, ``queue_per_key`` of them
        under one API key. ``max_running_per_key``: sessions one API key (or, with no keys, one
        client address) may run at once; past them a request is refused 429 (0: no cap).
        ``speculate``: the most drafted tokens a decode window of a route may carry (speculative
        decoding, exact where the route's engines are; 0: none)."""
        if any(not key for key in api_keys):
            raise ValueError("an API key must not be empty: it would let in every request that sends none")
        self.models = {m.model_id: m for m in models}
        self.trackers = trackers if isinstance(trackers, Trackers) else Trackers(trackers)
        self.api_keys = set(api_keys)
        self.cors_origins = tuple(cors_origins)
        self.request_timeout = request_timeout
        self.speculate = speculate
        self.ledger = ledger
        self.metrics = GatewayMetrics()
        self.http = httpx.AsyncClient()
        self.runner = RouteRunner(
            self.trackers,
            connector,
            http=self.http,
            identity=identity or Identity.generate(),
            metrics=self.metrics,
            tracker_api_key=tracker_api_key,
            issuers=IssuerKeys(self.http, tracker_pins or KnownTrackers(None)),
            request_timeout=request_timeout,
            queue_timeout=queue_timeout,
            queue_limit=queue_limit,
            queue_per_key=queue_per_key,
            audit_rate=audit_rate,
            on_dispute=self._dispute,
        )
        self.running = RunningSessions(max_running_per_key)
        # its own threads: a burst of huge prompts must not hold those of name lookups and the ledger
        self._tokenizing = trio.CapacityLimiter(max(2, os.cpu_count() or 2))
        self.app = self._build()
        self._answered: dict[str, int] = {"requests": 0, "completed": 0, "errors": 0, "cancelled": 0}

    @property
    def counters(self) -> dict[str, int]:
        """What it answered (requests, completed, errors, cancelled) and what its runner did (retries,
        repairs): a snapshot."""
        return {**self._answered, **self.runner.counters}

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
        route that serves, known once the route is granted. The runner repairs a route that fails
        mid-reply (:mod:`noderuntime.runner.runner`): the reply goes on where it stopped, and the
        final item lists each repair.
        """
        text = TextStream(stop)
        produced = 0
        logprobs: list[TokenLogprob] = []
        try:
            async with (
                self._running_session(client),
                self.runner.session(model.target, request, open_ended=open_ended, client=client) as run,
            ):
                fingerprint = system_fingerprint(model.artifact, run.grant.recipe)
                check_logprobs(model, request, run.first, prompt=True)
                if run.first.prompt_logprobs:
                    yield Emitted("", fingerprint=fingerprint, prompt_logprobs=run.first.prompt_logprobs)
                while (event := await run.next()) is not None:
                    fingerprint = system_fingerprint(model.artifact, run.grant.recipe)
                    if event is not run.first:
                        check_logprobs(model, request, event, prompt=False)
                    for k, token in enumerate(event.token_ids):
                        produced += 1
                        if token in request.stop_token_ids and event.finished:
                            continue  # the end-of-turn token itself is not text
                        delta = text.push(model.vocab.piece(token))
                        mine = (event.logprobs[k],) if event.logprobs else ()
                        logprobs += mine
                        if delta or mine:
                            yield Emitted(delta, mine, fingerprint=fingerprint)
                        if text.stopped:
                            break
                    if text.stopped:
                        break
                reason = "stop" if text.stopped or run.finish_reason == "stop" else "length"
        except RunError as exc:
            raise run_error(exc) from None
        # the session was released on leaving the block: every hop's signed usage is in its records
        tail = text.finish()
        if tail:
            yield Emitted(tail, fingerprint=fingerprint)
        done = Generated(
            text.text,
            produced,
            reason,
            run.route,
            run.records,
            logprobs,
            run.first.prompt_logprobs,
            run.repairs,
            run.cached_tokens,
            run.drafted,
            run.accepted,
        )
        yield Emitted("", done=done, fingerprint=fingerprint)

    @contextlib.asynccontextmanager
    async def _running_session(self, client: Client | None) -> AsyncIterator[None]:
        """Count a session of ``client``'s key while it runs; 429 past the key's cap (``max_running_per_key``)."""
        key = client.key if client is not None else ""
        try:
            self.running.start_nowait(key)
        except LineFull as exc:
            raise ApiError(429, str(exc), "rate_limit_error", "too_many_sessions") from None
        try:
            yield
        finally:
            self.running.finish(key)

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
            audits = self.runner.audits
            return {
                "counters": self.counters,
                "line": attrs.asdict(self.runner.line.statistics()),
                "audits": {**audits.counters, "rate": audits.rate, "excluded": audits.failed_nodes},
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
            generation = generation_request(
                model, body, prompt, max_tokens, grammar, timeout=self.request_timeout, speculate=self.speculate
            )
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
            generation = generation_request(
                model, body, prompt, body.max_tokens, grammar, timeout=self.request_timeout, speculate=self.speculate
            )
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
        self._answered["requests"] += 1
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
            model, generations, shapes, stop_strings, open_ended, started, include_usage, client_of(request, watch=True)
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
                client = client_of(request, watch=False)
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
            self._answered["errors"] += 1
            self.metrics.errors.labels(failed.code or failed.kind).inc()
            raise failed
        if any(r is None for r in results):
            self._answered["cancelled"] += 1
            self.metrics.cancelled.inc()
            log.info("request %s: the client left before the answer; generation cancelled", generation.request_id)
            return Response(status_code=499)  # nobody reads it
        done = [r for r in results if r is not None]
        self._answered["completed"] += 1
        for g, r in zip(generations, done, strict=True):
            await self._record(model, g, created, r)
        return {
            **shapes[0].envelope(kind, fingerprint),
            "choices": [shape.whole_choice(r) for shape, r in zip(shapes, done, strict=True)],
            "usage": usage_counts(
                len(generation.prompt_tokens),
                sum(r.completion_tokens for r in done),
                done[0].cached_tokens,
                sum(r.drafted_tokens for r in done),
                sum(r.accepted_tokens for r in done),
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
                self._answered["cancelled"] += 1
                self.metrics.cancelled.inc()
            else:
                self._answered["errors"] += 1
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
        cached = drafted = accepted = 0
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
                        drafted += done.drafted_tokens
                        accepted += done.accepted_tokens
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
                        "usage": usage_counts(len(generations[0].prompt_tokens), tokens, cached, drafted, accepted),
                    }
                )
            finished = True
            yield b"data: [DONE]\n\n"
            self._answered["completed"] += 1
        except ApiError as exc:
            # headers are gone: report in the stream, as OpenAI does
            self._answered["errors"] += 1
            self.metrics.errors.labels(exc.code or exc.kind).inc()
            finished = True  # ended by the route, counted as an error: the client did not leave
            yield event(exc.body())
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                self._answered["cancelled"] += 1
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
