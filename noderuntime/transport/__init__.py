"""Frame streams: the bytes of one seam, over memory, gRPC or a relay."""

from noderuntime.transport.base import FrameStream, PeerAuthentication, StreamBroken, StreamClosed, TransportError
from noderuntime.transport.memory import memory_stream_pair

__all__ = ["FrameStream", "PeerAuthentication", "StreamBroken", "StreamClosed", "TransportError", "memory_stream_pair"]
