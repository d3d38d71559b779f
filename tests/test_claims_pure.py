"""Promises the docstrings make, each checked where no other test checked it: plain
synchronous code, no event loop (a few write a file under the test's own directory)."""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from noderuntime.access import identity as ids
from noderuntime.access import signing, untrusted
from noderuntime.access.tickets import ReplayGuard, TicketError
from noderuntime.control import admission
from noderuntime.control.admission import AdmissionError, Capability, ProbeReferences
from noderuntime.control.ledger import USAGE_DOMAIN, Ledger, check
from noderuntime.engine.base import token_logprob
from noderuntime.gateway.errors import run_error
from noderuntime.gateway.shaping import check_logprobs
from noderuntime.gateway.textstream import TextStream
from noderuntime.runner.policy import RunError, route_error, to_exclude
from noderuntime.seams.client import GenerationRequest, RouteError
from noderuntime.tracker.app import PROBE_ANSWER_SECONDS, Tracker
from noderuntime.tracker.client import RouteGrant
from noderuntime.tracker.records import NodeRecord
from noderuntime.tracker.registry import TrackerState
from noderuntime.tracker.routechoice import NoRoute
from protocol import Header, Hop, Identity, Phase, Sampling, Span, StatusCode, TokenLogprob, Tokens, UsageRecord

# --- access


def test_a_signature_made_for_one_domain_verifies_for_no_other_and_junk_never_raises() -> None:
    """identity.py: "a signature made for one purpose never verifies for another"."""
    me = ids.Identity.generate()
    signature = me.sign(b"usage", b"body")
    assert ids.verify(me.node_id, b"usage", b"body", signature)
    assert not ids.verify(me.node_id, b"ticket", b"body", signature)
    # the domain and the message are joined with a separator: moving bytes across it is another message
    assert not ids.verify(me.node_id, b"usag", b"ebody", signature)
    assert not ids.verify(ids.Identity.generate().node_id, b"usage", b"body", signature)
    # a peer's junk is a False, never an exception
    for node_id, sig in ((b"", signature), (b"\x00" * 32, signature), (me.node_id, b"x" * 63), (b"\xff" * 32, b"")):
        assert ids.verify(node_id, b"usage", b"body", sig) is False


def test_a_node_key_is_made_once_private_and_reused(tmp_path: Path) -> None:
    """identity.py: the key "is created at first start, stored ... (PEM, mode 0600) and reused afterwards"."""
    first = ids.load_or_create(tmp_path / "node")
    path = tmp_path / "node" / ids.KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ids.load_or_create(tmp_path / "node").node_id == first.node_id
    path.write_bytes(b"not a key")
    with pytest.raises(ids.IdentityError, match="not a readable private key"):
        ids.load_or_create(tmp_path / "node")


def test_signed_requests_must_be_fresh_accepted_once_and_intact() -> None:
    """signing.py: fresh "and each accepted once"; "it does not ask timestamps to increase"."""
    me = ids.Identity.generate()
    checker = signing.SignatureChecker()
    now = 1_700_000_000_000
    body = b'{"load": 1}'
    headers = signing.sign(me, "POST", "/v1/nodes/heartbeat", body, now)
    assert checker.check(headers, "POST", "/v1/nodes/heartbeat", body, now + 10) == me.node_id
    with pytest.raises(signing.SignatureError, match="replayed"):
        checker.check(headers, "POST", "/v1/nodes/heartbeat", body, now + 20)
    # a concurrent request signed a moment before, arriving after: accepted, once
    older = signing.sign(me, "POST", "/v1/nodes/heartbeat", body, now - 1)
    assert checker.check(older, "POST", "/v1/nodes/heartbeat", body, now + 20) == me.node_id
    with pytest.raises(signing.SignatureError, match="replayed"):
        checker.check(older, "POST", "/v1/nodes/heartbeat", body, now + 30)
    # the memory of accepted requests is bounded; a full one refuses, and forgets what expired
    small = signing.SignatureChecker(capacity=1)
    small.check(headers, "POST", "/v1/nodes/heartbeat", body, now)
    with pytest.raises(signing.SignatureError, match="too many"):
        small.check(older, "POST", "/v1/nodes/heartbeat", body, now)
    later = signing.sign(me, "POST", "/v1/nodes/heartbeat", body, now + signing.WINDOW_MS + 5)
    assert small.check(later, "POST", "/v1/nodes/heartbeat", body, now + signing.WINDOW_MS + 5) == me.node_id
    stale = signing.sign(me, "POST", "/v1/nodes/heartbeat", body, now + 1)
    with pytest.raises(signing.SignatureError, match="too far"):
        checker.check(stale, "POST", "/v1/nodes/heartbeat", body, now + 1 + 10 * 60_000)  # ten minutes old
    fresh = signing.sign(me, "POST", "/v1/nodes/heartbeat", body, now + 2)
    for method, path, sent in (("POST", "/v1/nodes/heartbeat", b"{}"), ("POST", "/v1/nodes/register", body)):
        with pytest.raises(signing.SignatureError, match="does not verify"):
            checker.check(fresh, method, path, sent, now + 2)
    for broken in ({}, {**fresh, "x-node-id": "zz"}, {**fresh, "x-timestamp": "soon"}, {**fresh, "x-signature": "q"}):
        with pytest.raises(signing.SignatureError, match="malformed"):
            checker.check(broken, "POST", "/v1/nodes/heartbeat", body, now + 2)


