"""The JSON a node, a gateway and a tracker exchange, defined once: the tracker validates
with these and the others build their messages with them; a gateway validates a route
grant (:class:`RouteReply`) with them in turn.

A route's hops travel as :class:`RouteHop` objects: :func:`encode_hops` writes them and
:func:`decode_hops` reads them back as :class:`protocol.Hop` values, raising pydantic's
``ValidationError`` (a ``ValueError``) on anything malformed.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, Field, TypeAdapter, field_validator

from noderuntime.access import untrusted
from noderuntime.access.tickets import MAX_TICKET_BYTES
from protocol import Hop, Span

HEX32 = r"^[0-9a-f]{64}$"
MAX_LAYERS = 4096
DEVICE = r"^(cpu|(vulkan|cuda|hip|metal):[0-9]{1,4})$"  # engine.backends.parse_device, bounded


class Registration(BaseModel):
    """A node's description of itself."""

    node_id: str = Field(pattern=HEX32)
    artifact: str = Field(pattern=HEX32)
    model_name: str = Field(default="", max_length=200)
    n_layer: int = Field(gt=0, le=MAX_LAYERS)
    layers: tuple[int, int]
    recipe: str = Field(pattern=r"^[0-9a-f]{16}$")
    address: str = Field(default="", max_length=300)  # HOST:PORT for direct seams, or none
    relay: str = Field(default="", max_length=300)  # ws:// or wss:// URL of the relay it listens through
    tls_cert_sha256: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    slots: int = Field(gt=0, le=4096)
    ctx_per_session: int = Field(gt=0, le=1 << 22)
    capability: dict[str, str]  # {"body": signed JSON text, "signature": hex}
    # where its layers and KV live (the recipe fingerprint names the kind of device, not the index)
    device: str = Field(default="cpu", pattern=DEVICE)
    # its drift class (engine.llama.kernel_class), which the recipe fingerprint covers: shown, and
    # told apart when two recipes differ by it alone
    kernel_class: str = Field(default="", max_length=300)

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        # peers dial what routes name: a malformed address would fail every route through the node
        if value and not _dialable(value):
            raise ValueError("address must be HOST:PORT (or [IPv6]:PORT) with a port in 1..65535")
        return value

    @field_validator("relay")
    @classmethod
    def _relay(cls, value: str) -> str:
        if value and not _relay_url(value):
            raise ValueError("relay must be a ws:// or wss:// URL with a host")
        return value


def _dialable(address: str) -> bool:
    try:
        untrusted.host_port(address)
    except ValueError:
        return False
    return True


