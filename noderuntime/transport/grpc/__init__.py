"""Direct seams over gRPC: grpclib on an asyncio loop in one thread, bridged into trio.

Only this package's modules import grpclib or asyncio. grpclib runs on asyncio only, so
every process that speaks gRPC runs one asyncio loop in a dedicated thread
(:class:`AsyncioThread`); grpclib's Server and Channel objects are created on that
thread, because they capture the running loop. Frames cross between the loops through
bounded pipes (``bridge.Pipe``): a trio sender waits while the asyncio side has not taken
its frames, and grpclib's HTTP/2 flow control makes the asyncio side wait for the peer,
so backpressure reaches the session that produces the frames.

One seam of one route session is one long-lived bidirectional stream of the method
``/noderuntime.seam.v1.Seam/Open``. Messages are the protocol's frame bytes as they are
(a pass-through codec), so the same frames travel here as over memory or a relay.
Closing a stream ends our side and waits briefly for the peer to end its side;
cancelling the trio side, or a peer that does not end, resets the HTTP/2 stream
(RST_STREAM), which cancels the peer's handler within milliseconds.

The parts: ``bridge`` (the asyncio thread and the pipes), ``wire`` (the method, the
codec, keepalive, addresses), ``stream`` (a seam's trio end and the pump that moves its
frames), ``server``, ``connector`` (dialing, with spare connections), ``tls`` (pinned
certificates), ``errors`` (how grpclib's, asyncio's, the OS's and ssl's errors become the
transport's) and ``_grpclib_private`` (every reach into grpclib's internals).
"""

from noderuntime.transport.grpc.bridge import AsyncioThread
from noderuntime.transport.grpc.connector import GrpcConnector
from noderuntime.transport.grpc.server import GrpcServer
from noderuntime.transport.grpc.wire import parse_address

__all__ = ["AsyncioThread", "GrpcConnector", "GrpcServer", "parse_address"]