def test_the_replay_guard_is_bounded_and_forgets_only_expired_tickets() -> None:
    """tickets.py: ReplayGuard "remembers accepted tickets until they expire (bounded)"."""
    guard = ReplayGuard(capacity=2)
    guard.accept((b"a", 0, b"n"), expires_unix_ms=1_000, now_ms=0)
    with pytest.raises(TicketError, match="replay") as replayed:
        guard.accept((b"a", 0, b"n"), expires_unix_ms=1_000, now_ms=500)
    assert replayed.value.code is StatusCode.PERMISSION_DENIED
    guard.accept((b"a", 0, b"n"), expires_unix_ms=3_000, now_ms=1_500)  # expired: forgotten
    guard.accept((b"b", 0, b"n"), expires_unix_ms=5_000, now_ms=1_500)
    with pytest.raises(TicketError, match="too many") as full:
        guard.accept((b"c", 0, b"n"), expires_unix_ms=5_000, now_ms=1_600)  # both still live
    assert full.value.code is StatusCode.RESOURCE_EXHAUSTED
    guard.accept((b"c", 0, b"n"), expires_unix_ms=5_000, now_ms=3_500)  # a's expiry made room


def test_a_ticket_checks_who_opened_the_seam_before_it_is_used_up() -> None:
    """tickets.py: the dialer "must be the hop the ticket puts before node_id, or its client at the head",
    "checked before the ticket is used up"."""
    from noderuntime.access.tickets import TicketVerifier, issue
    from protocol import Hop, Span

    issuer, head, tail, client, stranger = (ids.Identity.generate() for _ in range(5))
    hops = [Hop(head.node_id, Span(0, 1)), Hop(tail.node_id, Span(1, 2))]
    ticket = issue(issuer, session_id=b"s" * 16, epoch=0, artifact=b"a" * 32, hops=hops, client=client.node_id)
    for node, index, right in ((tail, 1, head), (head, 0, client)):
        verifier = TicketVerifier([issuer.node_id])
        check = dict(session_id=b"s" * 16, epoch=0, artifact=b"a" * 32, hops=hops, node_id=node.node_id, index=index)
        with pytest.raises(TicketError, match="puts before this node") as refused:
            verifier.check(ticket, dialer=stranger.node_id, **check)  # type: ignore[arg-type]
        assert refused.value.code is StatusCode.PERMISSION_DENIED
        verifier.check(ticket, dialer=right.node_id, **check)  # type: ignore[arg-type]  # not used up above
    nameless = issue(issuer, session_id=b"s" * 16, epoch=0, artifact=b"a" * 32, hops=hops)
    with pytest.raises(TicketError, match="names no client"):
        TicketVerifier([issuer.node_id]).check(
            nameless, session_id=b"s" * 16, epoch=0, artifact=None, hops=None, node_id=head.node_id, dialer=b"x" * 32
        )


@pytest.mark.parametrize(
    "address",
    [
        "",
        ":",
        "host",
        "host:",
        ":80",
        "host:0",
        "host:65536",
        "host:-1",
        "host:99999999999999999999999",
        "a" * 64 + ":80",
        "a..b:80",
        ".:80",
        "\ud800:80",
        "ho st:80",
        "\x00:80",
        "[::1:80",
        "[zz]:80",
        "[]:80",
        "1:2:3:80",
        "é" * 80 + ":80",
    ],
)
def test_a_malformed_address_is_a_value_error_and_nothing_else(address: str) -> None:
    """untrusted.py: "Everything here raises ValueError and nothing else"."""
    with pytest.raises(ValueError) as refused:
        untrusted.host_port(address)
    assert type(refused.value) is ValueError  # not a UnicodeError or other subclass


