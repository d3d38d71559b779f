"""The OpenAI-compatible gateway: HTTP/SSE in front of the routes the tracker picks.

For each request: render the model's chat template, tokenize, ask the tracker for a
route and a ticket, open the route session on its head (direct or through its relay),
turn the tokens that come back into text (holding back possible stop strings), and
answer in OpenAI's format. A route that refuses the session or fails before its first
token is left for another one. A client that disconnects mid-stream cancels the
session on every shard.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Any

import attrs
import httpx
import trio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from noderuntime.chat import ChatTemplate, TemplateError, prompt_tokens
from noderuntime.client import GenerationRequest, RouteError, open_route_generation
from noderuntime.engine import GrammarError, Vocab, check_grammar, json_schema_grammar
from noderuntime.gateway.logprobs import CompletionLogprobs, chat_entries
from noderuntime.gateway.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    Constraint,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from noderuntime.gateway.textstream import TextStream
from noderuntime.gateway.tools import (
    THINK_OPEN,
    ChatOutput,
    TemplateTraits,
    call_grammar,
    call_schema,
    hermes_history,
    template_traits,
)
from noderuntime.httpserve import BodyLimit
from noderuntime.ledger import CheckedRecord, Ledger, check
from noderuntime.telemetry import GatewayMetrics, exposition, trio_tasks
from noderuntime.tracker.client import RouteGrant, TrackerError, request_route
from protocol import Sampling, StatusCode, TokenLogprob, Tokens

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
DEADLINE_GRACE_SECONDS = 5.0  # beyond a request's deadline, for the route's own word on it
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|list|dict|.*\[.*\])$")
MAX_BODY = 8 << 20  # a request body: far above any prompt that fits a context
# A request without max_tokens asks for a route with room for at least this many tokens
# after its prompt, then may run to the end of the context that route holds (as OpenAI's
# API does: the reply ends at a stop, or when the context is full).
DEFAULT_MAX_TOKENS = 256
# a prompt whose logprobs are echoed: they travel back in one frame (about 70 bytes a token)
MAX_SCORED_PROMPT = 32768


def system_fingerprint(artifact: str, recipe: bytes) -> str:
    """OpenAI's ``system_fingerprint``: the same model file run the same way gives the same one."""
    return "fp_" + hashlib.sha256(f"{artifact}:{recipe.hex()}".encode()).hexdigest()[:16]


def _gbnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'


