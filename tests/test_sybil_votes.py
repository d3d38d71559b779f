"""An open swarm under attack by votes: sybil identities voting a model's shape away, or
agreeing as auditors against an honest node, against a real tracker over HTTP.

Each test plays one attack (anyone can make a key and register) and asserts that honest
service is unharmed; the other attacks on the tracker and gateway are in tests/test_adversaries.py.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from noderuntime.access.identity import Identity
from noderuntime.control.admission import (
    PROBE_ROWS,
    SKETCH_DIM,
    ProbeAnswer,
    ProbeReferences,
)
from noderuntime.testing.usage import reported_usage
from noderuntime.tracker.audits import (
    auditor_weight,
    network_prefix,
)
from noderuntime.tracker.records import NodeRecord
from noderuntime.tracker.registry import TrackerState
from tests.adversary_swarm import ARTIFACT, RECIPE, Swarm, beat, open_swarm, shaped_artifact

# --- attack 2: taking a model away by vote


async def test_unadmitted_sybils_claiming_another_layer_count_cannot_take_the_model_away() -> None:
    """Three sybils that never pass a probe claim the 30-layer artifact has 31 layers: routes
    and an honest joiner's placement still go by the two admitted nodes' 30."""
    answer = ProbeAnswer(7, "00" * 32, (0.5,) * (PROBE_ROWS * SKETCH_DIM))
    halves = ((0, 15), (15, 30))
    references = ProbeReferences([((ARTIFACT, layers, RECIPE), answer) for layers in halves])
    async with open_swarm(references=references, require_probe=True) as swarm:
        for layers in halves:
            honest = Identity.generate()
            assert (await swarm.register(honest, layers)).json()["probe"] == {"seed": 7}
            reply = {"node_id": honest.node_id.hex(), **answer.to_json()}
            assert (await swarm.post("/v1/nodes/probe", reply, honest)).json()["passed"]
        for layers in ((0, 16), (16, 31), (0, 31)):
            sybil = Identity.generate()
            assert (await swarm.register(sybil, layers, n_layer=31)).status_code == 200
        await swarm.honest_service()
        assert (await swarm.client.get(swarm.url + "/v1/artifacts")).json()["artifacts"][ARTIFACT]["n_layer"] == 30
        joiner = Identity.generate()
        asked = {"node_id": joiner.node_id.hex(), "artifact": ARTIFACT, "n_layer": 30, "max_layers": 15}
        placed = await swarm.post("/v1/placement", asked, joiner)
        assert placed.status_code == 200, placed.text


async def test_unadmitted_sybils_on_a_range_do_not_make_it_look_served_to_placement() -> None:
    """Three sybils register on 0:15 and never answer their probes: the range is as unserved as
    before, and an honest joiner is placed there, not beside the one admitted node on 15:30."""
    answer = ProbeAnswer(7, "00" * 32, (0.5,) * (PROBE_ROWS * SKETCH_DIM))
    halves = ((0, 15), (15, 30))
    references = ProbeReferences([((ARTIFACT, layers, RECIPE), answer) for layers in halves])
    async with open_swarm(references=references, require_probe=True) as swarm:
        honest = Identity.generate()
        assert (await swarm.register(honest, (15, 30))).json()["probe"] == {"seed": 7}
        reply = {"node_id": honest.node_id.hex(), **answer.to_json()}
        assert (await swarm.post("/v1/nodes/probe", reply, honest)).json()["passed"]
        for _ in range(3):
            assert (await swarm.register(Identity.generate(), (0, 15))).status_code == 200
        assert swarm.tracker.placement.capacity(ARTIFACT, 30, time.time()).max() == 0.0
        joiner = Identity.generate()
        asked = {"node_id": joiner.node_id.hex(), "artifact": ARTIFACT, "n_layer": 30, "max_layers": 15}
        placed = await swarm.post("/v1/placement", asked, joiner)
        assert placed.status_code == 200 and placed.json()["layers"] == [0, 15], placed.text


async def test_sybils_claiming_another_layer_count_on_default_settings_cannot_take_the_model_away() -> None:
    """No manifest, no probes: three sybils claim the 30-layer artifact has 31 layers, before the
    honest nodes come and after. The honest nodes' registrations prove its 30 by its fingerprint:
    the sybils that came first are dropped, and every sybil registration after is refused, whether
    it sends no proof, the artifact's own proof, or one that shows 31."""
    artifact, proof = shaped_artifact(30)
    sybil_ranges = ((0, 16), (16, 31), (0, 31))
    async with open_swarm() as swarm:
        early = [Identity.generate() for _ in sybil_ranges]
        for sybil, layers in zip(early, sybil_ranges, strict=True):
            assert (await swarm.register(sybil, layers, artifact=artifact, n_layer=31)).status_code == 200
        for layers in ((0, 15), (15, 30)):
            answer = await swarm.register(Identity.generate(), layers, artifact=artifact, shape=proof)
            assert answer.status_code == 200, answer.text
        for sybil in early:  # dropped: told to register again, and refused then
            assert (await swarm.post("/v1/nodes/heartbeat", beat(sybil), sybil)).status_code == 404
        forged = {**proof, "n_layer": 31}
        for shape in (None, proof, forged):
            for layers in sybil_ranges:
                sybil = Identity.generate()
                answer = await swarm.register(sybil, layers, artifact=artifact, n_layer=31, shape=shape)
                assert answer.status_code == 409, answer.text
        assert {r.n_layer for r in swarm.tracker.state.nodes.values()} == {30}
        granted = await swarm.route(artifact=artifact)
        assert granted.status_code == 200, granted.text
        assert (await swarm.client.get(swarm.url + "/v1/artifacts")).json()["artifacts"][artifact]["n_layer"] == 30
        joiner = Identity.generate()
        asked = {"node_id": joiner.node_id.hex(), "artifact": artifact, "n_layer": 31, "max_layers": 15}
        assert (await swarm.post("/v1/placement", asked, joiner)).status_code == 409


