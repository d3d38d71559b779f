"""The swarm map's JSON: what the tracker aggregates for its page (pure), and who may read it (over ASGI)."""

from __future__ import annotations

import json
import random
import urllib.error

import attrs
import httpx
import pytest
import trio

from noderuntime.access.identity import Identity
from noderuntime.operations.httpserve import serve_http
from noderuntime.tracker import status, swarm
from noderuntime.tracker.app import Tracker
from noderuntime.tracker.messages import NodeQuery
from noderuntime.tracker.records import NodeRecord
from noderuntime.tracker.registry import TrackerState

ARTIFACT = "ab" * 32


def node(name: str, layers: tuple[int, int], *, step: float = 10.0, relay: bool = False) -> NodeRecord:
    """A node that measured nothing: the tracker takes it at ``step`` ms, 4 slots."""
    return NodeRecord(
        node_id=name.encode().ljust(32, b"."),
        artifact=ARTIFACT,
        n_layer=30,
        layers=layers,
        recipe="r" * 16,
        address="" if relay else f"{name}:1",
        relay="ws://relay" if relay else "",
        tls_cert_sha256=b"",
        slots=4,
        ctx_per_session=2048,
        step_ms=step,
    )


def state_with(*records: NodeRecord) -> TrackerState:
    state = TrackerState(rng=random.Random(0))
    for record in records:
        state.register(record, 0.0)
    return state


def test_the_swarm_status_cuts_the_layers_where_ranges_meet_and_marks_the_thinnest() -> None:
    slow = node("c", (0, 10), step=40.0)
    failed = attrs.evolve(node("d", (10, 30)), probe_required=True, probe_passed=False)
    state = state_with(node("a", (0, 10)), node("b", (10, 30), relay=True), slow, failed, node("e", (0, 30)))
    state.leave(b"e".ljust(32, b"."), 3.0)
    status = swarm.swarm_status(state, 4.0, routes_issued=7)
    (model,) = status.models
    assert (model.n_layer, model.nodes, model.admitted, model.routable) == (30, 4, 3, True)
    strip = [(s.start, s.end, s.nodes, s.admitted, s.tokens_per_s, s.thin) for s in model.segments]
    # a and c measured nothing: taken at their step times, 4 slots each (400 and 100 tokens/s)
    assert strip == [(0, 10, 2, 2, 500.0, False), (10, 30, 2, 1, 400.0, True)]
    assert [(b.start, b.end, b.nodes, b.admitted) for b in model.bands] == [(0, 10, 2, 2), (10, 30, 2, 1)]
    # the routes the tracker would pick from, cheapest first; the failed node is in none
    hops = [[h.node_id[:2] for h in r.hops] for r in model.routes]
    assert hops == [["61", "62"], ["63", "62"]] and [r.near_equal for r in model.routes] == [True, False]
    assert model.probes == {"none": 3, "failed": 1} and model.slow == 1
    assert model.reachability == {"direct": 3, "relay-only": 1}
    assert [(d.node_id[:2], d.why, d.seconds_ago) for d in status.departed] == [("65", "left", 1.0)]


def test_a_thousand_nodes_make_a_status_of_bounded_size_and_come_a_page_at_a_time() -> None:
    rng = random.Random(3)
    records = []
    for i in range(1000):
        start = rng.randrange(0, 29)
        records.append(node(f"n{i}", (start, rng.randrange(start + 1, 31)), step=rng.uniform(5, 50), relay=i % 3 == 0))
    state = state_with(*records)
    status = swarm.swarm_status(state, 1.0, routes_issued=0)
    (model,) = status.models
    # no list in it grows with the nodes
    assert len(model.segments) <= 30 and len(model.bands) == swarm.BANDS_SHOWN and len(model.routes) == 5
    assert model.bands_not_shown == len({r.layers for r in records}) - swarm.BANDS_SHOWN
    assert len(json.dumps(status.model_dump(mode="json"))) < 20_000
    assert [s.nodes for s in model.segments] == [
        sum(r.layers[0] <= s.start < r.layers[1] for r in records) for s in model.segments
    ]
    page = swarm.node_page(state, NodeQuery(), 1.0)
    assert page.total == 1000 and len(page.nodes) == 25
    assert [n.layers for n in page.nodes] == sorted(n.layers for n in page.nodes)
    holding = swarm.node_page(state, NodeQuery(layer=29, state="relay", limit=200), 1.0)
    expected = [r for r in records if r.layers[1] == 30 and r.relay]
    assert holding.total == len(expected) and {n.node_id for n in holding.nodes} == {r.node_id.hex() for r in expected}
    found = swarm.node_page(state, NodeQuery(q=records[7].node_id.hex()[:6].upper()), 1.0)
    assert found.total >= 1 and records[7].node_id.hex() in {n.node_id for n in found.nodes}
    slowest = swarm.node_page(state, NodeQuery(sort="step", limit=1), 1.0).nodes[0]
    per_layer = max(records, key=lambda r: r.estimated_step_ms() / (r.layers[1] - r.layers[0]))
    assert slowest.slow and slowest.node_id == per_layer.node_id.hex()
    beyond = swarm.node_page(state, NodeQuery(offset=1000), 1.0)
    assert beyond.total == 1000 and beyond.nodes == []


