"""The tracker's identity pinned, and addresses bound to the swarm, attacked as a stranger would.

- a tracker's key is pinned at first contact; one whose key changed is refused, with a
  message naming ``--tracker-key``, which accepts it on purpose;
- a route reply forged between a gateway and its tracker (another signer, a hop's address
  swapped) is refused before anything reaches a head;
- a registration naming loopback or private addresses is refused by a tracker whose swarm
  is not declared local; a connector refuses to dial them under a ticket that does not
  declare it; a ticket's plan binds each hop's address and relay, which a node checks.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from fastapi import FastAPI, Request, Response

from noderuntime.access import addresses, tickets
from noderuntime.access.identity import Identity
from noderuntime.access.known_trackers import KnownTrackers, TrackerKeyChanged, parse_given
from noderuntime.access.signing import sign
from noderuntime.access.tickets import TicketError, TicketVerifier, issue
from noderuntime.operations.httpserve import serve_http
from noderuntime.operations.telemetry import GatewayMetrics
from noderuntime.runner.policy import RunError
from noderuntime.runner.runner import RouteRunner, Target
from noderuntime.seams.client import GenerationRequest, RouteError, open_route_generation
from noderuntime.seams.dialer import open_dialer
from noderuntime.seams.network import ticket_check
from noderuntime.tracker.app import Tracker
from noderuntime.tracker.trackers import IssuerKeys, Trackers, first_issuer_keys
from protocol import Header, Hop, OpenRoute, Phase, RemoteProtocolError, Sampling, Span
from protocol import Identity as SessionIdentity
from tests.swarm_records import ARTIFACT
from tests.test_tracker import _registration

# --- addresses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",  # a cloud's metadata service
        "100.64.0.1",  # shared address space (CGNAT)
        "0.0.0.0",
        "224.0.0.1",
        "233.252.0.1",  # multicast that ipaddress calls global
        "240.0.0.1",
        "255.255.255.255",
        "192.0.2.1",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "ff02::1",
        "ff0e::1",
        "2001:db8::1",
        "::ffff:127.0.0.1",  # IPv4-mapped
        "2002:7f00:1::",  # 6to4 around 127.0.0.1
        "2002:a00:1::",  # 6to4 around 10.0.0.1
        "64:ff9b::a00:1",  # NAT64 around 10.0.0.1
        "2001:0:4136:e378:8000:63bf:f5ff:fffe",  # Teredo whose client is 10.0.0.1
    ],
)
def test_addresses_that_are_not_public_are_told_apart(address: str) -> None:
    assert not addresses.is_public(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2001:4860:4860::8888", "2606:4700::1111"])
def test_public_addresses_pass(address: str) -> None:
    assert addresses.is_public(ipaddress.ip_address(address))


def test_a_direct_address_must_be_a_literal_public_ip_and_a_relay_name_is_checked_when_dialled() -> None:
    addresses.check_endpoints("8.8.8.8:7000", "wss://relay.example.org/")
    addresses.check_endpoints("[2001:4860:4860::8888]:7000", "ws://8.8.4.4:7001")
    for address in ("127.0.0.1:7000", "[::1]:7000", "node.example.org:7000", "localhost:7000"):
        with pytest.raises(addresses.AddressError):
            addresses.check_endpoints(address, "")
    for relay in ("ws://127.0.0.1:7001", "wss://[fe80::1]:443/", "ws://169.254.169.254/"):
        with pytest.raises(addresses.AddressError):
            addresses.check_endpoints("", relay)


async def test_a_relay_name_that_resolves_to_loopback_is_refused_when_dialled() -> None:
    with pytest.raises(addresses.AddressError, match=r"resolves to .*not public"):
        await addresses.check_relay_resolved("ws://localhost:7001")
    addresses.check_resolved("relay", ["8.8.8.8", "2001:4860:4860::8888"])
    with pytest.raises(addresses.AddressError, match=r"10\.0\.0\.7"):
        addresses.check_resolved("relay", ["8.8.8.8", "10.0.0.7"])  # one private answer is enough


# --- registrations -------------------------------------------------------------------------


async def _register(tracker: Tracker, **changes: Any) -> httpx.Response:
    me = Identity.generate()
    body = json.dumps(_registration(me, **changes)).encode()
    headers = {
        **sign(me, "POST", "/v1/nodes/register", body, int(time.time() * 1000)),
        "content-type": "application/json",
    }
    async with httpx.AsyncClient(transport=httpx.ASGITransport(tracker.app), base_url="http://tracker") as client:
        return await client.post("/v1/nodes/register", content=body, headers=headers)


@pytest.mark.parametrize(
    "endpoints",
    [
        {"address": "127.0.0.1:7000"},
        {"address": "[::1]:7000"},
        {"address": "10.0.0.5:7000"},
        {"address": "169.254.169.254:80"},
        {"address": "metadata.internal:80"},  # a name: resolved by whoever dials, after any check
        {"address": "", "relay": "ws://127.0.0.1:7001"},
        {"address": "8.8.8.8:7000", "relay": "wss://192.168.0.2/"},
    ],
)
async def test_a_registration_naming_a_private_address_is_refused_unless_the_swarm_is_local(
    endpoints: dict[str, str],
) -> None:
    refused = await _register(Tracker(Identity.generate()), **endpoints)
    assert refused.status_code == 400, refused.text
    assert "not declared local" in refused.json()["detail"]
    accepted = await _register(Tracker(Identity.generate(), local_swarm=True), **endpoints)
    assert accepted.status_code == 200, accepted.text


async def test_a_registration_naming_public_addresses_is_taken_by_any_tracker() -> None:
    answer = await _register(Tracker(Identity.generate()), address="8.8.8.8:7000", relay="wss://relay.example.org/")
    assert answer.status_code == 200, answer.text


# --- tickets bind addresses ----------------------------------------------------------------


def _route(address: str = "8.8.8.8:7000", relay: str = "") -> list[Hop]:
    return [
        Hop(Identity.generate().node_id, Span(0, 15), address, relay),
        Hop(Identity.generate().node_id, Span(15, 30), "8.8.4.4:7000", "wss://relay.example.org/"),
    ]


@pytest.mark.parametrize(
    "change",
    [
        {"address": "10.0.0.5:7000"},  # the next hop's dial pointed into the node's own network
        {"address": "9.9.9.9:7000"},
        {"relay": "wss://evil.example.org/"},
        {"address": ""},  # made to go through a relay the plan does not name for it
    ],
)
async def test_a_node_refuses_a_ticket_whose_plan_names_other_addresses_than_its_open_route(
    change: dict[str, Any],
) -> None:
    issuer = Identity.generate()
    hops = _route()
    session = b"s" * 16
    ticket = issue(issuer, session_id=session, epoch=0, artifact=b"a" * 32, hops=hops)
    check = ticket_check(TicketVerifier([issuer.node_id]), hops[0].node_id)
    await check(_open_route(hops, ticket, session, 0), 0, None)  # the plan as issued passes (once: then it is spent)
    ticket = issue(issuer, session_id=session, epoch=1, artifact=b"a" * 32, hops=hops)
    bent = [hops[0], attrs.evolve(hops[1], **change)]
    with pytest.raises(RemoteProtocolError, match="other addresses or relays"):
        await check(_open_route(bent, ticket, session, 1), 0, None)


def _open_route(hops: list[Hop], ticket: bytes, session: bytes, epoch: int) -> OpenRoute:
    """A client's opening of ``session`` at ``epoch`` on ``hops``, as the head receives it."""
    ident = SessionIdentity("req", session, epoch, b"a" * 32, b"r" * 8, hops[0].layers)
    return OpenRoute(Header(ident, Phase.PREFILL, 0), tuple(hops), Sampling(), (1, 2, 3), 4, (), 0, ticket)


