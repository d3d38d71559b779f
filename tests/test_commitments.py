"""Commitments and the judging of audits, on their own: no engine, no I/O.

What ``control/commitments.py`` promises (a digest that does not depend on how rows were
cut into steps; a sender commits to what its peer decodes), what the gateway checks of a
route's chain (``runner/audits.py``: ``commitment_problems``), and how the tracker judges
an audit's evidence (``tracker/audits.py``): signed records only, from the nodes the route
and the grants put there, a node excluded only when two auditors agree against it.
"""

from __future__ import annotations

import numpy as np
import pytest

from noderuntime.access.identity import Identity
from noderuntime.control.commitments import Commitment, as_received, tokens_digest
from noderuntime.control.ledger import check
from noderuntime.runner.audits import Served, commitment_problems
from noderuntime.seams.client import GenerationRequest
from noderuntime.testing.usage import signed_usage
from noderuntime.tracker.audits import AuditBook, AuditError, Grant, detection_probability
from noderuntime.tracker.client import RouteGrant
from protocol import Encoding, Hop, Span, UsageRecord

RNG = np.random.default_rng(3)


def test_a_digest_is_the_same_however_the_rows_were_cut_into_steps() -> None:
    rows = RNG.standard_normal((40, 8)).astype(np.float32)
    whole = Commitment(5)
    whole.add_rows(0, rows)  # one prefill from 0: the rows before 5 are not committed
    cut = Commitment(5)
    for start, end in ((5, 17), (17, 18), (18, 40)):
        cut.add_rows(start, rows[start:end])
    assert whole.hexdigest() == cut.hexdigest() and whole.rows == cut.rows == 35
    other = Commitment(5)
    other.add_rows(5, rows[5:] + np.float32(1e-6))
    assert other.hexdigest() != whole.hexdigest()
    assert Commitment(6).hexdigest() != Commitment(5).hexdigest()  # where it starts is committed too
    with pytest.raises(ValueError, match="where 40 was next"):
        whole.add_rows(41, rows[:1])  # a gap
    tokens = Commitment(3)
    tokens.add_tokens(3, [7, 8])
    tokens.add_tokens(5, [9])
    assert tokens.hexdigest() == tokens_digest(3, [7, 8, 9])


def test_a_sender_commits_to_what_its_peer_decodes() -> None:
    rows = RNG.standard_normal((3, 16)).astype(np.float32)
    assert as_received(rows, Encoding.F32) is rows
    f16 = as_received(rows, Encoding.F16)
    assert np.array_equal(f16, rows.astype(np.float16).astype(np.float32)) and not np.array_equal(f16, rows)


# --- a route's chain of commitments, as the gateway checks it

NODES = [Identity.generate() for _ in range(6)]
PROMPT = (5, 6, 7, 8, 9)
GENERATED = (11, 12, 13)


def _record(
    me: Identity, layers: tuple[int, int], session: bytes, *, audit: bool = False, **digests: object
) -> UsageRecord:
    return signed_usage(me, layers=layers, session=session.hex(), artifact="aa" * 32, audit=audit, **digests)


def _route(session: bytes, nodes: list[Identity], rows: list[np.ndarray], *, audit: bool = False) -> list[UsageRecord]:
    """Honest records of a two-hop route: head 0:2 takes the tokens, sends rows[0]; tail 2:4 draws GENERATED."""
    tokens = (*PROMPT, *GENERATED)
    head_in = Commitment(0)
    head_in.add_tokens(0, tokens[:-1])
    sent = Commitment(0)
    sent.add_rows(0, rows[0])
    drawn = Commitment(len(PROMPT) - 1)
    drawn.add_tokens(len(PROMPT) - 1, GENERATED)
    common = {"digest_from": 0, "output_from": 0}
    return [
        _record(
            nodes[0],
            (0, 2),
            session,
            audit=audit,
            input_rows=head_in.rows,
            input_digest=head_in.hexdigest(),
            output_rows=sent.rows,
            output_digest=sent.hexdigest(),
            **common,
        ),
        _record(
            nodes[1],
            (2, 4),
            session,
            audit=audit,
            input_rows=sent.rows,
            input_digest=sent.hexdigest(),
            digest_from=0,
            output_from=len(PROMPT) - 1,
            output_rows=drawn.rows,
            output_digest=drawn.hexdigest(),
        ),
    ]


def _served(records: list[UsageRecord], nodes: list[Identity]) -> tuple[list, list, Served]:  # type: ignore[type-arg]
    hops = (Hop(nodes[0].node_id, Span(0, 2)), Hop(nodes[1].node_id, Span(2, 4)))
    grant = RouteGrant(hops, b"s" * 16, 0, b"", b"r" * 8)
    checked = [check(r, request_id="r", hops=hops) for r in records]
    order = [(h.node_id, h.layers.start, h.layers.end) for h in hops]
    served = Served("r", b"a" * 32, grant, GenerationRequest(PROMPT, 8), GENERATED, tuple(records))
    return checked, order, served


def test_the_gateway_finds_where_a_routes_chain_of_commitments_breaks() -> None:
    rows = [RNG.standard_normal((7, 4)).astype(np.float32)]
    honest = _route(b"s" * 16, NODES, rows)
    checked, order, served = _served(honest, NODES)
    assert all(c.valid for c in checked) and commitment_problems(checked, order, served) == {}
    # the tail says it took other rows than the head says it sent: the seam between them is named
    altered = _route(b"s" * 16, NODES, [rows[0] + np.float32(1.0)])
    checked, order, served = _served([honest[0], altered[1]], NODES)
    problems = commitment_problems(checked, order, served)
    assert set(problems) == {NODES[0].node_id, NODES[1].node_id} and "layers 0:2 to 2:4" in problems[NODES[1].node_id]
    # other tokens than the gateway received, at the route's end
    checked, order, served = _served(honest, NODES)
    other = Served("r", b"a" * 32, served.grant, served.request, (11, 12, 14), served.records)
    assert set(commitment_problems(checked, order, other)) == {NODES[1].node_id}