def test_a_well_formed_address_is_read() -> None:
    assert untrusted.host_port("[::1]:7000") == ("::1", 7000)
    assert untrusted.host_port("node-1.example:443") == ("node-1.example", 443)
    assert untrusted.host_port("0.0.0.0:0", listen=True) == ("0.0.0.0", 0)


# --- control


def _answer(seed: int, scale: float = 1.0) -> admission.ProbeAnswer:
    output = np.random.default_rng(7).standard_normal((admission.PROBE_ROWS, 64)).astype(np.float32) * scale
    return admission.answer_for(seed, output)


def test_a_probe_answer_passes_on_its_digest_or_within_tolerance_and_nothing_else() -> None:
    """admission.compare: "Exact digest match passes; otherwise the sketches must agree to tolerance"."""
    reference = _answer(11)
    assert admission.compare(reference, _answer(11)) == admission.Verdict(True, True, 0.0)
    near = _answer(11, scale=1.0 + 1e-5)  # another rounding of the same weights: digest differs, sketch agrees
    verdict = admission.compare(reference, near)
    assert verdict.passed and not verdict.exact and 0 < verdict.relative_error <= admission.DEFAULT_TOLERANCE
    far = admission.compare(reference, _answer(11, scale=1.01))
    assert not far.passed and not far.exact
    assert not admission.compare(reference, _answer(12)).passed  # another seed's answer
    # what a node sends is its word: a sketch of NaNs (which parses) never passes
    nan = admission.ProbeAnswer.from_json({"seed": 11, "digest": "0" * 64, "sketch": ["nan"] * len(reference.sketch)})
    nan_verdict = admission.compare(reference, nan)
    assert not nan_verdict.passed and nan_verdict.relative_error == math.inf