def test_a_ticket_of_the_version_that_bound_no_addresses_is_refused() -> None:
    issuer = Identity.generate()
    ticket = issue(issuer, session_id=b"s" * 16, epoch=0, artifact=b"a" * 32, hops=_route())
    length = int.from_bytes(ticket[4:6], "big")
    fields = json.loads(ticket[6 : 6 + length])
    fields["v"] = 1
    fields["hops"] = [hop[:3] for hop in fields["hops"]]
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    old = tickets.MAGIC + len(body).to_bytes(2, "big") + body + issuer.sign(tickets.DOMAIN, body)
    with pytest.raises(TicketError, match="version 1"):
        tickets.decode(old, [issuer.node_id])


# --- dialling ------------------------------------------------------------------------------


@asynccontextmanager
async def _recording_listener() -> AsyncIterator[tuple[int, list[object]]]:
    """A TCP listener on loopback that records each connection it is given (and closes it)."""
    accepted: list[object] = []
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def keep(stream: trio.SocketStream) -> None:
        accepted.append(stream.socket.getpeername())
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, keep, listeners)
        yield port, accepted
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("local", [False, True])
async def test_a_connector_dials_a_loopback_address_only_under_a_ticket_that_declares_the_swarm_local(
    local: bool,
) -> None:
    """As a gateway dials a head (a node dials its next hop through the same connector)."""
    async with _recording_listener() as (port, accepted), open_dialer() as dialer:
        hops = [Hop(Identity.generate().node_id, Span(0, 30), f"127.0.0.1:{port}")]
        session = b"s" * 16
        ticket = issue(
            Identity.generate(),
            session_id=session,
            epoch=0,
            artifact=b"a" * 32,
            hops=hops,
            client=dialer.node_id,
            local=local,
        )
        request = GenerationRequest((1, 2, 3), 4, deadline_unix_ms=int(time.time() * 1000) + 10_000)
        with pytest.raises(RouteError) as raised, trio.fail_after(20):
            async with open_route_generation(
                dialer, hops, request, artifact=b"a" * 32, recipe=b"r" * 8, ticket=ticket, session_id=session, epoch=0
            ):
                pass
        await trio.sleep(0.2)  # a connection made would have been accepted by now
    if local:
        assert accepted, "the dial was allowed, and reached the listener"
        assert dialer.addresses_refused == 0
    else:
        assert "not public" in str(raised.value) and raised.value.code.name == "PERMISSION_DENIED"
        assert accepted == [] and dialer.addresses_refused == 1


