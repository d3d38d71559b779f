"""Audits: which the tracker granted, what the evidence of each says, and each node's standing.

No I/O; the tracker's app calls it. A gateway that served a session may have it audited
(``runner/audits.py``): the tracker grants an audit route of other nodes, one for each
hop of the audited route, with the same layers, recipe and kernel class, and remembers
the grant. The gateway runs the audit (a teacher-forced recomputation whose hops commit
to their rows, ``control/commitments.py``) and reports back with the signed usage records
of both sessions. The tracker believes nothing it cannot check: every record must verify
under its node's key, belong to the session it names, and come from the node the route or
the grant put at that hop.

A hop that took in the same rows as its auditor (equal input digests) and gave out other
rows (different output digests) has computed something else than its recipe computes, for
rows and kernels are bit-exact within one recipe and kernel class. One auditor's word is
a suspicion: an auditor can lie too. Two auditors the tracker chose, in two audits, that
agree with each other and not with the node are an accusation, and no more: in an open
swarm both may be one attacker's sybils. The reporting gateway avoids an accused node and
the tracker counts a suspicion against it. A node is excluded only when a referee (a node
the tracker's operator names, ``--referee``) re-executed the hop in a third audit and its
signed record agrees with the two auditors; a referee that agrees with the node instead
outvotes both. An auditor outvoted by the other is counted against it. A hop whose input
differed from its auditor's cannot be judged by this audit: a hop before it differed first.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from noderuntime.access.identity import verify
from noderuntime.control.ledger import USAGE_DOMAIN
from protocol import UsageRecord

AUDIT_GRANT_SECONDS = 600.0  # how long a granted audit may take to be reported
MAX_OPEN_AUDITS = 10_000  # granted and not yet reported, by all clients together
MAX_OPEN_AUDITS_PER_CLIENT = 64  # ... by one client (its oldest forgotten first)
# Auditor choice weighs against sybils: a node weighs in full once it has served this long, and
# less before (never nothing: a new swarm must audit too); one in the audited node's network
# prefix weighs this share of what it would
SEASONED_SECONDS = 3600.0
NEWCOMER_WEIGHT = 0.05
SAME_PREFIX_WEIGHT = 0.05


class AuditError(ValueError):
    """A report the tracker cannot take: its evidence does not hold together."""


@attrs.frozen
class Commitments:
    """What one usage record says a hop committed to (see ``control/commitments.py``)."""

    node_id: bytes
    layers: tuple[int, int]
    session_id: bytes
    epoch: int
    audit: bool
    digest_from: int
    input_rows: int
    input_digest: str
    output_from: int
    output_rows: int
    output_digest: str

    @property
    def input(self) -> tuple[int, int, str]:
        """Where the input commitment starts, how many rows, and its digest."""
        return (self.digest_from, self.input_rows, self.input_digest)

    @property
    def output(self) -> tuple[int, int, str]:
        """Where the output commitment starts, how many rows, and its digest."""
        return (self.output_from, self.output_rows, self.output_digest)


def commitments(record: UsageRecord) -> Commitments:
    """The commitments in a signed usage record; :class:`AuditError` unless it verifies and says them."""
    if not verify(record.node_id, USAGE_DOMAIN, record.body, record.signature):
        raise AuditError(f"the usage record of node {record.node_id.hex()[:16]} does not verify")
    try:
        fields = json.loads(record.body)
    except ValueError:
        raise AuditError("a usage record is not JSON") from None
    if not isinstance(fields, dict) or fields.get("node_id") != record.node_id.hex():
        raise AuditError("a usage record names another node than its signer")
    try:
        layers = fields["layers"]
        out = Commitments(
            node_id=record.node_id,
            layers=(_count(layers[0]), _count(layers[1])),
            session_id=bytes.fromhex(fields["session_id"]),
            epoch=_count(fields["epoch"]),
            audit=fields.get("audit") is True,
            digest_from=_count(fields.get("digest_from", 0)),
            input_rows=_count(fields.get("input_rows", 0)),
            input_digest=_digest(fields.get("input_digest", "")),
            output_from=_count(fields.get("output_from", 0)),
            output_rows=_count(fields.get("output_rows", 0)),
            output_digest=_digest(fields.get("output_digest", "")),
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise AuditError(f"a usage record lacks its commitments or holds nonsense: {exc}") from None
    if not out.input_digest or not out.output_digest:
        raise AuditError(f"node {record.node_id.hex()[:16]} committed to nothing (a node from before commitments)")
    return out


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(f"{value!r:.40} is not a count")
    return value


def _digest(value: Any) -> str:
    if not isinstance(value, str) or (value and (len(value) != 64 or value.strip("0123456789abcdef"))):
        raise ValueError(f"{value!r:.80} is not a digest")
    return value


@attrs.frozen
class Grant:
    """An audit the tracker granted: whose session, and which node audits which hop."""

    client: bytes
    audited_session: bytes
    audited_epoch: int
    audited: tuple[tuple[bytes, int, int], ...]  # the audited route's hops: (node, start, end)
    auditors: tuple[tuple[bytes, int, int], ...]  # the audit route's, hop for hop
    expires: float
    refereed: tuple[bool, ...] = ()  # hop for hop, whether its auditor is a referee the operator named


@attrs.define
class Standing:
    """How a node has fared in audits."""

    passed: int = 0  # hops of it that an auditor recomputed to the same bits
    suspected: int = 0  # hops one auditor, or two no referee confirmed, disagreed with
    failed: int = 0  # hops two auditors and a referee agreed against it
    outvoted: int = 0  # audits it ran whose result the second auditor did not confirm
    reason: str = ""  # why it was excluded, when it was


@attrs.frozen
class Verdict:
    """What one report established, hop by hop of the audited route."""

    passed: tuple[bytes, ...]
    suspected: tuple[bytes, ...]
    failed: tuple[tuple[bytes, str], ...]  # (node, why): excluded, a referee confirmed it
    outvoted: tuple[bytes, ...]
    unjudged: tuple[bytes, ...]  # hops after the first that differed: their input differed
    accused: tuple[tuple[bytes, str], ...] = ()  # (node, why): two auditors agreed, no referee confirmed it


class AuditBook:
    """Granted audits and nodes' standings (soft state, like the rest of the tracker's)."""

    def __init__(self) -> None:
        self._grants: collections.OrderedDict[bytes, Grant] = collections.OrderedDict()
        self._by_client: dict[bytes, collections.OrderedDict[bytes, None]] = {}  # each client's, oldest first
        self.standing: dict[bytes, Standing] = collections.defaultdict(Standing)
        self.granted = 0
        self.reported = 0

    def grant(self, audit_session: bytes, grant: Grant, now: float | None = None) -> None:
        """Remember that ``audit_session`` audits ``grant.audited_session`` (``now``: to forget lapsed grants).

        Bounded per client: a client past ``MAX_OPEN_AUDITS_PER_CLIENT`` loses its own oldest
        grant, never another's. When all clients together hold ``MAX_OPEN_AUDITS`` live grants,
        :class:`AuditError` refuses the new one: a flood of clients can delay audits, never
        forget an honest client's pending ones.
        """
        mine = self._by_client.setdefault(grant.client, collections.OrderedDict())
        if len(mine) >= MAX_OPEN_AUDITS_PER_CLIENT:
            self._forget(next(iter(mine)))
        if len(self._grants) >= MAX_OPEN_AUDITS and now is not None:
            for session in [s for s, g in self._grants.items() if g.expires < now]:
                self._forget(session)
            if len(self._grants) >= MAX_OPEN_AUDITS:
                if not mine:
                    del self._by_client[grant.client]
                raise AuditError("too many audits are open; try again later")
        self._grants[audit_session] = grant
        mine[audit_session] = None
        self.granted += 1

    def _forget(self, audit_session: bytes) -> None:
        grant = self._grants.pop(audit_session, None)
        if grant is None:
            return
        mine = self._by_client[grant.client]
        del mine[audit_session]
        if not mine:
            del self._by_client[grant.client]

    def auditors_of(self, client: bytes, audited_session: bytes) -> set[bytes]:
        """The auditors of ``client``'s open grants that audit ``audited_session``: a second audit
        of it must use others."""
        return {
            node
            for session in self._by_client.get(client, ())
            if self._grants[session].audited_session == audited_session
            for node, _, _ in self._grants[session].auditors
        }

    def open_of(self, client: bytes, audited_session: bytes) -> int:
        """How many of ``client``'s open grants audit ``audited_session``."""
        return sum(self._grants[s].audited_session == audited_session for s in self._by_client.get(client, ()))

    def open_audits(self, client: bytes | None = None) -> int:
        """Audits granted and not yet reported (of ``client`` alone, when given)."""
        return len(self._grants) if client is None else len(self._by_client.get(client, ()))

    def standing_of(self, node_id: bytes) -> Standing:
        """``node_id``'s standing (all zero for a node never audited)."""
        return self.standing.get(node_id) or Standing()

    def excluded(self, node_id: bytes) -> str:
        """Why ``node_id`` is kept out of routes by audits; "" when it is not."""
        standing = self.standing.get(node_id)
        return standing.reason if standing is not None else ""

    def judge(
        self,
        client: bytes,
        audited: Sequence[UsageRecord],
        audits: Mapping[bytes, Sequence[UsageRecord]],
        now: float,
    ) -> Verdict:
        """Check a report (the audited session's records; each audit session's records) and record its verdict.

        A report carries one audit, two when the first found a difference, and a referee's
        audit third when the two agreed. :class:`AuditError` when the evidence does not hold
        together; nothing is recorded then.
        """
        if not 1 <= len(audits) <= 3:
            raise AuditError("a report carries one audit, two when the first found a difference, and a referee's")
        grants = []
        for session, _records in audits.items():
            grant = self._grants.get(session)
            if grant is None or grant.expires < now:
                raise AuditError(f"audit {session.hex()[:16]} was not granted by this tracker, or has expired")
            if grant.client != client:
                raise AuditError("only the client an audit was granted to may report it")
            grants.append(grant)
        first = grants[0]
        if any((g.audited_session, g.audited_epoch) != (first.audited_session, first.audited_epoch) for g in grants):
            raise AuditError("the audits of one report must audit one session")
        served = _by_hop(audited, first.audited, first.audited_session, first.audited_epoch, audit=False)
        recomputed = [
            _by_hop(records, grant.auditors, session, 0, audit=True)
            for (session, records), grant in zip(audits.items(), grants, strict=True)
        ]
        refereed = [any(g.refereed) for g in grants]
        if any(refereed[:2]) or (len(grants) == 3 and not refereed[2]):
            raise AuditError("a referee's audit comes third, after two ordinary audits")
        ordinary = grants[:2]
        if len(ordinary) == 2 and {n for n, _, _ in ordinary[0].auditors} & {n for n, _, _ in ordinary[1].auditors}:
            raise AuditError("the two audits of a report must have no auditor in common")
        referee = None
        if len(grants) == 3:
            referee = [c if checked else None for c, checked in zip(recomputed[2], grants[2].refereed, strict=True)]
        verdict = _compare(served, recomputed[:2], referee)
        for session in audits:
            self._forget(session)
        self.reported += 1
        for node in verdict.passed:
            self.standing[node].passed += 1
        for node in (*verdict.suspected, *(n for n, _ in verdict.accused)):
            self.standing[node].suspected += 1
        for node, why in verdict.failed:
            standing = self.standing[node]
            standing.failed += 1
            standing.reason = why
        for node in verdict.outvoted:
            self.standing[node].outvoted += 1
        return verdict


