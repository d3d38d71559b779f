"""The tracker's API: authentication, registration, tickets and heartbeats (in process, over HTTP); route
choice itself is tests/test_route_choice.py."""

from __future__ import annotations

import base64
import functools
import itertools
import json
import sys
import time
import zlib
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

from noderuntime.access.identity import Identity
from noderuntime.access.signing import WINDOW_MS, SignatureChecker, sign
from noderuntime.access.tickets import TicketVerifier
from noderuntime.control.admission import Capability, capability_record
from noderuntime.models import gguf as ggufio
from noderuntime.models.artifacts import field_digest
from noderuntime.node.leases import LeaseManager
from noderuntime.operations.httpserve import serve_http
from noderuntime.tracker import registry, shapes
from noderuntime.tracker.app import Tracker
from noderuntime.tracker.client import NodeLoad, TrackerError, TrackerLink, request_route
from noderuntime.tracker.columns import MIN_CAPACITY
from noderuntime.tracker.messages import MAX_PEERS, MAX_SHAPE_FIELDS, MAX_SHAPE_INDEX_CHARS, Registration, ShapeProof
from noderuntime.tracker.records import NodeRecord
from noderuntime.tracker.registry import TrackerState
from noderuntime.tracker.roundtrips import RoundTrips, connect_ms, measure_round_trips
from noderuntime.verify.certificates import CoveredPair
from protocol import Hop, Span, route_recipe
from tests.adversary_swarm import made_up_model, shaped_artifact
from tests.swarm_records import ARTIFACT, node, node_id