# --- the tracker's key, pinned ------------------------------------------------------------


@asynccontextmanager
async def _tracker_at(tracker: Tracker | FastAPI, listen: str) -> AsyncIterator[str]:
    """``tracker`` (or an app in a tracker's place) served on ``listen`` while the block runs; its URL."""
    app = tracker.app if isinstance(tracker, Tracker) else tracker
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, app, listen)
        yield url
        nursery.cancel_scope.cancel()


async def test_a_tracker_whose_key_changed_is_refused_until_tracker_key_accepts_it(tmp_path: Path) -> None:
    first, impostor = Tracker(Identity.generate()), Tracker(Identity.generate())
    async with _tracker_at(first, "127.0.0.1:0") as url:
        keys = await first_issuer_keys([url], KnownTrackers.in_data_dir(tmp_path))
    assert keys == {url: first.identity.node_id}
    assert f"{url} {first.identity.node_id.hex()}" in (tmp_path / "known_trackers").read_text()
    # another process answers at the same URL, with another key
    async with _tracker_at(impostor, url.removeprefix("http://")):
        with pytest.raises(TrackerKeyChanged) as refused, trio.fail_after(10):
            await first_issuer_keys([url], KnownTrackers.in_data_dir(tmp_path))
        new = impostor.identity.node_id.hex()
        assert f"--tracker-key {url}={new}" in str(refused.value)
        assert first.identity.node_id.hex() in str(refused.value)
        # accepted on purpose: pinned without asking, and the tracker now passes
        given = parse_given([f"{url}={new}"], [url])
        keys = await first_issuer_keys([url], KnownTrackers.in_data_dir(tmp_path, given))
        assert keys == {url: impostor.identity.node_id}
        assert f"{url} {new}" in (tmp_path / "known_trackers").read_text()
        assert KnownTrackers.in_data_dir(tmp_path).pinned(url + "/") == impostor.identity.node_id


