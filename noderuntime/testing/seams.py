"""Seams of every transport for tests and benchmarks: a fresh pair of ends over memory, gRPC or the relay."""

from __future__ import annotations

import os
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from noderuntime.access.identity import Identity, channel_keys
from noderuntime.access.tickets import TicketVerifier, issue
from noderuntime.seams.connection import SeamConnection
from noderuntime.transport import FrameStream, memory_stream_pair
from noderuntime.transport.grpc import AsyncioThread, GrpcConnector, GrpcServer
from noderuntime.transport.relay_client import RelayDialer, RelayListener
from noderuntime.transport.sealed import seal_acceptor, seal_dialer
from protocol import Direction, Hop, OpenRoute, SeamEndpoint, Span
from protocol.channel import Binding, sealed_size
from relay.server import Relay, serve

KINDS = ("memory", "grpc", "sealed_grpc", "relay")
# the relayed seam without its end-to-end channel, for benchmarks that measure what the channel costs
PLAINTEXT_RELAY = "relay_plaintext"


@asynccontextmanager
async def grpc_peer(
    max_frame_bytes: int = 1 << 20, tls: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[GrpcConnector, int, trio.MemoryReceiveChannel[FrameStream]]]:
    """A gRPC server on loopback and a connector: (connector, server port, the server's new streams)."""
    runtime = AsyncioThread()
    send, receive = trio.open_memory_channel[FrameStream](4)
    server = GrpcServer(runtime, send.send_nowait, max_frame_bytes=max_frame_bytes)
    connector = GrpcConnector(runtime, max_frame_bytes=max_frame_bytes)
    try:
        port = await server.start("127.0.0.1", 0, tls)
        yield connector, port, receive
    finally:
        await connector.close()
        await server.close()
        runtime.close()


@asynccontextmanager
async def seam(kind: str) -> AsyncIterator[tuple[FrameStream, FrameStream]]:
    """(client end, server end) of one fresh seam over ``kind`` (one of :data:`KINDS`, or :data:`PLAINTEXT_RELAY`)."""
    if kind == "memory":
        a, b = memory_stream_pair()
        yield a, b
        return
    if kind == "grpc":
        async with grpc_peer(8 << 20) as (connector, port, streams):
            client = await connector.open(f"127.0.0.1:{port}")
            yield client, await streams.receive()
        return
    if kind == "sealed_grpc":
        # a direct seam as nodes open it: gRPC, the handshake in its first messages, then sealed frames
        async with grpc_peer(sealed_size(8 << 20)) as (connector, port, streams):
            near, far = channel_keys(Identity.generate()), channel_keys(Identity.generate())
            binding = Binding(os.urandom(16), 0, near.node_id, far.node_id)
            raw = await connector.open(f"127.0.0.1:{port}")
            server_end = seal_acceptor(await streams.receive(), far, "the dialer")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server_end.handshake)
                sealed = await seal_dialer(raw, near, binding, "the acceptor")
            yield sealed, server_end
        return
    send, receive = trio.open_memory_channel[FrameStream](4)
    issuer, node = Identity.generate(), Identity.generate()
    relay = Relay(TicketVerifier([issuer.node_id]))
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, relay, "127.0.0.1", 0)
        url = f"ws://127.0.0.1:{server.port}"
        plaintext = kind == PLAINTEXT_RELAY
        listener = RelayListener(url, node, send.send_nowait, plaintext=plaintext)
        async with trio.open_nursery() as listening:
            await listening.start(listener.run)
            session = os.urandom(16)
            hops = [Hop(node.node_id, Span(0, 1))]
            dialer = RelayDialer(nursery, channel_keys(Identity.generate()), plaintext=plaintext)
            ticket = issue(issuer, session_id=session, epoch=0, artifact=b"a" * 32, hops=hops, client=dialer.node_id)
            relayed = await dialer.dial(url, node.node_id, session_id=session, epoch=0, ticket=ticket)
            yield relayed, await receive.receive()
            # the node leaves while the relay still runs to answer its closing handshake:
            # cancelled together, the close would wait out its second
            listener.stop()
        nursery.cancel_scope.cancel()


async def first_hop_seam(stream: FrameStream, shard: Span) -> tuple[SeamConnection, OpenRoute]:
    """The seam a route's first hop (serving ``shard``) serves on ``stream``, once the client's
    OpenRoute came in on it: the seam, and that OpenRoute."""
    conn = SeamConnection(stream)
    opening = await conn.receive()
    assert isinstance(opening, OpenRoute), opening
    endpoint = SeamEndpoint(opening.header.identity.at(shard), Direction.UPSTREAM, peer_shard=Span())
    endpoint.receive(opening)
    conn.endpoint = endpoint
    return conn, opening