async def test_the_map_and_the_node_lists_need_the_status_key_when_there_is_one() -> None:
    tracker = Tracker(Identity.generate(), status_key="look-here")
    me = Identity.generate()
    tracker.state.register(
        NodeRecord(me.node_id, ARTIFACT, 30, (0, 30), "0" * 16, "h:1", "", b"", 2, 512, model_name="<b>m</b>"), 0.0
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(tracker.app), base_url="http://tracker") as http:
        page = await http.get("/")
        assert page.status_code == 401 and "status key" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for path in ("/v1/status", "/v1/status/nodes", "/v1/nodes"):
            assert (await http.get(path)).status_code == 401
            assert (await http.get(path, headers={"authorization": "Bearer wrong"})).status_code == 401
            assert (await http.get(path, headers={"authorization": "Bearer look-here"})).status_code == 200
            assert (await http.get(path, params={"key": "look-here"})).status_code == 200
        opened = await http.get("/", params={"key": "look-here"})
        assert opened.status_code == 200 and opened.headers["content-type"].startswith("text/html")
        assert 'src="web/swarm.js"' in opened.text
        # the page's own files hold no data: no key; and no other file is served
        script = await http.get("/web/swarm.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        for path in ("/web/chat.js", "/web/__init__.py", "/web/..%2Fapp.py", "/web/"):
            assert (await http.get(path)).status_code == 404, path
        # what nodes and gateways read stays open
        assert (await http.get("/v1/artifacts")).status_code == 200 and (await http.get("/v1/info")).status_code == 200
        listed = (await http.get("/v1/status/nodes", params={"key": "look-here"})).json()
        assert listed["total"] == 1 and listed["nodes"][0]["model_name"] == "<b>m</b>"
        assert "address" not in listed["nodes"][0]  # nothing on the map tells where a node is


@pytest.mark.parametrize(
    "query",
    [
        {"limit": "0"},
        {"limit": "201"},
        {"limit": "many"},
        {"offset": "-1"},
        {"layer": "-1"},
        {"layer": "1e3"},
        {"artifact": "xyz"},
        {"state": "asleep"},
        {"sort": "name"},
        {"q": "x" * 101},
        {"unknown": "1"},
    ],
    ids=lambda q: "-".join(q),
)
async def test_a_node_query_the_tracker_cannot_answer_is_a_422_that_says_which_field(query: dict[str, str]) -> None:
    tracker = Tracker(Identity.generate())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(tracker.app), base_url="http://tracker") as http:
        refused = await http.get("/v1/status/nodes", params=query)
        assert refused.status_code == 422
        assert refused.json()["detail"][0]["loc"] == ["query", next(iter(query))]
        assert (await http.get("/v1/status/nodes")).status_code == 200  # and it serves on


async def test_status_reads_a_tracker_with_a_status_key() -> None:
    tracker = Tracker(Identity.generate(), status_key="look-here")
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        nodes, _ = await trio.to_thread.run_sync(status.fetch, url, "look-here")
        assert nodes == []
        with pytest.raises(urllib.error.HTTPError) as refused:
            await trio.to_thread.run_sync(status.fetch, url)
        assert refused.value.code == 401
        nursery.cancel_scope.cancel()
