"""Protocol errors that say whose fault it was, each with a gRPC status code."""

from __future__ import annotations

import enum


class StatusCode(enum.IntEnum):
    """gRPC status codes (google.rpc.Code); Error frames and gRPC trailers carry them."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def coerce(cls, value: int) -> StatusCode:
        """A known code, or UNKNOWN for a value from a newer peer."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


class ProtocolError(Exception):
    """A seam protocol violation; ``code`` is what the peer is told."""

    def __init__(self, message: str, code: StatusCode = StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.code = code

    @property
    def message(self) -> str:
        """The human-readable reason."""
        return str(self.args[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, {self.code.name})"


class LocalProtocolError(ProtocolError):
    """We were about to do something the protocol forbids (our bug or our caller's)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids."""