async def test_a_node_measures_its_next_hops_and_its_heartbeat_carries_them() -> None:
    """TCP connects to the next hops' addresses, smoothed and bounded; a node's heartbeat names them by id."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    began = time.perf_counter()
    ms = await connect_ms(f"127.0.0.1:{port}")
    took = (time.perf_counter() - began) * 1e3
    assert ms is not None and 0 <= ms <= took  # milliseconds, of the connect alone: within the call
    assert await connect_ms("not an address") is None
    now = [0.0]
    trips = RoundTrips(clock=lambda: now[0])
    hop = Hop(node_id("b"), Span(15, 30), f"127.0.0.1:{port}")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(measure_round_trips, trips, lambda: [hop], every=0.05, look_every=0.01))
        with trio.fail_after(5):
            while not trips.snapshot():
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    listener.socket.close()
    assert set(trips.snapshot()) == {node_id("b")}
    trips.note(node_id("b"), 100.0)
    smoothed = trips.snapshot()[node_id("b")]
    assert 0 < smoothed < 100.0
    for i in range(MAX_PEERS + 5):
        trips.note(bytes([i]) * 32, 1.0)
    assert len(trips.snapshot()) == MAX_PEERS
    now[0] = 1e6  # not measured for long: no longer reported
    assert trips.snapshot() == {}
    load = NodeLoad(active_sessions=1, free_slots=2, queue_depth=0, step_ms=3.0, round_trips={node_id("b"): 4.5})
    assert load.heartbeat(node_id("a")).round_trips == {node_id("b").hex(): 4.5}


def _registration(me: Identity, **changes: Any) -> dict[str, Any]:
    body = {
        "node_id": me.node_id.hex(),
        "artifact": ARTIFACT,
        "model_name": "m",
        "n_layer": 30,
        "layers": [0, 30],
        "recipe": "0123456789abcdef",
        "address": "127.0.0.1:1",
        "relay": "",
        "tls_cert_sha256": "",
        "slots": 2,
        "ctx_per_session": 512,
    }
    body.update(changes)
    if "capability" not in changes:
        layers = body["layers"]
        body["capability"] = capability_record(
            me,
            artifact=body["artifact"],
            layers=(layers[0], layers[1]),
            recipe=body["recipe"],
            capability=Capability(2.0, ((1, 10.0), (2, 12.0)), 1, 1, 1, 2),
        )
    return body


def test_a_registration_speaks_the_node_description_and_the_record_keeps_all_of_it() -> None:
    """The JSON a node registers with keeps its keys; the tracker's record holds every field of its
    description (the hex ids as bytes), with what the tracker adds."""
    me = Identity.generate()
    body = _registration(me, tls_cert_sha256="ab" * 32, device="vulkan:0", kernel_class="vulkan:gpu")
    registration = Registration(**body)
    assert set(registration.model_dump(mode="json")) == {
        "node_id",
        "artifact",
        "model_name",
        "n_layer",
        "layers",
        "recipe",
        "address",
        "relay",
        "tls_cert_sha256",
        "slots",
        "ctx_per_session",
        "device",
        "kernel_class",
        "capability",
        "join_proof",
        "shape",
    }
    record = NodeRecord.of(registration, probe_required=True)
    assert record.node_id == me.node_id and record.tls_cert_sha256 == b"\xab" * 32 and record.probe_required
    for name, value in registration.description().model_dump().items():
        held = getattr(record, name)
        assert (held.hex() if isinstance(held, bytes) else held) == value, name


async def test_api_authenticates_nodes_and_issues_verifiable_tickets() -> None:
    tracker = Tracker(Identity.generate(), local_swarm=True, expire_after=2.0, api_key="gw-secret")
    me, other = Identity.generate(), Identity.generate()
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")

        async def post(path: str, body: dict[str, Any], signer: Identity, ts: int | None = None) -> httpx.Response:
            data = json.dumps(body).encode()
            headers = sign(signer, "POST", path, data, ts or int(time.time() * 1000))
            return await client.post(url + path, content=data, headers={**headers, "content-type": "application/json"})

        assert (await post("/v1/nodes/register", _registration(me), me)).status_code == 200
        # a node cannot register under another node's id, nor with a bad signature
        assert (await post("/v1/nodes/register", _registration(me), other)).status_code == 403
        unsigned = await client.post(url + "/v1/nodes/register", json=_registration(me))
        assert unsigned.status_code == 401
        # a replayed request is refused
        stamp = int(time.time() * 1000) + 5
        beat = {"node_id": me.node_id.hex(), "active_sessions": 0, "free_slots": 2, "queue_depth": 0, "step_ms": 3.0}
        assert (await post("/v1/nodes/heartbeat", beat, me, stamp)).status_code == 200
        assert (await post("/v1/nodes/heartbeat", beat, me, stamp)).status_code == 401
        assert (await post("/v1/nodes/register", _registration(me, layers=[5, 40]), me, stamp + 1)).status_code == 400
        # a node must send the capability it measured, signed by itself, for this very shard
        assert (await post("/v1/nodes/register", _registration(me, capability={}), me, stamp + 2)).status_code == 400
        theirs = _registration(other)["capability"]
        assert (
            await post("/v1/nodes/register", _registration(me, capability=theirs), me, stamp + 3)
        ).status_code == 400
        elsewhere = _registration(me, layers=[0, 15])["capability"]
        assert (
            await post("/v1/nodes/register", _registration(me, capability=elsewhere), me, stamp + 4)
        ).status_code == 400
        assert tracker.state.nodes[me.node_id].layers == (0, 30)

        with pytest.raises(TrackerError) as unauthorized:
            await request_route(client, url, ARTIFACT, 100)
        assert unauthorized.value.status == 401
        grant = await request_route(client, url, ARTIFACT, 100, api_key="gw-secret")
        assert [h.node_id for h in grant.hops] == [me.node_id]
        ticket = TicketVerifier([tracker.identity.node_id]).check(
            grant.ticket,
            session_id=grant.session_id,
            epoch=grant.epoch,
            artifact=bytes.fromhex(ARTIFACT),
            hops=grant.hops,
            node_id=me.node_id,
            index=0,
        )
        assert ticket.issuer == tracker.identity.node_id
        with pytest.raises(TrackerError) as none:
            await request_route(client, url, "cd" * 32, 100, api_key="gw-secret")
        assert none.value.status == 503
        nursery.cancel_scope.cancel()


async def test_a_mixed_grant_names_each_hops_recipe_and_the_session_names_them_together() -> None:
    cpu, gpu = "c" * 16, "9" * 16
    tracker = Tracker(Identity.generate(), local_swarm=True, mixes=[CoveredPair(ARTIFACT, cpu, gpu)])
    head, tail = Identity.generate(), Identity.generate()
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        for me, layers, recipe, device in ((head, [0, 13], cpu, "cpu"), (tail, [13, 30], gpu, "vulkan:0")):
            body = _registration(me, layers=layers, recipe=recipe, device=device)
            data = json.dumps(body).encode()
            headers = {**sign(me, "POST", "/v1/nodes/register", data, int(time.time() * 1000))}
            registered = await client.post(
                url + "/v1/nodes/register", content=data, headers={**headers, "content-type": "application/json"}
            )
            assert registered.status_code == 200, registered.text
        grant = await request_route(client, url, ARTIFACT, 100)
        assert [h.recipe_fingerprint.hex() for h in grant.hops] == [cpu, gpu]
        assert grant.recipe == route_recipe([bytes.fromhex(cpu), bytes.fromhex(gpu)])
        listed = (await client.get(url + "/v1/nodes")).json()
        assert listed["mixes"] == [{"artifact": ARTIFACT, "recipes": sorted([cpu, gpu])}]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "change",
    [
        {"address": "no-port"},
        {"address": "host:0"},
        {"address": "host:70000"},
        {"address": ":7000"},
        {"address": "a" * 64 + ":7000"},
        {"address": "a..b:7000"},
        {"address": "[not-v6]:7000"},
        {"relay": "http://relay:1"},
        {"relay": "ws://"},
        {"relay": "ws://relay:99999"},
        {"capability": {"body": "[" * 20_000, "signature": "00"}},
    ],
    ids=lambda c: next(iter(c)),
)
async def test_a_registration_that_peers_could_not_use_is_refused_and_the_tracker_serves_on(
    change: dict[str, Any],
) -> None:
    """What routes hand to peers must be dialable; JSON that breaks parsers is a 4xx, not a crash."""
    tracker = Tracker(Identity.generate(), local_swarm=True, expire_after=2.0)
    me = Identity.generate()
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")

        async def register(body: dict[str, Any]) -> int:
            data = json.dumps(body).encode()
            headers = sign(me, "POST", "/v1/nodes/register", data, int(time.time() * 1000))
            response = await client.post(
                url + "/v1/nodes/register", content=data, headers={**headers, "content-type": "application/json"}
            )
            return response.status_code

        assert await register(_registration(me, **change)) in (400, 422)
        assert me.node_id not in tracker.state.nodes
        assert await register(_registration(me, address="[::1]:7000", relay="wss://relay.example:443/")) == 200
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 5000,
        b'{"epoch": 1e999}',
        b"[]",
        b'{"session_id": "00", "epoch": 0, "ticket": "00", "recipe": "00", "hops": []}',
        b'{"error": "route granted"}',
    ],
)
async def test_a_malformed_route_grant_is_a_tracker_error(body: bytes) -> None:
    """A gateway reads the tracker's route with the tracker's own message type; nonsense is a TrackerError."""
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(TrackerError, match="malformed route") as refused:
            await request_route(client, "http://tracker", ARTIFACT, 100)
    assert refused.value.status == 200


async def test_nodes_register_again_after_a_tracker_restart() -> None:
    me = Identity.generate()
    first = Tracker(Identity.generate(), local_swarm=True, expire_after=2.0)
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()
        gone = trio.Event()

        async def serve(tracker: Tracker, port: int, task_status: trio.TaskStatus[str]) -> None:
            try:
                with scope:
                    await serve_http(tracker.app, f"127.0.0.1:{port}", task_status=task_status)
            finally:
                gone.set()

        url = await nursery.start(serve, first, 0)
        port = int(url.rsplit(":", 1)[1])
        link = TrackerLink(
            url,
            me,
            Registration(**_registration(me)),
            lambda: NodeLoad(active_sessions=0, free_slots=2, queue_depth=0, step_ms=1.0),
            retry_seconds=0.2,
        )
        await nursery.start(link.run)
        assert me.node_id in first.state.nodes
        scope.cancel()  # the tracker goes away...
        await gone.wait()  # (its port free again)
        second = Tracker(Identity.generate(), local_swarm=True, expire_after=2.0)
        scope, gone = trio.CancelScope(), trio.Event()
        await nursery.start(serve, second, port)  # ...and comes back empty
        # the tracker stores the node before the link has read the answer: wait for both
        with trio.fail_after(15):
            while me.node_id not in second.state.nodes or link.registrations < 2:
                await trio.sleep(0.1)
        assert link.registrations == 2
        nursery.cancel_scope.cancel()


async def test_a_node_the_tracker_counts_full_heartbeats_as_soon_as_a_slot_frees() -> None:
    """TrackerLink.slot_freed: the tracker takes a slot off per route it grants, so a node it may count
    full (one route on its way allowed for) says at once when one frees; one with room waits."""
    me = Identity.generate()
    tracker = Tracker(Identity.generate(), local_swarm=True)
    load = {"free_slots": 4, "sessions_opened": 0}
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        link = TrackerLink(
            url,
            me,
            Registration(**{**_registration(me), "slots": 4}),
            lambda: NodeLoad(active_sessions=4 - load["free_slots"], queue_depth=0, step_ms=1.0, **load),
        )
        await nursery.start(link.run)
        _beats_a_minute_apart_after_the_first(tracker)
        with trio.fail_after(10):
            while link.heartbeats < 1:  # the tracker heard "4 free"
                await trio.sleep(0.02)
        link.slot_freed()  # nothing routed here since: the tracker counts 4 free, no hurry
        load.update(free_slots=3, sessions_opened=2)  # two routed since, one of them over
        link.slot_freed()  # the tracker counts 2 free: still no hurry
        await trio.testing.wait_all_tasks_blocked()  # a link told to beat would have woken, and counted it
        assert link.early_heartbeats == 0 and link.heartbeats == 1
        for _ in range(4):  # four routes granted (a slot off each time); three sessions opened, one on its way
            tracker.state.note_session([me.node_id])
        load.update(free_slots=1, sessions_opened=3)
        assert tracker.state.nodes[me.node_id].free_slots == 0
        load.update(free_slots=2)  # one more ends
        link.slot_freed()
        # the next beat at the interval is a minute away; the link counts a beat once the tracker
        # answered it, after the tracker took it in (waiting on the tracker's count alone raced that)
        with trio.fail_after(10):
            while link.heartbeats < 2:
                await trio.sleep(0.01)
        assert link.early_heartbeats == 1 and link.heartbeats == 2
        assert tracker.state.nodes[me.node_id].free_slots == 2
        nursery.cancel_scope.cancel()


def test_the_heartbeat_interval_grows_with_the_swarm_and_expiry_with_each_nodes_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A swarm of N nodes beats every N / HEARTBEATS_PER_SECOND seconds (within its bounds); a node is
    dropped after EXPIRE_HEARTBEATS of the interval it was told, and never sooner than expire_after."""
    monkeypatch.setattr(registry, "HEARTBEATS_PER_SECOND", 2.0)  # 10 nodes: 5 s
    state = TrackerState(expire_after=10.0)
    assert state.heartbeat_seconds == registry.HEARTBEAT_SECONDS
    state.register(node("first", (0, 30)), 0.0)
    assert state.nodes[node_id("first")].beat_seconds == registry.HEARTBEAT_SECONDS
    for i in range(9):
        state.register(node(f"n{i}", (0, 30)), 0.0)
    assert state.heartbeat_seconds == 5.0
    for i in range(9):  # each heartbeat's answer tells the interval of the swarm now
        state.heartbeat(node_id(f"n{i}"), 1.0, active_sessions=0, free_slots=4, queue_depth=0, step_ms=9)
        assert state.nodes[node_id(f"n{i}")].beat_seconds == 5.0
    # the first, told 2 s, goes once silent past expire_after; those told 5 s once silent 3 beats
    assert state.expire(10.5) == [node_id("first")]
    assert state.expire(15.9) == []
    assert len(state.expire(16.1)) == 9
    # an operator's interval for a small swarm (--heartbeat-seconds): told to nodes, and expiry follows it
    quick = TrackerState(expire_after=1.0, heartbeat_seconds=1.0)
    quick.register(node("q", (0, 30)), 0.0)
    assert quick.heartbeat_seconds == quick.nodes[node_id("q")].beat_seconds == 1.0
    assert quick.expire(2.9) == [] and quick.expire(3.1) == [node_id("q")]
    for i in range(400):
        state.register(node(f"m{i}", (0, 30)), 20.0)
    # 200 s at 2 a second: bounded, or a vanished node would linger ten minutes
    assert state.heartbeat_seconds == registry.MAX_HEARTBEAT_SECONDS
    state.heartbeat(node_id("m0"), 21.0, active_sessions=0, free_slots=4, queue_depth=0, step_ms=9)
    assert state.nodes[node_id("m0")].beat_seconds == registry.MAX_HEARTBEAT_SECONDS
    assert node_id("m0") not in state.expire(21.0 + 3 * 60.0 - 1)
    assert node_id("m0") in state.expire(21.0 + 3 * 60.0 + 1)


