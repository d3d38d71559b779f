"""An open swarm under attack: sybil identities and floods against a real tracker over HTTP.

Each test plays one attack of an open network (anyone can make a key and register) and
asserts that honest service is unharmed: honest requests complete, no endpoint answers
5xx, no map grows without bound. The tracker runs in process, speaking real HTTP on
loopback; the sybils are throwaway keys that sign their own requests. Sybils that vote (on a
model's shape, as auditors) are tests/test_sybil_votes.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from trio_websocket import ConnectionClosed, open_websocket_url

from benchmarks.burst import stream_chat
from benchmarks.serving import PROMPTS
from noderuntime.access import tickets
from noderuntime.access.identity import Identity
from noderuntime.access.signing import SignatureChecker, join_proof, read_join_secret
from noderuntime.access.tickets import ReplayGuard, TicketError, TicketVerifier
from noderuntime.control.admission import (
    PROBE_ROWS,
    SKETCH_DIM,
    Capability,
    ProbeAnswer,
    ProbeReferences,
    capability_record,
)
from noderuntime.gateway.app import Gateway, client_of
from noderuntime.gateway.auth import ApiKeys
from noderuntime.runner.line import LineFull, RunningSessions, WaitLine
from noderuntime.services import localsystem
from noderuntime.services.cluster import ManagedProcess
from noderuntime.services.ready import TrackerReady, expect
from noderuntime.testing.clusters import local_tracker_args
from noderuntime.tracker.audits import (
    MAX_OPEN_AUDITS,
    MAX_OPEN_AUDITS_PER_CLIENT,
    AuditBook,
    AuditError,
)
from noderuntime.tracker.audits import Grant as AuditGrant
from noderuntime.tracker.grants import MAX_TICKET_SECONDS
from noderuntime.transport import relay_messages
from noderuntime.transport.relay_client import RelayListener
from protocol import Hop, Span
from relay.server import Relay
from relay.server import serve as relay_serve
from tests.adversary_swarm import ARTIFACT, RECIPE, beat, open_swarm, registration
from tests.conftest import local_system

# --- attack 3: one number that breaks the tracker


@pytest.mark.parametrize(
    "field, value",
    [
        ("queue_depth", "1" + "0" * 400),
        ("active_sessions", "1" + "0" * 400),
        ("free_slots", "1" + "0" * 400),
        ("queue_depth", "-1"),
        ("queue_depth", "NaN"),
        ("step_ms", "Infinity"),
        ("step_ms", "NaN"),
        ("step_ms", "1e400"),
    ],
)
async def test_one_huge_number_in_a_heartbeat_is_refused_and_the_tracker_serves_on(field: str, value: str) -> None:
    """A heartbeat whose numbers would overflow route scoring (10**400, NaN, inf, negative) is a 4xx,
    nothing of it is stored, and the status, node list and routes still answer."""
    async with open_swarm() as swarm:
        honest, sybil = Identity.generate(), Identity.generate()
        assert (await swarm.register(honest)).status_code == 200
        assert (await swarm.register(sybil)).status_code == 200
        text = json.dumps(beat(sybil, queue_depth=7)).replace('"queue_depth": 7', f'"{field}": {value}', 1)
        if field != "queue_depth":
            text = json.dumps(beat(sybil)).replace(f'"{field}": ', f'"{field}": {value}, "_": ', 1)
        answer = await swarm.post("/v1/nodes/heartbeat", text, sybil)
        assert 400 <= answer.status_code < 500, answer.text
        assert swarm.tracker.state.nodes[sybil.node_id].queue_depth == 0  # nothing of it was stored
        await swarm.honest_service()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/routes", {"artifact": ARTIFACT, "tokens": 10**400}),
        ("/v1/routes", {"artifact": ARTIFACT, "tokens": 100, "ttl_seconds": "NaN"}),
        ("/v1/routes", {"artifact": ARTIFACT, "tokens": 100, "ttl_seconds": -1}),
        ("/v1/placement", {"artifact": ARTIFACT, "n_layer": 30, "max_layers": 10, "tokens_per_s": 1e400}),
        ("/v1/placement", {"artifact": ARTIFACT, "n_layer": 10**400, "max_layers": 10}),
        ("/v1/nodes/probe", {"seed": 10**400, "digest": "00" * 32, "sketch": []}),
        ("/v1/nodes/probe", {"seed": 1, "digest": "00" * 32, "sketch": [1e400]}),
        ("/v1/placement/reconsider", {"max_layers": -3}),
        ("/v1/audits", {"ticket": "00", "ttl_seconds": 1e400}),
        ("/v1/routes/repair", {"ticket": "00", "keep": 10**400, "tokens": 1, "recipe": RECIPE}),
    ],
)
async def test_every_tracker_request_bounds_its_numbers(path: str, body: dict[str, Any]) -> None:
    """Registration aside (below), each signed or open request with a number out of range is a 4xx."""
    async with open_swarm() as swarm:
        honest = Identity.generate()
        assert (await swarm.register(honest)).status_code == 200
        sybil = Identity.generate()
        body = {"node_id": sybil.node_id.hex(), **body} if path != "/v1/routes" else body
        text = json.dumps(body).replace("Infinity", "1e400")
        answer = await swarm.post(path, text, sybil)
        assert 400 <= answer.status_code < 500, answer.text
        await swarm.honest_service()


@pytest.mark.parametrize(
    "change",
    [
        {"slots": 10**400},
        {"ctx_per_session": -1},
        {"n_layer": 10**400},
        {"capability": Capability(2.0, ((1, 1e400),), 1, 1, 1, 2)},
        {"capability": Capability(2.0, ((1, 10.0),), 10**400, 1, 1, 2)},
        {"capability": Capability(2.0, ((1, 10.0),), 1, 1, 1, 10**400)},
    ],
    ids=["slots", "ctx", "n_layer", "decode_ms", "memory", "threads"],
)
async def test_a_registration_with_a_huge_number_is_refused_whole(change: dict[str, Any]) -> None:
    """A registration is stored whole or not at all: one out-of-range number, even inside the
    signed capability, refuses it."""
    async with open_swarm() as swarm:
        sybil = Identity.generate()
        if "capability" in change:
            signed = capability_record(
                sybil, artifact=ARTIFACT, layers=(0, 30), recipe=RECIPE, capability=change["capability"]
            )
            change = {"capability": signed}
        answer = await swarm.post("/v1/nodes/register", registration(sybil, **change), sybil)
        assert 400 <= answer.status_code < 500, answer.text
        assert sybil.node_id not in swarm.tracker.state.nodes
        assert (await swarm.register(Identity.generate())).status_code == 200
        await swarm.honest_service()


# --- attack 7: memory that only grows

SYBILS = 2000


async def test_what_the_tracker_keeps_of_thousands_of_throwaway_nodes_goes_when_they_expire() -> None:
    """2,000 sybils register, answer their probes and fall silent: after expiry the tracker keeps
    no node, no challenge, no probe time of theirs."""
    answer = ProbeAnswer(7, "00" * 32, (0.5,) * (PROBE_ROWS * SKETCH_DIM))
    references = ProbeReferences([((ARTIFACT, (0, 30), RECIPE), answer)])
    async with open_swarm(references=references) as swarm:
        sybils = [Identity.generate() for _ in range(SYBILS)]
        for k, sybil in enumerate(sybils):
            registered = await swarm.register(sybil)
            assert registered.json()["probe"] == {"seed": 7}
            if k % 2:  # half answer: a probe time is kept of them, a challenge of the rest
                reply = {"node_id": sybil.node_id.hex(), **answer.to_json()}
                assert (await swarm.post("/v1/nodes/probe", reply, sybil)).json()["passed"]
        tracker = swarm.tracker
        assert len(tracker.challenges) == len(tracker.last_probed) == SYBILS // 2
        gone = tracker.expire(time.time() + 3600)
        assert len(gone) == SYBILS and not tracker.state.nodes
        assert tracker.challenges == {} and tracker.last_probed == {}
        # one that leaves takes its entries with it at once
        honest = Identity.generate()
        await swarm.register(honest)
        assert honest.node_id in tracker.challenges
        assert (await swarm.post("/v1/nodes/leave", {"node_id": honest.node_id.hex()}, honest)).status_code == 200
        assert honest.node_id not in tracker.challenges and honest.node_id not in tracker.last_probed


@pytest.mark.parametrize("operator", [None, "pymalloc"], ids=["default", "operators-choice"])
def test_the_tracker_command_runs_on_the_allocator_that_gives_a_floods_pages_back(
    operator: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``noderuntime tracker`` replaces itself (same pid) with one whose Python objects live on glibc's
    malloc, which ``malloc_trim`` empties page by page once a flood expired; an operator's
    ``PYTHONMALLOC`` stands."""
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    env = None if operator is None else {"PYTHONMALLOC": operator}
    process = ManagedProcess("tracker", local_tracker_args(tmp_path / "t"), env=env)
    try:
        ready = expect(process.start(), TrackerReady)
        assert process.proc is not None and ready.pid == process.proc.pid
        environ = Path(f"/proc/{ready.pid}/environ").read_bytes().split(b"\0")
        assert ("PYTHONMALLOC=" + (operator or "malloc")).encode() in environ
        assert httpx.get(ready.url + "/v1/status", timeout=10).status_code == 200
    finally:
        process.stop()


