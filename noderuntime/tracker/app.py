"""The tracker's HTTP/JSON API (FastAPI on hypercorn's trio worker).

- ``GET  /v1/info``: the tracker's ticket-issuer public key.
- ``POST /v1/nodes/register`` and ``POST /v1/nodes/heartbeat``: signed by the node's key
  (see :mod:`noderuntime.signing`); a node cannot register under another node's id.
- ``GET  /v1/nodes``, ``GET /v1/artifacts``: what the tracker knows.
- ``POST /v1/routes``: a route for a session and its signed ticket (optionally behind a
  bearer key): 503 when no route exists, 429 when every route is full.
"""

from __future__ import annotations

import os
import time
from typing import Any

import trio
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from noderuntime import tickets
from noderuntime.identity import Identity
from noderuntime.signing import SignatureChecker, SignatureError
from noderuntime.tracker.state import NodeRecord, NoRoute, TrackerState
from protocol import Hop, Span

HEARTBEAT_SECONDS = 2.0
MAX_BODY = 64 << 10
HEX32 = r"^[0-9a-f]{64}$"


class Registration(BaseModel):
    """A node's description of itself."""

    node_id: str = Field(pattern=HEX32)
    artifact: str = Field(pattern=HEX32)
    model_name: str = Field(default="", max_length=200)
    n_layer: int = Field(gt=0, le=4096)
    layers: tuple[int, int]
    recipe: str = Field(pattern=r"^[0-9a-f]{16}$")
    address: str = Field(default="", max_length=300)
    relay: str = Field(default="", max_length=300)
    tls_cert_sha256: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    slots: int = Field(gt=0, le=4096)
    ctx_per_session: int = Field(gt=0, le=1 << 22)
    capability: dict[str, Any] = Field(default_factory=dict)


class Heartbeat(BaseModel):
    """A node's load now."""

    node_id: str = Field(pattern=HEX32)
    active_sessions: int = Field(ge=0)
    free_slots: int = Field(ge=0)
    queue_depth: int = Field(ge=0)
    step_ms: float = Field(ge=0, le=1e6)


class RouteRequest(BaseModel):
    """What a gateway asks for."""

    artifact: str = Field(pattern=HEX32)
    tokens: int = Field(gt=0, le=1 << 22)
    exclude: list[str] = Field(default_factory=list, max_length=256)
    ttl_seconds: float = Field(default=600.0, gt=0, le=86400)


