"""The client side of the network: reach a route's head directly or through its relay.

Used by the gateway, tests and benchmarks::

    async with open_dialer() as dialer:
        stream = await dialer.connect(route.hops[0], open_route)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from noderuntime.access.identity import Identity, channel_keys
from noderuntime.seams.network import NetworkConnector
from noderuntime.transport.grpc import AsyncioThread, GrpcConnector
from noderuntime.transport.relay_client import RelayDialer
from protocol import Limits
from protocol.channel import sealed_size


@asynccontextmanager
async def open_dialer(
    limits: Limits = Limits(), identity: Identity | None = None, *, plaintext: bool = False
) -> AsyncIterator[NetworkConnector]:
    """A connector with its own gRPC runtime and relay connections, closed on exit.

    ``identity``: whom it proves to be at the far end of its seams (a fresh key when
    None); where the nodes check tickets, the tickets of the sessions it opens must name
    it as their client. ``plaintext``: see :class:`NetworkConnector`.
    """
    keys = channel_keys(identity or Identity.generate())
    runtime = AsyncioThread()
    grpc = GrpcConnector(runtime, max_frame_bytes=sealed_size(limits.max_frame_bytes))
    try:
        async with trio.open_nursery() as nursery:
            yield NetworkConnector(grpc, RelayDialer(nursery, keys, plaintext=plaintext), keys, plaintext)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # the nursery only hosts websocket readers: an error is the caller's own, unwrap it
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:
        with trio.CancelScope(shield=True):
            await grpc.close()
        runtime.close()
