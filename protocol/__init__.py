"""The seam protocol, sans-IO: bytes in, typed events out, and back.

This package imports no trio, grpclib or llama_cpp. See ``seam.proto`` for the
schema, :mod:`protocol.codec` for frames, :mod:`protocol.seam` for the per-session
state machine and ``README.md`` for encodings and their measured error.
"""

from protocol.codec import FrameDecoder, FrameEncoder
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError, StatusCode
from protocol.events import (
    MAX_TOP_LOGPROBS,
    SCHEMA_MAJOR,
    SCHEMA_MINOR,
    Activations,
    Cancel,
    Credit,
    Encoding,
    Error,
    Event,
    Header,
    Hop,
    Identity,
    NamedTensor,
    OpenRoute,
    Phase,
    Prefix,
    Release,
    Sampling,
    Span,
    TokenLogprob,
    Tokens,
    Usage,
    UsageRecord,
    route_recipe,
)
from protocol.limits import Limits
from protocol.seam import HEARTBEAT_MINOR, Direction, SeamEndpoint, State, error_event

__all__ = [
    "HEARTBEAT_MINOR",
    "MAX_TOP_LOGPROBS",
    "SCHEMA_MAJOR",
    "SCHEMA_MINOR",
    "Activations",
    "Cancel",
    "Credit",
    "Direction",
    "Encoding",
    "Error",
    "Event",
    "FrameDecoder",
    "FrameEncoder",
    "Header",
    "Hop",
    "Identity",
    "Limits",
    "LocalProtocolError",
    "NamedTensor",
    "OpenRoute",
    "Phase",
    "Prefix",
    "ProtocolError",
    "Release",
    "RemoteProtocolError",
    "Sampling",
    "SeamEndpoint",
    "Span",
    "State",
    "StatusCode",
    "TokenLogprob",
    "Tokens",
    "Usage",
    "UsageRecord",
    "error_event",
    "route_recipe",
]
