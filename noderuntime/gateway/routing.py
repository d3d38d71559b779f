"""The served route's policy: which errors another route may cure, whom the next attempt
avoids, how long a route may stay silent."""

from __future__ import annotations

import time
from typing import Any

from noderuntime.gateway.errors import ApiError
from noderuntime.seams.client import GenerationRequest, RouteError
from noderuntime.tracker.client import RouteGrant
from protocol import StatusCode

MAX_ATTEMPTS = 3
MAX_REPAIRS = 3  # a session whose routes keep failing ends with the last failure
DEADLINE_GRACE_SECONDS = 5.0  # beyond a request's deadline, for the route's own word on it


def describe_route(grant: RouteGrant) -> list[dict[str, Any]]:
    return [
        {
            "node_id": h.node_id.hex()[:16],
            "layers": [h.layers.start, h.layers.end],
            "via": "direct" if h.address else "relay",
        }
        for h in grant.hops
    ]


def time_left(request: GenerationRequest) -> float:
    # the nodes end a session at its deadline and say so; this bounds a route gone silent
    # (a head that accepted and hung, a relay host that vanished) on the gateway's side
    return max(0.0, request.deadline_unix_ms / 1000 - time.time()) + DEADLINE_GRACE_SECONDS


def silent_route() -> ApiError:
    return ApiError(504, "the route went silent past the request's deadline", "timeout", "deadline_exceeded")


def route_error(exc: RouteError) -> ApiError:
    # Never a 400: the gateway checked the request before any route saw it, so a route
    # that calls it invalid (or out of range) is wrong or hostile, and another may serve it.
    if exc.code == StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, f"every route is busy: {exc}", "rate_limit_error", "routes_full")
    if exc.code == StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, f"the request timed out: {exc}", "timeout", "deadline_exceeded")
    return ApiError(503, f"the route failed: {exc}", "service_unavailable", "route_failed")


def repairable(exc: RouteError) -> bool:
    """Whether a route that failed mid-generation may be replaced: not when the client or the
    request's own deadline ended it, or a route refused it for good reason."""
    return exc.code not in (StatusCode.CANCELLED, StatusCode.DEADLINE_EXCEEDED, StatusCode.OK)


def to_exclude(grant: RouteGrant, exc: RouteError) -> list[bytes]:
    """Which nodes the next attempt should avoid: the one the error names (every hop names
    the node an error is about: itself, or the next or previous hop it lost), else the head,
    whose own seam to this gateway failed."""
    ids = [h.node_id for h in grant.hops]
    return [exc.node_id] if exc.node_id in ids else ids[:1]


def bad_route(what: str) -> ApiError:
    return ApiError(503, f"the route failed: {what}", "service_unavailable", "route_failed")
