"""A registered node: what it told the tracker about itself, its load, and what it costs a route.

A node describes itself once, at registration (:class:`~noderuntime.tracker.messages.NodeDescription`),
and its heartbeats report its load; :class:`NodeRecord` holds both, with what the node
measured of itself (signed, checked at registration) and whether it passed its
known-answer probe. Its estimated step time under its current load, its capacity in
sessions and the constant seam into it are what route choice costs it by.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

from noderuntime.control.admission import Capability
from noderuntime.tracker.messages import NodeDescription

DIRECT_SEAM_MS = 1.0  # a seam nobody measured, into a node peers dial directly
RELAY_SEAM_MS = 2.5  # ... into a node reached through its relay
DEFAULT_STEP_MS = 10.0
HEARTBEAT_SECONDS = 2.0  # the interval a small swarm's nodes beat at (a large one's: registry.py)


@attrs.frozen
class NodeRecord:
    """What a node told the tracker about itself (registration) and its load (heartbeats)."""

    # its description: the fields of messages.NodeDescription, bounded there, the hex ids as bytes
    node_id: bytes
    artifact: str
    n_layer: int
    layers: tuple[int, int]
    recipe: str
    address: str  # "" for a relay-only node
    relay: str
    tls_cert_sha256: bytes
    slots: int
    ctx_per_session: int
    model_name: str = ""
    device: str = "cpu"  # where its layers and KV live ("vulkan:0"): shown, not routed on
    kernel_class: str = ""  # its drift class, as the node names it (the recipe fingerprint covers it)
    # load, from heartbeats
    active_sessions: int = 0
    free_slots: int = 0
    queue_depth: int = 0
    step_ms: float = 0.0  # recent engine time per batch
    last_seen: float = 0.0
    # what the node measured of itself (signed, checked at registration)
    measured: Capability | None = None
    # known-answer probe: required when the tracker holds references for this shard
    probe_required: bool = False
    probe_passed: bool | None = None
    probe_detail: str = ""
    beat_seconds: float = HEARTBEAT_SECONDS  # the heartbeat interval the tracker last told it
    # why audits excluded it (two auditors agreed against it: tracker/audits.py); "" when they did not
    audit_failed: str = ""

    @classmethod
    def of(cls, description: NodeDescription, **more: Any) -> NodeRecord:
        """The record of the node ``description`` describes (its registration), with ``more`` of the other fields."""
        fields: dict[str, Any] = description.description().model_dump()
        for name in _HEX_FIELDS:
            fields[name] = bytes.fromhex(fields[name])
        return cls(**fields, **more)

    @property
    def reachability(self) -> str:
        """``direct``, ``direct+relay`` or ``relay-only``."""
        if self.address and self.relay:
            return "direct+relay"
        return "direct" if self.address else "relay-only"

    @property
    def admitted(self) -> bool:
        """Whether routes may use this node: it passed its probe (or needs none) and no audit excluded it."""
        probed = self.probe_passed is True or (self.probe_passed is None and not self.probe_required)
        return probed and not self.audit_failed

    def estimated_step_ms(self) -> float:
        """Decode step time with one more session.

        From the measured step time at that batch size; a node running slower than it
        measured (heartbeats report its recent step time) is costed at what it shows.
        """
        if self.measured is None:
            base = self.step_ms or DEFAULT_STEP_MS
            busy = self.active_sessions / max(1, self.slots)
            return base * (1.0 + busy) + 0.1 * self.queue_depth * base
        single = self.measured.step_ms(1)
        at_load = max(self.measured.step_ms(self.active_sessions + 1), self.step_ms)
        return at_load + 0.1 * self.queue_depth * single

    def capacity(self, step_budget_ms: float) -> int:
        """Sessions this node should get: as many as keep its measured step time within budget."""
        if self.measured is None:
            return self.slots
        return _capacity(self.measured, self.slots, step_budget_ms)

    def tokens_per_s(self, step_budget_ms: float) -> float:
        """Decode tokens per second this node gives its layers at the sessions routes may send it.

        Its capacity in sessions, each advancing one token per measured step at that batch;
        a node that measured nothing is taken at its reported step time (or the default).
        """
        sessions = self.capacity(step_budget_ms)
        step = self.measured.step_ms(sessions) if self.measured is not None else (self.step_ms or DEFAULT_STEP_MS)
        return sessions * 1000.0 / max(step, 1e-3)

    def has_room(self, step_budget_ms: float) -> bool:
        """Whether one more session may be routed here now."""
        if self.free_slots <= 0:
            return False
        capacity = self.capacity(step_budget_ms)
        # below its slot count the measured capacity binds (counting sessions routed since
        # the last heartbeat); at it, the free slots the node reports do
        return capacity >= self.slots or self.active_sessions < capacity

    def seam_ms(self) -> float:
        """Latency of the seam into this node, where neither end measured it."""
        return DIRECT_SEAM_MS if self.address else RELAY_SEAM_MS

    def public(self, now: float, step_budget_ms: float) -> dict[str, Any]:
        """The record as the tracker's ``/v1/nodes`` shows it (``now``: for how long ago it beat)."""
        return {
            "node_id": self.node_id.hex(),
            "model_name": self.model_name,
            "artifact": self.artifact,
            "layers": list(self.layers),
            "n_layer": self.n_layer,
            "recipe": self.recipe,
            "device": self.device,
            "kernel_class": self.kernel_class,
            "address": self.address,
            "relay": self.relay,
            "reachability": self.reachability,
            "slots": self.slots,
            "free_slots": self.free_slots,
            "active_sessions": self.active_sessions,
            "queue_depth": self.queue_depth,
            "step_ms": self.step_ms,
            "estimated_step_ms": self.estimated_step_ms(),
            "ctx_per_session": self.ctx_per_session,
            "seconds_since_heartbeat": round(now - self.last_seen, 2),
            "capability": self.measured.to_json() if self.measured is not None else None,
            "capacity": self.capacity(step_budget_ms),
            "probe_required": self.probe_required,
            "probe_passed": self.probe_passed,
            "probe_detail": self.probe_detail,
            "audit_failed": self.audit_failed,
            "admitted": self.admitted,
        }


@functools.lru_cache(maxsize=1 << 14)
def _capacity(measured: Capability, slots: int, step_budget_ms: float) -> int:
    # every heartbeat asks it again, of figures fixed at registration
    fitting = sum(1 for batch in range(1, slots + 1) if measured.step_ms(batch) <= step_budget_ms)
    return max(1, fitting)


# the description's fields the record holds as bytes (the JSON carries them in hex)
_HEX_FIELDS = tuple(f.name for f in attrs.fields(attrs.resolve_types(NodeRecord)) if f.type is bytes)
