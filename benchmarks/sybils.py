"""The sybils of ``benchmarks.adversaries``: throwaway keys, each from its own loopback address, playing
every attack on an open swarm at once, in a process of their own."""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import httpx
import trio

from benchmarks.serving import PROMPTS

MAX_TOKENS = 32
ROLES = ("huge_numbers", "layer_vote", "placement", "route_flood", "audit_flood", "framing", "line")
PACE = 1.0  # seconds between one sybil's requests
ROUTE_PACE = 0.25  # a route flooder's
LINE_STREAMS = 2  # requests each line sybil keeps going at once
ATTACKER_KEY = "sk-attacker"
SPELLINGS = ("Bearer {}", "bearer {}", "BEARER {}", "Bearer  {}", "Bearer {}  ", "bEaReR   {} ")
HUGE = (
    ("queue_depth", "1" + "0" * 400),
    ("step_ms", "1e400"),
    ("active_sessions", "-1"),
    ("step_ms", "NaN"),
    ("free_slots", "Infinity"),
)


def _address(k: int) -> str:
    """Sybil ``k``'s own loopback address (the honest processes use 127.0.0.1)."""
    return f"127.0.{1 + k // 250}.{1 + k % 250}"


# --- the attackers (a process of their own)


class _Stamps:
    """Request timestamps that never repeat within this process: equal signed requests are not replays."""

    def __init__(self) -> None:
        self.last = 0

    def now_ms(self) -> int:
        self.last = max(int(time.time() * 1000), self.last + 1)
        return self.last


STAMPS = _Stamps()


