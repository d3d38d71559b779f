"""A real tracker on loopback for the attacks of tests/test_adversaries.py, and the signed requests a sybil
sends it."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio

from noderuntime.access.identity import Identity
from noderuntime.access.signing import sign
from noderuntime.control.admission import (
    Capability,
    capability_record,
)
from noderuntime.models import gguf as ggufio
from noderuntime.models.artifacts import TensorEntry, fingerprint_of_digests
from noderuntime.models.artifacts import field_digest as digest_of
from noderuntime.operations.httpserve import serve_http
from noderuntime.tracker import shapes
from noderuntime.tracker.app import Tracker

ARTIFACT = "ab" * 32
RECIPE = "0123456789abcdef"


def made_up_model(n_layer: int = 30) -> tuple[list[tuple[str, bytes]], list[TensorEntry]]:
    """The identity fields (in key order) and tensor index of a made-up ``n_layer``-layer Llama: what its
    fingerprint hashes (:func:`shaped_artifact`)."""
    fields = [
        ("general.architecture", ggufio.string_field("general.architecture", "llama")),
        ("general.name", ggufio.string_field("general.name", "made up")),
        ("llama.block_count", ggufio.uint32_field("llama.block_count", n_layer)),
        ("llama.embedding_length", ggufio.uint32_field("llama.embedding_length", 64)),
    ]
    names = ["token_embd.weight", "output_norm.weight"]
    names += [f"blk.{i}.{t}.weight" for i in range(n_layer) for t in ("attn_q", "attn_k", "ffn_up")]
    index = [TensorEntry(n, 8, (64, 64), 4352, hashlib.sha256(n.encode()).hexdigest()) for n in names]
    return fields, index


def shaped_artifact(n_layer: int = 30) -> tuple[str, dict[str, Any]]:
    """A made-up ``n_layer``-layer artifact's fingerprint, and the proof of its shape a node sends (JSON)."""
    fields, index = made_up_model(n_layer)
    artifact = fingerprint_of_digests((digest_of(k, raw) for k, raw in fields), sorted(e.line() for e in index))
    return artifact, shapes.prove(fields, index).model_dump(mode="json")


def registration(me: Identity, layers: tuple[int, int] = (0, 30), **changes: Any) -> dict[str, Any]:
    """A registration of ``me`` for ``layers`` of the 30-layer test artifact, its capability signed."""
    body: dict[str, Any] = {
        "node_id": me.node_id.hex(),
        "artifact": ARTIFACT,
        "model_name": "m",
        "n_layer": 30,
        "layers": list(layers),
        "recipe": RECIPE,
        "address": "127.0.0.1:1",
        "relay": "",
        "tls_cert_sha256": "",
        "slots": 4,
        "ctx_per_session": 512,
    }
    body.update(changes)
    body.setdefault(
        "capability",
        capability_record(
            me,
            artifact=body["artifact"],
            layers=(body["layers"][0], body["layers"][1]),
            recipe=body["recipe"],
            capability=Capability(2.0, ((1, 10.0), (4, 12.0)), 1, 1, 1, 2),
        ),
    )
    return body


def beat(me: Identity, **changes: Any) -> dict[str, Any]:
    """A heartbeat of ``me``, idle unless ``changes`` say otherwise."""
    return {"node_id": me.node_id.hex(), "active_sessions": 0, "free_slots": 4, "queue_depth": 0, "step_ms": 3.0} | (
        changes
    )


@attrs.define
class Swarm:
    """A tracker on loopback and an HTTP client that speaks to it, signed as any identity."""

    tracker: Tracker
    url: str
    client: httpx.AsyncClient
    _stamp: int = 0

    async def post(self, path: str, body: Any, signer: Identity | None = None, **headers: str) -> httpx.Response:
        """POST ``body`` as JSON (raw text when it is ``str``), signed by ``signer`` when given."""
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        sent = {"content-type": "application/json", **headers}
        if signer is not None:
            # distinct timestamps: one signer's equal requests are not replays of each other
            self._stamp += 1
            sent |= sign(signer, "POST", path, data, int(time.time() * 1000) + self._stamp % 1000)
        return await self.client.post(self.url + path, content=data, headers=sent)

    async def register(self, me: Identity, layers: tuple[int, int] = (0, 30), **changes: Any) -> httpx.Response:
        """Register ``me`` (see :func:`registration`)."""
        return await self.post("/v1/nodes/register", registration(me, layers, **changes), me)

    async def route(self, **changes: Any) -> httpx.Response:
        """Ask for a route of the test artifact."""
        return await self.post("/v1/routes", {"artifact": ARTIFACT, "tokens": 100} | changes)

    async def honest_service(self) -> None:
        """Every read an honest party makes answers 200, and a route is granted."""
        for path in ("/v1/status", "/v1/nodes", "/v1/status/nodes", "/v1/artifacts", "/status"):
            answer = await self.client.get(self.url + path)
            assert answer.status_code == 200, (path, answer.text)
        granted = await self.route()
        assert granted.status_code == 200, granted.text


@asynccontextmanager
async def open_swarm(**options: Any) -> AsyncIterator[Swarm]:
    """A tracker built with ``options``, served over HTTP on loopback for the test's duration."""
    tracker = Tracker(Identity.generate(), **{"local_swarm": True, **options})  # its nodes are on loopback
    async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=30) as client:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        yield Swarm(tracker, url, client)
        nursery.cancel_scope.cancel()
