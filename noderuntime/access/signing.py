"""Signed HTTP requests: a node proves it holds the key of the node id it claims."""

from __future__ import annotations

import hashlib

import attrs

from noderuntime.access.identity import Identity, verify

DOMAIN = b"noderuntime-signed-request-v1"
WINDOW_MS = 60_000


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
    """Verifies signed requests; timestamps must be fresh and increase per node (no replays)."""

    last: dict[bytes, int] = attrs.Factory(dict)

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
        if not verify(node_id, DOMAIN, _message(method, path, timestamp, body), signature):
            raise SignatureError("request signature does not verify for the claimed node id")
        if ts <= self.last.get(node_id, -1):
            raise SignatureError("request replayed (timestamp not newer than the last one)")
        self.last[node_id] = ts
        return node_id