def test_tracker_urls_are_pinned_normalised_and_a_bare_tracker_key_needs_one_tracker(tmp_path: Path) -> None:
    pins = KnownTrackers.in_data_dir(tmp_path)
    key = Identity.generate().node_id
    pins.accept("HTTP://Tracker.Example:80/", key)
    assert KnownTrackers.in_data_dir(tmp_path).pinned("http://tracker.example") == key
    with pytest.raises(TrackerKeyChanged):
        KnownTrackers.in_data_dir(tmp_path).accept("http://tracker.example", Identity.generate().node_id)
    assert parse_given([key.hex()], ["http://t:7000"]) == {"http://t:7000": key}
    with pytest.raises(ValueError, match="URL=KEY"):
        parse_given([key.hex()], ["http://a", "http://b"])


# --- a forged route reply ------------------------------------------------------------------


def _forging_proxy(upstream: str, mode: str, head: str) -> FastAPI:
    """Stands between a gateway and its tracker: /v1/info as the tracker says, route replies bent by ``mode``."""
    app = FastAPI()
    attacker = Identity.generate()

    @app.get("/v1/info")
    async def info() -> Response:
        async with httpx.AsyncClient() as client:
            answer = await client.get(upstream + "/v1/info")
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.post("/v1/routes")
    async def routes(request: Request) -> Response:
        async with httpx.AsyncClient() as client:
            answer = await client.post(upstream + "/v1/routes", content=await request.body(), headers=request.headers)
        reply = answer.json()
        if mode == "swap_head":  # the honest ticket, the head's address pointed elsewhere
            reply["hops"][0]["address"] = head
        elif mode == "resign":  # a whole route of the attacker's, under a ticket it signed
            reply["hops"][0]["address"] = head
            hops = [
                Hop(bytes.fromhex(h["node_id"]), Span(*h["layers"]), h["address"], h["relay"]) for h in reply["hops"]
            ]
            client_id = bytes.fromhex(json.loads(await request.body())["client"])
            reply["ticket"] = issue(
                attacker,
                session_id=bytes.fromhex(reply["session_id"]),
                epoch=0,
                artifact=bytes.fromhex(ARTIFACT),
                hops=hops,
                client=client_id,
                local=True,
            ).hex()
        return Response(json.dumps(reply), answer.status_code, media_type="application/json")

    return app


@pytest.mark.parametrize("mode", ["swap_head", "resign", "honest"])
async def test_a_forged_route_reply_is_refused_before_any_prompt_is_sent(mode: str, tmp_path: Path) -> None:
    tracker = Tracker(Identity.generate(), local_swarm=True)  # loopback allowed: the ticket is what must stop it
    async with (
        _recording_listener() as (honest_port, honest_seen),
        _recording_listener() as (evil_port, evil_seen),
        _tracker_at(tracker, "127.0.0.1:0") as tracker_url,
    ):
        node = Identity.generate()
        body = json.dumps(_registration(node, address=f"127.0.0.1:{honest_port}")).encode()
        headers = {**sign(node, "POST", "/v1/nodes/register", body, int(time.time() * 1000))}
        async with httpx.AsyncClient() as http:
            registered = await http.post(
                tracker_url + "/v1/nodes/register",
                content=body,
                headers={**headers, "content-type": "application/json"},
            )
            assert registered.status_code == 200, registered.text
            proxy = _forging_proxy(tracker_url, mode, f"127.0.0.1:{evil_port}")
            async with _tracker_at(proxy, "127.0.0.1:0") as proxy_url, open_dialer() as dialer:
                me = Identity.generate()
                runner = RouteRunner(
                    Trackers([proxy_url]),
                    dialer,
                    http=http,
                    identity=me,
                    metrics=GatewayMetrics(),
                    issuers=IssuerKeys(http, KnownTrackers.in_data_dir(tmp_path)),
                )
                request = GenerationRequest((1, 2, 3), 4, deadline_unix_ms=int(time.time() * 1000) + 10_000)
                with pytest.raises(RunError) as refused, trio.fail_after(30):
                    async with runner.session(Target(ARTIFACT, 512, 1000), request):
                        pass
                await trio.sleep(0.2)
    if mode == "honest":  # the control: the same route unbent is dialled (and fails: no node listens there)
        assert refused.value.code in ("route_failed", "no_route") and honest_seen and not evil_seen
        return
    assert refused.value.code == "untrusted_route", refused.value
    assert not honest_seen and not evil_seen, "nothing reached a head"
    assert "someone may have answered in its place" in str(refused.value)
