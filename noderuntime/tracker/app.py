"""The tracker's HTTP/JSON API (FastAPI on hypercorn's trio worker).

- ``GET  /v1/info``: the tracker's ticket-issuer public key.
- ``POST /v1/nodes/register`` and ``POST /v1/nodes/heartbeat``: signed by the node's key
  (see :mod:`noderuntime.access.signing`); a node cannot register under another node's id.
- ``GET  /v1/nodes``, ``GET /v1/artifacts``: what the tracker knows.
- ``GET  /``: the swarm map, a page that reads ``GET /v1/status`` (every model's coverage,
  aggregated) and ``GET /v1/status/nodes`` (a page of nodes, filtered) as it goes.
  Read-only and open, unless the tracker has a status key: then these and ``/v1/nodes``
  need it (``Authorization: Bearer KEY``, or ``?key=KEY``); ``/v1/info`` and
  ``/v1/artifacts`` stay open, for the nodes and gateways that read them.
- ``POST /v1/nodes/probe``: a node's answer to its known-answer probe (signed).
- ``POST /v1/placement``: a node with no layer range yet asks for one (signed): the window
  of as many layers as it can hold around the least served layer, reserved for it while it
  loads (see :mod:`noderuntime.tracker.placement`); 409 when the request contradicts the swarm.
- ``POST /v1/placement/reconsider``: a serving node that was placed asks whether it should
  move (signed): stay, or a range that raises the swarm's least capacity by the margin
  (:meth:`Placement.reconsider`), reserved for it; 404 when it is not registered.
- ``POST /v1/routes``: a route for a session and its signed ticket (optionally behind a
  bearer key): 503 when no route exists, 429 when every route is full.
- ``GET  /metrics``: Prometheus metrics.
- ``GET  /v1/manifests`` and ``GET /v1/manifests/{artifact}``: the signed manifests it was
  given (:mod:`noderuntime.models.manifest`), for nodes that fetch only their layers.

A registration carries the node's signed capability record (see
:mod:`noderuntime.control.admission`); one that does not verify, or that was measured for
another shard, is refused. When the tracker holds probe references for the shard, the
answer to registration (and, every ``probe_interval`` seconds, to a heartbeat) carries
a probe seed; until the node answers it correctly it is kept out of routes.
"""

from __future__ import annotations

import hmac
import logging
import os
import random
import time
from collections.abc import Iterable
from typing import Annotated, Any

import attrs
import trio
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from noderuntime.access import tickets
from noderuntime.access.addresses import AddressError, check_endpoints
from noderuntime.access.identity import Identity
from noderuntime.access.signing import SignatureChecker, SignatureError, join_proof
from noderuntime.control.admission import AdmissionError, ProbeAnswer, ProbeReferences, check_capability, compare
from noderuntime.models.manifest import Manifest
from noderuntime.operations.httpserve import BodyLimit
from noderuntime.operations.memory import compacted, give_back
from noderuntime.operations.telemetry import TrackerMetrics, exposition, trio_tasks
from noderuntime.tracker import shapes, swarm
from noderuntime.tracker.audits import AUDIT_GRANT_SECONDS, AuditBook, AuditError, auditor_weight, network_prefix
from noderuntime.tracker.audits import Grant as AuditGrant
from noderuntime.tracker.limits import Outstanding, RateLimits
from noderuntime.tracker.messages import (
    AuditFailure,
    AuditReport,
    AuditRequest,
    AuditVerdict,
    Heartbeat,
    Leave,
    NodeQuery,
    PlacementReply,
    PlacementRequest,
    ProbeReply,
    RebalanceReply,
    RebalanceRequest,
    Registration,
    RepairRequest,
    RouteHop,
    RouteReply,
    RouteRequest,
)
from noderuntime.tracker.placement import HOLD_DOWN_SECONDS, Placement, PlacementError
from noderuntime.tracker.records import NodeRecord
from noderuntime.tracker.registry import STEP_BUDGET_MS, TrackerState
from noderuntime.tracker.routechoice import NoRoute
from noderuntime.verify.certificates import CoveredPair
from noderuntime.web import add_pages, file_response
from protocol import Hop, Span, route_recipe

MAX_BODY = 64 << 10
PROBE_ANSWER_SECONDS = 60.0  # a challenge unanswered this long is sent again
# the swarm's status is computed at most this often, however many pages poll it
SWARM_CACHE_SECONDS = 1.0
# a ticket lives as long as its request asks, up to this: minutes, for a session and its repairs
MAX_TICKET_SECONDS = 1800.0
# route grants one client (an address, a key) may take: at once, and a second in the long run
ROUTE_BURST = 200
ROUTE_RATE = 50.0
# route grants one client (an address, a key) may hold at once: their tickets not yet expired
ROUTE_CONCURRENCY = 4096

log = logging.getLogger(__name__)