def _grammar(vocab: Vocab, constraint: Constraint | None) -> str:
    """The GBNF a session's tail follows for ``constraint``, compiled here first: a 400, not a failed route."""
    if constraint is None:
        return ""
    try:
        if constraint.kind == "json":
            text = json_schema_grammar(constraint.value)
        elif constraint.kind == "tools":
            tools, syntax, several = constraint.value
            text = call_grammar(json_schema_grammar(call_schema(tools, syntax)), syntax, several=several)
        elif constraint.kind == "choice":
            text = "root ::= " + " | ".join(_gbnf_literal(option) for option in constraint.value)
        else:
            text = str(constraint.value)
        check_grammar(vocab, text)
    except GrammarError as exc:
        raise ApiError(400, f"{constraint.param}: {exc}", param=constraint.param) from None
    return text


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        """``{"error": {...}}``."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


# how long a client should wait before trying a busy (429) or routeless (503) gateway
# again: the official clients honour it, and nodes report their sessions each second
RETRY_AFTER_SECONDS = 1
# paths outside /v1/ that need a key too: what llama-server names them
_KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})


def _error_response(error: ApiError) -> JSONResponse:
    headers = {"retry-after": str(RETRY_AFTER_SECONDS)} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _bearer(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """The token of an ``Authorization: Bearer ...`` header (the scheme in any case), or b""."""
    auth = dict(headers).get(b"authorization", b"")
    scheme, _, token = auth.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


class ApiKeys:
    """ASGI middleware: a ``/v1/`` request without a valid key is answered 401 first.

    Before its body is read or checked, so that a client without a key learns that,
    not what else is wrong with its request. No keys configured: everyone is let in.
    """

    def __init__(self, app: Any, keys: Collection[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys:
            await self.app(scope, receive, send)  # lifespan events have no path
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))  # mounted under a prefix: its own path
        # a browser's CORS preflight carries no credentials, by the fetch standard
        if (path.startswith("/v1/") or path in _KEYED_PATHS) and scope.get("method") != "OPTIONS":
            given = _bearer(scope.get("headers") or ())
            # compare every key in constant time: how long a refusal takes says nothing of a key
            if not sum(hmac.compare_digest(given, key) for key in self.keys):
                refusal = ApiError(
                    401,
                    "invalid or missing API key (Authorization: Bearer ...)",
                    "authentication_error",
                    "invalid_api_key",
                )
                await _error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


@attrs.define(slots=False)  # slots off: a cached property needs the instance's dict
class ServedModel:
    """A model this gateway serves: its tokenizer and template, and its artifact."""

    model_id: str
    artifact: str
    vocab: Vocab
    template: ChatTemplate | None
    created: int
    n_ctx: int

    def stop_tokens(self) -> tuple[int, ...]:
        """Tokens that always end a generation (end of text, end of turn)."""
        return tuple(sorted(self.vocab.eog_tokens))

    def card(self) -> dict[str, Any]:
        """The model as ``/v1/models`` lists it."""
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "noderuntime"}

    @functools.cached_property
    def traits(self) -> TemplateTraits:
        """What the chat template does with tools and thinking."""
        return template_traits(self.template.source if self.template is not None else "")

    def chat_prompt(self, messages: Sequence[dict[str, Any]], **context: Any) -> list[int]:
        """The prompt tokens of a conversation; text a message types stays text (see ``chat``).

        ``context``: ``tools`` and ``variables`` for the template.
        """
        assert self.template is not None
        try:
            return prompt_tokens(self.template, self.vocab, messages, **context)
        except TemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        except UnicodeEncodeError:
            raise ApiError(400, "message text is not valid Unicode (a lone surrogate?)", param="messages") from None

    def text_prompt(self, text: str) -> list[int]:
        """The tokens of a text completion's prompt; special-token text stays text."""
        try:
            return self.vocab.tokenize(text, add_special=self.vocab.add_bos, parse_special=False)
        except UnicodeEncodeError:
            raise ApiError(400, "the prompt is not valid Unicode (a lone surrogate?)", param="prompt") from None


@attrs.define
class Generated:
    """What a finished (or stopped) generation produced."""

    text: str
    completion_tokens: int
    finish_reason: str
    route: list[dict[str, Any]]
    records: list[CheckedRecord] = attrs.Factory(list)
    logprobs: list[TokenLogprob] = attrs.Factory(list)  # of the reply's tokens, when asked
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # of the prompt's tokens but the first, when asked