async def test_a_forged_shape_proof_for_an_artifact_nobody_proved_yet_is_refused() -> None:
    """The first registrant of an artifact cannot set its shape with a proof that does not hash to it."""
    artifact, proof = shaped_artifact(30)
    _, other = shaped_artifact(31)  # a real proof, of another artifact
    async with open_swarm() as swarm:
        for shape in ({**proof, "n_layer": 31}, other):
            answer = await swarm.register(Identity.generate(), (0, 31), artifact=artifact, n_layer=31, shape=shape)
            assert answer.status_code == 400 and "shape proof" in answer.text, answer.text
        assert swarm.tracker.state.shape_of(artifact) is None and not swarm.tracker.state.nodes


def test_a_manifest_gives_the_shape_and_no_vote_changes_it() -> None:
    """Where the tracker holds an artifact's manifest, its layer count is the manifest's."""
    state = TrackerState(shapes={ARTIFACT: 30})
    for k, layers in enumerate(((0, 16), (16, 31))):
        record = NodeRecord(
            node_id=bytes([k]) * 32,
            artifact=ARTIFACT,
            n_layer=31,
            layers=layers,
            recipe=RECIPE,
            address="a:1",
            relay="",
            tls_cert_sha256=b"",
            slots=4,
            ctx_per_session=512,
        )
        state.register(record, 0.0)
    assert state.shape(ARTIFACT) == 30 and state.artifacts()[ARTIFACT]["n_layer"] == 30
    assert not state.routable(ARTIFACT)


# --- attack 1: framing an honest node through audits