def _by_hop(
    records: Iterable[UsageRecord],
    hops: Sequence[tuple[bytes, int, int]],
    session: bytes,
    epoch: int,
    *,
    audit: bool,
) -> list[Commitments]:
    """The commitments of each hop of ``hops``, in order, from ``records``; every one must be there."""
    found: dict[tuple[bytes, int, int], Commitments] = {}
    for record in records:
        c = commitments(record)
        if (c.session_id, c.epoch) != (session, epoch) or c.audit != audit:
            raise AuditError(f"node {c.node_id.hex()[:16]}'s record is for another session")
        found[(c.node_id, *c.layers)] = c
    missing = [hop for hop in hops if hop not in found]
    if missing:
        raise AuditError(f"no record of node {missing[0][0].hex()[:16]} for layers {missing[0][1]}:{missing[0][2]}")
    return [found[hop] for hop in hops]


def _compare(
    served: Sequence[Commitments],
    recomputed: Sequence[Sequence[Commitments]],
    referee: Sequence[Commitments | None] | None = None,
) -> Verdict:
    """Judge hop by hop; ``referee``: a referee's commitments at the hops a referee recomputed (else None)."""
    passed: list[bytes] = []
    suspected: list[bytes] = []
    failed: list[tuple[bytes, str]] = []
    outvoted: list[bytes] = []
    unjudged: list[bytes] = []
    accused: list[tuple[bytes, str]] = []
    for k, hop in enumerate(served):
        audits = [audit[k] for audit in recomputed]
        if len(audits) != len(recomputed) or any(a.layers != hop.layers for a in audits):
            raise AuditError("an audit route must have the audited route's hops, layer for layer")
        if any(a.input != hop.input for a in audits):
            # its input differed: a hop before it differed, and every hop after it is unjudged
            unjudged += [h.node_id for h in served[k:]]
            break
        differing = [a for a in audits if a.output != hop.output]
        if not differing:
            passed.append(hop.node_id)
            continue
        if len(audits) == 2 and len(differing) == 2 and audits[0].output == audits[1].output:
            why = (
                f"layers {hop.layers[0]}:{hop.layers[1]} gave other rows than two auditors for the same "
                f"input ({hop.input_rows} rows from position {hop.digest_from})"
            )
            checked = referee[k] if referee is not None else None
            if checked is not None and checked.layers != hop.layers:
                raise AuditError("a referee's audit route must have the audited route's hops, layer for layer")
            if checked is None or checked.input != hop.input:
                accused.append((hop.node_id, why))  # two auditors may be one attacker's: no referee has seen it
            elif checked.output == audits[0].output:
                failed.append((hop.node_id, f"{why}, and a referee confirmed them"))
            elif checked.output == hop.output:
                outvoted += [a.node_id for a in audits]  # the referee agrees with the node: both auditors lied
                passed.append(hop.node_id)
                continue
            else:
                suspected.append(hop.node_id)
        elif len(audits) == 2 and len(differing) == 1:
            outvoted.append(differing[0].node_id)  # the other auditor agrees with the node
            passed.append(hop.node_id)
            continue
        else:
            suspected.append(hop.node_id)
        unjudged += [h.node_id for h in served[k + 1 :]]
        break
    return Verdict(tuple(passed), tuple(suspected), tuple(failed), tuple(outvoted), tuple(unjudged), tuple(accused))


