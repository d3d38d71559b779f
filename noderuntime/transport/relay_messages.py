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

After ``paired`` both connections carry binary messages, forwarded byte for byte: the
two ends' end-to-end handshake, then their sealed seam frames
(:mod:`noderuntime.transport.sealed`); the relay can read none of them. Refusals close
the connection with one of the codes below and a reason.

Each message is a small frozen class (:class:`Challenge`, :class:`Hello`, ...):
``message.encode()`` writes it and ``decode(text, Hello)`` reads one, raising
:class:`ControlError` and nothing else on whatever a peer sent.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, TypeVar

import attrs

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


_WIRE, _SIZE = "wire", "size"  # in a field's metadata: how it is sent


def _hex(size: int | None = None) -> dict[str, Any]:
    """A bytes field's metadata: sent as hex, of exactly ``size`` bytes when given."""
    return {_WIRE: "hex", _SIZE: size}


def _count() -> dict[str, Any]:
    """A non-negative integer field's metadata."""
    return {_WIRE: "int"}


@attrs.frozen
class Message:
    """A control message: its ``type`` and its fields, bytes sent as hex."""

    TYPE: ClassVar[str] = ""

    def encode(self) -> str:
        """The text message, keys in field order after ``type``."""
        fields = {
            field.name: value.hex() if isinstance(value := getattr(self, field.name), bytes) else value
            for field in attrs.fields(type(self))
        }
        return json.dumps({"type": self.TYPE, **fields}, separators=(",", ":"))


@attrs.frozen
class Challenge(Message):
    """Relay to node on ``/control``: sign this nonce."""

    TYPE: ClassVar[str] = "challenge"
    nonce: bytes = attrs.field(metadata=_hex(32))


@attrs.frozen
class Hello(Message):
    """Node to relay: its id and its signature over the nonce (domain :data:`CONTROL_DOMAIN`)."""

    TYPE: ClassVar[str] = "hello"
    node_id: bytes = attrs.field(metadata=_hex(32))
    signature: bytes = attrs.field(metadata=_hex(64))


@attrs.frozen
class Welcome(Message):
    """Relay to node: the control connection is open."""

    TYPE: ClassVar[str] = "welcome"


@attrs.frozen
class Incoming(Message):
    """Relay to node: a peer waits; dial ``/accept/<pair as hex>``."""

    TYPE: ClassVar[str] = "incoming"
    pair: bytes = attrs.field(metadata=_hex(16))


@attrs.frozen
class Dial(Message):
    """Peer to relay on ``/dial``: a seam to ``target`` for this session, with its ticket."""

    TYPE: ClassVar[str] = "dial"
    target: bytes = attrs.field(metadata=_hex(32))
    session: bytes = attrs.field(metadata=_hex(16))
    epoch: int = attrs.field(metadata=_count())
    ticket: bytes = attrs.field(metadata=_hex())


@attrs.frozen
class Paired(Message):
    """Relay to both sides of a pair: binary seam frames follow."""

    TYPE: ClassVar[str] = "paired"


M = TypeVar("M", bound=Message)


def decode(message: str | bytes, kind: type[M]) -> M:
    """``message`` as a ``kind``; :class:`ControlError` for anything else, whatever it holds."""
    if not isinstance(message, str) or len(message) > MAX_CONTROL_BYTES:
        raise ControlError("expected a short text control message")
    try:
        data = untrusted.json_object(message, "control message")
    except ValueError as exc:
        raise ControlError(str(exc)) from None
    if data.get("type") != kind.TYPE:
        raise ControlError(f"expected a {kind.TYPE!r} message")
    return kind(**{field.name: _field(data, field) for field in attrs.fields(kind)})


def _field(data: dict[str, Any], field: attrs.Attribute[Any]) -> bytes | int:
    value = data.get(field.name)
    if field.metadata[_WIRE] == "int":
        try:
            return untrusted.integer(value, field.name)
        except ValueError as exc:
            raise ControlError(str(exc)) from None
    if not isinstance(value, str):
        raise ControlError(f"missing {field.name}")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise ControlError(f"{field.name} is not hex") from None
    size = field.metadata[_SIZE]
    if size is not None and len(raw) != size:
        raise ControlError(f"{field.name} must be {size} bytes")
    return raw
