"""Opening a route session on a route the tracker granted: the one place that turns a grant
into a seam to its head."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

from noderuntime.seams.client import Generation, GenerationRequest, open_route_generation
from noderuntime.tracker.client import RouteGrant


def open_granted(
    connector: Any, grant: RouteGrant, request: GenerationRequest, *, artifact: bytes
) -> AbstractAsyncContextManager[Generation]:
    """``request`` as a route session on ``grant``'s hops, under its ticket, session and epoch."""
    return open_route_generation(
        connector,
        grant.hops,
        request,
        artifact=artifact,
        recipe=grant.recipe,
        ticket=grant.ticket,
        session_id=grant.session_id,
        epoch=grant.epoch,
    )
