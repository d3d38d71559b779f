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
- ``POST /v1/routes``, ``/v1/routes/repair``, ``/v1/audits`` and ``/v1/audits/report``: the
  grants of routes, repairs and audits, and an audit's verdict (:mod:`noderuntime.tracker.grants`).
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
import random
import time
from collections.abc import Iterable
from typing import Annotated, Any

import attrs
import trio
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from noderuntime.access.addresses import AddressError, check_endpoints
from noderuntime.access.identity import Identity
from noderuntime.access.signing import SignatureChecker, SignatureError, join_proof
from noderuntime.control.admission import AdmissionError, ProbeAnswer, ProbeReferences, check_capability, compare
from noderuntime.models.manifest import Manifest
from noderuntime.operations.httpserve import BodyLimit
from noderuntime.operations.memory import compacted, give_back
from noderuntime.operations.telemetry import TrackerMetrics, exposition, trio_tasks
from noderuntime.tracker import shapes, swarm
from noderuntime.tracker.grants import ROUTE_BURST, ROUTE_CONCURRENCY, ROUTE_RATE, Grants
from noderuntime.tracker.messages import (
    Heartbeat,
    Leave,
    NodeQuery,
    PlacementReply,
    PlacementRequest,
    ProbeReply,
    RebalanceReply,
    RebalanceRequest,
    Registration,
)
from noderuntime.tracker.placement import HOLD_DOWN_SECONDS, Placement, PlacementError
from noderuntime.tracker.records import HEARTBEAT_SECONDS, NodeRecord
from noderuntime.tracker.registry import STEP_BUDGET_MS, TrackerState
from noderuntime.verify.certificates import CoveredPair
from noderuntime.web import add_pages, file_response

MAX_BODY = 64 << 10
PROBE_ANSWER_SECONDS = 60.0  # a challenge unanswered this long is sent again
# the swarm's status is computed at most this often, however many pages poll it
SWARM_CACHE_SECONDS = 1.0

log = logging.getLogger(__name__)


class Tracker:
    """The tracker service: state, issuer key, request checks."""

    def __init__(
        self,
        identity: Identity,
        *,
        expire_after: float = 10.0,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
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
            heartbeat_seconds=heartbeat_seconds,
            step_budget_ms=step_budget_ms,
            mixes=by_artifact,
            shapes={m.artifact: m.n_layer for m in self.manifests.values()},
        )
        self.placement = Placement(self.state, hold_down_seconds=move_hold_down)
        self.signatures = SignatureChecker()
        self._given_back_at = 0  # the maps' compactions when memory was last given back (expire)
        self.references = references or ProbeReferences()
        self.require_probe = require_probe
        self.probe_interval = probe_interval
        self.probe_tolerance = probe_tolerance
        self.metrics = TrackerMetrics()
        # node id -> (seed, when issued) of the challenge it has yet to answer; when last probed
        self.challenges: dict[bytes, tuple[int, float]] = {}
        self.last_probed: dict[bytes, float] = {}
        self._rng = random.SystemRandom()
        self.joined: dict[bytes, float] = {}  # node id -> when it first registered, while it stays
        self.grants = Grants(
            identity,
            self.state,
            self.metrics,
            authenticate=self._authenticated,
            joined_at=lambda node_id, default: self.joined.get(node_id, default),
            api_key=api_key,
            local_swarm=local_swarm,
            route_rate=route_rate,
            route_burst=route_burst,
            route_concurrency=route_concurrency,
            referees=referees,
        )
        self.app = self._build()

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
        app.get("/v1/manifests")(self._manifests)
        app.get("/v1/manifests/{artifact}")(self._manifest)
        self.grants.add_to(app)
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
        return {"nodes": len(self.state.nodes), "routes_issued": self.grants.issued, "tasks": trio_tasks()}

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
        record = attrs.evolve(record, audit_failed=self.grants.audits.excluded(node_id))
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
        self.grants.limit(request, node_id)  # each key may hold one reservation; an address may not make keys fast
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
            status = swarm.swarm_status(self.state, now, routes_issued=self.grants.issued)
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
                    "audits": attrs.asdict(self.grants.audits.standing_of(r.node_id)),
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