async def test_a_flood_signed_with_free_keys_cannot_crowd_out_an_honest_nodes_heartbeats() -> None:
    """The signed-request replay cache is partitioned by signer: fresh keys past its bound are
    refused, a key it knows is not, and no key's flood takes another's room."""
    async with open_swarm() as swarm:
        swarm.tracker.signatures = SignatureChecker(capacity=50, signers=20)
        honest = Identity.generate()
        assert (await swarm.register(honest)).status_code == 200
        refused = 0
        for _ in range(40):  # each sybil key signs a few beats: unknown nodes, but signed and fresh
            sybil = Identity.generate()
            for _ in range(3):
                answer = await swarm.post("/v1/nodes/heartbeat", beat(sybil), sybil)
                refused += answer.status_code == 401
        assert refused >= 20 * 3  # the keys past the bound
        assert (await swarm.post("/v1/nodes/heartbeat", beat(honest), honest)).status_code == 200
        flooder = Identity.generate()
        swarm.tracker.signatures = SignatureChecker(capacity=50, signers=20)
        assert (await swarm.post("/v1/nodes/heartbeat", beat(honest), honest)).status_code == 200
        for _ in range(60):  # one key past its own share: refused, and only it
            await swarm.post("/v1/nodes/heartbeat", beat(flooder), flooder)
        assert (await swarm.post("/v1/nodes/heartbeat", beat(flooder), flooder)).status_code == 401
        for _ in range(10):
            assert (await swarm.post("/v1/nodes/heartbeat", beat(honest), honest)).status_code == 200