@attrs.frozen
class Emitted:
    """What a generation yields: text that may be shown, its tokens' logprobs, and once finished, all."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    done: Generated | None = None
    fingerprint: str = ""  # OpenAI's system_fingerprint of the serving route
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # on the first item, when asked


class Gateway:
    """Serves OpenAI requests for its models over the network of nodes."""

    def __init__(
        self,
        models: Sequence[ServedModel],
        tracker_url: str,
        connector: Any,
        *,
        api_keys: Sequence[str] = (),
        cors_origins: Sequence[str] = (),
        tracker_key: str | None = None,
        request_timeout: float = 600.0,
        queue_timeout: float = 10.0,
        ledger: Ledger | None = None,
    ) -> None:
        if any(not key for key in api_keys):
            raise ValueError("an API key must not be empty: it would let in every request that sends none")
        self.models = {m.model_id: m for m in models}
        self.tracker_url = tracker_url
        self.connector = connector
        self.api_keys = set(api_keys)
        self.cors_origins = tuple(cors_origins)
        self.tracker_key = tracker_key
        self.request_timeout = request_timeout
        self.queue_timeout = queue_timeout
        self.ledger = ledger
        self.metrics = GatewayMetrics()
        self.http = httpx.AsyncClient()
        # its own threads: a burst of huge prompts must not hold those of name lookups and the ledger
        self._tokenizing = trio.CapacityLimiter(max(2, os.cpu_count() or 2))
        self.app = self._build()
        self.counters: dict[str, int] = {"requests": 0, "completed": 0, "errors": 0, "cancelled": 0, "retries": 0}

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
        )

    async def _grant(self, model: ServedModel, tokens: int, exclude: list[bytes]) -> RouteGrant:
        try:
            return await request_route(
                self.http, self.tracker_url, model.artifact, tokens, exclude=exclude, api_key=self.tracker_key
            )
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
        self, model: ServedModel, request: GenerationRequest, *, open_ended: bool = False
    ) -> AsyncIterator[tuple[Any, Tokens, RouteGrant]]:
        """A route session that produced its first tokens.

        ``open_ended`` (the client gave no max_tokens): the reply may fill the context the
        granted route holds, not only the tokens asked of the tracker.

        A route that fails before its first token is left for another one (up to
        ``MAX_ATTEMPTS``). When every route is full, the request waits up to
        ``queue_timeout`` for a slot: the tracker's view of free slots is a heartbeat old,
        and sessions end all the time.
        """
        exclude: list[bytes] = []
        failures = 0
        queue_until = trio.current_time() + self.queue_timeout
        backoff = 0.05
        while True:
            try:
                grant = await self._grant(model, len(request.prompt_tokens) + request.max_tokens, exclude)
            except ApiError as exc:
                if exc.status == 429 and trio.current_time() + backoff < queue_until:
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, 0.5)
                    continue
                raise
            session_request = request
            if open_ended and grant.ctx_per_session:
                room = min(model.n_ctx, grant.ctx_per_session) - len(request.prompt_tokens)
                session_request = attrs.evolve(request, max_tokens=max(request.max_tokens, room))
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
                    with trio.fail_after(_time_left(request)):
                        first = await gen.next()
                except trio.TooSlowError:
                    raise _silent_route() from None
                except RouteError as exc:
                    error = _route_error(exc)
                    if exc.code == StatusCode.DEADLINE_EXCEEDED and _time_left(request) <= DEADLINE_GRACE_SECONDS + 1:
                        # the request's own time is (all but) up, by this clock or a node's running ahead
                        raise error from None
                    self.counters["retries"] += 1
                    self.metrics.route_retries.labels(exc.code.name).inc()
                    if exc.code == StatusCode.RESOURCE_EXHAUSTED:
                        # a full node is busy, not broken: wait for a slot, and when the wait is
                        # over say so (429); excluding it would turn "busy" into "no route" (503)
                        if trio.current_time() + backoff >= queue_until:
                            raise error from None
                        log.info("a node on the route is full; waiting for a slot")
                        await trio.sleep(backoff)
                        backoff = min(backoff * 2, 0.5)
                        continue
                    failures += 1
                    if failures >= MAX_ATTEMPTS:
                        raise error from None
                    exclude += _to_exclude(grant, exc)
                    log.info("route attempt failed before the first token (%s); trying another", exc)
                    continue
                assert first is not None
                yield gen, first, grant
                return

    async def _generate(
        self, model: ServedModel, request: GenerationRequest, stop: Sequence[str], *, open_ended: bool
    ) -> AsyncIterator[Emitted]:
        """What may be shown while generating, then an item with ``done`` set once finished.

        The fingerprint is OpenAI's ``system_fingerprint``: of the artifact and the recipe of the
        route that serves, known once the route is granted.
        """
        text = TextStream(stop)
        produced = 0
        logprobs: list[TokenLogprob] = []
        async with self._route_session(model, request, open_ended=open_ended) as (gen, first, grant):
            route = _describe(grant)
            fingerprint = system_fingerprint(model.artifact, grant.recipe)
            prompt_logprobs = first.prompt_logprobs
            _check_logprobs(model, request, first, prompt=True)
            if prompt_logprobs:
                yield Emitted("", fingerprint=fingerprint, prompt_logprobs=prompt_logprobs)
            event: Tokens | None = first
            while event is not None:
                if event is not first:
                    _check_logprobs(model, request, event, prompt=False)
                for k, token in enumerate(event.token_ids):
                    if not 0 <= token < model.vocab.n_vocab:  # the route's word, not a known piece
                        raise _bad_route(f"it sent token id {token}, outside the vocabulary")
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
                if text.stopped or event.finished:
                    break
                try:
                    with trio.fail_after(_time_left(request)):
                        event = await gen.next()
                except trio.TooSlowError:
                    raise _silent_route() from None
                except RouteError as exc:
                    # tokens already went out: no retry, a typed error in their place
                    raise _route_error(exc) from None
            reason = "stop" if text.stopped or gen.finish_reason == "stop" else "length"
        # the session was released on leaving the block: every hop's signed usage is here
        records = [check(r, request_id=request.request_id, hops=grant.hops) for r in gen.usage or ()]
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
        done = Generated(text.text, produced, reason, route, records, logprobs, prompt_logprobs)
        yield Emitted("", done=done, fingerprint=fingerprint)

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
            return _error_response(exc)

        @app.exception_handler(Exception)
        async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
            # a bug, not the client's fault: typed for the client, the traceback for the operator
            log.error("unexpected error answering a request", exc_info=exc)
            return _error_response(ApiError(500, "internal error (see the gateway log)", "server_error", "internal"))

        @app.exception_handler(RequestValidationError)
        async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0] if exc.errors() else {}
            # the field's path, without "body" and the union branches pydantic tried ("str", "list[int]")
            where = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not _UNION_BRANCH.match(str(p)))
            message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", exc))
            # checks across fields name the field they refuse in their context
            param = where or (first.get("ctx") or {}).get("param")
            return _error_response(ApiError(400, message, param=param))

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
            kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
            return _error_response(ApiError(exc.status_code, str(exc.detail), kind))

        @app.middleware("http")
        async def count(request: Request, call_next: Any) -> Any:
            response = await call_next(request)
            if request.url.path.startswith("/v1/"):
                # by the route that matched, never the raw path: anyone may send any path,
                # and each label value is a series the process keeps for good
                route = getattr(request.scope.get("route"), "path", "")
                self.metrics.requests.labels(route or "unmatched", str(response.status_code)).inc()
            return response

        @app.get("/metrics", include_in_schema=False)
        async def metrics() -> Any:
            status, content_type, payload = exposition(self.metrics.registry)
            return Response(payload, status_code=status, media_type=content_type)

        @app.get("/status", include_in_schema=False)
        async def status() -> dict[str, Any]:
            return {"counters": dict(self.counters), "models": list(self.models), "tasks": trio_tasks()}

        @app.get("/health", include_in_schema=False)
        async def health() -> JSONResponse:
            # 200 only while the tracker knows a complete route for every model served here
            try:
                response = await self.http.get(self.tracker_url + "/v1/artifacts", timeout=5.0)
                response.raise_for_status()
                known = response.json()["artifacts"]
                routable = {m.model_id: bool(known.get(m.artifact, {}).get("routable")) for m in self.models.values()}
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
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

        @app.get("/v1/models")
        async def list_models() -> dict[str, Any]:
            return {"object": "list", "data": [m.card() for m in self.models.values()]}

        @app.get("/v1/models/{model_id:path}")
        async def one_model(model_id: str) -> dict[str, Any]:
            return self._model(model_id).card()

        @app.post("/v1/chat/completions", response_model=None)
        async def chat(body: ChatCompletionRequest, request: Request) -> Any:
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
            max_tokens = body.max_completion_tokens or body.max_tokens
            # a large schema's grammar takes milliseconds to build and compile: not on the event loop
            constraint = body.constraint()
            forced = body.forced_tools()
            if forced is not None:
                several = body.tool_choice == "required" and body.parallel_tool_calls is not False
                constraint = Constraint("tools", (forced, traits.syntax, several), "tools")
            grammar = await trio.to_thread.run_sync(_grammar, model.vocab, constraint, limiter=self._tokenizing)
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
            grammar = await trio.to_thread.run_sync(_grammar, model.vocab, body.constraint(), limiter=self._tokenizing)
            generation = self._prepare(model, body, prompt, body.max_tokens, grammar)
            echo = None
            if body.echo:
                echo = body.prompt_text() if body.prompt_tokens() is None else model.vocab.detokenize(prompt)
            open_ended = body.max_tokens is None
            return await self._answer(model, body, generation, request, chat=False, open_ended=open_ended, echo=echo)

        return app

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
            _Shape(
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
        kind = "chat.completion" if chat else "text_completion"
        if not body.stream:
            results: list[Generated | None] = [None] * len(generations)
            fingerprint = ""
            failed: ApiError | None = None

            async def collect(i: int, scope: trio.CancelScope) -> None:
                nonlocal fingerprint, failed
                awaiting_first = i == 0  # the first choice's first token is the request's
                try:
                    async for item in self._generate(model, generations[i], stop_strings, open_ended=open_ended):
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
                "usage": _usage(len(generation.prompt_tokens), sum(r.completion_tokens for r in done)),
                "route": done[0].route,
            }
        # streaming: find the routes and their first tokens before answering 200, so that
        # "no route" and "all full" are still proper HTTP errors
        streams = [self._generate(model, g, stop_strings, open_ended=open_ended) for g in generations]
        firsts = []
        try:
            # one after another: each generator's route session must live in this one task
            for stream in streams:
                firsts.append(await stream.__anext__())
        except ApiError as exc:
            self.counters["errors"] += 1
            self.metrics.errors.labels(exc.code or exc.kind).inc()
            for stream in streams:
                await _aclose(stream)
            raise
        self.metrics.ttft.observe(time.perf_counter() - started)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
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
        shapes: list[_Shape],
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
                        yield chunk(shape.chunk_choice(finish=done.finish_reason), route=done.route)
                        del pending[i]
                    elif item.prompt_logprobs:
                        yield chunk(shape.chunk_choice(text=shape.echo or "", prompt_logprobs=item.prompt_logprobs))
                    elif item.text or item.logprobs:
                        choice = shape.chunk_choice(text=item.text, logprobs=item.logprobs)
                        if choice.get("delta", True) or choice["logprobs"] is not None:  # chat holds a marker back
                            now = time.perf_counter()
                            self.metrics.inter_token.observe(now - last_delta)
                            last_delta = now
                            yield chunk(choice)
            if include_usage:
                yield event({**envelope, "choices": [], "usage": _usage(len(generations[0].prompt_tokens), tokens)})
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


@attrs.define
class _Shape:
    """How one request's choices look in OpenAI's format, whole or as chunks."""

    ident: str
    created: int
    model: ServedModel
    chat: bool
    prompt: tuple[int, ...]
    top: int
    logprobs: bool
    echo: str | None
    output: ChatOutput  # chat: splits content, reasoning and tool calls
    index: int = 0  # of the choice
    _completion: CompletionLogprobs | None = None

    def __attrs_post_init__(self) -> None:
        if not self.chat and self.logprobs:
            self._completion = CompletionLogprobs(self.model.vocab.piece, self.top)

    def envelope(self, kind: str, fingerprint: str) -> dict[str, Any]:
        """The fields every reply and chunk has."""
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.model.model_id,
            "system_fingerprint": fingerprint,
        }

    def _chat_logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": chat_entries(self.model.vocab.piece, entries, self.top), "refusal": None}

    def _completion_logprobs(
        self, entries: Sequence[TokenLogprob], prompt_logprobs: Sequence[TokenLogprob] = ()
    ) -> dict[str, Any] | None:
        track = self._completion
        if track is None:
            return None
        if prompt_logprobs:
            track.add(self.prompt[0], None)  # the first prompt token has no context
            for e in prompt_logprobs:
                track.add(e.token, e)
        for e in entries:
            track.add(e.token, e)
        return track.take()

    def whole_choice(self, result: Generated) -> dict[str, Any]:
        """The one choice of a whole reply."""
        choice: dict[str, Any] = {"index": self.index, "finish_reason": result.finish_reason}
        if self.chat:
            self.output.push(result.text)
            self.output.finish()
            choice["message"] = self._message()
            choice["finish_reason"] = self.finish_reason(result.finish_reason)
            choice["logprobs"] = self._chat_logprobs(result.logprobs)
        else:
            choice["text"] = (self.echo or "") + result.text
            choice["logprobs"] = self._completion_logprobs(result.logprobs, result.prompt_logprobs)
        return choice

    def _message(self) -> dict[str, Any]:
        out = self.output
        message: dict[str, Any] = {"role": "assistant", "content": out.content}
        if out.reasoning:
            message["reasoning_content"] = out.reasoning
        if out.calls:
            message["tool_calls"] = [c.as_dict() for c in out.calls]
            if not out.content.strip():
                message["content"] = None  # a reply that is only calls, as OpenAI sends it
        return message

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` for a reply that ended after calling, else the route's reason."""
        return "tool_calls" if self.output.calls and reason == "stop" else reason

    def chunk_choice(
        self,
        *,
        text: str = "",
        logprobs: Sequence[TokenLogprob] = (),
        prompt_logprobs: Sequence[TokenLogprob] = (),
        role: bool = False,
        finish: str | None = None,
    ) -> dict[str, Any]:
        """The one choice of a streamed chunk."""
        choice: dict[str, Any] = {"index": self.index, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            told = self.output.finish() if finish is not None else self.output.push(text)
            if finish is not None:
                choice["finish_reason"] = self.finish_reason(finish)
            if told.content:
                delta["content"] = told.content
            if told.reasoning:
                delta["reasoning_content"] = told.reasoning
            if told.calls:
                first = len(self.output.calls) - len(told.calls)
                delta["tool_calls"] = [c.as_dict(first + i) for i, c in enumerate(told.calls)]
            choice["delta"] = delta
            if logprobs:
                choice["logprobs"] = self._chat_logprobs(logprobs)
        else:
            choice["text"] = text
            if logprobs or prompt_logprobs:
                choice["logprobs"] = self._completion_logprobs(logprobs, prompt_logprobs)
        return choice


def _check_logprobs(model: ServedModel, request: GenerationRequest, event: Tokens, *, prompt: bool) -> None:
    """The route's logprobs must be those asked for, of the tokens sent, inside the vocabulary."""
    sampling = request.sampling
    if sampling.logprobs and len(event.logprobs) != len(event.token_ids):
        raise _bad_route("it sent tokens without the logprobs asked for")
    entries = list(zip(event.token_ids, event.logprobs, strict=False))
    if prompt and sampling.prompt_logprobs:
        if len(event.prompt_logprobs) != len(request.prompt_tokens) - 1:
            raise _bad_route("it sent no logprobs for the prompt, or not one for each token")
        entries += zip(request.prompt_tokens[1:], event.prompt_logprobs, strict=True)
    for token, entry in entries:
        if entry.token != token or len(entry.top) > sampling.top_logprobs:
            raise _bad_route("its logprobs are not those of the tokens sent")
        if any(not 0 <= t < model.vocab.n_vocab for t, _ in entry.top):
            raise _bad_route("its logprobs name tokens outside the vocabulary")


def _bad_route(what: str) -> ApiError:
    return ApiError(503, f"the route failed: {what}", "service_unavailable", "route_failed")


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


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _describe(grant: RouteGrant) -> list[dict[str, Any]]:
    return [
        {
            "node_id": h.node_id.hex()[:16],
            "layers": [h.layers.start, h.layers.end],
            "via": "direct" if h.address else "relay",
        }
        for h in grant.hops
    ]


def _time_left(request: GenerationRequest) -> float:
    # the nodes end a session at its deadline and say so; this bounds a route gone silent
    # (a head that accepted and hung, a relay host that vanished) on the gateway's side
    return max(0.0, request.deadline_unix_ms / 1000 - time.time()) + DEADLINE_GRACE_SECONDS


def _silent_route() -> ApiError:
    return ApiError(504, "the route went silent past the request's deadline", "timeout", "deadline_exceeded")


def _route_error(exc: RouteError) -> ApiError:
    # Never a 400: the gateway checked the request before any route saw it, so a route
    # that calls it invalid (or out of range) is wrong or hostile, and another may serve it.
    if exc.code == StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, f"every route is busy: {exc}", "rate_limit_error", "routes_full")
    if exc.code == StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, f"the request timed out: {exc}", "timeout", "deadline_exceeded")
    return ApiError(503, f"the route failed: {exc}", "service_unavailable", "route_failed")


def _to_exclude(grant: RouteGrant, exc: RouteError) -> list[bytes]:
    """Which nodes the next attempt should avoid, from who reported what."""
    ids = [h.node_id for h in grant.hops]
    if exc.node_id in ids:
        at = ids.index(exc.node_id)
        if exc.code in (StatusCode.RESOURCE_EXHAUSTED, StatusCode.INTERNAL) or at + 1 == len(ids):
            return [exc.node_id]  # full, or failed in its own engine
        # the reporter is alive (it reported): its next hop went away, hung or broke the protocol
        return [ids[at + 1]]
    return ids[:1]