async def test_a_node_beats_at_the_interval_the_trackers_latest_answer_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interval is in every heartbeat's answer: a node registered in a small swarm slows its beats
    when the swarm grows, and the tracker expires it by the interval it told it."""
    monkeypatch.setattr(registry, "HEARTBEATS_PER_SECOND", 10.0)
    tracker = Tracker(Identity.generate(), local_swarm=True, expire_after=0.5, heartbeat_seconds=0.2)
    me = Identity.generate()
    beats: list[float] = []  # when each heartbeat left
    kept: list[bool] = []  # whether the tracker's sweep kept the node then, the longest it had been silent

    def load() -> NodeLoad:
        beats.append(trio.current_time())
        tracker.expire(time.time())
        kept.append(me.node_id in tracker.state.nodes)
        return NodeLoad(active_sessions=0, free_slots=2, queue_depth=0, step_ms=1.0)

    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        link = TrackerLink(url, me, Registration(**_registration(me)), load)
        await nursery.start(link.run)
        assert link.interval == 0.2
        for i in range(14):  # others join: 15 nodes at 10 beats a second is a beat every 1.5 s
            tracker.state.register(node(f"n{i}", (0, 30)), time.time() + 3600)
        with trio.fail_after(10):
            while link.interval != 1.5:
                await trio.sleep(0.05)
        told = len(beats)  # the answer to one of these said 1.5 s, and so did every one since
        with trio.fail_after(10):
            while len(beats) < told + 2:
                await trio.sleep(0.05)
        # each beat after it waited the interval, give or take its tenth of jitter (at 0.2 s: 0.18 s apart)
        gaps = [b - a for a, b in itertools.pairwise(beats[told - 1 :])]
        assert min(gaps) >= 0.9 * 1.5, gaps
        # silent that long, beyond expire_after, the node was kept: told 1.5 s, it is expired by that
        assert all(kept), kept
        nursery.cancel_scope.cancel()


async def test_a_node_that_refuses_for_want_of_a_slot_tells_the_tracker_at_once_and_only_once() -> None:
    """TrackerLink.slot_refused: slots another tracker's routes took are news to this one; a node whose
    last heartbeat said it was full sends no more for each refusal."""
    me = Identity.generate()
    tracker = Tracker(Identity.generate(), local_swarm=True)
    load = {"free_slots": 4, "sessions_opened": 0}
    leases = LeaseManager(4, 64)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        link = TrackerLink(
            url,
            me,
            Registration(**{**_registration(me), "slots": 4}),
            lambda: NodeLoad(active_sessions=4 - load["free_slots"], queue_depth=0, step_ms=1.0, **load),
        )
        leases.on_refused.append(link.slot_refused)
        await nursery.start(link.run)
        _beats_a_minute_apart_after_the_first(tracker)
        with trio.fail_after(10):
            while link.heartbeats < 1:  # the tracker heard "4 free"
                await trio.sleep(0.02)
        held = [leases.acquire(16) for _ in range(4)]  # another tracker's sessions fill the node
        load.update(free_slots=0, sessions_opened=4)
        assert all(held) and tracker.state.nodes[me.node_id].free_slots == 4
        assert leases.acquire(16) is None  # refused: this tracker's count is 4 too many
        with trio.fail_after(10):  # the next beat at the interval is a minute away
            # the tracker holds the beat before its answer reaches the link, which counts it then
            while tracker.state.nodes[me.node_id].free_slots != 0 or link.heartbeats < 2:
                await trio.sleep(0.01)
        assert link.early_heartbeats == 1 and link.heartbeats == 2
        for _ in range(20):  # a flood of refusals: the tracker already knows
            assert leases.acquire(16) is None
        await trio.testing.wait_all_tasks_blocked()  # a link told to beat would have woken, and counted it
        assert link.early_heartbeats == 1
        nursery.cancel_scope.cancel()


def _beats_a_minute_apart_after_the_first(tracker: Tracker) -> None:
    """From the answer to its first heartbeat on, a node registered now beats a minute apart (the longest
    interval): within a test, every heartbeat but the first is an early one."""
    tracker.state.heartbeat_floor = registry.MAX_HEARTBEAT_SECONDS


# --- an artifact's shape, proven by its fingerprint


def test_a_shape_proof_proves_the_layer_count_its_fingerprint_hashes_and_nothing_else() -> None:
    """The proof of a model's shape gives its layer count; shown another count, fields that hash
    otherwise, another index, or sent for another artifact, it proves nothing."""
    artifact, sent = shaped_artifact(30)
    proof = ShapeProof(**sent)
    assert shapes.proven_layers(artifact, proof) == 30
    fields, index = made_up_model(30)
    swapped = [field_digest("llama.block_count", ggufio.uint32_field("llama.block_count", 31)).hex()]
    at = [key for key, _ in fields].index("llama.block_count")
    packed = base64.b64encode(zlib.compress("\n".join(sorted(e.line() for e in index[1:])).encode())).decode()
    forged = [
        proof.model_copy(update={"n_layer": 31}),  # the count shown is not the one hashed
        proof.model_copy(update={"n_layer": 31, "fields": [*proof.fields[:at], *swapped, *proof.fields[at + 1 :]]}),
        proof.model_copy(update={"architecture": "qwen3"}),
        proof.model_copy(update={"index": packed}),  # a tensor left out
        proof.model_copy(update={"n_layer_type": 6}),  # a float32 is no block count
        proof.model_copy(update={"n_layer_type": 0}),  # 30 as a uint8: another field's bytes
    ]
    for wrong in forged:
        with pytest.raises(shapes.ShapeError):
            shapes.proven_layers(artifact, wrong)
    with pytest.raises(shapes.ShapeError, match="do not hash"):
        shapes.proven_layers(shaped_artifact(31)[0], proof)


def test_an_oversized_shape_proof_is_refused_before_anything_is_decoded() -> None:
    """Too many fields, or a packed index past its bound, fail the message's own check; an index that
    unpacks past its bound stops there (a zip bomb inflates no further); a broken one is refused."""
    artifact, sent = shaped_artifact(30)
    with pytest.raises(ValueError, match="at most"):
        ShapeProof(**{**sent, "fields": ["00" * 32] * (MAX_SHAPE_FIELDS + 1)})
    with pytest.raises(ValueError, match="at most"):
        ShapeProof(**{**sent, "index": "A" * (MAX_SHAPE_INDEX_CHARS + 1)})
    bomb = base64.b64encode(zlib.compress(b"x" * (16 << 20), 9)).decode()
    assert len(bomb) < MAX_SHAPE_INDEX_CHARS
    with pytest.raises(shapes.ShapeError, match="more than"):
        shapes.proven_layers(artifact, ShapeProof(**{**sent, "index": bomb}))
    lines = base64.b64encode(zlib.compress(b"\n" * shapes.MAX_INDEX_TENSORS)).decode()
    with pytest.raises(shapes.ShapeError, match="more than"):
        shapes.proven_layers(artifact, ShapeProof(**{**sent, "index": lines}))
    for broken in ("AAAA", sent["index"][:-8]):
        with pytest.raises(shapes.ShapeError):
            shapes.proven_layers(artifact, ShapeProof(**{**sent, "index": broken}))


def test_proven_shapes_are_kept_while_their_artifact_is_served_and_bounded_after() -> None:
    """A shape stays while a node of its artifact is registered; of artifacts nobody serves, the longest
    idle go first past the bound, and all go after the time kept."""
    kept = shapes.ProvenShapes(kept=2, keep_seconds=100.0)
    kept.prove("served", 30, 0.0)
    kept.in_use("served")
    for k in range(5):
        kept.prove(f"made-up {k}", 31, float(k))
    assert kept.get("served") == 30 and len(kept) == 3
    assert kept.get("made-up 4") == 31 and kept.get("made-up 0") is None
    kept.expire(500.0)
    assert kept.get("served") == 30 and len(kept) == 1
    kept.idle("served", 500.0)
    kept.expire(550.0)
    assert kept.get("served") == 30
    kept.expire(601.0)
    assert kept.get("served") is None and len(kept) == 0


def test_a_proven_shape_drops_the_nodes_that_claimed_another_and_goes_some_time_after_the_last_node() -> None:
    """Learning an artifact's shape drops its nodes of another count; once its last node leaves, the shape
    is kept for a while, then forgotten."""
    state = TrackerState()
    for k, n_layer in enumerate((31, 31, 30)):
        state.register(attrs.evolve(node(chr(ord("a") + k), (0, n_layer)), n_layer=n_layer), 0.0)
    assert state.learn_shape(ARTIFACT, 30, 0.0) == [node_id("a"), node_id("b")]
    assert list(state.nodes) == [node_id("c")] and state.shape(ARTIFACT) == 30
    assert state.departed[-1][2] == "refused"
    state.leave(node_id("c"), 10.0)
    state.expire(10.0 + state.proven.keep_seconds / 2)
    assert state.shape_of(ARTIFACT) == 30
    state.expire(11.0 + state.proven.keep_seconds)
    assert state.shape_of(ARTIFACT) is None


def _compact(table: dict[Any, Any]) -> bool:
    """Whether ``table`` takes no more than a copy of it would: it kept no table of a larger past."""
    return sys.getsizeof(table) <= sys.getsizeof(dict(table))


def test_the_registry_shrinks_back_after_a_flood_of_throwaway_nodes_expires() -> None:
    """A flood registered around honest nodes of the same artifact and expired: the node map, the
    artifact's columns (arrays, row map, records) are back at the size of what stays, and the honest
    nodes' routes and measured seams are as before (their rows were renumbered)."""
    flood = 4000
    state = TrackerState()
    for i in range(flood // 2):  # the honest nodes' rows lie in the middle of the flood's
        state.register(node(f"flood{i}", (0, 30), recipe="0123456789abcdef"), 0.0)
    for record in (node("a", (0, 15)), node("b", (15, 30)), node("c", (15, 30))):
        state.register(record, 0.0)
    for i in range(flood // 2, flood):
        state.register(node(f"flood{i}", (0, 30), recipe=f"{i:016x}"), 0.0)
    columns = state._columns[ARTIFACT]
    assert columns.capacity >= flood and len(columns.recipe_codes) > flood // 2
    now = 1000.0  # long past the flood's expiry; the honest nodes beat
    for name, trips in (("a", {"b": 150.0, "c": 0.8}), ("b", {}), ("c", {})):
        state.heartbeat(
            node_id(name),
            now,
            active_sessions=0,
            free_slots=4,
            queue_depth=0,
            step_ms=10.0,
            round_trips={node_id(peer): ms for peer, ms in trips.items()},
        )
    gone = state.expire(now)
    assert len(gone) == flood and set(state.nodes) == {node_id(n) for n in "abc"}
    assert _compact(state.nodes) and state.compactions >= 1
    columns = state._columns[ARTIFACT]
    assert columns.capacity == MIN_CAPACITY and len(columns.records) <= MIN_CAPACITY and len(columns.vacant) < 64
    assert len(columns.rows) == 3 and len(columns.recipe_codes) <= 16
    assert sys.getsizeof(columns.rows) <= sys.getsizeof({i: i for i in range(MIN_CAPACITY)})
    # the measured seam a -> b (150 ms) still steers every route through c
    assert {tuple(r.node_id for r in state.choose(ARTIFACT, 10).nodes) for _ in range(30)} == {
        (node_id("a"), node_id("c"))
    }
    assert state.choose(ARTIFACT, 10).cost_ms == pytest.approx(10 + 1.0 + 10 + 0.8)
    state.register(node("d", (15, 30)), now)  # and newcomers take rows as before
    assert columns.rows[node_id("d")] < MIN_CAPACITY and columns.capacity == MIN_CAPACITY


def test_the_signature_replay_cache_shrinks_back_after_a_flood_of_keys_leaves_its_window() -> None:
    """Thousands of fresh keys each sign one request; once their window passed, one request prunes
    the cache, and its map of signers is back at the size of what it holds."""
    checker = SignatureChecker()
    now = 10_000_000
    body = b"{}"
    for _ in range(3000):
        me = Identity.generate()
        checker.check(sign(me, "POST", "/v1/nodes/register", body, now), "POST", "/v1/nodes/register", body, now)
    assert checker.statistics() == (3000, 3000)
    later = now + WINDOW_MS + 1
    me = Identity.generate()
    checker.check(sign(me, "POST", "/v1/nodes/leave", body, later), "POST", "/v1/nodes/leave", body, later)
    assert checker.statistics() == (1, 1)
    assert _compact(checker._seen) and checker.compactions == 1