def test_a_flood_of_audit_grants_cannot_flush_an_honest_clients_pending_audits() -> None:
    """Audit grants are bounded per client: a flood from many clients is refused once all are
    full, and one client's many grants push out only its own oldest."""
    book = AuditBook()

    def grant(client: bytes, k: int) -> None:
        hop = ((b"n" * 32, 0, 30),)
        book.grant(k.to_bytes(16, "big"), AuditGrant(client, b"s" * 16, 0, hop, hop, expires=1000.0), 0.0)

    honest = b"h" * 32
    grant(honest, 0)
    refused = 0
    for k in range(1, MAX_OPEN_AUDITS + 100):
        try:
            grant(k.to_bytes(32, "big"), k)
        except AuditError:
            refused += 1
    assert refused == 100 and book.open_audits(honest) == 1
    greedy = b"g" * 32
    book = AuditBook()
    grant(honest, 0)
    for k in range(1, 1000):
        grant(greedy, k)
    assert book.open_audits(greedy) == MAX_OPEN_AUDITS_PER_CLIENT and book.open_audits(honest) == 1
    assert book.open_audits() == MAX_OPEN_AUDITS_PER_CLIENT + 1


# --- attack 6: one key filling the gateway's line

SPELLINGS = ("Bearer sk-k", "bearer sk-k", "BEARER sk-k", "Bearer  sk-k", "Bearer sk-k  ", "bEaReR   sk-k ")


