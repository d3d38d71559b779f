"""Talking to a tracker: a node's registration and heartbeats, a gateway's route requests."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import httpx
import trio
from pydantic import ValidationError

from noderuntime.access import untrusted
from noderuntime.access.identity import Identity
from noderuntime.access.signing import sign
from noderuntime.tracker.messages import Heartbeat, ProbeReply, Registration, RouteReply
from protocol import Hop

log = logging.getLogger(__name__)


class TrackerError(Exception):
    """The tracker refused or could not be reached; ``status`` is its HTTP status (0: unreachable)."""

    def __init__(self, message: str, status: int = 0, *, full: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.full = full


def _answer(response: httpx.Response, what: str) -> dict[str, Any]:
    """The tracker's JSON answer to a ``what``; :class:`TrackerError` if it is not an object."""
    try:
        return untrusted.json_object(response.content, f"the tracker's answer to a {what}")
    except ValueError as exc:
        raise TrackerError(str(exc), response.status_code) from None


async def fetch_info(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """The tracker's ``/v1/info``."""
    try:
        response = await client.get(url.rstrip("/") + "/v1/info", timeout=10)
        response.raise_for_status()
        info: dict[str, Any] = response.json()
        return info
    except (httpx.HTTPError, ValueError) as exc:
        raise TrackerError(f"cannot read {url}/v1/info: {exc}") from None


@attrs.frozen
class NodeLoad:
    """What a node's heartbeat reports of its load now."""

    active_sessions: int
    free_slots: int
    queue_depth: int
    step_ms: float


class TrackerLink:
    """Keeps a node registered: register, heartbeat, re-register whenever the tracker forgot it."""

    def __init__(
        self,
        url: str,
        identity: Identity,
        registration: Registration,
        load: Callable[[], NodeLoad],
        *,
        retry_seconds: float = 1.0,
        on_probe: Callable[[int], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        """``on_probe(seed)`` answers the tracker's known-answer probes (see :mod:`noderuntime.control.admission`)."""
        self.url = url.rstrip("/")
        self.identity = identity
        self.registration = registration
        self._load = load
        self._retry = retry_seconds
        self.registered = False
        self.heartbeats = 0
        self.registrations = 0
        self._on_probe = on_probe
        self.probes_answered = 0
        self.probe_verdicts: list[dict[str, Any]] = []

    async def _post(self, client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
        data = json.dumps(body).encode()
        headers = {
            "content-type": "application/json",
            **sign(self.identity, "POST", path, data, int(time.time() * 1000)),
        }
        return await client.post(self.url + path, content=data, headers=headers, timeout=10)

    async def _answer_probe(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        challenge = body.get("probe")
        if not challenge or self._on_probe is None:
            return
        try:
            seed = untrusted.integer(challenge.get("seed") if isinstance(challenge, dict) else None, "probe seed")
        except ValueError as exc:
            raise TrackerError(f"the tracker's probe is malformed: {exc}", 200) from None
        try:
            answer = await self._on_probe(seed)
        except ValueError as exc:
            log.warning("cannot answer the tracker's probe %d: %s", seed, exc)
            return
        reply_body = ProbeReply(node_id=self.identity.node_id.hex(), **answer).model_dump(mode="json")
        reply = await self._post(client, "/v1/nodes/probe", reply_body)
        self.probes_answered += 1
        if reply.status_code == 200:
            verdict = _answer(reply, "probe answer")
            self.probe_verdicts.append(verdict)
            log.log(
                logging.INFO if verdict.get("passed") else logging.ERROR,
                "known-answer probe %d: %s",
                seed,
                verdict.get("detail", ""),
            )
        else:
            log.warning("the tracker refused the probe answer: %s", reply.text[:200])

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled; ``started`` once first registered. Tracker outages are waited out."""
        started = False
        interval = 2.0
        async with httpx.AsyncClient() as client:
            while True:
                try:
                    if not self.registered:
                        body = self.registration.model_dump(mode="json")
                        response = await self._post(client, "/v1/nodes/register", body)
                        if response.status_code != 200:
                            raise TrackerError(f"registration refused: {response.text[:200]}", response.status_code)
                        body = _answer(response, "registration")
                        interval = body.get("heartbeat_seconds", 2.0)
                        if (
                            isinstance(interval, bool)
                            or not isinstance(interval, int | float)
                            or not 0 < interval < 3600
                        ):
                            raise TrackerError("the tracker's heartbeat interval is not a number of seconds", 200)
                        self.registered = True
                        self.registrations += 1
                        log.info("registered with the tracker %s", self.url)
                        await self._answer_probe(client, body)
                        if not started:
                            started = True
                            task_status.started()
                    else:
                        beat = Heartbeat(node_id=self.identity.node_id.hex(), **attrs.asdict(self._load()))
                        response = await self._post(client, "/v1/nodes/heartbeat", beat.model_dump(mode="json"))
                        if response.status_code == 404:
                            log.info("the tracker forgot this node (restarted?): registering again")
                            self.registered = False
                            continue
                        if response.status_code != 200:
                            raise TrackerError(f"heartbeat refused: {response.text[:200]}", response.status_code)
                        self.heartbeats += 1
                        await self._answer_probe(client, _answer(response, "heartbeat"))
                except (httpx.HTTPError, TrackerError) as exc:
                    if self.registered:
                        log.warning("tracker %s unreachable (%s); retrying", self.url, exc)
                    self.registered = self.registered and not isinstance(exc, TrackerError)
                    await trio.sleep(self._retry)
                    continue
                await trio.sleep(interval)


@attrs.frozen
class RouteGrant:
    """A route and the ticket for one session on it."""

    hops: tuple[Hop, ...]
    session_id: bytes
    epoch: int
    ticket: bytes
    recipe: bytes
    ctx_per_session: int = 0  # positions a session may fill on every hop; 0 when the tracker did not say


async def request_route(
    client: httpx.AsyncClient,
    url: str,
    artifact: str,
    tokens: int,
    *,
    exclude: list[bytes] | None = None,
    api_key: str | None = None,
    client_id: bytes = b"",
) -> RouteGrant:
    """Ask the tracker for a route; :class:`TrackerError` with 503 (none) or 429 (all full).

    ``client_id``: the node id the asker proves when it dials a head through a relay; its ticket names it.
    """
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"artifact": artifact, "tokens": tokens, "exclude": [n.hex() for n in exclude or []]}
    if client_id:
        body["client"] = client_id.hex()
    try:
        response = await client.post(url.rstrip("/") + "/v1/routes", json=body, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise TrackerError(f"the tracker {url} is unreachable: {exc}") from None
    if response.status_code != 200:
        try:
            detail = untrusted.json_object(response.text, "the tracker's answer")
        except ValueError:
            detail = {"error": response.text[:200]}
        message = detail.get("error") or detail.get("detail") or response.text[:200]
        raise TrackerError(str(message), response.status_code, full=bool(detail.get("full")))
    try:
        reply = RouteReply.model_validate_json(response.content)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        message = f"the tracker {url} sent a malformed route: {where}: {first['msg']}"
        raise TrackerError(message, response.status_code) from None
    return RouteGrant(
        tuple(hop.hop() for hop in reply.hops),
        bytes.fromhex(reply.session_id),
        reply.epoch,
        bytes.fromhex(reply.ticket),
        bytes.fromhex(reply.recipe),
        reply.ctx_per_session,
    )
