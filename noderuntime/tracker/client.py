"""Talking to a tracker: a node's registration and heartbeats, a gateway's route requests."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import attrs
import httpx
import trio
from pydantic import BaseModel, ValidationError

from noderuntime.access import untrusted
from noderuntime.access.identity import Identity
from noderuntime.access.signing import sign
from noderuntime.tracker.messages import (
    AuditReport,
    AuditRequest,
    AuditVerdict,
    Heartbeat,
    Leave,
    PlacementReply,
    PlacementRequest,
    ProbeReply,
    RebalanceReply,
    RebalanceRequest,
    Registration,
    RepairRequest,
    RouteReply,
)
from protocol import Hop

log = logging.getLogger(__name__)


LEAVE_SECONDS = 1.0  # how long a leaving node gives the tracker to hear it
EARLY_HEARTBEAT_GATHER_SECONDS = 0.02  # an early heartbeat waits this long for other slots freeing with it
# routes the tracker granted that have not reached the node yet, which it cannot count: a
# gateway's line sends one at a time (without this, a slot freed while one was on its way
# stayed unseen until the next heartbeat, a second in the tests' runs)
ROUTES_IN_FLIGHT = 1


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
    # smoothed round trips to the peers it talks to (ms, by node id; see tracker.roundtrips)
    round_trips: Mapping[bytes, float] = attrs.field(factory=dict)
    # sessions it ever opened: not reported, the link compares it with the tracker's count (slot_freed)
    sessions_opened: int = 0

    def heartbeat(self, node_id: bytes) -> Heartbeat:
        """The heartbeat that reports this load for ``node_id``."""
        return Heartbeat(
            node_id=node_id.hex(),
            active_sessions=self.active_sessions,
            free_slots=self.free_slots,
            queue_depth=self.queue_depth,
            step_ms=self.step_ms,
            round_trips={peer.hex(): ms for peer, ms in self.round_trips.items()},
        )


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
        self._reported: NodeLoad | None = None  # what the last heartbeat said (or the one on its way)
        self._soon = trio.Event()  # set: heartbeat now, not at the interval
        self.early_heartbeats = 0
        # seconds between heartbeats, as the tracker last said (it grows with the swarm)
        self.interval = 2.0

    def slot_freed(self) -> None:
        """A sequence slot of this node freed: heartbeat at once if the tracker may count the node full.

        The tracker takes a free slot off its count for each session it routes here and
        learns of slots freed only from heartbeats (``TrackerState.note_session``): without
        this, a node it counted full would sit idle until the next heartbeat. Only a node
        the tracker may count full (allowing for ``ROUTES_IN_FLIGHT``) reports early, so
        heartbeats stay few in a large swarm.
        """
        last = self._reported
        if last is None or self._soon.is_set():
            return
        routed_since = self._load().sessions_opened - last.sessions_opened
        if last.free_slots - routed_since <= ROUTES_IN_FLIGHT:
            self._soon.set()

    def register_again(self, registration: Registration) -> None:
        """Register anew, at once, with ``registration`` (a node that moved to other layers): the tracker
        replaces its record. :attr:`registered` is False until it has."""
        self.registration = registration
        self.registered = False
        self._soon.set()

    def slot_refused(self) -> None:
        """The node refused a session for want of a slot: heartbeat at once unless the last one said it was full.

        A tracker takes a slot off its count for each route it grants, so its count errs
        where others (another tracker's grants, a route never opened) filled the node: left
        to the next heartbeat, up to a minute away in a large swarm, its routes would go on
        meeting a full node. Once a heartbeat has said the node is full, refusals send no
        more until one says a slot is free again, so a flood of them costs each tracker one.
        """
        last = self._reported
        if last is None or self._soon.is_set():
            return
        if last.free_slots > 0:
            self._soon.set()

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
        """Run until cancelled; ``started`` once first registered. Tracker outages are waited out.

        Cancelled (the node is leaving), it tells the tracker so, at once and briefly: routes
        stop naming it before its sessions' neighbours repair them around it.
        """
        async with httpx.AsyncClient() as client:
            try:
                await self._run(client, task_status)
            finally:
                with trio.CancelScope(shield=True):
                    await self.leave(client)

    async def leave(self, client: httpx.AsyncClient | None = None) -> None:
        """Tell the tracker this node leaves (bounded, idempotent): it stops routing to it at once."""
        if not self.registered:
            return
        if client is None:
            async with httpx.AsyncClient() as own:
                await self.leave(own)
            return
        with trio.move_on_after(LEAVE_SECONDS):
            await self._leave(client)

    async def _leave(self, client: httpx.AsyncClient) -> None:
        body = Leave(node_id=self.identity.node_id.hex()).model_dump(mode="json")
        try:
            response = await self._post(client, "/v1/nodes/leave", body)
        except httpx.HTTPError as exc:
            log.warning("could not tell the tracker %s that this node leaves: %s", self.url, exc)
            return
        if response.status_code == 200:
            self.registered = False
            log.info("told the tracker %s that this node leaves", self.url)

    async def _run(self, client: httpx.AsyncClient, task_status: trio.TaskStatus[None]) -> None:
        started = False
        while True:
            try:
                if not self.registered:
                    body = self.registration.model_dump(mode="json")
                    response = await self._post(client, "/v1/nodes/register", body)
                    if response.status_code != 200:
                        raise TrackerError(f"registration refused: {response.text[:200]}", response.status_code)
                    body = _answer(response, "registration")
                    self.interval = _interval(body, 2.0)
                    self.registered = True
                    self.registrations += 1
                    log.info("registered with the tracker %s", self.url)
                    await self._answer_probe(client, body)
                    if not started:
                        started = True
                        task_status.started()
                else:
                    load = self._load()
                    beat = load.heartbeat(self.identity.node_id)
                    # what the tracker is being told from now: a slot freed or a session refused
                    # while this beat is on its way is weighed against it, not the one before
                    self._reported = load
                    response = await self._post(client, "/v1/nodes/heartbeat", beat.model_dump(mode="json"))
                    if response.status_code == 404:
                        log.info("the tracker forgot this node (restarted?): registering again")
                        self.registered = False
                        continue
                    if response.status_code != 200:
                        raise TrackerError(f"heartbeat refused: {response.text[:200]}", response.status_code)
                    self.heartbeats += 1
                    body = _answer(response, "heartbeat")
                    self.interval = _interval(body, self.interval)
                    await self._answer_probe(client, body)
            except (httpx.HTTPError, TrackerError) as exc:
                if self.registered:
                    log.warning("tracker %s unreachable (%s); retrying", self.url, exc)
                self.registered = self.registered and not isinstance(exc, TrackerError)
                await trio.sleep(self._retry)
                continue
            # a jitter of a tenth keeps nodes that registered together from beating together
            with trio.move_on_after(self.interval * random.uniform(0.9, 1.1)):
                await self._soon.wait()
                self.early_heartbeats += 1
                # a moment for the slots that free together (a batch's sessions ending) to share one beat
                await trio.sleep(EARLY_HEARTBEAT_GATHER_SECONDS)
            self._soon = trio.Event()


def _interval(answer: Mapping[str, Any], current: float) -> float:
    """The heartbeat interval a tracker's answer gives (it grows with the swarm), or ``current`` if it gives none."""
    interval = answer.get("heartbeat_seconds", current)
    if isinstance(interval, bool) or not isinstance(interval, int | float) or not 0 < interval < 3600:
        raise TrackerError("the tracker's heartbeat interval is not a number of seconds", 200)
    return float(interval)


_Reply = TypeVar("_Reply", bound=BaseModel)


async def _signed_answer(
    client: httpx.AsyncClient,
    url: str,
    identity: Identity,
    path: str,
    asked: BaseModel,
    reply_type: type[_Reply],
    what: str,
) -> tuple[_Reply, int]:
    """POST ``asked`` to ``path``, signed by ``identity``; the tracker's answer as ``reply_type``, and its status.

    :class:`TrackerError` when it is unreachable, refuses (its status, with the reason it gave
    for it: "the tracker refused to ``what``"), or answers what ``reply_type`` does not read.
    """
    response = await _signed_post(client, url, path, RequestSigner(identity), asked)
    if response.status_code != 200:
        try:
            detail = untrusted.json_object(response.content, "the tracker's answer").get("detail")
        except ValueError:
            detail = None
        message = detail if isinstance(detail, str) else response.text[:300]
        raise TrackerError(f"the tracker refused to {what}: {message}", response.status_code)
    try:
        return reply_type.model_validate_json(response.content), response.status_code
    except ValidationError:
        raise TrackerError(f"the tracker {url} sent a malformed answer", response.status_code) from None


async def request_placement(
    client: httpx.AsyncClient, url: str, identity: Identity, asked: PlacementRequest
) -> PlacementReply:
    """The layer range the tracker gives a node that has none yet (see :mod:`noderuntime.tracker.placement`).

    :class:`TrackerError` when it is unreachable, refuses (its status), or answers a range that
    is not one of ``asked.n_layer`` layers of at most ``asked.max_layers``.
    """
    reply, status = await _signed_answer(
        client, url, identity, "/v1/placement", asked, PlacementReply, "place this node"
    )
    start, end = reply.layers
    if reply.n_layer != asked.n_layer or end > asked.n_layer or end - start > asked.max_layers:
        raise TrackerError(
            f"the tracker {url} placed this node on layers {start}:{end} of {reply.n_layer}, which it cannot "
            f"serve ({asked.max_layers} of {asked.n_layer} layers at most)",
            status,
        )
    return reply


async def request_reconsider(
    client: httpx.AsyncClient, url: str, identity: Identity, asked: RebalanceRequest
) -> RebalanceReply:
    """Whether the tracker would move this serving node, and where (see :meth:`Placement.reconsider`).

    :class:`TrackerError` when it is unreachable, refuses (its status: 404 for a node it does
    not know), or answers a range of more than ``asked.max_layers`` layers.
    """
    reply, status = await _signed_answer(
        client, url, identity, "/v1/placement/reconsider", asked, RebalanceReply, "reconsider this node"
    )
    if reply.layers is not None and reply.layers[1] - reply.layers[0] > asked.max_layers:
        start, end = reply.layers
        raise TrackerError(
            f"the tracker {url} moved this node to layers {start}:{end}, more than the {asked.max_layers} it can hold",
            status,
        )
    return reply


@attrs.frozen
class RouteGrant:
    """A route and the ticket for one session on it."""

    hops: tuple[Hop, ...]
    session_id: bytes
    epoch: int
    ticket: bytes
    recipe: bytes
    ctx_per_session: int = 0  # positions a session may fill on every hop; 0 when the tracker did not say
    exact: bool = True  # a repair's route: it runs the session's recipe (bit-exact continuation)
    # the tracker that granted it, the only one that reads its ticket: its repairs and audits go there
    tracker: str = ""


class RequestSigner:
    """Signs tracker requests for one identity, each with a distinct timestamp.

    The tracker accepts each signed request once: two identical requests signed in the
    same millisecond (a gateway repairing two sessions of one prompt) would read as a replay.
    """

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self._last = 0

    def headers(self, method: str, path: str, body: bytes) -> dict[str, str]:
        """The signature headers for this request."""
        self._last = max(int(time.time() * 1000), self._last + 1)
        return sign(self.identity, method, path, body, self._last)


async def request_route(
    client: httpx.AsyncClient,
    url: str,
    artifact: str,
    tokens: int,
    *,
    exclude: list[bytes] | None = None,
    api_key: str | None = None,
    client_id: bytes = b"",
    prefer: list[bytes] | None = None,
) -> RouteGrant:
    """Ask the tracker for a route; :class:`TrackerError` with 503 (none) or 429 (all full).

    ``client_id``: the node id the asker proves when it dials a head through a relay; its ticket names it.
    ``prefer``: nodes that hold the prompt's prefix, taken when a route through them has room.
    """
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    body: dict[str, Any] = {"artifact": artifact, "tokens": tokens, "exclude": [n.hex() for n in exclude or []]}
    if client_id:
        body["client"] = client_id.hex()
    if prefer:
        body["prefer"] = [n.hex() for n in prefer]
    try:
        response = await client.post(url.rstrip("/") + "/v1/routes", json=body, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise TrackerError(f"the tracker {url} is unreachable: {exc}") from None
    return _grant(response, url)


async def request_repair(
    client: httpx.AsyncClient, url: str, signer: RequestSigner, repair: RepairRequest
) -> RouteGrant:
    """Ask the tracker for the rest of a session's route and its next epoch's ticket (see :class:`RepairRequest`).

    :class:`TrackerError` with 503 (no replacement) or 429 (all full), as :func:`request_route`.
    """
    return _grant(await _signed_post(client, url, "/v1/routes/repair", signer, repair), url)


async def request_audit(client: httpx.AsyncClient, url: str, signer: RequestSigner, audit: AuditRequest) -> RouteGrant:
    """An audit route for a session this client was granted (see :class:`AuditRequest`); :class:`TrackerError`
    with 503 when some hop has no auditor."""
    return _grant(await _signed_post(client, url, "/v1/audits", signer, audit), url)


async def report_audit(client: httpx.AsyncClient, url: str, signer: RequestSigner, report: AuditReport) -> AuditVerdict:
    """Tell the tracker what an audit found; its verdict, or :class:`TrackerError`."""
    response = await _signed_post(client, url, "/v1/audits/report", signer, report)
    if response.status_code != 200:
        raise TrackerError(f"the tracker refused the audit report: {response.text[:300]}", response.status_code)
    try:
        return AuditVerdict.model_validate_json(response.content)
    except ValidationError:
        raise TrackerError(f"the tracker {url} sent a malformed audit verdict", response.status_code) from None


async def _signed_post(
    client: httpx.AsyncClient, url: str, path: str, signer: RequestSigner, body: BaseModel
) -> httpx.Response:
    """POST ``body`` as JSON to the tracker at ``url``, signed by ``signer``; :class:`TrackerError` if unreachable."""
    data = body.model_dump_json().encode()
    headers = {"content-type": "application/json", **signer.headers("POST", path, data)}
    try:
        return await client.post(url.rstrip("/") + path, content=data, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise TrackerError(f"the tracker {url} is unreachable: {exc}") from None


def _grant(response: httpx.Response, url: str) -> RouteGrant:
    """The route grant in a tracker's answer, or :class:`TrackerError` for a refusal or a malformed one."""
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
        reply.exact,
        url.rstrip("/"),
    )