async def post(
    client: httpx.AsyncClient,
    url: str,
    path: str,
    body: Any,
    signer: Any = None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """POST ``body`` (JSON, or raw text when ``str``), signed by ``signer`` when given."""
    from noderuntime.access.signing import sign

    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    sent = {"content-type": "application/json", **(headers or {})}
    if signer is not None:
        sent |= sign(signer, "POST", path, data, STAMPS.now_ms())
    return await client.post(url + path, content=data, headers=sent)


def registration(me: Any, swarm: dict[str, Any], layers: tuple[int, int], n_layer: int, address: str) -> dict[str, Any]:
    """A registration of ``me`` on ``layers`` of the swarm's artifact, claiming ``n_layer`` layers in all."""
    from noderuntime.control.admission import Capability, capability_record

    capability = Capability(2.0, ((1, 10.0), (4, 12.0)), 1, 1, 1, 2)
    return {
        "node_id": me.node_id.hex(),
        "artifact": swarm["artifact"],
        "model_name": "m",
        "n_layer": n_layer,
        "layers": list(layers),
        "recipe": swarm["recipe"],
        "address": address,
        "relay": "",
        "tls_cert_sha256": "",
        "slots": 4,
        "ctx_per_session": 512,
        "capability": capability_record(
            me, artifact=swarm["artifact"], layers=layers, recipe=swarm["recipe"], capability=capability
        ),
    }


def _beat(me: Any) -> dict[str, Any]:
    return {"node_id": me.node_id.hex(), "active_sessions": 0, "free_slots": 4, "queue_depth": 0, "step_ms": 3.0}


def _usage(me: Any, node_id: bytes, session: str, *, audit: bool, output: str) -> dict[str, Any]:
    """A usage record for layers 0:10 of ``session`` that says ``node_id`` gave out ``output``, signed by ``me``."""
    from noderuntime.testing.usage import reported_usage

    return reported_usage(
        me, node_id=node_id, layers=(0, 10), session=session, artifact="00" * 32, audit=audit, output=output
    )


class _Attack:
    """The sybils: each plays one role in a loop until the attack is stopped; what each was answered."""

    def __init__(self, swarm: dict[str, Any], sybils: int, roles: tuple[str, ...]) -> None:
        from noderuntime.access.identity import Identity

        self.swarm = swarm
        self.roles = roles
        self.ids = [Identity.generate() for _ in range(sybils)]
        self.statuses: dict[str, collections.Counter[str]] = {role: collections.Counter() for role in ROLES}
        self.notes: dict[str, collections.Counter[str]] = {role: collections.Counter() for role in ROLES}

    def count(self, role: str, step: str, answer: httpx.Response | None, error: str = "") -> None:
        """One answer to ``role``'s ``step`` (a request): its status, or the error that stood for it."""
        self.statuses[role][f"{step} {answer.status_code if answer is not None else error or 'error'}"] += 1

    async def run(self, stop: trio.Event) -> None:
        async with trio.open_nursery() as nursery:
            for k, me in enumerate(self.ids):
                nursery.start_soon(self._sybil, k, me)
            await stop.wait()
            nursery.cancel_scope.cancel()

    async def _sybil(self, k: int, me: Any) -> None:
        role = ROLES[k % len(ROLES)]
        if role not in self.roles:
            return
        transport = httpx.AsyncHTTPTransport(local_address=_address(k))
        async with httpx.AsyncClient(transport=transport, timeout=60) as client:
            play = getattr(self, "_" + role)
            while True:
                try:
                    await play(client, k, me)
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    self.count(role, "any", None, type(exc).__name__)
                    await trio.sleep(PACE)

    async def _huge_numbers(self, client: httpx.AsyncClient, k: int, me: Any) -> None:
        tracker, role = self.swarm["tracker"], "huge_numbers"
        layers = self.swarm["ranges"][k % len(self.swarm["ranges"])]
        body = registration(me, self.swarm, tuple(layers), self.swarm["n_layer"], f"{_address(k)}:1")
        self.count(role, "register", await post(client, tracker, "/v1/nodes/register", body, me))
        for i in range(10**9):
            field, value = HUGE[i % len(HUGE)]
            # the number as JSON text: json.dumps writes no 10**400, nor would a client that checks
            text = json.dumps(_beat(me) | {field: 123456.5}).replace("123456.5", value)
            answer = await post(client, tracker, "/v1/nodes/heartbeat", text, me)
            self.count(role, "heartbeat", answer)
            if i % 4 == 3:  # an honest-looking beat now and then keeps it registered
                kept = await post(client, tracker, "/v1/nodes/heartbeat", _beat(me), me)
                if kept.status_code == 404:
                    return  # expired: register again
            await trio.sleep(PACE)

    async def _layer_vote(self, client: httpx.AsyncClient, k: int, me: Any) -> None:
        tracker, role = self.swarm["tracker"], "layer_vote"
        claim = ((0, 31), (20, 31), (0, 16), (16, 31))[k % 4]
        body = registration(me, self.swarm, claim, 31, f"{_address(k)}:1")
        self.count(role, "register", await post(client, tracker, "/v1/nodes/register", body, me))
        while True:
            await trio.sleep(PACE)
            answer = await post(client, tracker, "/v1/nodes/heartbeat", _beat(me), me)
            self.count(role, "heartbeat", answer)
            if answer.status_code == 404:
                return

    async def _placement(self, client: httpx.AsyncClient, k: int, me: Any) -> None:
        asked = {
            "node_id": me.node_id.hex(),
            "artifact": self.swarm["artifact"],
            "n_layer": self.swarm["n_layer"],
            "max_layers": 10,
            "tokens_per_s": 1e9,
        }
        answer = await post(client, self.swarm["tracker"], "/v1/placement", asked, me)
        self.count("placement", "placement", answer)
        if answer.status_code == 200:
            self.notes["placement"]["layers " + ":".join(map(str, answer.json()["layers"]))] += 1
        await trio.sleep(PACE)

    async def _route(self, client: httpx.AsyncClient, me: Any, role: str) -> dict[str, Any] | None:
        asked = {"artifact": self.swarm["artifact"], "tokens": 512, "ttl_seconds": 86400, "client": me.node_id.hex()}
        answer = await post(client, self.swarm["tracker"], "/v1/routes", asked)
        self.count(role, "route", answer)
        if answer.status_code != 200:
            return None
        granted: dict[str, Any] = answer.json()
        return granted

    async def _route_flood(self, client: httpx.AsyncClient, k: int, me: Any) -> None:
        await self._route(client, me, "route_flood")
        await trio.sleep(ROUTE_PACE)

    async def _audit_flood(self, client: httpx.AsyncClient, k: int, me: Any) -> None:
        granted = await self._route(client, me, "audit_flood")
        if granted is None:
            await trio.sleep(PACE)
            return
        for _ in range(600):
            await trio.sleep(PACE)
            answer = await post(client, self.swarm["tracker"], "/v1/audits", {"ticket": granted["ticket"]}, me)
            self.count("audit_flood", "audit", answer)

    async def _framing(self, client: httpx.AsyncClient, k: int, me: Any) -> None:
        role, tracker = "framing", self.swarm["tracker"]
        granted = await self._route(client, me, role)
        if granted is None:
            await trio.sleep(PACE)
            return
        victim = bytes.fromhex(granted["hops"][0]["node_id"])
        audits: dict[str, list[dict[str, Any]]] = {}
        for i in range(2):
            audit = await post(client, tracker, "/v1/audits", {"ticket": granted["ticket"]}, me)
            self.count(role, "audit", audit)
            if audit.status_code != 200:
                break  # no other node can audit it: the report goes with the audits it has
            auditor = bytes.fromhex(audit.json()["hops"][0]["node_id"])
            # one record signed by the sybil as itself, one forging the auditor the tracker granted
            said = me.node_id if (k + i) % 2 == 0 else auditor
            audits[audit.json()["session_id"]] = [
                _usage(me, said, audit.json()["session_id"], audit=True, output="33" * 32)
            ]
        if not audits:
            await trio.sleep(PACE)
            return
        audited = [_usage(me, victim, granted["session_id"], audit=False, output="22" * 32)]
        verdict = await post(client, tracker, "/v1/audits/report", {"audited": audited, "audits": audits}, me)
        self.count(role, "report", verdict)
        if verdict.status_code == 200:
            for outcome in ("failed", "accused", "suspected"):
                self.notes[role][outcome] += len(verdict.json().get(outcome, []))
        await trio.sleep(PACE)

    async def _line(self, client: httpx.AsyncClient, k: int, me: Any) -> None:
        # the line's sybils are every len(ROLES)-th: each of them spells the key its own way
        header = {"authorization": SPELLINGS[k // len(ROLES) % len(SPELLINGS)].format(ATTACKER_KEY)}
        body = {
            "model": self.swarm["model"],
            "messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}],
            "max_tokens": MAX_TOKENS,
        }

        async def ask() -> None:
            while True:
                try:
                    answer = await client.post(
                        self.swarm["gateway"] + "/v1/chat/completions", json=body, headers=header
                    )
                except httpx.HTTPError as exc:
                    self.count("line", "completion", None, type(exc).__name__)
                    answer = None
                else:
                    self.count("line", "completion", answer)
                if answer is None or answer.status_code != 200:
                    await trio.sleep(PACE)

        async with trio.open_nursery() as nursery:
            for _ in range(LINE_STREAMS):
                nursery.start_soon(ask)


def attack_process(conn: Any, swarm: dict[str, Any], sybils: int, roles: tuple[str, ...]) -> None:
    """The attackers' process: the sybils of ``roles`` attack until the parent says stop (the others idle),
    then it sends back what each role was answered."""

    async def main() -> dict[str, Any]:
        attack = _Attack(swarm, sybils, roles)
        stop = trio.Event()

        async def wait_stop() -> None:
            await trio.to_thread.run_sync(conn.recv)
            stop.set()

        began = time.monotonic()
        cpu = time.process_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_stop)
            conn.send("started")
            await attack.run(stop)
        seconds = time.monotonic() - began
        return {
            role: {
                "sybils": sum(1 for k in range(sybils) if ROLES[k % len(ROLES)] == role) if role in roles else 0,
                "answers": dict(attack.statuses[role].most_common()),
                "requests_per_s": round(sum(attack.statuses[role].values()) / seconds, 1),
                **({"outcomes": dict(attack.notes[role])} if attack.notes[role] else {}),
            }
            for role in ROLES
        } | {"_seconds": seconds, "_cpu_s": time.process_time() - cpu}

    conn.send(trio.run(main))
