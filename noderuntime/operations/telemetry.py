"""Prometheus metrics of every process, and session-tagged logging.

Each component owns its own registry (several nodes can live in one test process);
``/metrics`` serves it in the text exposition format. Names follow Prometheus
conventions: a ``noderuntime_`` prefix, base units (seconds, bytes), ``_total`` for
counters.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SECONDS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TTFT_BUCKETS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def trio_tasks() -> int:
    """Live trio tasks in this process (a leak shows as a count that keeps growing)."""
    root = trio.lowlevel.current_root_task()
    stack = [root] if root is not None else []
    count = 0
    while stack:
        task = stack.pop()
        count += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count


def exposition(registry: CollectorRegistry) -> tuple[int, str, bytes]:
    """(status, content type, body) for a ``/metrics`` response."""
    return 200, CONTENT_TYPE_LATEST, generate_latest(registry)


class NodeMetrics:
    """What a shard node exports."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("noderuntime_node_queue_depth", "Steps waiting for the next batch", registry=r)
        self.batch_rows = Histogram("noderuntime_node_batch_rows", "Rows per batch", buckets=BATCH_BUCKETS, registry=r)
        self.tick_seconds = Histogram(
            "noderuntime_node_tick_seconds", "Engine time per batch", buckets=SECONDS_BUCKETS, registry=r
        )
        self.prefill_tokens = Counter("noderuntime_node_prefill_tokens_total", "Prefill rows run", registry=r)
        self.decode_tokens = Counter("noderuntime_node_decode_tokens_total", "Decode rows run", registry=r)
        self.slots_in_use = Gauge("noderuntime_node_sequence_slots_in_use", "Leased or draining slots", registry=r)
        self.slots_total = Gauge("noderuntime_node_sequence_slots", "Sequence slots", registry=r)
        self.kv_cells = Gauge("noderuntime_node_kv_cells_in_use", "KV cells held (llama.cpp's count)", registry=r)
        self.seam_bytes = Counter(
            "noderuntime_seam_bytes_total", "Frame bytes on seams", ["transport", "direction"], registry=r
        )
        self.seam_frames = Counter(
            "noderuntime_seam_frames_total", "Frames on seams", ["transport", "direction"], registry=r
        )
        self.seam_round_trip = Histogram(
            "noderuntime_seam_round_trip_seconds",
            "From a decode step's Activations sent downstream to its token coming back",
            ["transport"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.windows_ahead = Counter(
            "noderuntime_node_windows_ahead_total",
            "Decode windows that follow one in flight: sent (at a head), run, or stale and passed over",
            ["outcome"],
            registry=r,
        )
        self.sessions_opened = Counter("noderuntime_sessions_opened_total", "Route sessions admitted", registry=r)
        self.sessions_ended = Counter(
            "noderuntime_sessions_ended_total", "Route sessions ended", ["reason"], registry=r
        )
        self.admissions_refused = Counter(
            "noderuntime_admissions_refused_total", "Sessions refused", ["code"], registry=r
        )
        self.errors = Counter("noderuntime_errors_total", "Errors", ["kind"], registry=r)
        self.probes = Counter("noderuntime_node_probes_total", "Known-answer probes answered", registry=r)
        self.prefix_lookups = Counter(
            "noderuntime_prefix_cache_lookups_total", "Prefix cache lookups", ["result"], registry=r
        )
        self.prefix_tokens = Counter(
            "noderuntime_prefix_cache_hit_tokens_total", "Prompt positions found in the prefix cache", registry=r
        )
        self.prefix_evictions = Counter(
            "noderuntime_prefix_cache_evictions_total", "Prefix cache entries dropped for room", registry=r
        )
        self.prefix_bytes = Gauge("noderuntime_prefix_cache_bytes", "Bytes the prefix cache holds", registry=r)

    def on_tick(self, rows: int, decode_rows: int, seconds: float) -> None:
        """The batcher's per-batch hook."""
        self.batch_rows.observe(rows)
        self.tick_seconds.observe(seconds)
        self.decode_tokens.inc(decode_rows)
        self.prefill_tokens.inc(rows - decode_rows)


class GatewayMetrics:
    """What the gateway exports."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "noderuntime_gateway_requests_total", "Requests answered", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "noderuntime_gateway_time_to_first_token_seconds",
            "Request to first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "noderuntime_gateway_inter_token_latency_seconds",
            "Between streamed tokens",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("noderuntime_gateway_prompt_tokens_total", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("noderuntime_gateway_completion_tokens_total", "Completion tokens", registry=r)
        self.route_repairs = Counter(
            "noderuntime_gateway_route_repairs_total",
            "Sessions moved to a new route after theirs failed mid-generation",
            ["code"],
            registry=r,
        )
        self.route_retries = Counter(
            "noderuntime_gateway_route_retries_total", "Routes abandoned before a token", ["code"], registry=r
        )
        self.cancelled = Counter("noderuntime_gateway_cancelled_total", "Streams the client left", registry=r)
        self.usage_records = Counter(
            "noderuntime_gateway_usage_records_total", "Usage records received", ["valid"], registry=r
        )
        self.commitment_mismatches = Counter(
            "noderuntime_gateway_commitment_mismatches_total",
            "Hops whose commitments broke their route's chain (a seam's two ends, or the route's ends)",
            registry=r,
        )
        self.errors = Counter("noderuntime_errors_total", "Errors", ["kind"], registry=r)


class TrackerMetrics:
    """What the tracker exports."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.nodes = Gauge("noderuntime_tracker_nodes", "Registered nodes", registry=r)
        self.registrations = Counter("noderuntime_tracker_registrations_total", "Registrations", registry=r)
        self.heartbeats = Counter("noderuntime_tracker_heartbeats_total", "Heartbeats", registry=r)
        self.routes = Counter("noderuntime_tracker_routes_total", "Route requests", ["outcome"], registry=r)
        self.auth_failures = Counter("noderuntime_tracker_auth_failures_total", "Refused signatures", registry=r)
        self.probes = Counter("noderuntime_tracker_probes_total", "Known-answer probe results", ["result"], registry=r)
        self.audits = Counter("noderuntime_tracker_audits_total", "Audit reports judged", ["verdict"], registry=r)
        self.errors = Counter("noderuntime_errors_total", "Errors", ["kind"], registry=r)


class RelayMetrics:
    """What the relay exports."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.nodes = Gauge("noderuntime_relay_nodes_connected", "Nodes with a control connection", registry=r)
        self.pairs = Gauge("noderuntime_relay_pairs_active", "Seams being forwarded", registry=r)
        self.bytes = Counter("noderuntime_relay_bytes_forwarded_total", "Bytes forwarded", registry=r)
        self.refused = Counter("noderuntime_relay_refused_total", "Refused connections", ["reason"], registry=r)
        self.errors = Counter("noderuntime_errors_total", "Errors", ["kind"], registry=r)


class SessionLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger whose every line names the route session (``session=<id>/<epoch> request=<id>``)."""

    def __init__(self, logger: logging.Logger, session: str, request_id: str) -> None:
        super().__init__(logger, {"session": session, "request_id": request_id})

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        extra = self.extra or {}
        return f"session={extra['session']} request={extra['request_id'] or '-'} {msg}", kwargs