def _line_app(line: WaitLine, keys: list[str]) -> FastAPI:
    """The gateway's front as far as the line: its key check, its naming of clients, a place in line."""
    app = FastAPI()
    app.add_middleware(ApiKeys, keys=keys)

    @app.post("/v1/wait")
    async def wait(request: Request) -> JSONResponse:
        try:
            line.join_nowait(client_of(request, watch=False).key)
        except LineFull as exc:
            return JSONResponse({"error": str(exc)}, status_code=429)
        return JSONResponse({"ok": True})

    return app


@pytest.mark.parametrize("keys", [["sk-k", "sk-other"], []], ids=["keys", "no-keys"])
async def test_one_key_spelled_six_ways_holds_no_more_than_its_share_of_the_line(keys: list[str]) -> None:
    """The line's share is the authenticated key's, however its header is spelled; with no keys
    configured, the client's address's, whatever header it sends."""
    line = WaitLine(limit=64, per_key=4)
    transport = httpx.ASGITransport(_line_app(line, keys), client=("203.0.113.7", 4000))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        answers = [
            (await http.post("/v1/wait", headers={"authorization": spelling})).status_code
            for spelling in SPELLINGS
            for _ in range(4)
        ]
        assert answers.count(200) == 4 and answers.count(429) == len(answers) - 4
        assert line.statistics().keys == 1
        if keys:  # another key still has its share
            other = [(await http.post("/v1/wait", headers={"authorization": "Bearer sk-other"})).status_code]
            assert other == [200]
    other_address = httpx.ASGITransport(_line_app(line, keys), client=("198.51.100.9", 4000))
    async with httpx.AsyncClient(transport=other_address, base_url="http://gw") as http:
        header = {"authorization": "Bearer sk-other"} if keys else {}
        assert (await http.post("/v1/wait", headers=header)).status_code == 200


def test_a_key_runs_no_more_sessions_than_its_cap() -> None:
    """Past its cap a key's new session is refused (the gateway answers 429); its ended sessions
    make room, and another key is not affected."""
    running = RunningSessions(per_key=3)
    for _ in range(3):
        running.start_nowait("a")
    with pytest.raises(LineFull, match="at most 3"):
        running.start_nowait("a")
    running.start_nowait("b")
    running.finish("a")
    running.start_nowait("a")
    assert running.running("a") == 3 and running.running("b") == 1
    assert Gateway([], "http://127.0.0.1:9", None).running.per_key == 256  # on by default


# --- attack 4: draining the swarm's slots


async def test_a_client_asking_for_routes_in_a_tight_loop_is_refused_and_an_honest_one_is_served() -> None:
    """Route grants are rate-limited by address and by client key: a greedy client gets 429s
    within its burst, an honest gateway from another address still gets routes, and no ticket
    lives longer than minutes, whatever it asks."""
    async with open_swarm(route_rate=1.0, route_burst=5) as swarm:
        for layers in ((0, 15), (15, 30)):
            assert (await swarm.register(Identity.generate(), layers, slots=64)).status_code == 200
        request = {"artifact": ARTIFACT, "tokens": 100, "ttl_seconds": 86400}
        greedy_http = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with httpx.AsyncClient(transport=greedy_http) as greedy:
            answers = [(await greedy.post(swarm.url + "/v1/routes", json=request)).status_code for _ in range(40)]
            assert answers.count(200) <= 6 and answers.count(429) >= 34
            # another client key from the same address is the same address
            refused = await greedy.post(swarm.url + "/v1/routes", json=request | {"client": "cd" * 32})
            assert refused.status_code == 429 and "retry-after" in refused.headers
        honest_http = httpx.AsyncHTTPTransport(local_address="127.0.0.3")
        async with httpx.AsyncClient(transport=honest_http) as honest:
            for _ in range(3):
                granted = await honest.post(swarm.url + "/v1/routes", json=request | {"client": "ef" * 32})
                assert granted.status_code == 200, granted.text
        ticket = tickets.decode(bytes.fromhex(granted.json()["ticket"]), [swarm.tracker.identity.node_id])
        assert ticket.expires_unix_ms <= (time.time() + MAX_TICKET_SECONDS + 5) * 1000