async def test_a_client_cannot_steer_its_audits_to_auditors_of_its_choosing() -> None:
    """A client that names every other node in ``exclude`` but its sybil does not get the sybil as
    its auditor each time: the tracker alone picks, and a second audit of a session never
    reuses the first's auditors."""
    async with open_swarm() as swarm:
        nodes = [Identity.generate() for _ in range(5)]
        for me in nodes:
            assert (await swarm.register(me, slots=64)).status_code == 200
        client = Identity.generate()

        async def session() -> tuple[str, bytes]:
            granted = await swarm.route(client=client.node_id.hex())
            assert granted.status_code == 200, granted.text
            return granted.json()["ticket"], bytes.fromhex(granted.json()["hops"][0]["node_id"])

        async def audit(ticket: str, exclude: list[bytes]) -> httpx.Response:
            asked = {"ticket": ticket, "exclude": [n.hex() for n in exclude]}
            return await swarm.post("/v1/audits", asked, client)

        steered = 0
        for _ in range(12):
            ticket, victim = await session()
            sybil = next(n.node_id for n in nodes if n.node_id != victim)
            honest = [n.node_id for n in nodes if n.node_id not in (victim, sybil)]
            granted = await audit(ticket, honest)
            assert granted.status_code == 200, granted.text
            steered += bytes.fromhex(granted.json()["hops"][0]["node_id"]) == sybil
        assert steered < 12
        ticket, victim = await session()
        auditors = []
        for _ in range(4):
            granted = await audit(ticket, [])
            assert granted.status_code == 200, granted.text
            auditors.append(granted.json()["hops"][0]["node_id"])
        assert len(set(auditors)) == 4 and victim.hex() not in auditors
        assert (await audit(ticket, [])).status_code == 503  # every other node has audited it


def usage(me: Identity, session: str, *, audit: bool, output: str) -> dict[str, Any]:
    """A usage record signed by ``me`` for layers 0:30 of ``session`` (hex) that gave out ``output``."""
    return reported_usage(me, layers=(0, 30), session=session, artifact=ARTIFACT, audit=audit, output=output)


HONEST_ROWS, FORGED_ROWS = "22" * 32, "33" * 32


async def frame(swarm: Swarm, victim: Identity, sybils: list[Identity], referee: Identity | None = None) -> Any:
    """A sybil client runs a session through ``victim``, has it audited by the two sybils (the only
    other nodes, so the tracker must pick them), and both say the victim's rows were wrong. With
    ``referee`` (registered only now, so that it audits nothing before), a third audit goes through
    it, and it recomputes honestly. The tracker's verdict."""
    client = sybils[0]
    others = [s.node_id.hex() for s in sybils]
    granted = await swarm.route(client=client.node_id.hex(), exclude=others)
    assert granted.status_code == 200, granted.text
    assert granted.json()["hops"][0]["node_id"] == victim.node_id.hex()
    ticket, session = granted.json()["ticket"], granted.json()["session_id"]
    audits: dict[str, list[dict[str, str]]] = {}
    for _ in sybils:
        audit = await swarm.post("/v1/audits", {"ticket": ticket}, client)
        assert audit.status_code == 200, audit.text
        auditor = next(s for s in sybils if s.node_id.hex() == audit.json()["hops"][0]["node_id"])
        audit_session = audit.json()["session_id"]
        audits[audit_session] = [usage(auditor, audit_session, audit=True, output=FORGED_ROWS)]
    if referee is not None:
        assert (await swarm.register(referee, slots=64)).status_code == 200
        audit = await swarm.post("/v1/audits", {"ticket": ticket, "referee": True}, client)
        assert audit.status_code == 200, audit.text
        assert audit.json()["hops"][0]["node_id"] == referee.node_id.hex()
        audit_session = audit.json()["session_id"]
        audits[audit_session] = [usage(referee, audit_session, audit=True, output=HONEST_ROWS)]
    report = {"audited": [usage(victim, session, audit=False, output=HONEST_ROWS)], "audits": audits}
    verdict = await swarm.post("/v1/audits/report", report, client)
    assert verdict.status_code == 200, verdict.text
    return verdict.json()


