"""Opening a route session on a route the tracker granted: the one place that turns a grant
into a seam to its head, once its ticket has been checked."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

from noderuntime.access.known_trackers import TrackerKeyChanged
from noderuntime.access.tickets import TicketError, check_grant
from noderuntime.runner.policy import RunError
from noderuntime.seams.client import Generation, GenerationRequest, open_route_generation
from noderuntime.tracker.client import RouteGrant, TrackerError


class Issuers(Protocol):
    """Whose tickets a route may carry: the key of the tracker that granted it."""

    async def key_of(self, url: str) -> bytes:
        """The ticket-issuer key of the tracker at ``url``, as pinned for it
        (:class:`~noderuntime.tracker.trackers.IssuerKeys`)."""
        ...


async def checked(grant: RouteGrant, *, artifact: bytes, issuers: Issuers) -> None:
    """:class:`RunError` (``untrusted_route``) unless ``grant``'s ticket is its tracker's and names its route.

    Signed by the key pinned for the tracker that granted it, unexpired, for the grant's
    session, epoch and ``artifact``, on the grant's hops exactly (node ids, layers,
    addresses, relays). A reply forged on the way from the tracker (another head, another
    signer, a hop's address swapped) fails here, before anything is sent to its head.
    """
    try:
        issuer = await issuers.key_of(grant.tracker)
    except TrackerKeyChanged as exc:
        raise RunError("untrusted_route", str(exc)) from None
    except TrackerError as exc:
        why = f"the tracker {grant.tracker} does not say what key signs its tickets: {exc}"
        raise RunError("tracker", why) from None
    try:
        check_grant(
            grant.ticket,
            issuer=issuer,
            session_id=grant.session_id,
            epoch=grant.epoch,
            artifact=artifact,
            hops=grant.hops,
        )
    except TicketError as exc:
        raise RunError(
            "untrusted_route",
            f"refused the route the tracker {grant.tracker or '(none named)'} answered: {exc} (the key pinned for "
            f"it is {issuer.hex()[:16]}…; someone may have answered in its place)",
        ) from None


@asynccontextmanager
async def open_granted(
    connector: Any, grant: RouteGrant, request: GenerationRequest, *, artifact: bytes, issuers: Issuers
) -> AsyncIterator[Generation]:
    """``request`` as a route session on ``grant``'s hops, under its ticket, session and epoch.

    The ticket is checked first (:func:`checked`): :class:`RunError` before the head is dialled.
    """
    await checked(grant, artifact=artifact, issuers=issuers)
    async with open_route_generation(
        connector,
        grant.hops,
        request,
        artifact=artifact,
        recipe=grant.recipe,
        ticket=grant.ticket,
        session_id=grant.session_id,
        epoch=grant.epoch,
    ) as generation:
        yield generation
