"""The JSON a node and a tracker exchange, defined once: the tracker validates with these,
and a node builds its messages with them.
"""

from __future__ import annotations

import urllib.parse

from pydantic import BaseModel, Field, field_validator

from noderuntime.access import untrusted

HEX32 = r"^[0-9a-f]{64}$"


class Registration(BaseModel):
    """A node's description of itself."""

    node_id: str = Field(pattern=HEX32)
    artifact: str = Field(pattern=HEX32)
    model_name: str = Field(default="", max_length=200)
    n_layer: int = Field(gt=0, le=4096)
    layers: tuple[int, int]
    recipe: str = Field(pattern=r"^[0-9a-f]{16}$")
    address: str = Field(default="", max_length=300)  # HOST:PORT for direct seams, or none
    relay: str = Field(default="", max_length=300)  # ws:// or wss:// URL of the relay it listens through
    tls_cert_sha256: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    slots: int = Field(gt=0, le=4096)
    ctx_per_session: int = Field(gt=0, le=1 << 22)
    capability: dict[str, str]  # {"body": signed JSON text, "signature": hex}

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
