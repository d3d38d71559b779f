"""What both ends of a gRPC seam agree on: the method, the frame codec, keepalive, addresses."""

from __future__ import annotations

from typing import Any

from grpclib.config import Configuration
from grpclib.encoding.base import CodecBase

from noderuntime.access import untrusted
from noderuntime.transport.grpc import _grpclib_private

SEAM_METHOD = "/noderuntime.seam.v1.Seam/Open"
KEEPALIVE_SECONDS = 10.0  # a connection pings its peer this often, idle or not
KEEPALIVE_TIMEOUT = 20.0  # and closes when a ping goes unanswered this long


def configuration() -> Configuration:
    """grpclib's settings for every server and channel of the transport."""
    # keepalive finds a dead peer (a hung host, a cut link) even on an idle seam or spare
    return _grpclib_private.keepalive_configuration(KEEPALIVE_SECONDS, KEEPALIVE_TIMEOUT)


class FrameCodec(CodecBase):
    """Messages are protocol frames: bytes in, the same bytes out."""

    __content_subtype__ = "noderuntime-frames"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


def parse_address(address: str, *, listen: bool = False) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) into its parts; ``ValueError`` when malformed.

    A listen address may use port 0 (any free port).
    """
    return untrusted.host_port(address, listen=listen)
