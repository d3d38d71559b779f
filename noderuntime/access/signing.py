"""Signed HTTP requests: a node proves it holds the key of the node id it claims."""

from __future__ import annotations

import hashlib
import heapq
import hmac

import attrs

from noderuntime.access.identity import Identity, verify
from noderuntime.operations.memory import compacted

DOMAIN = b"noderuntime-signed-request-v1"
WINDOW_MS = 60_000


JOIN_DOMAIN = b"noderuntime-join-v1"


def join_proof(secret: bytes, node_id: bytes) -> str:
    """What a node shows a private swarm's tracker to prove it holds the swarm's join secret (hex).

    Bound to its node id, which its registration's signature proves: seen, it lets no other
    key in, and it says nothing of the secret.
    """
    return hmac.new(secret, JOIN_DOMAIN + node_id, hashlib.sha256).hexdigest()


def read_join_secret(path: str) -> bytes:
    """A join secret from a file (its text, stripped); :class:`ValueError` when it is empty."""
    with open(path, "rb") as f:
        secret = f.read().strip()
    if not secret:
        raise ValueError(f"{path}: a join secret must not be empty")
    return secret


class SignatureError(Exception):
    """A request's signature is missing, stale, replayed or wrong."""


def _message(method: str, path: str, timestamp: str, body: bytes) -> bytes:
    return f"{method.upper()}\n{path}\n{timestamp}\n".encode() + hashlib.sha256(body).digest()


def sign(identity: Identity, method: str, path: str, body: bytes, now_ms: int) -> dict[str, str]:
    """Headers that authenticate ``body`` sent by ``identity``."""
    timestamp = str(now_ms)
    return {
        "x-node-id": identity.node_id.hex(),
        "x-timestamp": timestamp,
        "x-signature": identity.sign(DOMAIN, _message(method, path, timestamp, body)).hex(),
    }


@attrs.define
class SignatureChecker:
    """Verifies signed requests: fresh (within :data:`WINDOW_MS` of this clock) and each accepted once.

    A replay is the same signed message again, so the checker remembers the digest of every
    message it accepted until its timestamp leaves the window (after which the clock check
    refuses it anyway). It does not ask timestamps to increase: one signer's concurrent requests (a
    gateway repairing two sessions) may arrive in any order.

    What it remembers is partitioned by signer, since anyone can make keys: one key holds
    at most ``capacity`` live digests (past them its requests are refused until some age
    out), and at most ``signers`` keys hold any (past them a key new to the checker is
    refused). A flood signed with many fresh keys can neither evict another key's digests
    nor stop a key that signed within the window.
    """

    capacity: int = 4096  # live digests of one signer
    signers: int = 65_536  # signers with live digests
    _seen: dict[bytes, set[bytes]] = attrs.Factory(dict)  # signer -> digests of its accepted requests
    _expiry: list[tuple[int, bytes, bytes]] = attrs.Factory(list)  # a heap: (timestamp, signer, digest)
    compactions: int = 0  # times the signer map was rebuilt at its size (three quarters of it aged out)

    def check(self, headers: dict[str, str], method: str, path: str, body: bytes, now_ms: int) -> bytes:
        """The authenticated node id; :class:`SignatureError` otherwise."""
        try:
            node_id = bytes.fromhex(headers["x-node-id"])
            timestamp = headers["x-timestamp"]
            signature = bytes.fromhex(headers["x-signature"])
            ts = int(timestamp)
        except (KeyError, ValueError):
            raise SignatureError("missing or malformed x-node-id / x-timestamp / x-signature headers") from None
        if abs(now_ms - ts) > WINDOW_MS:
            raise SignatureError("request timestamp is too far from the tracker's clock")
        message = _message(method, path, timestamp, body)
        if not verify(node_id, DOMAIN, message, signature):
            raise SignatureError("request signature does not verify for the claimed node id")
        pruned = False
        while self._expiry and self._expiry[0][0] < now_ms - WINDOW_MS:
            _, signer, old = heapq.heappop(self._expiry)
            digests = self._seen[signer]
            digests.discard(old)
            if not digests:
                del self._seen[signer]
                pruned = True
        if pruned:  # a flood of keys gone leaves its table behind otherwise (a dict never shrinks)
            seen = self._seen
            self._seen = compacted(seen)
            self.compactions += self._seen is not seen
        digest = hashlib.sha256(node_id + message).digest()
        mine = self._seen.get(node_id)
        if mine is not None and digest in mine:
            raise SignatureError("request replayed (this signed request was accepted already)")
        if mine is None and len(self._seen) >= self.signers:
            raise SignatureError("too many signing keys within the freshness window; try again shortly")
        if mine is not None and len(mine) >= self.capacity:
            raise SignatureError("too many signed requests from this key within the freshness window")
        self._seen.setdefault(node_id, set()).add(digest)
        heapq.heappush(self._expiry, (ts, node_id, digest))
        return node_id

    def statistics(self) -> tuple[int, int]:
        """How many signers, and how many digests in all, it remembers now."""
        return len(self._seen), sum(len(d) for d in self._seen.values())