def test_a_reference_file_that_breaks_the_json_parser_is_an_admission_error(tmp_path: Path) -> None:
    """admission.ProbeReferences.load: "AdmissionError names the first bad one"."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"references": []}))
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000)
    with pytest.raises(AdmissionError, match=r"nested\.json"):
        ProbeReferences.load([good, nested])


def test_a_flagged_usage_record_is_kept_with_its_reason_and_never_counted(tmp_path: Path) -> None:
    """ledger.py: "a record that fails is kept, flagged with the reason, and never counted"."""
    node = ids.Identity.generate()
    hops = [Hop(node.node_id, Span(0, 30))]

    def record(**changes: Any) -> UsageRecord:
        fields = {
            "node_id": node.node_id.hex(),
            "request_id": "r1",
            "layers": [0, 30],
            "prefill_tokens": 5,
            "decode_tokens": 3,
            "compute_ms": 1.5,
            "bytes_in": 10,
            "bytes_out": 20,
            **changes,
        }
        body = json.dumps(fields).encode()
        return UsageRecord(body, node.node_id, node.sign(USAGE_DOMAIN, body))

    sound = check(record(), request_id="r1", hops=hops)
    # signed by the node itself, yet not this request's or this route's: flagged, each with its reason
    wrong = [
        check(record(request_id="r2", decode_tokens=1000), request_id="r1", hops=hops),
        check(record(layers=[0, 15], decode_tokens=1000), request_id="r1", hops=hops),
        check(attrs.evolve(record(), signature=bytes(64)), request_id="r1", hops=hops),
    ]
    assert sound.valid and [c.problem for c in wrong] == [
        "record is for another request",
        "node or layers not on the request's route",
        "signature does not verify",
    ]
    ledger = Ledger(tmp_path / "ledger.sqlite")
    common: dict[str, Any] = {"model": "m", "artifact": "ab" * 32, "created": 0.0, "finish_reason": "stop"}
    ledger.append(request_id="r1", prompt_tokens=5, completion_tokens=3, records=[sound, *wrong], **common)
    totals = ledger.totals()
    assert [(n["sessions"], n["decode_tokens"]) for n in totals["nodes"]] == [(1, 3)]
    assert [f["problem"] for f in totals["flagged"]] == [c.problem for c in wrong]


# --- engine


def test_top_logprobs_list_the_most_likely_first_and_ties_in_id_order() -> None:
    """base.token_logprob: "most likely first (ties: lower id first)"."""
    logits = np.array([0.0, 2.0, 1.0, 2.0, -1.0, 2.0, 1.0], np.float32)
    entry = token_logprob(logits, 4, 5)
    assert [t for t, _ in entry.top] == [1, 3, 5, 2, 6]
    assert entry.token == 4 and entry.logprob < entry.top[-1][1]


# --- tracker


def _record(slots: int, capability: Capability | None) -> NodeRecord:
    return NodeRecord(
        node_id=b"a".ljust(32, b"."),
        artifact="ab" * 32,
        n_layer=30,
        layers=(0, 30),
        recipe="r" * 16,
        address="a:1",
        relay="",
        tls_cert_sha256=b"",
        slots=slots,
        ctx_per_session=2048,
        measured=capability,
    )


def test_sessions_routed_since_the_last_heartbeat_count_where_a_nodes_measured_capacity_binds() -> None:
    """state.note_session: the cost sees a routed session at once, and so does a capacity below the slot count."""
    slow = Capability(2.0, ((1, 400.0), (2, 800.0)), 1, 1, 1, 2)  # 1000 ms per step admits 2 sessions
    state = TrackerState()
    state.register(_record(8, slow), 0.0)
    costs = []
    for _ in range(2):
        choice = state.choose("ab" * 32, 100)
        costs.append(choice.cost_ms)
        state.note_session(n.node_id for n in choice.nodes)
    assert costs[1] > costs[0]
    with pytest.raises(NoRoute) as full:  # 8 free slots reported, 2 sessions its measurements allow
        state.choose("ab" * 32, 100)
    assert full.value.full and state.nodes[b"a".ljust(32, b".")].free_slots == 6


def test_a_routed_session_takes_a_free_slot_until_the_next_heartbeat_says_otherwise() -> None:
    """state.note_session: routes between two heartbeats do not all go to the same free slots."""
    node_id = b"a".ljust(32, b".")
    roomy = TrackerState()
    roomy.register(_record(2, None), 0.0)  # measurements allow all its slots: the free slots bind
    for _ in range(2):
        roomy.note_session(n.node_id for n in roomy.choose("ab" * 32, 100).nodes)
    assert roomy.nodes[node_id].free_slots == 0
    with pytest.raises(NoRoute) as full:
        roomy.choose("ab" * 32, 100)
    assert full.value.full
    # the node's word wins: one of the two sessions ended
    roomy.heartbeat(node_id, 1.0, active_sessions=1, free_slots=1, queue_depth=0, step_ms=9)
    roomy.note_session(n.node_id for n in roomy.choose("ab" * 32, 100).nodes)
    with pytest.raises(NoRoute):
        roomy.choose("ab" * 32, 100)


def test_the_tracker_probes_at_registration_again_when_unanswered_and_every_interval() -> None:
    """app.py: a probe seed on registration, again when unanswered for a while and every ``probe_interval``;
    none while an answer may be on its way, none to a node that failed until it registers again."""
    key = ("ab" * 32, (0, 30), "r" * 16)
    references = ProbeReferences([(key, _answer(5))])
    tracker = Tracker(ids.Identity.generate(), references=references, probe_interval=600.0)
    node = attrs.evolve(_record(2, None), probe_required=True)
    tracker.state.register(node, 0.0)
    assert tracker._challenge(node, 0.0) == {"seed": 5}
    assert tracker._challenge(node, 1.0) is None  # its answer may be on the way
    assert tracker._challenge(node, PROBE_ANSWER_SECONDS + 1) == {"seed": 5}  # lost: asked again
    del tracker.challenges[node.node_id]  # answered, and passed
    tracker.last_probed[node.node_id] = 100.0
    passed = attrs.evolve(node, probe_passed=True)
    assert tracker._challenge(passed, 100.0 + 599) is None
    assert tracker._challenge(passed, 100.0 + 600) == {"seed": 5}
    del tracker.challenges[node.node_id]
    assert tracker._challenge(attrs.evolve(node, probe_passed=False), 10_000.0) is None
    assert tracker._challenge(attrs.evolve(node, layers=(0, 29)), 0.0) is None  # no reference: never probed


# --- gateway


def _grant(*names: bytes) -> RouteGrant:
    hops = tuple(Hop(name.ljust(32, b"."), Span(i * 10, i * 10 + 10)) for i, name in enumerate(names))
    return RouteGrant(hops, b"s" * 16, 0, b"", b"r" * 8)


def test_the_next_attempt_avoids_whom_the_failure_points_at() -> None:
    """routing.to_exclude: "the one the error names ... else the head"."""
    grant = _grant(b"a", b"b", b"c")
    a, b, c = (h.node_id for h in grant.hops)
    # a hop names the node the error is about: its next hop gone, hung or broken; itself full,
    # failed in its own engine, or leaving
    assert to_exclude(grant, RouteError("next hop went away", StatusCode.UNAVAILABLE, b)) == [b]
    assert to_exclude(grant, RouteError("next hop broke the protocol", StatusCode.UNAVAILABLE, c)) == [c]
    assert to_exclude(grant, RouteError("full", StatusCode.RESOURCE_EXHAUSTED, b)) == [b]
    assert to_exclude(grant, RouteError("engine", StatusCode.INTERNAL, a)) == [a]
    assert to_exclude(grant, RouteError("leaving", StatusCode.UNAVAILABLE, b)) == [b]
    # nobody named (the head unreachable, or a stranger's id): the head
    assert to_exclude(grant, RouteError("cannot reach the head", StatusCode.UNAVAILABLE)) == [a]
    assert to_exclude(grant, RouteError("?", StatusCode.UNAVAILABLE, b"z" * 32)) == [a]
    assert run_error(route_error(RouteError("full", StatusCode.RESOURCE_EXHAUSTED))).status == 429


def test_text_is_released_only_as_whole_characters() -> None:
    """textstream.py: "Token pieces are bytes that may split a UTF-8 character; text is released
    only when it is whole"."""
    text = TextStream()
    euro = "€".encode()  # three bytes
    assert text.push(b"1" + euro[:1]) == "1"
    assert text.push(euro[1:2]) == ""
    assert text.push(euro[2:] + b"2") == "€2"
    assert text.push(b"\xff") == "\ufffd"  # a byte no character starts with is not waited for
    assert text.push(euro[:2]) == ""
    assert text.finish() == "\ufffd"  # the generation ended mid-character
    assert text.text == "1€2\ufffd\ufffd"