class Tracker:
    """The tracker service: state, issuer key, request checks."""

    def __init__(
        self,
        identity: Identity,
        *,
        expire_after: float = 10.0,
        api_key: str | None = None,
        references: ProbeReferences | None = None,
        require_probe: bool = False,
        probe_interval: float = 600.0,
        probe_tolerance: float = 1e-3,
        step_budget_ms: float = STEP_BUDGET_MS,
        mixes: Iterable[CoveredPair] = (),
        manifests: Iterable[Manifest] = (),  # served to nodes that fetch only their layers
        status_key: str | None = None,
        move_hold_down: float = HOLD_DOWN_SECONDS,
        route_rate: float = ROUTE_RATE,
        route_burst: int = ROUTE_BURST,
        route_concurrency: int = ROUTE_CONCURRENCY,
        referees: Iterable[bytes] = (),
        allow_nodes: Iterable[bytes] = (),
        join_secret: bytes | None = None,
        local_swarm: bool = False,
    ) -> None:
        """``references`` let the tracker probe shards; ``require_probe`` admits no shard it cannot probe;
        ``mixes`` are the pairs of recipes that certificates let share a route; ``status_key``, when
        given, is needed to read the swarm map and the node lists; ``move_hold_down``: seconds a node
        told to move is not told again; ``route_rate`` and ``route_burst``: the route grants (and
        repairs and audits) one client address, and one client key, may take a second and at once;
        ``route_concurrency``: the route grants one client address, and one client key, may hold at once
        (a grant is held until its ticket expires: the tracker does not see a session end);
        ``referees``: node ids whose re-execution confirms two auditors before a node is excluded (none:
        audits never exclude, they make the reporting gateway avoid a node). ``allow_nodes`` and
        ``join_secret`` make the swarm private: only a node allow-listed, or one that proves it holds
        the secret (:func:`~noderuntime.access.signing.join_proof`), may register or be placed; with
        neither, the swarm is open. ``local_swarm``: the swarm runs on one machine or a private
        network: nodes may register loopback and private addresses, and every ticket says so, so
        that nodes and gateways dial them (else they are refused: :mod:`noderuntime.access.addresses`)."""
        if join_secret is not None and not join_secret:
            raise ValueError("a join secret must not be empty")
        self.allow_nodes = frozenset(allow_nodes)
        self.join_secret = join_secret
        if status_key is not None and not status_key:
            raise ValueError("a status key must not be empty: it would let in every request that sends none")
        self.status_key = status_key
        self._swarm_cache: tuple[float, dict[str, Any]] | None = None
        self.identity = identity
        self.local_swarm = local_swarm
        self.manifests = {m.artifact: m for m in manifests}
        self.mixes = tuple(mixes)
        by_artifact: dict[str, set[frozenset[str]]] = {}
        for pair in self.mixes:
            by_artifact.setdefault(pair.artifact, set()).add(pair.recipes)
        self.state = TrackerState(
            expire_after=expire_after,
            step_budget_ms=step_budget_ms,
            mixes=by_artifact,
            shapes={m.artifact: m.n_layer for m in self.manifests.values()},
        )
        self.placement = Placement(self.state, hold_down_seconds=move_hold_down)
        self.signatures = SignatureChecker()
        self._given_back_at = 0  # the maps' compactions when memory was last given back (expire)
        self.api_key = api_key
        self.references = references or ProbeReferences()
        self.require_probe = require_probe
        self.probe_interval = probe_interval
        self.probe_tolerance = probe_tolerance
        self.metrics = TrackerMetrics()
        # node id -> (seed, when issued) of the challenge it has yet to answer; when last probed
        self.challenges: dict[bytes, tuple[int, float]] = {}
        self.last_probed: dict[bytes, float] = {}
        self._rng = random.SystemRandom()
        self.app = self._build()
        self.routes_issued = 0
        self.audits = AuditBook()
        self.referees = frozenset(referees)
        self.joined: dict[bytes, float] = {}  # node id -> when it first registered, while it stays
        self.route_limits = RateLimits(rate=route_rate, burst=route_burst)
        self.outstanding = Outstanding(limit=route_concurrency)

    @staticmethod
    def _client_names(request: Request, client: bytes | str) -> list[str]:
        """What a requester is known by: its address, and the key it names (if it names one)."""
        names = [f"address:{request.client.host if request.client else ''}"]
        key = client.hex() if isinstance(client, bytes) else client
        if key:
            names.append(f"key:{key}")
        return names

    @staticmethod
    def _grantee(request: Request, client: bytes | str) -> str:
        """Whom a route grant goes to, for the count of grants its nodes have not confirmed
        (``TrackerState.note_session``): the address it connects from with the key it names.

        Another's grants weigh little in a client's view and its own in full, so the name must
        be one nobody else can take: a key alone is anyone's to name, an address is not.
        """
        key = client.hex() if isinstance(client, bytes) else client
        return f"{request.client.host if request.client else ''} {key}"

    def _limit(self, request: Request, client: bytes | str) -> None:
        """Take one route grant from the requester's address and key; 429 when either has none left."""
        wait = self.route_limits.take(self._client_names(request, client), time.monotonic())
        if wait > 0:
            self.metrics.routes.labels("limited").inc()
            raise HTTPException(
                429,
                f"too many route requests from this client; try again in {wait:.1f} s",
                headers={"retry-after": str(max(1, round(wait)))},
            )

    def _challenge(self, record: NodeRecord, now: float) -> dict[str, int] | None:
        """A probe seed for this node if one is due (registration, interval, or lost answer)."""
        seeds = self.references.seeds((record.artifact, record.layers, record.recipe))
        if not seeds:
            return None
        if record.probe_passed is False:
            return None  # failed: it stays out of routes until it registers again
        pending = self.challenges.get(record.node_id)
        if pending is not None and now - pending[1] < PROBE_ANSWER_SECONDS:
            return None  # an answer is on its way
        due = (
            pending is not None  # lost: ask again
            or record.probe_passed is None
            or now - self.last_probed.get(record.node_id, 0.0) >= self.probe_interval
        )
        if not due:
            return None
        seed = self._rng.choice(seeds)
        self.challenges[record.node_id] = (seed, now)
        return {"seed": seed}

    async def expire_loop(self) -> None:
        """Drop nodes that stopped sending heartbeats (:meth:`expire`), every second."""
        while True:
            await trio.sleep(1.0)
            self.expire(time.time())

    def expire(self, now: float) -> list[bytes]:
        """Drop nodes silent too long, lapsed reservations, and everything kept of a node that is gone
        (its probe challenge, when it was last probed): a map strangers can grow shrinks with them."""
        gone = self.state.expire(now)
        self.placement.expire(now)
        for kept in (self.challenges, self.last_probed, self.joined):
            for node_id in [n for n in kept if n not in self.state.nodes]:
                del kept[node_id]
        # maps that held a flood now gone are rebuilt at their size (a dict never shrinks its table)
        self.challenges = compacted(self.challenges)
        self.last_probed = compacted(self.last_probed)
        self.joined = compacted(self.joined)
        compactions = self.state.compactions + self.signatures.compactions
        if compactions != self._given_back_at:
            self._given_back_at = compactions
            # Three quarters of the nodes, or of the keys that signed, went since their map was last
            # rebuilt (a replay cache shrinks as requests arrive, between two sweeps): glibc keeps
            # the pages their tables and records lay on until asked. 20,000 throwaway registrations
            # over HTTP, expired: RSS 1.23-1.25x what it was before them with the maps rebuilt
            # alone, 1.14-1.16x with the pages given back as well, on pymalloc (the tracker's
            # command runs on the C allocator: operations.memory).
            give_back()
        return gone

    async def _authenticated(self, request: Request, claimed: str) -> bytes:
        body = await request.body()
        try:
            node_id = self.signatures.check(
                dict(request.headers), request.method, request.url.path, body, int(time.time() * 1000)
            )
        except SignatureError as exc:
            self.metrics.auth_failures.inc()
            raise HTTPException(401, str(exc)) from None
        if node_id.hex() != claimed:
            raise HTTPException(403, "a node may only speak for its own node id")
        return node_id

    def _build(self) -> FastAPI:
        app = FastAPI(title="noderuntime tracker", version="1")
        app.add_middleware(BodyLimit, limit=MAX_BODY)
        app.exception_handler(RequestValidationError)(self._invalid)
        app.get("/status", include_in_schema=False)(self._status)
        app.get("/metrics", include_in_schema=False)(self._metrics)
        app.get("/v1/info")(self._info)
        app.post("/v1/nodes/register")(self._register)
        app.post("/v1/nodes/heartbeat")(self._heartbeat)
        app.post("/v1/nodes/leave")(self._leave)
        app.post("/v1/nodes/probe")(self._probe)
        app.post("/v1/placement")(self._place)
        app.post("/v1/placement/reconsider")(self._reconsider)
        app.get("/v1/nodes")(self._nodes)
        app.get("/v1/status")(self._swarm)
        app.get("/v1/status/nodes")(self._swarm_nodes)
        add_pages(app, "swarm.html", ("swarm.js", "dom.js", "pages.css"), guard=self._page_guard)
        app.get("/v1/artifacts")(self._artifacts)
        app.post("/v1/routes")(self._route)
        app.post("/v1/routes/repair")(self._repair)
        app.get("/v1/manifests")(self._manifests)
        app.get("/v1/manifests/{artifact}")(self._manifest)
        app.post("/v1/audits")(self._audit_grant)
        app.post("/v1/audits/report")(self._audit_report)
        return app

    async def _invalid(self, _request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer echoes the input, which fails on bytes that are not UTF-8:
        # say where and what only
        detail = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    async def _status(self) -> dict[str, Any]:
        return {"nodes": len(self.state.nodes), "routes_issued": self.routes_issued, "tasks": trio_tasks()}

    async def _metrics(self) -> Response:
        self.metrics.nodes.set(len(self.state.nodes))
        status, content_type, payload = exposition(self.metrics.registry)
        return Response(payload, status_code=status, media_type=content_type)

    async def _info(self) -> dict[str, Any]:
        return {
            "issuer_key": self.identity.node_id.hex(),
            # informative: what nodes and gateways honour is the same flag in each ticket, signed
            "local_swarm": self.local_swarm,
            "heartbeat_seconds": self.state.heartbeat_seconds,
            "expire_after_seconds": self.state.expires_after(self.state.heartbeat_seconds),
        }

    def private(self) -> bool:
        """Whether only members may join: some node is allow-listed, or a join secret is set."""
        return bool(self.allow_nodes) or self.join_secret is not None

    def _member(self, node_id: bytes, proof: str) -> bool:
        """Whether ``node_id`` may join: the swarm is open, the node is allow-listed, or ``proof`` shows the secret."""
        if not self.private() or node_id in self.allow_nodes:
            return True
        if self.join_secret is None:
            return False
        # in constant time: how long a refusal takes says nothing of the proof expected
        return hmac.compare_digest(proof.encode(), join_proof(self.join_secret, node_id).encode())

    async def _register(self, body: Registration, request: Request) -> dict[str, Any]:
        node_id = await self._authenticated(request, body.node_id)
        if not self._member(node_id, body.join_proof):
            self.metrics.auth_failures.inc()
            raise HTTPException(403, "this is a private swarm: the node is not allow-listed, nor shows its join secret")
        start, end = body.layers
        if not 0 <= start < end <= body.n_layer:
            raise HTTPException(400, f"layers {start}:{end} do not lie in 0:{body.n_layer}")
        proven = self._proven_shape(body)
        if not body.address and not body.relay:
            raise HTTPException(400, "a node needs an address, a relay, or both")
        if not self.local_swarm:
            try:
                check_endpoints(body.address, body.relay)
            except AddressError as exc:
                self.metrics.errors.labels("address").inc()
                raise HTTPException(400, f"{exc}; this tracker's swarm is not declared local") from None
        try:
            measured = check_capability(
                body.capability, node_id=node_id, artifact=body.artifact, layers=(start, end), recipe=body.recipe
            )
        except AdmissionError as exc:
            self.metrics.errors.labels("capability").inc()
            raise HTTPException(400, str(exc)) from None
        key = (body.artifact, (start, end), body.recipe)
        # node_id is the one the signature proved: _authenticated checked that the body claims it
        record = NodeRecord.of(
            body, measured=measured, probe_required=self.require_probe or bool(self.references.seeds(key))
        )
        now = time.time()
        if proven is not None:
            for wrong in self.state.learn_shape(body.artifact, proven, now):
                log.warning("node %s dropped: its layer count is not its artifact's %d", wrong.hex()[:12], proven)
        # a node that audits excluded stays out, however often it registers again
        record = attrs.evolve(record, audit_failed=self.audits.excluded(node_id))
        self.state.register(record, now)
        self.joined.setdefault(node_id, now)
        self.placement.registered(node_id)
        self.metrics.registrations.inc()
        self.challenges.pop(node_id, None)
        self.last_probed.pop(node_id, None)
        beat = self.state.nodes[node_id].beat_seconds
        answer: dict[str, Any] = {
            "heartbeat_seconds": beat,
            "expire_after_seconds": self.state.expires_after(beat),
        }
        challenge = self._challenge(self.state.nodes[node_id], now)
        if challenge is not None:
            answer["probe"] = challenge
        elif record.probe_required:
            log.warning("node %s: no probe references for its shard; kept out of routes", node_id.hex()[:12])
        return answer

    def _proven_shape(self, body: Registration) -> int | None:
        """The layer count ``body``'s shape proof newly proves of its artifact (None: the shape is known
        already, or nothing is sent); 409 when the claimed count is not the artifact's, 400 when the
        proof does not hold. An artifact's shape comes from its manifest or its fingerprint, never
        from a vote: with neither, the nodes that claim the most admitted count stand in."""
        known = self.state.shape_of(body.artifact)
        if known is None and body.shape is not None:
            try:
                proven = shapes.proven_layers(body.artifact, body.shape)
            except shapes.ShapeError as exc:
                self.metrics.errors.labels("shape").inc()
                raise HTTPException(400, f"the shape proof does not hold: {exc}") from None
            if proven != body.n_layer:
                raise HTTPException(409, f"artifact {body.artifact[:16]}… has {proven} layers, not {body.n_layer}")
            return proven
        if known is not None and known != body.n_layer:
            raise HTTPException(409, f"artifact {body.artifact[:16]}… has {known} layers, not {body.n_layer}")
        return None

    async def _heartbeat(self, body: Heartbeat, request: Request) -> dict[str, Any]:
        node_id = await self._authenticated(request, body.node_id)
        known = self.state.heartbeat(
            node_id,
            time.time(),
            active_sessions=body.active_sessions,
            free_slots=body.free_slots,
            queue_depth=body.queue_depth,
            step_ms=body.step_ms,
            round_trips={bytes.fromhex(peer): ms for peer, ms in body.round_trips.items()},
        )
        if not known:
            raise HTTPException(404, "unknown node: register again")
        self.metrics.heartbeats.inc()
        # the interval grows and shrinks with the swarm: each answer says the one to keep now
        answer: dict[str, Any] = {"ok": True, "heartbeat_seconds": self.state.nodes[node_id].beat_seconds}
        challenge = self._challenge(self.state.nodes[node_id], time.time())
        if challenge is not None:
            answer["probe"] = challenge
        return answer

    async def _leave(self, body: Leave, request: Request) -> dict[str, Any]:
        node_id = await self._authenticated(request, body.node_id)
        known = self.state.leave(node_id, time.time())
        if not body.moving:  # a moving node loads the range reserved for it next
            self.placement.forget(node_id)
        self.challenges.pop(node_id, None)
        self.last_probed.pop(node_id, None)
        self.joined.pop(node_id, None)
        log.info("node %s left%s", node_id.hex()[:12], "" if known else " (it was not registered)")
        return {"ok": True, "was_registered": known}

    async def _reconsider(self, body: RebalanceRequest, request: Request) -> JSONResponse:
        """Whether a serving node should move, and where: see :meth:`Placement.reconsider`."""
        node_id = await self._authenticated(request, body.node_id)
        if node_id not in self.state.nodes:
            raise HTTPException(404, "unknown node: register first")
        now = time.time()
        move = self.placement.reconsider(node_id, body.max_layers, now)
        held = self.placement.held_down(node_id, now)
        if move is None:
            return JSONResponse(RebalanceReply(hold_seconds=held).model_dump(mode="json"))
        log.info(
            "node %s moves from layers %d:%d to %d:%d: the least capacity grows from %.1f to %.1f tokens/s",
            node_id.hex()[:12],
            *self.state.nodes[node_id].layers,
            *move.layers,
            move.least_before,
            move.least_after,
        )
        reply = RebalanceReply(
            layers=move.layers,
            least_before=move.least_before,
            least_after=move.least_after,
            hold_seconds=held,
            reserved_seconds=self.placement.reservation_seconds,
        )
        return JSONResponse(reply.model_dump(mode="json"))

    async def _place(self, body: PlacementRequest, request: Request) -> JSONResponse:
        """The range a node without one should load: see :mod:`noderuntime.tracker.placement`."""
        node_id = await self._authenticated(request, body.node_id)
        if node_id not in self.state.nodes and not self._member(node_id, body.join_proof):
            # a private swarm places only its members: listed, registered, or showing the secret
            raise HTTPException(403, "this is a private swarm: the node is not allow-listed, nor shows its join secret")
        self._limit(request, node_id)  # each key may hold one reservation; an address may not make keys fast
        try:
            given = self.placement.assign(
                node_id, body.artifact, body.n_layer, body.max_layers, time.time(), tokens_per_s=body.tokens_per_s
            )
        except PlacementError as exc:
            raise HTTPException(409, str(exc)) from None
        log.info(
            "node %s (%d layers at most) placed on layers %d:%d, around layer %d (%.1f tokens/s before it)",
            node_id.hex()[:12],
            body.max_layers,
            *given.layers,
            given.weakest,
            given.weakest_capacity,
        )
        reply = PlacementReply(
            layers=given.layers,
            n_layer=body.n_layer,
            weakest=given.weakest,
            weakest_capacity=given.weakest_capacity,
            reserved_seconds=self.placement.reservation_seconds,
        )
        return JSONResponse(reply.model_dump(mode="json"))

    async def _probe(self, body: ProbeReply, request: Request) -> dict[str, Any]:
        node_id = await self._authenticated(request, body.node_id)
        record = self.state.nodes.get(node_id)
        pending = self.challenges.get(node_id)
        if record is None:
            raise HTTPException(404, "unknown node: register again")
        if pending is None or pending[0] != body.seed:
            raise HTTPException(409, "no probe with this seed is outstanding for this node")
        reference = self.references.get((record.artifact, record.layers, record.recipe), body.seed)
        assert reference is not None  # only seeds with references are issued
        try:
            answer = ProbeAnswer.from_json(body.model_dump())
        except AdmissionError as exc:
            raise HTTPException(400, str(exc)) from None
        verdict = compare(reference, answer, self.probe_tolerance)
        del self.challenges[node_id]
        now = time.time()
        self.last_probed[node_id] = now
        self.state.update(node_id, probe_passed=verdict.passed, probe_detail=verdict.describe())
        self.metrics.probes.labels("passed" if verdict.passed else "failed").inc()
        if not verdict.passed:
            log.error(
                "node %s failed its known-answer probe for layers %s: %s; kept out of routes",
                node_id.hex()[:12],
                record.layers,
                verdict.describe(),
            )
        return {"passed": verdict.passed, "exact": verdict.exact, "detail": verdict.describe()}

    def _may_read_status(self, request: Request) -> bool:
        """Whether ``request`` may read the swarm's status: there is no status key, or it shows it."""
        if self.status_key is None:
            return True
        given = request.query_params.get("key", "")
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            given = token.strip()
        # in constant time: how long a refusal takes says nothing of the key
        return hmac.compare_digest(given.encode(), self.status_key.encode())

    def _check_status_key(self, request: Request) -> None:
        if not self._may_read_status(request):
            raise HTTPException(
                401,
                "this tracker's status needs its status key (Authorization: Bearer KEY, or ?key=KEY)",
                headers={"www-authenticate": "Bearer"},
            )

    async def _page_guard(self, request: Request) -> Response | None:
        # a page that asks for the key, rather than a JSON refusal a browser shows as code
        return None if self._may_read_status(request) else file_response("locked.html", 401)

    async def _swarm(self, request: Request) -> JSONResponse:
        """The swarm at a glance, for the map (see :mod:`noderuntime.tracker.swarm`)."""
        self._check_status_key(request)
        now = time.time()
        if self._swarm_cache is None or now - self._swarm_cache[0] >= SWARM_CACHE_SECONDS:
            status = swarm.swarm_status(self.state, now, routes_issued=self.routes_issued)
            self._swarm_cache = (now, status.model_dump(mode="json"))
        return JSONResponse(self._swarm_cache[1])

    async def _swarm_nodes(self, query: Annotated[NodeQuery, Query()], request: Request) -> JSONResponse:
        """One page of the nodes ``query`` selects, for the map's node list."""
        self._check_status_key(request)
        page = swarm.node_page(self.state, query, time.time())
        return JSONResponse(page.model_dump(mode="json"))

    async def _nodes(self, request: Request) -> dict[str, Any]:
        self._check_status_key(request)
        now = time.time()
        return {
            "nodes": [
                {
                    **r.public(now, self.state.step_budget_ms),
                    "audits": attrs.asdict(self.audits.standing_of(r.node_id)),
                }
                for r in sorted(self.state.nodes.values(), key=lambda r: r.layers)
            ],
            # the recipe pairs routes may mix, by the certificates this tracker was given
            "mixes": [{"artifact": p.artifact, "recipes": sorted(p.recipes)} for p in self.mixes],
        }

    async def _artifacts(self) -> dict[str, Any]:
        return {"artifacts": self.state.artifacts()}

    async def _manifests(self) -> dict[str, Any]:
        return {"manifests": [m.summary() for m in self.manifests.values()]}

    async def _manifest(self, artifact: str) -> Response:
        found = self.manifests.get(artifact)
        if found is None:
            raise HTTPException(404, "this tracker serves no manifest of that artifact")
        return Response(found.dumps(), media_type="application/json")

    async def _route(self, body: RouteRequest, request: Request) -> JSONResponse:
        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise HTTPException(401, "a valid tracker key is required to request routes")
        self._limit(request, body.client)
        names, now = self._client_names(request, body.client), time.time()
        if any(self.outstanding.held(name, now) >= self.outstanding.limit for name in names):
            self.metrics.routes.labels("limited").inc()
            raise HTTPException(
                429,
                f"this client holds {self.outstanding.limit} route grants whose tickets have not expired; "
                "try again when some have",
                headers={"retry-after": str(round(self.outstanding.granularity))},
            )
        try:
            exclude = [bytes.fromhex(x) for x in body.exclude]
            near = [bytes.fromhex(x) for x in body.prefer]
        except ValueError:
            raise HTTPException(400, "exclude and prefer hold hex node ids") from None
        grantee = self._grantee(request, body.client)
        try:
            choice = self.state.choose(body.artifact, body.tokens, exclude=exclude, near=near, client=grantee)
        except NoRoute as exc:
            self.metrics.routes.labels("full" if exc.full else "none").inc()
            return JSONResponse({"error": str(exc), "full": exc.full}, status_code=429 if exc.full else 503)
        recipes = [bytes.fromhex(n.recipe) for n in choice.nodes]
        mixed = len(set(recipes)) > 1  # only then does the plan name each hop's recipe
        hops = [
            Hop(n.node_id, Span(*n.layers), n.address, n.relay, n.tls_cert_sha256, recipe if mixed else b"")
            for n, recipe in zip(choice.nodes, recipes, strict=True)
        ]
        session_id = os.urandom(16)
        ttl = min(body.ttl_seconds, MAX_TICKET_SECONDS)
        ticket = tickets.issue(
            self.identity,
            session_id=session_id,
            epoch=0,
            artifact=bytes.fromhex(body.artifact),
            hops=hops,
            client=bytes.fromhex(body.client),
            ttl_seconds=ttl,
            local=self.local_swarm,
        )
        self.outstanding.take(names, now, now + ttl)
        self.state.note_session((n.node_id for n in choice.nodes), grantee)
        self.routes_issued += 1
        self.metrics.routes.labels("issued").inc()
        reply = RouteReply(
            session_id=session_id.hex(),
            epoch=0,
            ticket=ticket.hex(),
            recipe=route_recipe(recipes).hex(),
            cost_ms=round(choice.cost_ms, 3),
            ctx_per_session=min(n.ctx_per_session for n in choice.nodes),
            hops=[RouteHop.of(hop) for hop in hops],
        )
        return JSONResponse(reply.model_dump(mode="json"))

    async def _audit_grant(self, body: AuditRequest, request: Request) -> JSONResponse:
        """An audit route for a session: for each of its hops another admitted node with the same
        layers, recipe and kernel class, and a ticket for the audit session, for the session's client alone.

        503 when some hop has none: that session cannot be audited now.
        """
        requester = await self._authenticated(request, request.headers.get("x-node-id", ""))
        try:
            ticket = tickets.decode(bytes.fromhex(body.ticket), [self.identity.node_id])
        except tickets.TicketError as exc:
            raise HTTPException(403, f"not a ticket of this tracker's: {exc}") from None
        if not ticket.client or requester != ticket.client:
            raise HTTPException(403, "only a session's client may have it audited")
        self._limit(request, requester)
        # the tracker alone picks auditors: a client that could name or exclude them could steer
        # an audit to nodes of its own; only the audited nodes and a first audit's auditors are left out
        audited_nodes = {node for node, _, _ in ticket.hops}
        if body.referee and self.audits.open_of(requester, ticket.session_id) < 2:
            # a referee's time is the swarm's scarcest: only for two audits that agreed, as their report will show
            raise HTTPException(409, "a referee re-executes a session only after two audits of it")
        # a referee may have audited the session already: what counts is that the operator trusts it
        exclude = audited_nodes | (set() if body.referee else self.audits.auditors_of(requester, ticket.session_id))
        artifact = ticket.artifact.hex()
        now = time.time()
        grantee = self._grantee(request, requester)
        auditors: list[NodeRecord] = []
        refereed: list[bool] = []
        for node, start, end in ticket.hops:
            audited = self.state.nodes.get(node)
            # the audited node's recipe and kernel class as it registered them; gone, the route's
            like = [
                n
                for n in self.state.nodes.values()
                if n.artifact == artifact
                and n.layers == (start, end)
                and n.admitted
                and self.state.seen(n, grantee).free_slots > 0
                and n.node_id not in exclude
                and n.node_id not in {a.node_id for a in auditors}
                and (audited is None or (n.recipe, n.kernel_class) == (audited.recipe, audited.kernel_class))
            ]
            referees = [n for n in like if n.node_id in self.referees] if body.referee else []
            if not like:
                self.metrics.routes.labels("audit_none").inc()
                message = f"no other node of layers {start}:{end}, its recipe and kernel class can audit it now"
                return JSONResponse({"error": message, "full": False}, status_code=503)
            if referees:
                auditors.append(self._rng.choice(referees))
            else:
                prefixes = [network_prefix(audited.address)] if audited is not None else []
                weights = [auditor_weight(now - self.joined.get(n.node_id, now), n.address, prefixes) for n in like]
                auditors.append(self._rng.choices(like, weights)[0])
            refereed.append(bool(referees))
        if body.referee and not any(refereed):
            self.metrics.routes.labels("audit_none").inc()
            message = "no referee this tracker names can re-execute any hop of that session now"
            return JSONResponse({"error": message, "full": False}, status_code=503)
        session = os.urandom(16)
        hops = [Hop(n.node_id, Span(*n.layers), n.address, n.relay, n.tls_cert_sha256) for n in auditors]
        issued = tickets.issue(
            self.identity,
            session_id=session,
            epoch=0,
            artifact=ticket.artifact,
            hops=hops,
            client=requester,
            ttl_seconds=min(body.ttl_seconds, MAX_TICKET_SECONDS),
            local=self.local_swarm,
        )
        try:
            self.audits.grant(
                session,
                AuditGrant(
                    client=requester,
                    audited_session=ticket.session_id,
                    audited_epoch=ticket.epoch,
                    audited=ticket.hops,
                    auditors=tuple((n.node_id, *n.layers) for n in auditors),
                    expires=now + min(body.ttl_seconds, AUDIT_GRANT_SECONDS),
                    refereed=tuple(refereed) if body.referee else (),
                ),
                now,
            )
        except AuditError as exc:
            return JSONResponse({"error": str(exc), "full": True}, status_code=429)
        self.state.note_session((n.node_id for n in auditors), grantee)
        self.metrics.routes.labels("audit").inc()
        reply = RouteReply(
            session_id=session.hex(),
            epoch=0,
            ticket=issued.hex(),
            recipe=route_recipe([bytes.fromhex(n.recipe) for n in auditors]).hex(),
            ctx_per_session=min(n.ctx_per_session for n in auditors),
            hops=[RouteHop.of(h) for h in hops],
        )
        return JSONResponse(reply.model_dump(mode="json"))

    async def _audit_report(self, body: AuditReport, request: Request) -> dict[str, Any]:
        """Judge an audit's evidence (:meth:`AuditBook.judge`); exclude a node two auditors and a referee
        agreed against (two auditors alone: the verdict accuses it, for the reporter to avoid)."""
        requester = await self._authenticated(request, request.headers.get("x-node-id", ""))
        try:
            verdict = self.audits.judge(
                requester,
                [r.record() for r in body.audited],
                {bytes.fromhex(session): [r.record() for r in records] for session, records in body.audits.items()},
                time.time(),
            )
        except AuditError as exc:
            raise HTTPException(400, f"the audit's evidence does not hold: {exc}") from None
        for node, why in verdict.failed:
            self.state.update(node, audit_failed=why)
            log.error("node %s excluded by audit: %s", node.hex()[:12], why)
        for node, why in verdict.accused:
            log.warning("node %s accused by two auditors, no referee confirmed it: %s", node.hex()[:12], why)
        outcome = "failed" if verdict.failed else "suspected" if verdict.suspected or verdict.accused else "passed"
        self.metrics.audits.labels(outcome).inc()
        return AuditVerdict(
            passed=[n.hex() for n in verdict.passed],
            suspected=[n.hex() for n in verdict.suspected],
            failed=[AuditFailure(node_id=n.hex(), why=why) for n, why in verdict.failed],
            outvoted=[n.hex() for n in verdict.outvoted],
            unjudged=[n.hex() for n in verdict.unjudged],
            accused=[AuditFailure(node_id=n.hex(), why=why) for n, why in verdict.accused],
        ).model_dump(mode="json")

    async def _repair(self, body: RepairRequest, request: Request) -> JSONResponse:
        """The rest of a session's route after its first ``keep`` hops, and its ticket for the next epoch.

        Only a party of the session may ask, proven by its signature: the ticket's client for
        a whole new route, the hop before the lost range for the rest of one. A route that
        keeps hops runs the session's recipe (the kept hops' KV must meet bit-identical
        activations); a whole new one prefers it and says when it could not (``exact``).
        """
        requester = await self._authenticated(request, request.headers.get("x-node-id", ""))
        try:
            ticket = tickets.decode(bytes.fromhex(body.ticket), [self.identity.node_id])
        except tickets.TicketError as exc:
            raise HTTPException(403, f"not a ticket of this tracker's: {exc}") from None
        if ticket.expires_unix_ms <= time.time() * 1000:
            raise HTTPException(403, "the session's ticket has expired")
        if body.keep >= len(ticket.hops):
            raise HTTPException(400, f"keep must leave hops to replace: the route has {len(ticket.hops)}")
        if requester != ticket.dialer_of(body.keep):
            raise HTTPException(403, "only the session's client, or the hop before the lost range, may repair it")
        self._limit(request, requester)
        try:
            exclude = [bytes.fromhex(x) for x in body.exclude]
        except ValueError:
            raise HTTPException(400, "exclude holds hex node ids") from None
        kept = [Hop(node, Span(a, b)) for node, a, b in ticket.hops[: body.keep]]
        start = kept[-1].layers.end if kept else 0
        artifact = ticket.artifact.hex()
        grantee = self._grantee(request, requester)
        try:
            if kept:
                choice = self.state.choose(
                    artifact,
                    body.tokens,
                    exclude=[*exclude, *(h.node_id for h in kept)],
                    start=start,
                    recipe=body.recipe,
                    client=grantee,
                )
            else:
                choice = self.state.choose(artifact, body.tokens, exclude=exclude, prefer=body.recipe, client=grantee)
        except NoRoute as exc:
            self.metrics.routes.labels("repair_none").inc()
            return JSONResponse({"error": str(exc), "full": exc.full}, status_code=429 if exc.full else 503)
        recipes = [body.recipe] * len(kept) + [n.recipe for n in choice.nodes]
        mixed = len(set(recipes)) > 1
        # the kept hops as the registry knows them, for their neighbours to dial (one that has
        # left it keeps no address: the hops before it reach it by the seams they hold)
        known = [self.state.nodes.get(hop.node_id) for hop in kept]
        hops = [
            *(
                Hop(hop.node_id, hop.layers, r.address, r.relay, r.tls_cert_sha256) if r is not None else hop
                for hop, r in zip(kept, known, strict=True)
            ),
            *(Hop(n.node_id, Span(*n.layers), n.address, n.relay, n.tls_cert_sha256) for n in choice.nodes),
        ]
        if mixed:
            hops = [attrs.evolve(h, recipe_fingerprint=bytes.fromhex(r)) for h, r in zip(hops, recipes, strict=True)]
        epoch = ticket.epoch + 1
        issued = tickets.issue(
            self.identity,
            session_id=ticket.session_id,
            epoch=epoch,
            artifact=ticket.artifact,
            hops=hops,
            client=ticket.client,
            ttl_seconds=min(body.ttl_seconds, MAX_TICKET_SECONDS),
            local=self.local_swarm,
        )
        self.state.note_session((n.node_id for n in choice.nodes), grantee)
        self.metrics.routes.labels("repaired").inc()
        route = route_recipe([bytes.fromhex(r) for r in recipes])
        reply = RouteReply(
            session_id=ticket.session_id.hex(),
            epoch=epoch,
            ticket=issued.hex(),
            recipe=route.hex(),
            cost_ms=round(choice.cost_ms, 3),
            ctx_per_session=min(n.ctx_per_session for n in choice.nodes),
            hops=[RouteHop.of(hop) for hop in hops],
            exact=set(recipes) == {body.recipe},
        )
        return JSONResponse(reply.model_dump(mode="json"))
