"""Reaching the next hop: direct gRPC when it advertises an address, else (or on failure) its relay."""

from __future__ import annotations

import logging

import attrs

from noderuntime.access.tickets import TicketError, TicketVerifier
from noderuntime.transport import FrameStream, TransportError
from noderuntime.transport.grpc import GrpcConnector
from noderuntime.transport.relay_client import RelayDialer
from protocol import Hop, OpenRoute, RemoteProtocolError, StatusCode

log = logging.getLogger(__name__)


@attrs.define
class NetworkConnector:
    """Opens the seam to a hop: gRPC to its address, falling back to its relay."""

    grpc: GrpcConnector | None
    relay: RelayDialer | None
    direct_attempts: int = 0
    relay_attempts: int = 0
    fallbacks: int = 0

    @property
    def node_id(self) -> bytes:
        """The node id this connector proves on relayed seams (empty without a relay dialer)."""
        return self.relay.node_id if self.relay is not None else b""

    async def connect(self, hop: Hop, open_route: OpenRoute) -> FrameStream:
        """A frame stream to ``hop`` for the session ``open_route`` opens."""
        error: TransportError | None = None
        if hop.address and self.grpc is not None:
            self.direct_attempts += 1
            try:
                return await self.grpc.open(hop.address, tls_cert_sha256=hop.tls_cert_sha256)
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