async def test_a_client_holds_no_more_route_grants_at_once_than_its_limit() -> None:
    """Past its limit of grants whose tickets live, a client (by address, and by key) is refused;
    another is served, and the grants are released as their tickets expire."""
    async with open_swarm(route_concurrency=3) as swarm:
        for layers in ((0, 15), (15, 30)):
            assert (await swarm.register(Identity.generate(), layers, slots=64)).status_code == 200
        request = {"artifact": ARTIFACT, "tokens": 100, "ttl_seconds": 60}
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address="127.0.0.2")) as greedy:
            answers = [(await greedy.post(swarm.url + "/v1/routes", json=request)).status_code for _ in range(5)]
            assert answers == [200] * 3 + [429] * 2
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address="127.0.0.3")) as other:
            keyed = request | {"client": "ab" * 32}
            answers = [(await other.post(swarm.url + "/v1/routes", json=keyed)).status_code for _ in range(3)]
            assert answers == [200] * 3
        # the same key from a third address: the key holds its limit too
        assert (await swarm.route(**keyed)).status_code == 429
        later = time.time() + 200
        assert swarm.tracker.grants.outstanding.held("address:127.0.0.2", later) == 0
        assert swarm.tracker.grants.outstanding.held(f"key:{'ab' * 32}", later) == 0


DRAINERS = 10  # addresses of the crowd, each asking for a route every DRAIN_PACE with a fresh client key
DRAIN_PACE = 0.1


@pytest.fixture
def one_node_system(smollm2: Path, tmp_path: Path) -> Iterator[localsystem.LocalSystem]:
    """A real system on loopback: one node serving every layer with 4 slots; its gateway lets a
    request wait 6 s in line for a slot."""
    yield from local_system(tmp_path, cuts=(0, 30), slots=4, ctx=512, gateway_options=("--queue-timeout", "6"))


async def test_a_crowd_taking_route_grants_it_never_opens_cannot_keep_an_honest_gateway_out(
    one_node_system: localsystem.LocalSystem,
) -> None:
    """A grant counts against its nodes' free slots until their next heartbeat. Ten addresses, each
    far within its own limits and with a fresh client key per request, take routes and never open
    them: every slot looked taken within moments of each heartbeat, and an honest gateway's requests
    waited in line until they were refused. Others' grants a node has not confirmed weigh at most
    half its free slots: every honest request completes."""
    system = one_node_system
    async with httpx.AsyncClient(timeout=30) as http:
        (artifact,) = (await http.get(system.tracker_url + "/v1/artifacts")).json()["artifacts"]
    granted = 0

    async def drain(k: int) -> None:
        nonlocal granted
        transport = httpx.AsyncHTTPTransport(local_address=f"127.0.0.{2 + k}")
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:
            while True:
                asked = {"artifact": artifact, "tokens": 64, "ttl_seconds": 60, "client": os.urandom(32).hex()}
                answer = await client.post(system.tracker_url + "/v1/routes", json=asked)
                granted += answer.status_code == 200
                await trio.sleep(DRAIN_PACE)

    results: list[dict[str, Any]] = []

    async def honest(i: int) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            for r in range(3):
                results.append(await stream_chat(client, system.gateway_url, system.model_id, PROMPTS[i + r], 8))

    async with trio.open_nursery() as crowd:
        for k in range(DRAINERS):
            crowd.start_soon(drain, k)
        await trio.sleep(3.0)  # a head start: the crowd holds grants through a heartbeat or two
        with trio.fail_after(120):
            async with trio.open_nursery() as clients:
                for i in range(2):
                    clients.start_soon(honest, i)
        crowd.cancel_scope.cancel()
    assert granted >= 20  # the crowd did take grants throughout
    failed = [r for r in results if r["status"] != 200 or r["error"] or not r["arrivals"]]
    assert len(results) == 6 and not failed, failed