class Tracker:
    """The tracker service: state, issuer key, request checks."""

    def __init__(self, identity: Identity, *, expire_after: float = 10.0, api_key: str | None = None) -> None:
        self.identity = identity
        self.state = TrackerState(expire_after=expire_after)
        self.signatures = SignatureChecker()
        self.api_key = api_key
        self.app = self._build()
        self.routes_issued = 0

    async def expire_loop(self) -> None:
        """Drop nodes that stopped sending heartbeats."""
        while True:
            await trio.sleep(1.0)
            self.state.expire(time.time())

    async def _authenticated(self, request: Request, claimed: str) -> bytes:
        body = await request.body()
        try:
            node_id = self.signatures.check(
                dict(request.headers), request.method, request.url.path, body, int(time.time() * 1000)
            )
        except SignatureError as exc:
            raise HTTPException(401, str(exc)) from None
        if node_id.hex() != claimed:
            raise HTTPException(403, "a node may only speak for its own node id")
        return node_id

    def _build(self) -> FastAPI:
        app = FastAPI(title="noderuntime tracker", version="1")

        @app.get("/v1/info")
        async def info() -> dict[str, Any]:
            return {
                "issuer_key": self.identity.node_id.hex(),
                "heartbeat_seconds": HEARTBEAT_SECONDS,
                "expire_after_seconds": self.state.expire_after,
            }

        @app.post("/v1/nodes/register")
        async def register(body: Registration, request: Request) -> dict[str, Any]:
            node_id = await self._authenticated(request, body.node_id)
            start, end = body.layers
            if not 0 <= start < end <= body.n_layer:
                raise HTTPException(400, f"layers {start}:{end} do not lie in 0:{body.n_layer}")
            if not body.address and not body.relay:
                raise HTTPException(400, "a node needs an address, a relay, or both")
            self.state.register(
                NodeRecord(
                    node_id=node_id,
                    artifact=body.artifact,
                    n_layer=body.n_layer,
                    layers=(start, end),
                    recipe=body.recipe,
                    address=body.address,
                    relay=body.relay,
                    tls_cert_sha256=bytes.fromhex(body.tls_cert_sha256),
                    slots=body.slots,
                    ctx_per_session=body.ctx_per_session,
                    model_name=body.model_name,
                    capability=body.capability,
                ),
                time.time(),
            )
            return {"heartbeat_seconds": HEARTBEAT_SECONDS, "expire_after_seconds": self.state.expire_after}

        @app.post("/v1/nodes/heartbeat")
        async def heartbeat(body: Heartbeat, request: Request) -> dict[str, Any]:
            node_id = await self._authenticated(request, body.node_id)
            known = self.state.heartbeat(
                node_id,
                time.time(),
                active_sessions=body.active_sessions,
                free_slots=body.free_slots,
                queue_depth=body.queue_depth,
                step_ms=body.step_ms,
            )
            if not known:
                raise HTTPException(404, "unknown node: register again")
            return {"ok": True}

        @app.get("/v1/nodes")
        async def nodes() -> dict[str, Any]:
            now = time.time()
            return {"nodes": [_public(r, now) for r in sorted(self.state.nodes.values(), key=lambda r: r.layers)]}

        @app.get("/v1/artifacts")
        async def artifacts() -> dict[str, Any]:
            return {"artifacts": self.state.artifacts()}

        @app.post("/v1/routes")
        async def route(body: RouteRequest, request: Request) -> JSONResponse:
            if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
                raise HTTPException(401, "a valid tracker key is required to request routes")
            try:
                exclude = [bytes.fromhex(x) for x in body.exclude]
            except ValueError:
                raise HTTPException(400, "exclude holds hex node ids") from None
            try:
                choice = self.state.choose(body.artifact, body.tokens, exclude=exclude)
            except NoRoute as exc:
                return JSONResponse({"error": str(exc), "full": exc.full}, status_code=429 if exc.full else 503)
            hops = [Hop(n.node_id, Span(*n.layers), n.address, n.relay, n.tls_cert_sha256) for n in choice.nodes]
            session_id = os.urandom(16)
            ticket = tickets.issue(
                self.identity,
                session_id=session_id,
                epoch=0,
                artifact=bytes.fromhex(body.artifact),
                hops=hops,
                ttl_seconds=body.ttl_seconds,
            )
            self.state.note_session(n.node_id for n in choice.nodes)
            self.routes_issued += 1
            return JSONResponse(
                {
                    "session_id": session_id.hex(),
                    "epoch": 0,
                    "ticket": ticket.hex(),
                    "recipe": choice.nodes[0].recipe,
                    "cost_ms": round(choice.cost_ms, 3),
                    "hops": [
                        {
                            "node_id": n.node_id.hex(),
                            "layers": list(n.layers),
                            "address": n.address,
                            "relay": n.relay,
                            "tls_cert_sha256": n.tls_cert_sha256.hex(),
                        }
                        for n in choice.nodes
                    ],
                }
            )

        return app


def _public(record: NodeRecord, now: float) -> dict[str, Any]:
    return {
        "node_id": record.node_id.hex(),
        "model_name": record.model_name,
        "artifact": record.artifact,
        "layers": list(record.layers),
        "n_layer": record.n_layer,
        "recipe": record.recipe,
        "address": record.address,
        "relay": record.relay,
        "reachability": record.reachability,
        "slots": record.slots,
        "free_slots": record.free_slots,
        "active_sessions": record.active_sessions,
        "queue_depth": record.queue_depth,
        "step_ms": record.step_ms,
        "estimated_step_ms": record.estimated_step_ms(),
        "ctx_per_session": record.ctx_per_session,
        "seconds_since_heartbeat": round(now - record.last_seen, 2),
        "measured_step_ms": record.measured_step_ms,
        "probe_passed": record.probe_passed,
        "capability": record.capability,
    }
