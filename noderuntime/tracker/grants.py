"""Route grants: the tracker's answers that hand out tickets, and an audit's verdict.

- ``POST /v1/routes``: a route for a session and its signed ticket (optionally behind a
  bearer key): 503 when no route exists, 429 when every route is full.
- ``POST /v1/routes/repair``: the rest of a session's route after the hops it keeps, and its
  ticket for the next epoch, for a party of the session alone.
- ``POST /v1/audits``: an audit route for a session (the tracker alone picks the auditors),
  for the session's client alone; ``POST /v1/audits/report``: the audit's evidence judged
  (:class:`~noderuntime.tracker.audits.AuditBook`).

Every grant is counted against the requester's address and the key it names, at a rate and
at once (:mod:`noderuntime.tracker.limits`): a ticket is held until it expires, since the
tracker does not see a session end.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import attrs
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from noderuntime.access import tickets
from noderuntime.access.identity import Identity
from noderuntime.operations.telemetry import TrackerMetrics
from noderuntime.tracker.audits import AUDIT_GRANT_SECONDS, AuditBook, AuditError, auditor_weight, network_prefix
from noderuntime.tracker.audits import Grant as AuditGrant
from noderuntime.tracker.limits import Outstanding, RateLimits
from noderuntime.tracker.messages import (
    AuditFailure,
    AuditReport,
    AuditRequest,
    AuditVerdict,
    RepairRequest,
    RouteHop,
    RouteReply,
    RouteRequest,
)
from noderuntime.tracker.records import NodeRecord
from noderuntime.tracker.registry import TrackerState
from noderuntime.tracker.routechoice import NoRoute
from protocol import Hop, Span, route_recipe

# a ticket lives as long as its request asks, up to this: minutes, for a session and its repairs
MAX_TICKET_SECONDS = 1800.0
# route grants one client (an address, a key) may take: at once, and a second in the long run
ROUTE_BURST = 200
ROUTE_RATE = 50.0
# route grants one client (an address, a key) may hold at once: their tickets not yet expired
ROUTE_CONCURRENCY = 4096

log = logging.getLogger(__name__)


class Grants:
    """The tracker's route, repair and audit grants; see the module docstring."""

    def __init__(
        self,
        identity: Identity,
        state: TrackerState,
        metrics: TrackerMetrics,
        *,
        authenticate: Callable[[Request, str], Awaitable[bytes]],
        joined_at: Callable[[bytes, float], float],
        api_key: str | None = None,
        local_swarm: bool = False,
        route_rate: float = ROUTE_RATE,
        route_burst: int = ROUTE_BURST,
        route_concurrency: int = ROUTE_CONCURRENCY,
        referees: Iterable[bytes] = (),
    ) -> None:
        """``authenticate``: the node id a signed request speaks for (it must be the one it claims);
        ``joined_at``: when a node first registered (a default when it did not); the rest as
        :class:`~noderuntime.tracker.app.Tracker` takes them."""
        self.identity = identity
        self.state = state
        self.metrics = metrics
        self.authenticate = authenticate
        self.joined_at = joined_at
        self.api_key = api_key
        self.local_swarm = local_swarm
        self.referees = frozenset(referees)
        self.limits = RateLimits(rate=route_rate, burst=route_burst)
        self.outstanding = Outstanding(limit=route_concurrency)
        self.audits = AuditBook()
        self.issued = 0  # routes granted
        self._rng = random.SystemRandom()

    def add_to(self, app: FastAPI) -> None:
        """Serve the grants' endpoints on ``app``."""
        app.post("/v1/routes")(self.route)
        app.post("/v1/routes/repair")(self.repair)
        app.post("/v1/audits")(self.audit_grant)
        app.post("/v1/audits/report")(self.audit_report)

    @staticmethod
    def client_names(request: Request, client: bytes | str) -> list[str]:
        """What a requester is known by: its address, and the key it names (if it names one)."""
        names = [f"address:{request.client.host if request.client else ''}"]
        key = client.hex() if isinstance(client, bytes) else client
        if key:
            names.append(f"key:{key}")
        return names

    @staticmethod
    def grantee(request: Request, client: bytes | str) -> str:
        """Whom a route grant goes to, for the count of grants its nodes have not confirmed
        (``TrackerState.note_session``): the address it connects from with the key it names.

        Another's grants weigh little in a client's view and its own in full, so the name must
        be one nobody else can take: a key alone is anyone's to name, an address is not.
        """
        key = client.hex() if isinstance(client, bytes) else client
        return f"{request.client.host if request.client else ''} {key}"

    def limit(self, request: Request, client: bytes | str) -> None:
        """Take one grant from the requester's address and key; 429 when either has none left."""
        wait = self.limits.take(self.client_names(request, client), time.monotonic())
        if wait > 0:
            self.metrics.routes.labels("limited").inc()
            raise HTTPException(
                429,
                f"too many route requests from this client; try again in {wait:.1f} s",
                headers={"retry-after": str(max(1, round(wait)))},
            )

    async def route(self, body: RouteRequest, request: Request) -> JSONResponse:
        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise HTTPException(401, "a valid tracker key is required to request routes")
        self.limit(request, body.client)
        names, now = self.client_names(request, body.client), time.time()
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
        grantee = self.grantee(request, body.client)
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
        self.issued += 1
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

    async def audit_grant(self, body: AuditRequest, request: Request) -> JSONResponse:
        """An audit route for a session: for each of its hops another admitted node with the same
        layers, recipe and kernel class, and a ticket for the audit session, for the session's client alone.

        503 when some hop has none: that session cannot be audited now.
        """
        requester = await self.authenticate(request, request.headers.get("x-node-id", ""))
        try:
            ticket = tickets.decode(bytes.fromhex(body.ticket), [self.identity.node_id])
        except tickets.TicketError as exc:
            raise HTTPException(403, f"not a ticket of this tracker's: {exc}") from None
        if not ticket.client or requester != ticket.client:
            raise HTTPException(403, "only a session's client may have it audited")
        self.limit(request, requester)
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
        grantee = self.grantee(request, requester)
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
                weights = [auditor_weight(now - self.joined_at(n.node_id, now), n.address, prefixes) for n in like]
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

    async def audit_report(self, body: AuditReport, request: Request) -> dict[str, Any]:
        """Judge an audit's evidence (:meth:`AuditBook.judge`); exclude a node two auditors and a referee
        agreed against (two auditors alone: the verdict accuses it, for the reporter to avoid)."""
        requester = await self.authenticate(request, request.headers.get("x-node-id", ""))
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

    async def repair(self, body: RepairRequest, request: Request) -> JSONResponse:
        """The rest of a session's route after its first ``keep`` hops, and its ticket for the next epoch.

        Only a party of the session may ask, proven by its signature: the ticket's client for
        a whole new route, the hop before the lost range for the rest of one. A route that
        keeps hops runs the session's recipe (the kept hops' KV must meet bit-identical
        activations); a whole new one prefers it and says when it could not (``exact``).
        """
        requester = await self.authenticate(request, request.headers.get("x-node-id", ""))
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
        self.limit(request, requester)
        try:
            exclude = [bytes.fromhex(x) for x in body.exclude]
        except ValueError:
            raise HTTPException(400, "exclude holds hex node ids") from None
        kept = [Hop(node, Span(a, b)) for node, a, b in ticket.hops[: body.keep]]
        start = kept[-1].layers.end if kept else 0
        artifact = ticket.artifact.hex()
        grantee = self.grantee(request, requester)
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