class _Vocab:
    n_vocab = 100


@attrs.define
class _Model:
    vocab: _Vocab = attrs.Factory(_Vocab)


def _tokens(ids_: tuple[int, ...], logprobs: tuple[TokenLogprob, ...], prompt: tuple[TokenLogprob, ...] = ()) -> Tokens:
    header = Header(Identity("r", b"s" * 16, 0, b"a" * 32, b"r" * 8, Span()), Phase.DECODE, 0)
    return Tokens(header, ids_, False, "", logprobs, prompt)


def test_logprobs_a_route_sends_must_be_those_asked_for_else_the_route_failed() -> None:
    """shaping.check_logprobs: "The route's logprobs must be those asked for, of the tokens sent,
    inside the vocabulary"."""
    model: Any = _Model()
    asked = GenerationRequest((1, 2, 3), 4, Sampling(logprobs=True, top_logprobs=2, prompt_logprobs=True))
    good = TokenLogprob(7, -0.5, ((7, -0.5), (8, -1.0)))
    prompt = (TokenLogprob(2, -1.0), TokenLogprob(3, -2.0))
    check_logprobs(model, asked, _tokens((7,), (good,), prompt), prompt=True)
    check_logprobs(model, asked, _tokens((7,), (good,)), prompt=False)
    hostile = [
        (_tokens((7,), ()), False),  # none sent
        (_tokens((8,), (good,)), False),  # another token's
        (_tokens((7,), (attrs.evolve(good, top=((7, -0.5), (8, -1.0), (9, -2.0))),)), False),  # more than asked
        (_tokens((7,), (attrs.evolve(good, top=((7, -0.5), (100, -1.0))),)), False),  # outside the vocabulary
        (_tokens((7,), (good,), prompt[:1]), True),  # not one per prompt token
        (_tokens((7,), (good,), (prompt[0], TokenLogprob(9, -1.0))), True),  # another prompt token's
    ]
    for event, first in hostile:
        with pytest.raises(RunError) as failed:
            check_logprobs(model, asked, event, prompt=first)
        assert failed.value.code == "route_failed" and run_error(failed.value).status == 503