async def test_two_sybil_auditors_agreeing_against_an_honest_node_do_not_exclude_it() -> None:
    """Without a referee, two auditors' agreement accuses a node (the reporter avoids it) and never
    excludes it; with one, the referee's honest re-execution outvotes both sybils. Either way the
    victim stays in routes, even after it registers again."""
    for referee in (None, Identity.generate()):
        options = {"referees": [referee.node_id]} if referee is not None else {}
        async with open_swarm(**options) as swarm:
            victim, sybils = Identity.generate(), [Identity.generate(), Identity.generate()]
            for me in (victim, *sybils):
                assert (await swarm.register(me, slots=64)).status_code == 200
            verdict = await frame(swarm, victim, sybils, referee)
            assert verdict["failed"] == [], verdict
            if referee is None:
                assert [a["node_id"] for a in verdict["accused"]] == [victim.node_id.hex()]
                assert swarm.tracker.grants.audits.standing_of(victim.node_id).suspected == 1
            else:
                assert verdict["accused"] == [] and victim.node_id.hex() in verdict["passed"]
                assert sorted(verdict["outvoted"]) == sorted(s.node_id.hex() for s in sybils)
            assert not swarm.tracker.grants.audits.excluded(victim.node_id)
            assert (await swarm.register(victim, slots=64)).status_code == 200
            assert swarm.tracker.state.nodes[victim.node_id].admitted
            others = [s.node_id.hex() for s in sybils] + ([referee.node_id.hex()] if referee else [])
            assert (await swarm.route(exclude=others)).status_code == 200


async def test_a_node_is_excluded_when_a_referee_confirms_two_auditors() -> None:
    """The referee's signed re-execution agrees with the two auditors: the node is excluded, and a
    referee audit is granted only after two audits of the session."""
    referee = Identity.generate()
    async with open_swarm(referees=[referee.node_id]) as swarm:
        cheater, auditors = Identity.generate(), [Identity.generate(), Identity.generate()]
        for me in (cheater, *auditors):
            assert (await swarm.register(me, slots=64)).status_code == 200
        client = auditors[0]
        granted = await swarm.route(client=client.node_id.hex(), exclude=[a.node_id.hex() for a in auditors])
        ticket, session = granted.json()["ticket"], granted.json()["session_id"]
        early = await swarm.post("/v1/audits", {"ticket": ticket, "referee": True}, client)
        assert early.status_code == 409, early.text
        audits: dict[str, list[dict[str, str]]] = {}
        for _ in auditors:
            audit = (await swarm.post("/v1/audits", {"ticket": ticket}, client)).json()
            auditor = next(a for a in auditors if a.node_id.hex() == audit["hops"][0]["node_id"])
            audits[audit["session_id"]] = [usage(auditor, audit["session_id"], audit=True, output=HONEST_ROWS)]
        assert (await swarm.register(referee, slots=64)).status_code == 200
        audit = (await swarm.post("/v1/audits", {"ticket": ticket, "referee": True}, client)).json()
        audits[audit["session_id"]] = [usage(referee, audit["session_id"], audit=True, output=HONEST_ROWS)]
        report = {"audited": [usage(cheater, session, audit=False, output=FORGED_ROWS)], "audits": audits}
        verdict = (await swarm.post("/v1/audits/report", report, client)).json()
        assert [f["node_id"] for f in verdict["failed"]] == [cheater.node_id.hex()], verdict
        assert "referee" in swarm.tracker.grants.audits.excluded(cheater.node_id)
        assert not swarm.tracker.state.nodes[cheater.node_id].admitted


def test_auditor_choice_weighs_against_newcomers_and_the_audited_nodes_network() -> None:
    """A node that joined a minute ago, or that shares the audited node's /24, is drawn far less
    often than a seasoned node of another network."""
    audited = [network_prefix("203.0.113.5:7000")]
    seasoned = auditor_weight(7200.0, "198.51.100.9:7000", audited)
    assert seasoned == 1.0
    assert auditor_weight(60.0, "198.51.100.9:7000", audited) < 0.1 * seasoned
    assert auditor_weight(7200.0, "203.0.113.77:7000", audited) < 0.1 * seasoned
    assert network_prefix("[2001:db8::1]:7000") == network_prefix("[2001:db8::2]:9") != network_prefix("")
