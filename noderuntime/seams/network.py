"""Reaching the next hop: direct gRPC when it advertises an address, else (or on failure) its relay.

Either way the seam is sealed end to end and pinned to the node id the route plan names
(:mod:`noderuntime.transport.sealed`); plaintext direct seams only where both ends were
started with ``--insecure-plaintext-seams``.
"""

from __future__ import annotations

import logging

import attrs

from noderuntime.access.addresses import AddressError, check_address, check_relay_resolved
from noderuntime.access.tickets import TicketError, TicketVerifier, declares_local
from noderuntime.transport import FrameStream, TransportError
from noderuntime.transport.grpc import GrpcConnector
from noderuntime.transport.relay_client import RelayDialer
from noderuntime.transport.sealed import ANSWER_TIMEOUT, seal_dialer
from protocol import Hop, OpenRoute, RemoteProtocolError, StatusCode
from protocol.channel import Binding, ChannelKeys

log = logging.getLogger(__name__)


class AddressRefused(TransportError):
    """A hop names an address or relay that a swarm not declared local may not dial (loopback, private, ...)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, StatusCode.PERMISSION_DENIED)


async def check_dialable(hop: Hop, open_route: OpenRoute, *, local: bool = False) -> None:
    """:class:`AddressRefused` unless ``hop``'s address and relay are public, or its ticket declares the swarm
    local, or the dialler's own operator does (``local``).

    The ticket is one its holder verified already (a node's admission check; a gateway's
    :func:`~noderuntime.runner.opening.checked`); it binds the hop's address and relay too.
    """
    if local or declares_local(open_route.ticket):
        return
    try:
        if hop.address:
            check_address(hop.address)
        if hop.relay:
            await check_relay_resolved(hop.relay)
    except AddressError as exc:
        raise AddressRefused(f"not dialling hop {hop.layers.start}:{hop.layers.end}: {exc}") from None


@attrs.define
class NetworkConnector:
    """Opens the seam to a hop: gRPC to its address, falling back to its relay; sealed either way.

    ``keys``: whom it proves to be at the far end of every seam it opens.
    ``plaintext``: direct seams go unsealed (``--insecure-plaintext-seams``, for measuring
    what sealing costs; the relay dialer is given the same); a node not started with it
    refuses them. ``answer_timeout``: how long a direct hop may take to answer the seam
    handshake before the seam fails over to its relay, or fails (the relay dialer has its own).
    """

    grpc: GrpcConnector | None
    relay: RelayDialer | None
    keys: ChannelKeys
    plaintext: bool = False
    answer_timeout: float = ANSWER_TIMEOUT
    direct_attempts: int = 0
    relay_attempts: int = 0
    fallbacks: int = 0
    addresses_refused: int = 0  # hops not dialled: they named private addresses outside a local swarm
    # dial private addresses whatever the ticket says: for tools and tests that hand nodes on
    # loopback tickets of their own making (even bad ones, to see the node refuse them).
    # Nodes and gateways leave it off: their tickets say whether the swarm is local.
    local_swarm: bool = False

    @property
    def node_id(self) -> bytes:
        """The node id this connector proves at the far end of its seams."""
        return self.keys.node_id

    async def connect(self, hop: Hop, open_route: OpenRoute) -> FrameStream:
        """A frame stream to ``hop`` for the session ``open_route`` opens."""
        try:
            await check_dialable(hop, open_route, local=self.local_swarm)
        except AddressRefused:
            self.addresses_refused += 1
            raise
        error: TransportError | None = None
        if hop.address and self.grpc is not None:
            self.direct_attempts += 1
            try:
                stream = await self.grpc.open(hop.address, tls_cert_sha256=hop.tls_cert_sha256)
                if self.plaintext:
                    return stream
                ident = open_route.header.identity
                binding = Binding(ident.session_id, ident.epoch, self.keys.node_id, hop.node_id)
                return await seal_dialer(
                    stream, self.keys, binding, f"the node at {hop.address}", within=self.answer_timeout
                )
            except TransportError as exc:
                if not hop.relay:
                    raise
                error = exc
                self.fallbacks += 1
                log.warning("direct seam to %s failed (%s); falling back to its relay", hop.address, exc)
        if hop.relay and self.relay is not None:
            self.relay_attempts += 1
            ident = open_route.header.identity
            return await self.relay.dial(
                hop.relay, hop.node_id, session_id=ident.session_id, epoch=ident.epoch, ticket=open_route.ticket
            )
        raise error or TransportError(
            f"hop {hop.layers.start}:{hop.layers.end} has no address or relay this node can use", StatusCode.UNAVAILABLE
        )


def ticket_check(verifier: TicketVerifier, node_id: bytes):  # type: ignore[no-untyped-def]
    """The node's admission hook: a valid, unused ticket naming this node at its place in the plan.

    ``dialer``: the node id the seam's own handshake proved (relayed seams), else None.
    """

    async def check(open_route: OpenRoute, index: int, dialer: bytes | None) -> None:
        ident = open_route.header.identity
        try:
            verifier.check(
                open_route.ticket,
                session_id=ident.session_id,
                epoch=ident.epoch,
                artifact=ident.artifact_fingerprint,
                hops=open_route.hops,
                node_id=node_id,
                index=index,
                dialer=dialer,
            )
        except TicketError as exc:
            raise RemoteProtocolError(str(exc), exc.code) from None

    return check
