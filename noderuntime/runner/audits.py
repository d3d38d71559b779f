"""Checking what a route computed: its hops' commitments at once, and audits of a share of sessions.

Every hop signs, in its usage record, digests of what it took in and gave out
(``control/commitments.py``). When a session ends the gateway checks that they chain: each
hop's input is the previous hop's output, the head's input is the tokens the gateway sent
and the tail's output the tokens it received. A break names the seam where rows changed
(a relay, or one of the two nodes), at once.

That cannot show a node that computed the wrong rows and committed to them. For that, a
share of sessions (``--audit-rate``) is audited after it ended, when its hops have signed
what they did and could not tell it would be checked: the gateway asks the tracker for an
audit route (other nodes, one for each hop, of the same layers, recipe and kernel class),
and runs the session again on it, teacher-forced: all its tokens in one prefill, the tail
drawing each of the route's tokens again with the session's sampler. Its hops commit
likewise, and within one recipe and kernel class rows are bit-exact, so any difference is a
fault. A hop whose input matched its auditor's and whose output did not is audited once
more, by a second route the tracker chooses without the first's nodes. When the second agrees
with the first, the gateway asks for a third, through a referee the tracker's operator
named. The tracker checks the audits' signed records (``tracker/audits.py``) and excludes a
node only when the referee confirms the two auditors; without a referee, two auditors'
agreement is an accusation: this gateway avoids the node in its routes, the swarm does not
exclude it (two auditors may be one attacker's sybils). The gateway is chosen to run audits because it alone holds a
session's tokens and its sampling, and it is the party a reply is owed to.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import httpx
import trio

from noderuntime.access import untrusted
from noderuntime.control.commitments import tokens_digest
from noderuntime.control.ledger import CheckedRecord
from noderuntime.runner.opening import Issuers, open_granted
from noderuntime.runner.policy import RunError
from noderuntime.seams.client import GenerationRequest, RouteError
from noderuntime.tracker.audits import AuditError, commitments
from noderuntime.tracker.client import RequestSigner, RouteGrant, TrackerError, report_audit, request_audit
from noderuntime.tracker.messages import AuditReport, AuditRequest, AuditVerdict, RecordJSON
from noderuntime.tracker.trackers import Trackers
from protocol import StatusCode, UsageRecord

log = logging.getLogger(__name__)

QUEUE = 16  # sessions waiting to be audited; beyond, a session is not audited (and counted)


@attrs.frozen
class Served:
    """A finished session, as an audit needs it."""

    request_id: str
    artifact: bytes
    grant: RouteGrant
    request: GenerationRequest  # as its route ran it (resumed or not)
    generated: tuple[int, ...]  # every token the tail drew, in order
    records: tuple[UsageRecord, ...]


def commitment_problems(
    records: Sequence[CheckedRecord], hops_in_order: Sequence[tuple[bytes, int, int]], served: Served
) -> dict[bytes, str]:
    """For each node whose commitments break the chain, why; empty when they hold together.

    Records from nodes that commit to nothing (older ones) are passed over.
    """
    by_hop: dict[tuple[bytes, int, int], dict[str, Any]] = {}
    for checked in records:
        if checked.valid and checked.fields.get("input_digest"):
            layers = checked.fields.get("layers") or [0, 0]
            by_hop[(checked.record.node_id, int(layers[0]), int(layers[1]))] = checked.fields
    if len(by_hop) != len(hops_in_order) or any(hop not in by_hop for hop in hops_in_order):
        return {}
    problems: dict[bytes, str] = {}
    chain = [by_hop[hop] for hop in hops_in_order]
    tokens = (*served.request.prompt_tokens, *served.generated)
    head = chain[0]
    start = int(head.get("digest_from", 0))
    expected = tokens_digest(start, tokens[start : len(tokens) - 1])
    if head.get("input_digest") != expected:
        problems[hops_in_order[0][0]] = "the head committed to other tokens than this gateway sent"
    for k in range(1, len(chain)):
        sent, got = chain[k - 1], chain[k]
        if (sent.get("output_from"), sent.get("output_rows"), sent.get("output_digest")) != (
            got.get("digest_from"),
            got.get("input_rows"),
            got.get("input_digest"),
        ):
            why = (
                f"the rows of the seam from layers {hops_in_order[k - 1][1]}:{hops_in_order[k - 1][2]} to "
                f"{hops_in_order[k][1]}:{hops_in_order[k][2]} differ between the two ends' commitments"
            )
            problems[hops_in_order[k - 1][0]] = why
            problems[hops_in_order[k][0]] = why
    tail = chain[-1]
    first = len(served.request.prompt_tokens) - 1
    if tail.get("output_digest") != tokens_digest(first, served.generated):
        problems[hops_in_order[-1][0]] = "the tail committed to other tokens than this gateway received"
    return problems


class Audits:
    """Audits a share of finished sessions, one at a time, in the background (:meth:`run`)."""

    def __init__(
        self,
        rate: float,
        *,
        connector: Any,
        http: httpx.AsyncClient,
        trackers: Trackers,
        signer: RequestSigner,
        issuers: Issuers,
        on_dispute: Callable[[str, bytes, str], Awaitable[None]] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``on_dispute(request id, node id, why)``: a node the tracker excluded on an audit of that request;
        ``issuers``: the key each tracker signs with, under which an audit route's ticket is checked.

        A session is audited by the tracker (of ``trackers``) that issued its ticket, the only
        one that can read it, and the audit is reported to that one; while it does not
        answer, its sessions are not audited (counted in ``skipped_error``)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError("an audit rate is a share of sessions, between 0 and 1")
        self.rate = rate
        self.connector = connector
        self.http = http
        self.trackers = trackers
        self.signer = signer
        self.issuers = issuers
        self._rng = rng or random.SystemRandom()
        self._send, self._receive = trio.open_memory_channel[Served](QUEUE)
        self.counters: dict[str, float] = {
            "compute_ms": 0.0,  # what the auditors' hops reported computing
            "chosen": 0,
            "audited": 0,
            "passed": 0,
            "suspected": 0,
            "failed": 0,
            "accused": 0,
            "skipped_queue_full": 0,
            "skipped_no_auditors": 0,
            "skipped_busy": 0,
            "skipped_error": 0,
        }
        self.failed_nodes: dict[str, str] = {}  # node id (hex) -> why the tracker excluded it
        # node id (hex) -> why: two auditors agreed against it, no referee confirmed; this gateway avoids it
        self.avoided_nodes: dict[str, str] = {}
        self._on_dispute = on_dispute

    def consider(self, served: Served) -> None:
        """Audit ``served`` with probability ``rate`` (never blocks; a full queue skips it)."""
        if not served.generated or self._rng.random() >= self.rate:
            return
        self.counters["chosen"] += 1
        try:
            self._send.send_nowait(served)
        except trio.WouldBlock:
            self.counters["skipped_queue_full"] += 1

    async def run(self) -> None:
        """Audit the chosen sessions, one after another, until cancelled."""
        async with self._receive:
            async for served in self._receive:
                try:
                    await self.audit(served)
                except (TrackerError, RouteError, RunError, AuditError, httpx.HTTPError) as exc:
                    # the swarm could not audit it now (no auditors, a failed route): counted, not judged
                    if isinstance(exc, TrackerError) and exc.status == 503:
                        key = "skipped_no_auditors"
                    elif isinstance(exc, RouteError) and exc.code == StatusCode.RESOURCE_EXHAUSTED:
                        key = "skipped_busy"  # an auditor filled its slots after the tracker last heard
                    else:
                        key = "skipped_error"
                    self.counters[key] += 1
                    log.info("could not audit request %s: %s", served.request_id, exc)

    async def audit(self, served: Served) -> AuditVerdict:
        """Audit one session (twice when the first audit finds a hop that differs); the tracker's verdict."""
        first_grant, first_records = await self._recompute(served, exclude=())
        self.counters["compute_ms"] += _compute_ms(first_records)
        audits = [(first_grant, first_records)]
        if self._differs(served, first_records):
            # a second audit, by other nodes, confirms or refutes the first auditor
            used = [node for node, _, _ in _hops(first_grant)]
            audits.append(await self._recompute(served, exclude=used))
            self.counters["compute_ms"] += _compute_ms(audits[-1][1])
            if self._differs(served, audits[-1][1]):
                # two auditors agree against a hop: a referee's re-execution, where the tracker names one
                try:
                    audits.append(await self._recompute(served, exclude=(), referee=True))
                    self.counters["compute_ms"] += _compute_ms(audits[-1][1])
                except TrackerError as exc:
                    if exc.status != 503:
                        raise
                    log.info("request %s: no referee to confirm its audits: %s", served.request_id, exc)
        report = AuditReport(
            audited=[RecordJSON.of(r) for r in served.records],
            audits={grant.session_id.hex(): [RecordJSON.of(r) for r in records] for grant, records in audits},
        )
        verdict = await self.trackers.ask(
            lambda url: report_audit(self.http, url, self.signer, report),
            among=[self._issuer(first_grant)],
            past_no_route=False,
        )
        self.counters["audited"] += 1
        self.counters["passed"] += len(verdict.passed)
        self.counters["suspected"] += len(verdict.suspected)
        self.counters["failed"] += len(verdict.failed)
        self.counters["accused"] += len(verdict.accused)
        for accused in verdict.accused:
            self.avoided_nodes[accused.node_id] = accused.why
            log.warning(
                "audit of request %s: avoiding node %s: %s", served.request_id, accused.node_id[:16], accused.why
            )
        for failure in verdict.failed:
            self.failed_nodes[failure.node_id] = failure.why
            log.error("audit of request %s: node %s excluded: %s", served.request_id, failure.node_id[:16], failure.why)
            if self._on_dispute is not None:
                await self._on_dispute(served.request_id, bytes.fromhex(failure.node_id), failure.why)
        return verdict

    async def _recompute(
        self, served: Served, *, exclude: Sequence[bytes], referee: bool = False
    ) -> tuple[RouteGrant, tuple[UsageRecord, ...]]:
        """Run ``served`` again, teacher-forced, on an audit route without ``exclude`` (through the
        tracker's referees, with ``referee``): its grant and records."""
        request = AuditRequest(ticket=served.grant.ticket.hex(), exclude=[n.hex() for n in exclude], referee=referee)
        grant = await self.trackers.ask(
            lambda url: request_audit(self.http, url, self.signer, request),
            among=[self._issuer(served.grant)],
            past_no_route=False,
        )
        original = served.request
        tokens = (*original.prompt_tokens, *served.generated)
        start = _digest_from(served.records)
        audit = GenerationRequest(
            prompt_tokens=tokens[:-1],
            max_tokens=len(served.generated),
            sampling=attrs.evolve(original.sampling, logprobs=False, top_logprobs=0, prompt_logprobs=False),
            request_id=f"audit-{served.request_id}",
            prompt_length=len(original.prompt_tokens),
            audit_from=start,
        )
        async with open_granted(self.connector, grant, audit, artifact=served.artifact, issuers=self.issuers) as gen:
            while await gen.next() is not None:
                pass
        return grant, tuple(gen.usage or ())

    def avoided(self) -> list[bytes]:
        """The nodes this gateway's routes leave out: those audits excluded, and those two auditors accused."""
        return [bytes.fromhex(n) for n in (*self.failed_nodes, *self.avoided_nodes)]

    def _issuer(self, grant: RouteGrant) -> str:
        """The tracker that issued ``grant``'s ticket."""
        return grant.tracker or self.trackers.first

    @staticmethod
    def _differs(served: Served, audit_records: Sequence[UsageRecord]) -> bool:
        """Whether some hop's output differs from its auditor's where their inputs agree."""
        try:
            mine = {c.layers: c for c in map(commitments, served.records)}
            theirs = {c.layers: c for c in map(commitments, audit_records)}
        except AuditError:
            return True  # let the tracker, and a second audit, judge a record that does not read
        for layers in sorted(mine):
            a, b = mine[layers], theirs.get(layers)
            if b is None or a.input != b.input:
                return False  # a hop before differed first: no hop here can be judged by this audit
            if a.output != b.output:
                return True
        return False


def _digest_from(records: Sequence[UsageRecord]) -> int:
    """Where the audited route's commitments start (every hop's is the same: its agreed prefix)."""
    return min(commitments(r).digest_from for r in records)


def _compute_ms(records: Sequence[UsageRecord]) -> float:
    """What ``records`` say their hops computed, in ms (what an audit cost the swarm)."""
    total = 0.0
    for record in records:
        try:
            value = untrusted.json_object(record.body, "a usage record").get("compute_ms")
        except ValueError:
            continue  # an auditor's nonsense: the tracker judges its record
        if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e12:
            total += value
    return total


def _hops(grant: RouteGrant) -> list[tuple[bytes, int, int]]:
    return [(h.node_id, h.layers.start, h.layers.end) for h in grant.hops]
