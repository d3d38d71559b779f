"""Tracker records for tests: a node of a 30-layer artifact by name, and a registry holding some."""

from __future__ import annotations

import random

from noderuntime.tracker.records import NodeRecord
from noderuntime.tracker.registry import TrackerState

ARTIFACT = "ab" * 32


def node(
    name: str,
    layers: tuple[int, int],
    *,
    slots: int = 4,
    free: int | None = None,
    step: float = 10.0,
    relay: bool = False,
    recipe: str = "r" * 16,
) -> NodeRecord:
    return NodeRecord(
        node_id=node_id(name),
        artifact=ARTIFACT,
        n_layer=30,
        layers=layers,
        recipe=recipe,
        address="" if relay else f"{name}:1",
        relay="ws://relay" if relay else "",
        tls_cert_sha256=b"",
        slots=slots,
        ctx_per_session=2048,
        free_slots=slots if free is None else free,
        step_ms=step,
    )


def state_with(*records: NodeRecord, seed: int = 0) -> TrackerState:
    state = TrackerState(rng=random.Random(seed))
    for record in records:
        state.register(record, 0.0)
        if record.free_slots != record.slots:
            state.heartbeat(
                record.node_id,
                0.0,
                active_sessions=record.slots - record.free_slots,
                free_slots=record.free_slots,
                queue_depth=0,
                step_ms=record.step_ms,
            )
    return state


def node_id(name: str) -> bytes:
    """The 32-byte node id :func:`node` gives ``name``."""
    return name.encode().ljust(32, b".")
