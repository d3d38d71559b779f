"""Session tickets: the route issuer's signed permission for one route session.

A ticket binds a session id and epoch, the artifact, every hop of the route plan
(node id, layers, and the address and relay URL it is dialled at), the client it was
issued to (the key a gateway proves when it reaches a head through a relay), whether
the issuer declared its swarm local (its routes may then name loopback and private
addresses: :mod:`noderuntime.access.addresses`) and an expiry, and is signed with the
issuer's Ed25519 key (the tracker's; until a tracker runs, a configured key). A shard
accepts ``OpenRoute`` only with a valid ticket that names it at its place in the plan, at
the addresses the plan gives, so a client cannot point a node's next-hop dial anywhere;
a relay pairs only holders of a valid ticket for the node they dial; a gateway checks
a route's ticket before its prompt leaves (:func:`check_grant`). Each node's verifier
remembers the tickets it has accepted until they expire, so a replayed ticket is refused.

Wire form: ``b"NRT1" | u16 body length | body (canonical JSON) | 64-byte signature``;
the body's ``v`` is 2 (version 1 plans named no addresses, and are refused).
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from noderuntime.access import untrusted
from noderuntime.access.identity import Identity, verify
from protocol import Hop, Span, StatusCode

MAGIC = b"NRT1"
DOMAIN = b"noderuntime-session-ticket-v1"
MAX_TICKET_BYTES = 8192
VERSION = 2  # the plan names each hop's address and relay URL


class TicketError(Exception):
    """A ticket was refused; ``code`` is the status the peer gets."""

    def __init__(self, message: str, code: StatusCode = StatusCode.PERMISSION_DENIED) -> None:
        super().__init__(message)
        self.code = code


@attrs.frozen
class Ticket:
    """The decoded, verified contents of a ticket."""

    issuer: bytes
    session_id: bytes
    epoch: int
    artifact: bytes
    hops: tuple[tuple[bytes, int, int], ...]  # (node id, layer start, layer end)
    expires_unix_ms: int
    client: bytes = b""  # the node id of whom it was issued to; empty when it names none
    endpoints: tuple[tuple[str, str], ...] = ()  # each hop's (address, relay URL), "" where none
    local: bool = False  # the issuer declared its swarm local: its routes may name private addresses

    def dialer_of(self, index: int) -> bytes:
        """Who may open the seam into hop ``index``: the hop before it, or the client at the head."""
        return self.hops[index - 1][0] if index > 0 else self.client


def _plan(hops: Sequence[Hop]) -> list[list[Any]]:
    return [[h.node_id.hex(), h.layers.start, h.layers.end, h.address, h.relay] for h in hops]


def plan_of(hops: Sequence[Hop]) -> tuple[tuple[tuple[bytes, int, int], ...], tuple[tuple[str, str], ...]]:
    """What a ticket for ``hops`` binds of them: (node id, layers) and (address, relay URL), hop by hop."""
    return (
        tuple((h.node_id, h.layers.start, h.layers.end) for h in hops),
        tuple((h.address, h.relay) for h in hops),
    )


def issue(
    issuer: Identity,
    *,
    session_id: bytes,
    epoch: int,
    artifact: bytes,
    hops: Sequence[Hop],
    client: bytes = b"",
    ttl_seconds: float = 600.0,
    now: float | None = None,
    local: bool = False,
) -> bytes:
    """A signed ticket for one route session; ``client``: the node id of whom it is for, if known;
    ``local``: the issuer's swarm is declared local (its hops may be dialled at private addresses)."""
    expires = int(((now if now is not None else time.time()) + ttl_seconds) * 1000)
    fields: dict[str, Any] = {
        "v": VERSION,
        "iss": issuer.node_id.hex(),
        "sid": session_id.hex(),
        "epoch": epoch,
        "artifact": artifact.hex(),
        "hops": _plan(hops),
        "exp": expires,
    }
    if client:  # a field older nodes skip: they check no dialer
        fields["cli"] = client.hex()
    if local:
        fields["loc"] = True
    body = json.dumps(
        fields,
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    return MAGIC + struct.pack(">H", len(body)) + body + issuer.sign(DOMAIN, body)


def decode(data: bytes, trusted_issuers: Iterable[bytes]) -> Ticket:
    """Parse and check the signature; raises :class:`TicketError`."""
    if not data:
        raise TicketError("no session ticket", StatusCode.UNAUTHENTICATED)
    if len(data) > MAX_TICKET_BYTES or len(data) < 6 + 64 or data[:4] != MAGIC:
        raise TicketError("malformed session ticket", StatusCode.UNAUTHENTICATED)
    (length,) = struct.unpack(">H", data[4:6])
    body, signature = data[6 : 6 + length], data[6 + length :]
    if len(body) != length or len(signature) != 64:
        raise TicketError("malformed session ticket", StatusCode.UNAUTHENTICATED)
    try:
        fields = untrusted.json_object(body, "session ticket")
        version = untrusted.integer(fields["v"], "version")
        if version != VERSION:
            raise TicketError(
                f"a session ticket of version {version}, not {VERSION}: its plan does not bind the addresses of "
                "its hops (the tracker that issued it is older than this node)",
                StatusCode.UNAUTHENTICATED,
            )
        issuer = bytes.fromhex(fields["iss"])
        plan = [
            (bytes.fromhex(n), untrusted.integer(a, "layer"), untrusted.integer(b, "layer"), ad, re)
            for n, a, b, ad, re in fields["hops"]
        ]
        if not all(isinstance(ad, str) and isinstance(re, str) for *_, ad, re in plan):
            raise ValueError("a hop's address and relay are strings")
        local = fields.get("loc", False)
        if not isinstance(local, bool):
            raise ValueError("loc is true or absent")
        ticket = Ticket(
            issuer=issuer,
            session_id=bytes.fromhex(fields["sid"]),
            epoch=untrusted.integer(fields["epoch"], "epoch"),
            artifact=bytes.fromhex(fields["artifact"]),
            hops=tuple((n, a, b) for n, a, b, _, _ in plan),
            expires_unix_ms=untrusted.integer(fields["exp"], "expiry"),
            client=bytes.fromhex(fields.get("cli", "")),
            endpoints=tuple((ad, re) for *_, ad, re in plan),
            local=local,
        )
    except (ValueError, KeyError, TypeError):
        raise TicketError("malformed session ticket", StatusCode.UNAUTHENTICATED) from None
    if issuer not in set(trusted_issuers):
        raise TicketError("session ticket from an issuer this node does not trust", StatusCode.UNAUTHENTICATED)
    if not verify(issuer, DOMAIN, body, signature):
        raise TicketError("session ticket signature does not verify (forged or altered)", StatusCode.UNAUTHENTICATED)
    return ticket


class ReplayGuard:
    """Remembers accepted tickets until they expire, partitioned by the client each was issued to.

    One client holding ``per_client`` live tickets is refused more (RESOURCE_EXHAUSTED) until
    some expire, and so is anyone once ``capacity`` are live in all: a flood of tickets for one
    client (the tracker rate-limits how fast a client gets them) fills that client's part,
    never another's.
    """

    def __init__(self, capacity: int = 100_000, per_client: int = 4096) -> None:
        self._seen: dict[bytes, dict[tuple[bytes, int, bytes], int]] = {}  # client -> key -> expiry
        self._live = 0
        self._capacity = capacity
        self._per_client = per_client

    def accept(self, key: tuple[bytes, int, bytes], expires_unix_ms: int, now_ms: int, client: bytes = b"") -> None:
        """Record ``key`` (a ticket of ``client``'s); :class:`TicketError` if it was already used."""
        mine = self._seen.get(client, {})
        if key in mine and mine[key] > now_ms:
            raise TicketError("session ticket already used (replay)", StatusCode.PERMISSION_DENIED)
        if len(mine) >= self._per_client:
            self._forget_expired(client, now_ms)
            if len(self._seen.get(client, {})) >= self._per_client:
                raise TicketError("too many live tickets of this client", StatusCode.RESOURCE_EXHAUSTED)
        if self._live >= self._capacity:
            for other in list(self._seen):
                self._forget_expired(other, now_ms)
            if self._live >= self._capacity:
                raise TicketError("too many live tickets", StatusCode.RESOURCE_EXHAUSTED)
        mine = self._seen.setdefault(client, {})
        self._live += key not in mine
        mine[key] = expires_unix_ms

    def _forget_expired(self, client: bytes, now_ms: int) -> None:
        mine = self._seen.get(client)
        if mine is None:
            return
        live = {k: exp for k, exp in mine.items() if exp > now_ms}
        self._live -= len(mine) - len(live)
        if live:
            self._seen[client] = live
        else:
            del self._seen[client]


class TicketVerifier:
    """Checks tickets for one node (or a relay) against trusted issuers."""

    def __init__(self, trusted_issuers: Iterable[bytes], *, clock: Any = time.time) -> None:
        self.trusted = set(trusted_issuers)
        self._clock = clock
        self._replays = ReplayGuard()

    def trust(self, issuer: bytes) -> None:
        """Accept the tickets ``issuer`` signs from now on (a tracker that answered after the node started)."""
        self.trusted.add(issuer)

    def check(
        self,
        data: bytes,
        *,
        session_id: bytes,
        epoch: int,
        artifact: bytes | None,
        hops: Sequence[Hop] | None,
        node_id: bytes,
        index: int | None = None,
        dialer: bytes | None = None,
        consume: bool = True,
    ) -> Ticket:
        """Verify a ticket presented for ``node_id``; with ``consume`` it cannot be used here again.

        ``artifact`` and ``hops`` may be None where the verifier does not know them (a relay).
        ``dialer``: whom the seam that brought it proved to be, where its transport proves
        that (a relayed seam's handshake): it must be the hop the ticket puts before
        ``node_id``, or its client at the head. Checked before the ticket is used up, so
        that one who saw it (a relay) cannot spend it for its holder.
        """
        ticket = decode(data, self.trusted)
        now_ms = int(self._clock() * 1000)
        _check_session(ticket, now_ms, session_id=session_id, epoch=epoch, artifact=artifact, hops=hops)
        names = [n for n, _, _ in ticket.hops]
        if node_id not in names or (index is not None and (index >= len(names) or names[index] != node_id)):
            raise TicketError("session ticket was not issued for this node (misdirected)", StatusCode.PERMISSION_DENIED)
        if dialer is not None:
            expected = ticket.dialer_of(names.index(node_id) if index is None else index)
            if not expected:
                raise TicketError(
                    "the session ticket names no client, and a head reached through a relay serves only the "
                    "client its ticket names",
                    StatusCode.PERMISSION_DENIED,
                )
            if dialer != expected:
                raise TicketError(
                    f"the seam was opened by {dialer.hex()[:16]}, not by {expected.hex()[:16]}, whom the session "
                    "ticket puts before this node",
                    StatusCode.PERMISSION_DENIED,
                )
        if consume:
            self._replays.accept(
                (ticket.session_id, ticket.epoch, node_id), ticket.expires_unix_ms, now_ms, ticket.client
            )
        return ticket


def _check_session(
    ticket: Ticket,
    now_ms: int,
    *,
    session_id: bytes,
    epoch: int,
    artifact: bytes | None,
    hops: Sequence[Hop] | None,
) -> None:
    """What a node and a client both check of a verified ticket: not expired, this session, this plan."""
    if ticket.expires_unix_ms <= now_ms:
        raise TicketError("session ticket expired", StatusCode.PERMISSION_DENIED)
    if (ticket.session_id, ticket.epoch) != (session_id, epoch) or (
        artifact is not None and ticket.artifact != artifact
    ):
        raise TicketError("session ticket is for another session", StatusCode.PERMISSION_DENIED)
    if hops is not None:
        layers, endpoints = plan_of(hops)
        if ticket.hops != layers:
            raise TicketError(
                "the route plan differs from the one the ticket was issued for", StatusCode.PERMISSION_DENIED
            )
        if ticket.endpoints != endpoints:
            raise TicketError(
                "the route plan names other addresses or relays than the ticket was issued for",
                StatusCode.PERMISSION_DENIED,
            )


def check_grant(
    data: bytes,
    *,
    issuer: bytes,
    session_id: bytes,
    epoch: int,
    artifact: bytes,
    hops: Sequence[Hop],
    now: float | None = None,
) -> Ticket:
    """A route grant's ticket, as its client checks it before anything goes to the route's head.

    Signed by ``issuer`` (the key pinned for the tracker that granted it), not expired, for
    ``session_id`` at ``epoch`` and ``artifact``, on ``hops`` exactly (node ids, layers,
    addresses and relays): a reply that names another head, or swaps a hop's address, was
    not the tracker's. No replay guard: the client spends its own tickets.
    :class:`TicketError` when any of that fails.
    """
    ticket = decode(data, (issuer,))
    now_ms = int((time.time() if now is None else now) * 1000)
    _check_session(ticket, now_ms, session_id=session_id, epoch=epoch, artifact=artifact, hops=hops)
    return ticket


def declares_local(data: bytes) -> bool:
    """Whether a ticket says its issuer's swarm is local; its signature is NOT checked here.

    For a dialler that holds only tickets already verified (a node's, after its admission
    check; a gateway's, after :func:`check_grant`). A malformed ticket declares nothing.
    """
    if len(data) < 6 or data[:4] != MAGIC:
        return False
    (length,) = struct.unpack(">H", data[4:6])
    try:
        fields = untrusted.json_object(data[6 : 6 + length], "session ticket")
    except ValueError:
        return False
    return fields.get("loc") is True


def hops_of(ticket: Ticket) -> list[Hop]:
    """The route plan a ticket names, with the address and relay URL of each hop."""
    return [
        Hop(n, Span(a, b), address, relay)
        for (n, a, b), (address, relay) in zip(ticket.hops, ticket.endpoints, strict=True)
    ]