def _relay_url(url: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises ValueError when out of range
    except ValueError:
        return False
    return parts.scheme in ("ws", "wss") and bool(parts.hostname) and port != 0


class Heartbeat(BaseModel):
    """A node's load now."""

    node_id: str = Field(pattern=HEX32)
    active_sessions: int = Field(ge=0)
    free_slots: int = Field(ge=0)
    queue_depth: int = Field(ge=0)
    step_ms: float = Field(ge=0, le=1e6)


class Leave(BaseModel):
    """A node leaving (SIGTERM, ``noderuntime down``): routes stop naming it at once."""

    node_id: str = Field(pattern=HEX32)


class ProbeReply(BaseModel):
    """A node's answer to its probe challenge."""

    node_id: str = Field(pattern=HEX32)
    seed: int = Field(ge=0, lt=2**63)
    digest: str = Field(pattern=HEX32)
    sketch: list[float] = Field(max_length=4096)


class RouteRequest(BaseModel):
    """What a gateway asks for."""

    artifact: str = Field(pattern=HEX32)
    tokens: int = Field(gt=0, le=1 << 22)
    exclude: list[str] = Field(default_factory=list, max_length=256)
    ttl_seconds: float = Field(default=600.0, gt=0, le=86400)
    # the key the gateway proves when it reaches a head through a relay; the ticket names it
    client: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    # nodes that hold this prompt's prefix in their caches (the route that served its start):
    # a route through them is taken when it has room
    prefer: list[str] = Field(default_factory=list, max_length=256)


class RepairRequest(BaseModel):
    """A route session's repair: the rest of its route after ``keep`` hops, under the next epoch.

    Signed (``access.signing``) by whoever repairs: the ticket's client for a whole new route
    (``keep`` 0, the session replayed from its tokens), or the hop just before the lost range
    (``keep`` its index plus one: it replays what it sent, the hops before it keep their KV).
    """

    ticket: str = Field(pattern=r"^([0-9a-f]{2})+$", max_length=2 * MAX_TICKET_BYTES)  # the session's current one
    keep: int = Field(ge=0, le=255)
    tokens: int = Field(gt=0, le=1 << 22)
    recipe: str = Field(pattern=r"^[0-9a-f]{16}$")  # the session's: a replacement of the same is exact
    exclude: list[str] = Field(default_factory=list, max_length=256)
    ttl_seconds: float = Field(default=600.0, gt=0, le=86400)


class RouteHop(BaseModel):
    """One hop of a route: a node, the layers it runs for the route, and how to reach it."""

    node_id: str = Field(pattern=HEX32)
    layers: tuple[int, int]
    address: str = Field(default="", max_length=300)  # HOST:PORT, or none: through the relay only
    relay: str = Field(default="", max_length=300)
    tls_cert_sha256: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    # on a route that mixes recipes (certified), the one this hop runs; "" on any other route
    recipe: str = Field(default="", pattern=r"^([0-9a-f]{16})?$")

    @field_validator("layers")
    @classmethod
    def _layers(cls, value: tuple[int, int]) -> tuple[int, int]:
        start, end = value
        if not 0 <= start < end <= MAX_LAYERS:
            raise ValueError(f"layers must be [start, end] with 0 <= start < end <= {MAX_LAYERS}")
        return value

    @classmethod
    def of(cls, hop: Hop) -> RouteHop:
        """The JSON form of ``hop``."""
        return cls(
            node_id=hop.node_id.hex(),
            layers=(hop.layers.start, hop.layers.end),
            address=hop.address,
            relay=hop.relay,
            tls_cert_sha256=hop.tls_cert_sha256.hex(),
            recipe=hop.recipe_fingerprint.hex(),
        )

    def hop(self) -> Hop:
        """The hop this names."""
        return Hop(
            bytes.fromhex(self.node_id),
            Span(*self.layers),
            self.address,
            self.relay,
            bytes.fromhex(self.tls_cert_sha256),
            bytes.fromhex(self.recipe),
        )


class RouteReply(BaseModel):
    """The tracker's answer to a :class:`RouteRequest`: a route and the ticket for one session on it."""

    session_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    epoch: int = Field(ge=0, lt=2**63)
    ticket: str = Field(pattern=r"^([0-9a-f]{2})+$", max_length=2 * MAX_TICKET_BYTES)
    recipe: str = Field(pattern=r"^[0-9a-f]{16}$")
    cost_ms: float = 0.0  # what the tracker estimated the route costs per step, in ms
    # the longest session every hop of the route can hold (prompt and reply); 0: not said
    ctx_per_session: int = Field(default=0, ge=0, le=1 << 22)
    hops: list[RouteHop] = Field(min_length=1, max_length=256)
    # a repair's route: whether it runs the session's recipe, so the continuation is bit-exact
    exact: bool = True


_HOPS: TypeAdapter[list[RouteHop]] = TypeAdapter(list[RouteHop])


def encode_hops(hops: Iterable[Hop]) -> list[dict[str, Any]]:
    """``hops`` as JSON values."""
    return [RouteHop.of(hop).model_dump(mode="json") for hop in hops]


def decode_hops(data: Any) -> tuple[Hop, ...]:
    """A JSON list of hops (as :func:`encode_hops` writes it); ``ValidationError`` when malformed."""
    return tuple(hop.hop() for hop in _HOPS.validate_python(data))