# --- the tracker's judging of audits


def _book(
    audited_nodes: list[Identity], auditor_sets: list[list[Identity]], *, referee: bool = False
) -> tuple[AuditBook, list[bytes]]:
    """A book granting an audit to each of ``auditor_sets``; with ``referee``, the last set's head is a referee."""
    book = AuditBook()
    sessions = []
    for k, auditors in enumerate(auditor_sets):
        refereed = (True, False) if referee and k == len(auditor_sets) - 1 else ()
        session = bytes([k + 1]) * 16
        book.grant(
            session,
            Grant(
                client=b"c" * 32,
                audited_session=b"s" * 16,
                audited_epoch=0,
                audited=((audited_nodes[0].node_id, 0, 2), (audited_nodes[1].node_id, 2, 4)),
                auditors=((auditors[0].node_id, 0, 2), (auditors[1].node_id, 2, 4)),
                expires=100.0,
                refereed=refereed,
            ),
        )
        sessions.append(session)
    return book, sessions


def test_a_node_is_excluded_only_when_two_auditors_and_a_referee_agree_against_it() -> None:
    good = [RNG.standard_normal((7, 4)).astype(np.float32)]
    bad = [good[0] + np.float32(1e-3)]
    served, first, second = NODES[0:2], NODES[2:4], NODES[4:6]
    audited = _route(b"s" * 16, served, bad)  # the head sent other rows than its recipe computes
    book, sessions = _book(served, [first, second])
    one = {sessions[0]: _route(sessions[0], first, good, audit=True)}
    verdict = book.judge(b"c" * 32, audited, one, now=1.0)
    assert verdict.suspected == (served[0].node_id,) and not verdict.failed  # one auditor: a suspicion
    assert verdict.unjudged == (served[1].node_id,)  # the tail took the head's rows: it cannot be judged
    book, sessions = _book(served, [first, second])
    both = {s: _route(s, auditors, good, audit=True) for s, auditors in zip(sessions, (first, second), strict=True)}
    verdict = book.judge(b"c" * 32, audited, both, now=1.0)
    # two auditors agreeing, with no referee: an accusation the reporter acts on, not an exclusion
    assert [node for node, _ in verdict.accused] == [served[0].node_id] and not verdict.failed
    assert not book.excluded(served[0].node_id) and book.standing[served[0].node_id].suspected == 1
    audits = [first, second, [NODES[2], NODES[5]]]  # a referee may have audited the session already
    book, sessions = _book(served, audits, referee=True)
    three = {s: _route(s, auditors, good, audit=True) for s, auditors in zip(sessions, audits, strict=True)}
    verdict = book.judge(b"c" * 32, audited, three, now=1.0)
    assert [node for node, _ in verdict.failed] == [served[0].node_id]
    assert book.excluded(served[0].node_id) and book.standing[served[0].node_id].failed == 1
    # an honest node whose first auditor lied: the second outvotes it, and the node passes
    honest = _route(b"s" * 16, served, good)
    book, sessions = _book(served, [first, second])
    mixed = {sessions[0]: _route(sessions[0], first, bad, audit=True), sessions[1]: both[sessions[1]]}
    mixed[sessions[1]] = _route(sessions[1], second, good, audit=True)
    verdict = book.judge(b"c" * 32, honest, mixed, now=1.0)
    assert not verdict.failed and verdict.outvoted == (first[0].node_id,) and served[0].node_id in verdict.passed


def test_evidence_that_does_not_hold_together_is_refused() -> None:
    good = [RNG.standard_normal((7, 4)).astype(np.float32)]
    served, first, second = NODES[0:2], NODES[2:4], NODES[4:6]
    audited = _route(b"s" * 16, served, good)
    book, sessions = _book(served, [first, second])
    audit = _route(sessions[0], first, good, audit=True)
    with pytest.raises(AuditError, match="was not granted"):
        book.judge(b"c" * 32, audited, {b"\x09" * 16: audit}, now=1.0)
    with pytest.raises(AuditError, match="only the client"):
        book.judge(b"x" * 32, audited, {sessions[0]: audit}, now=1.0)
    with pytest.raises(AuditError, match="expired"):
        book.judge(b"c" * 32, audited, {sessions[0]: audit}, now=1000.0)
    forged = UsageRecord(audit[0].body, audit[0].node_id, bytes(64))
    with pytest.raises(AuditError, match="does not verify"):
        book.judge(b"c" * 32, audited, {sessions[0]: [forged, audit[1]]}, now=1.0)
    # an auditor's record from a node the grant did not name
    stranger = _route(sessions[0], [NODES[4], first[1]], good, audit=True)
    with pytest.raises(AuditError, match="no record of node"):
        book.judge(b"c" * 32, audited, {sessions[0]: stranger}, now=1.0)
    # the audited session's records passed off as an audit's
    with pytest.raises(AuditError, match="another session"):
        book.judge(b"c" * 32, audited, {sessions[0]: _route(sessions[0], first, good)}, now=1.0)
    assert book.reported == 0 and not book.standing  # nothing was recorded


def test_the_chance_to_catch_a_cheater_grows_with_the_sessions_it_cheats_on() -> None:
    assert detection_probability(0.03, 1.0, 0) == 0.0
    assert detection_probability(0.03, 1.0, 100) == pytest.approx(1 - 0.97**100)
    assert detection_probability(0.05, 0.2, 1000) > 0.9999
    with pytest.raises(ValueError):
        detection_probability(1.5, 0.1, 3)
