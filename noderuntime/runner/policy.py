"""A route's policy: which errors another route may cure, whom the next attempt avoids, how
long a route may stay silent, and the runner's typed errors."""

from __future__ import annotations

import time
from typing import Any

from noderuntime.seams.client import GenerationRequest, RouteError
from noderuntime.tracker.client import RouteGrant
from protocol import StatusCode

MAX_ATTEMPTS = 3
MAX_REPAIRS = 3  # a session whose routes keep failing ends with the last failure
DEADLINE_GRACE_SECONDS = 5.0  # beyond a request's deadline, for the route's own word on it


class RunError(Exception):
    """A request the runner could not serve; ``code`` says why, in words a client is told.

    ``routes_full`` and ``queue_full``: every route is busy (try again soon); ``client_closed``:
    the client left while it waited; ``no_route``, ``tracker`` and ``route_failed``: no route
    can serve it now; ``untrusted_route``: a route's ticket is not the tracker's (forged on the
    way, or the tracker's key changed), so nothing was sent; ``deadline_exceeded``: its time ran out.
    """

    CODES = frozenset(
        {
            "routes_full",
            "queue_full",
            "client_closed",
            "no_route",
            "tracker",
            "route_failed",
            "untrusted_route",
            "deadline_exceeded",
        }
    )

    def __init__(self, code: str, message: str) -> None:
        if code not in self.CODES:
            raise ValueError(f"unknown run error code {code!r}")
        super().__init__(message)
        self.code = code


def describe_route(grant: RouteGrant) -> list[dict[str, Any]]:
    """The route as a client is shown it: each hop's node (short), layers and how it is reached."""
    return [
        {
            "node_id": h.node_id.hex()[:16],
            "layers": [h.layers.start, h.layers.end],
            "via": "direct" if h.address else "relay",
        }
        for h in grant.hops
    ]


def time_left(request: GenerationRequest) -> float:
    """How long the route may stay silent: the request's own time, and a grace for its word on it."""
    # the nodes end a session at its deadline and say so; this bounds a route gone silent
    # (a head that accepted and hung, a relay host that vanished) on the gateway's side
    return max(0.0, request.deadline_unix_ms / 1000 - time.time()) + DEADLINE_GRACE_SECONDS


def silent_route() -> RunError:
    """A route that said nothing past the request's deadline."""
    return RunError("deadline_exceeded", "the route went silent past the request's deadline")


def route_error(exc: RouteError) -> RunError:
    """What a route's failure means for the request it served."""
    # Never the client's fault: the gateway checked the request before any route saw it, so a
    # route that calls it invalid (or out of range) is wrong or hostile, and another may serve it.
    if exc.code == StatusCode.RESOURCE_EXHAUSTED:
        return RunError("routes_full", f"every route is busy: {exc}")
    if exc.code == StatusCode.DEADLINE_EXCEEDED:
        return RunError("deadline_exceeded", f"the request timed out: {exc}")
    return RunError("route_failed", f"the route failed: {exc}")


def bad_route(what: str) -> RunError:
    """A route that sent what no honest route sends."""
    return RunError("route_failed", f"the route failed: {what}")


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