async def test_a_relay_spends_no_ticket_on_a_node_that_is_not_there() -> None:
    """A dial to a node not (yet) connected is refused and leaves its ticket good: once the node
    is connected, the same ticket pairs."""
    issuer, node, dialer = Identity.generate(), Identity.generate(), Identity.generate()
    relay = Relay(TicketVerifier([issuer.node_id]))
    session = b"s" * 16
    ticket = tickets.issue(
        issuer,
        session_id=session,
        epoch=0,
        artifact=b"a" * 32,
        hops=[Hop(node.node_id, Span(0, 1))],
        client=dialer.node_id,
    )
    dial = relay_messages.Dial(node.node_id, session, 0, ticket).encode()
    async with trio.open_nursery() as nursery:
        server = await nursery.start(relay_serve, relay, "127.0.0.1", 0)
        url = f"ws://127.0.0.1:{server.port}"
        with trio.fail_after(10):
            async with open_websocket_url(url + "/dial") as ws:
                await ws.send_message(dial)
                with pytest.raises(ConnectionClosed) as closed:
                    await ws.get_message()
            assert closed.value.reason is not None and closed.value.reason.code == relay_messages.CLOSE_NOT_CONNECTED
            listener = RelayListener(url, node, lambda _: None)
            await nursery.start(listener.run)
            async with open_websocket_url(url + "/dial") as ws:
                await ws.send_message(dial)
                relay_messages.decode(await ws.get_message(), relay_messages.Paired)
        listener.stop()
        nursery.cancel_scope.cancel()


def test_a_flood_of_tickets_for_one_client_does_not_crowd_out_anothers_at_a_node() -> None:
    """A node's replay guard is partitioned by the client each ticket names."""
    guard = ReplayGuard(capacity=1000, per_client=10)
    flooder, honest = b"f" * 32, b"h" * 32
    refused = 0
    for k in range(50):
        try:
            guard.accept((k.to_bytes(16, "big"), 0, b"n"), expires_unix_ms=10_000, now_ms=0, client=flooder)
        except TicketError:
            refused += 1
    assert refused == 40
    for k in range(10):
        guard.accept((k.to_bytes(16, "big"), 0, b"n"), expires_unix_ms=10_000, now_ms=0, client=honest)


# --- attack 5: steering placement without joining


async def test_a_key_that_never_registers_cannot_steer_joiners_by_a_claimed_throughput() -> None:
    """A reservation on 0:15 claiming 1e9 tokens/s weighs no more than a typical node's: the
    honest joiners that follow are not all sent to 15:30."""
    async with open_swarm() as swarm:
        for layers in ((0, 15), (15, 30)):
            assert (await swarm.register(Identity.generate(), layers)).status_code == 200

        async def place(me: Identity, **claim: Any) -> tuple[int, int]:
            asked = {"node_id": me.node_id.hex(), "artifact": ARTIFACT, "n_layer": 30, "max_layers": 15} | claim
            answer = await swarm.post("/v1/placement", asked, me)
            assert answer.status_code == 200, answer.text
            start, end = answer.json()["layers"]
            return start, end

        sybil = Identity.generate()
        assert await place(sybil) == (0, 15)
        assert await place(sybil, tokens_per_s=1e9) == (0, 15)  # its one reservation, renewed
        assert len(swarm.tracker.placement.reservations) == 1
        joiners = [await place(Identity.generate()) for _ in range(4)]
        assert joiners.count((0, 15)) >= 1, joiners


# --- private swarms