def network_prefix(address: str) -> str:
    """The network ``address`` ("host:port") lies in: its /24 for IPv4, its /48 for IPv6, else its host
    name; "" for no address (a node reached through a relay)."""
    host = address.rsplit(":", 1)[0].strip("[]") if address else ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host.casefold()
    bits = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


def auditor_weight(joined_seconds_ago: float, address: str, audited_prefixes: Iterable[str]) -> float:
    """How likely a candidate auditor is to be drawn: one that joined lately, or that shares a network
    prefix with a node it would audit, weighs little; sybils are cheap to make but not old, and not
    spread over networks."""
    weight = NEWCOMER_WEIGHT + (1.0 - NEWCOMER_WEIGHT) * min(1.0, max(0.0, joined_seconds_ago) / SEASONED_SECONDS)
    prefix = network_prefix(address)
    if prefix and prefix in set(audited_prefixes):
        weight *= SAME_PREFIX_WEIGHT
    return weight


def detection_probability(audit_rate: float, cheat_rate: float, sessions: int) -> float:
    """The chance that at least one of ``sessions`` cheated-on sessions is audited (closed form)."""
    if not (0 <= audit_rate <= 1 and 0 <= cheat_rate <= 1 and sessions >= 0):
        raise ValueError("rates are between 0 and 1, sessions a count")
    return 1.0 - math.pow(1.0 - audit_rate * cheat_rate, sessions)
