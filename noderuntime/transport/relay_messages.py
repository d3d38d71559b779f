"""The relay's small control vocabulary (JSON in text messages), shared with its clients.

Paths:

- ``/control``: a node behind NAT keeps this open. The relay sends
  ``{"type": "challenge", "nonce": HEX}``; the node answers ``{"type": "hello",
  "node_id": HEX, "signature": HEX}`` (Ed25519 over the nonce, domain
  :data:`CONTROL_DOMAIN`); the relay answers ``{"type": "welcome"}``. Later the relay
  sends ``{"type": "incoming", "pair": HEX}`` and the node dials ``/accept/<pair>``.
- ``/dial``: a peer that needs a seam to such a node sends ``{"type": "dial",
  "target": HEX, "session": HEX, "epoch": N, "ticket": HEX}``; once the target dialled
  in, the relay answers ``{"type": "paired"}``.
- ``/accept/<pair>``: the target's side of a pair; the relay answers ``{"type": "paired"}``.

After ``paired`` both connections carry binary seam frames, forwarded byte for byte.
Refusals close the connection with one of the codes below and a reason.
"""

from __future__ import annotations

import json
from typing import Any

from noderuntime.access import untrusted

CONTROL_DOMAIN = b"noderuntime-relay-control-v1"

CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008  # malformed or unexpected control message
CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403  # ticket refused
CLOSE_NOT_CONNECTED = 4404  # the target node has no control connection
CLOSE_TIMEOUT = 4408  # the target did not dial in
CLOSE_BUSY = 4429  # relay limits reached
CLOSE_PEER_GONE = 4410  # the other side of the pair left
# A side of a pair that ends its seam with a status closes with this base + the status
# code (0..16) and the status message as reason; the relay closes the other side alike.
CLOSE_STATUS_BASE = 4500

MAX_CONTROL_BYTES = 16 << 10


def is_status_close(code: int | None) -> bool:
    """Whether a close code carries a seam status (see :data:`CLOSE_STATUS_BASE`)."""
    return code is not None and CLOSE_STATUS_BASE <= code <= CLOSE_STATUS_BASE + 16


class ControlError(ValueError):
    """A control message is malformed."""


def dump(kind: str, **fields: Any) -> str:
    """A control message."""
    return json.dumps({"type": kind, **fields}, separators=(",", ":"))


def load(message: str | bytes, expect: str) -> dict[str, Any]:
    """Parse a control message of type ``expect``; :class:`ControlError` otherwise."""
    if not isinstance(message, str) or len(message) > MAX_CONTROL_BYTES:
        raise ControlError("expected a short text control message")
    try:
        data = untrusted.json_object(message, "control message")
    except ValueError as exc:
        raise ControlError(str(exc)) from None
    if data.get("type") != expect:
        raise ControlError(f"expected a {expect!r} message")
    return data


def hex_field(data: dict[str, Any], key: str, size: int | None = None) -> bytes:
    """A hex-encoded bytes field."""
    value = data.get(key)
    if not isinstance(value, str):
        raise ControlError(f"missing {key}")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise ControlError(f"{key} is not hex") from None
    if size is not None and len(raw) != size:
        raise ControlError(f"{key} must be {size} bytes")
    return raw