async def test_a_private_swarm_admits_only_allow_listed_keys_or_holders_of_its_join_secret(tmp_path: Path) -> None:
    """With an allow-list, a stranger's registration and placement are refused (403) and a listed
    key's accepted; with a join secret, a node that proves it is let in, one that guesses is not,
    and a proof seen on the wire lets no other key in. Open stays the default."""
    member, stranger = Identity.generate(), Identity.generate()
    async with open_swarm(allow_nodes=[member.node_id]) as swarm:
        assert (await swarm.register(stranger)).status_code == 403
        asked = {"node_id": stranger.node_id.hex(), "artifact": ARTIFACT, "n_layer": 30, "max_layers": 15}
        assert (await swarm.post("/v1/placement", asked, stranger)).status_code == 403
        assert (await swarm.register(member)).status_code == 200
        assert list(swarm.tracker.state.nodes) == [member.node_id]
    secret_file = tmp_path / "secret"
    secret_file.write_text("correct horse battery staple\n")
    secret = read_join_secret(str(secret_file))
    async with open_swarm(join_secret=secret) as swarm:
        proof = join_proof(secret, member.node_id)
        assert (await swarm.register(member, join_proof=proof)).status_code == 200
        assert (await swarm.register(stranger)).status_code == 403
        assert (await swarm.register(stranger, join_proof=join_proof(b"guess", stranger.node_id))).status_code == 403
        assert (await swarm.register(stranger, join_proof=proof)).status_code == 403  # the member's, replayed
        joiner = Identity.generate()
        asked = {"node_id": joiner.node_id.hex(), "artifact": ARTIFACT, "n_layer": 30, "max_layers": 15}
        assert (await swarm.post("/v1/placement", asked, joiner)).status_code == 403
        shown = asked | {"join_proof": join_proof(secret, joiner.node_id)}
        assert (await swarm.post("/v1/placement", shown, joiner)).status_code == 200
    async with open_swarm() as swarm:
        assert not swarm.tracker.private() and (await swarm.register(stranger)).status_code == 200


def test_the_private_swarm_flags_reach_the_tracker_and_the_node(tmp_path: Path) -> None:
    """``tracker --allow-node/--join-secret-file`` and ``up --join-secret-file`` parse into what runs."""
    import argparse

    from noderuntime.cli.serve import _join_secret, add_commands

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    secret_file = tmp_path / "secret"
    secret_file.write_text("s3cret")
    member = Identity.generate().node_id.hex()
    tracker = parser.parse_args(
        ["tracker", "--listen", "127.0.0.1:0", "--allow-node", member, "--join-secret-file", str(secret_file)]
    )
    assert [n.hex() for n in tracker.allow_node] == [member] and _join_secret(tracker.join_secret_file) == b"s3cret"
    up = parser.parse_args(["up", "--model", "m.gguf", "--layers", "0:1", "--join-secret-file", str(secret_file)])
    assert _join_secret(up.join_secret_file) == b"s3cret"


async def test_a_node_placed_by_a_secret_only_tracker_shows_its_join_secret(
    smollm2: Path, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    """``up --join-secret-file`` without ``--layers``: the node's placement request carries its proof,
    so a tracker that admits holders of the secret alone places it (it then stops: its TLS files
    are not there)."""
    secret_file = tmp_path / "secret"
    secret_file.write_text("correct horse battery staple\n")
    async with open_swarm(join_secret=read_join_secret(str(secret_file))) as swarm:
        argv = ["up", "--model", str(smollm2), "--listen", "127.0.0.1:0", "--tracker", swarm.url]
        argv += ["--data-dir", str(tmp_path / "n"), "--memory-limit", "4GiB", "--join-secret-file", str(secret_file)]
        argv += ["--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(tmp_path / "none.key")]
        with trio.fail_after(60):
            done = await trio.run_process(
                [sys.executable, "-m", "noderuntime", *argv],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=cli_env,
            )
    stderr = done.stderr.decode()
    assert done.returncode == 1, stderr[-2000:]
    assert "private swarm" not in stderr, stderr[-2000:]
    assert re.search(r"placed this node on layers 0:\d+", stderr), stderr[-2000:]
