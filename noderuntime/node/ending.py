"""How a route session ends: one table of reasons, as h11 keeps its transitions in one place.

Each :class:`EndReason` maps to the status its peers hear and which of them are told;
:func:`ending` is the one way to make a :class:`SessionEnd`, so the reasons a node counts
(its ``sessions_ended`` metric labels) are these and no others. The two rules that decide
an ending from a session's state are pure functions here: whom the idle watchdog blames,
and when the tail stops generating.
"""

from __future__ import annotations

import enum
from collections.abc import Collection

import attrs

from protocol import StatusCode


class EndReason(enum.Enum):
    """Why a session ended (the value is its metric label)."""

    RELEASED = "released"  # the client released it: the normal end
    CANCELLED = "cancelled"  # upstream cancelled it (a client that left)
    DOWNSTREAM_CANCELLED = "downstream_cancelled"  # the next hop cancelled it
    UPSTREAM_CLOSED = "upstream_closed"  # the previous hop's stream went away
    DOWNSTREAM_CLOSED = "downstream_closed"  # the next hop's stream went away
    DOWNSTREAM_ERROR = "downstream_error"  # the next hop reported an error: passed on
    CONNECT_FAILED = "connect_failed"  # the next hop could not be reached
    DEADLINE = "deadline"  # the request's deadline passed
    IDLE = "idle"  # no progress for the idle timeout (see idle_blame)
    ENGINE_ERROR = "engine_error"  # the shard's batch failed
    UPSTREAM_PROTOCOL_ERROR = "upstream_protocol_error"  # the previous hop broke the protocol
    DOWNSTREAM_PROTOCOL_ERROR = "downstream_protocol_error"  # the next hop broke the protocol
    SEAM_CORRUPTED = "seam_corrupted"  # a seam's bytes failed their integrity check: altered on the way
    DEFECT = "defect"  # a defect of ours, met while serving (the node serves on)
    NODE_STOPPED = "node_stopped"  # the node is shutting down


# reason -> (status the peers hear, tell the previous hop, tell the next hop); a status
# of None comes with the ending (a peer's own code, or the watchdog's blame)
ENDINGS: dict[EndReason, tuple[StatusCode | None, bool, bool]] = {
    EndReason.RELEASED: (StatusCode.OK, False, False),
    EndReason.CANCELLED: (StatusCode.CANCELLED, False, True),
    EndReason.DOWNSTREAM_CANCELLED: (StatusCode.CANCELLED, True, False),
    EndReason.UPSTREAM_CLOSED: (StatusCode.CANCELLED, False, True),
    EndReason.DOWNSTREAM_CLOSED: (StatusCode.UNAVAILABLE, True, False),
    EndReason.DOWNSTREAM_ERROR: (None, True, False),
    EndReason.CONNECT_FAILED: (StatusCode.UNAVAILABLE, True, False),
    EndReason.DEADLINE: (StatusCode.DEADLINE_EXCEEDED, True, True),
    EndReason.IDLE: (None, True, True),
    EndReason.ENGINE_ERROR: (StatusCode.INTERNAL, True, True),
    EndReason.UPSTREAM_PROTOCOL_ERROR: (None, False, True),
    EndReason.DOWNSTREAM_PROTOCOL_ERROR: (StatusCode.UNAVAILABLE, True, False),
    # both peers hear it: the one across the tampered seam may still be listening on its other side
    EndReason.SEAM_CORRUPTED: (StatusCode.DATA_LOSS, True, True),
    EndReason.DEFECT: (StatusCode.INTERNAL, True, True),
    EndReason.NODE_STOPPED: (StatusCode.UNAVAILABLE, True, True),
}


@attrs.frozen
class SessionEnd:
    """Why a session ended, and whom to tell (make one with :func:`ending`)."""

    reason: EndReason
    code: StatusCode = StatusCode.OK
    message: str = ""
    tell_upstream: bool = False
    tell_downstream: bool = False
    node_id: bytes = b""  # the node that reported the error, when forwarded

    @property
    def label(self) -> str:
        """The reason as metrics and logs name it."""
        return self.reason.value


def seam_lost(upstream: bool, code: StatusCode, detail: str) -> SessionEnd:
    """How a session ends when the stream of its seam ``upstream`` (or downstream) fails with ``code``.

    DATA_LOSS is a seam whose bytes failed their integrity check (on a relayed seam:
    altered, dropped, replayed on the way), not a peer that left: it is named as such,
    for whoever decides where to route next.
    """
    if code == StatusCode.DATA_LOSS:
        side = "from the previous hop" if upstream else "from the next hop"
        return ending(EndReason.SEAM_CORRUPTED, f"the seam {side} failed its integrity check: {detail}")
    if upstream:
        return ending(EndReason.UPSTREAM_CLOSED, f"the upstream peer went away: {detail}")
    return ending(EndReason.DOWNSTREAM_CLOSED, f"the next hop went away: {detail}")


def ending(reason: EndReason, message: str = "", code: StatusCode | None = None, node_id: bytes = b"") -> SessionEnd:
    """The :class:`SessionEnd` of ``reason``, from the table; ``code`` only where the table leaves it open."""
    fixed, upstream, downstream = ENDINGS[reason]
    if fixed is None and code is None:
        raise ValueError(f"{reason.value} needs a status code")
    if fixed is not None and code not in (None, fixed):
        raise ValueError(f"{reason.value} ends with {fixed.name}, not {code}")
    status = fixed if fixed is not None else code
    assert status is not None
    return SessionEnd(reason, status, message or reason.value, upstream, downstream, node_id)


def idle_blame(idle: float, *, sends_up: int, awaiting_downstream: bool) -> tuple[StatusCode, str]:
    """(status, message) of a session that made no progress for ``idle`` seconds: whom it blames."""
    if sends_up:
        # the previous hop (or the client behind it) stopped reading: not the next hop's fault,
        # though its tokens wait behind the blocked send
        return StatusCode.DEADLINE_EXCEEDED, f"the previous hop read nothing for {idle:.0f} s"
    if awaiting_downstream:
        # a hung or cut-off next hop: the route failed, not the request (it may be retried)
        return StatusCode.UNAVAILABLE, f"the next hop made no progress for {idle:.0f} s"
    return StatusCode.DEADLINE_EXCEEDED, f"no progress for {idle:.0f} s"


def stop_reason(
    token: int, *, generated: int, max_tokens: int, position: int, reserved: int, stop_tokens: Collection[int]
) -> str:
    """The tail's rule: ``stop`` at a stop token, ``length`` at max_tokens or the session's
    reserved positions (``position`` is the sampled token's), else "" (go on)."""
    if token in stop_tokens:
        return "stop"
    if generated >= max_tokens or position + 1 >= reserved:
        return "length"
    return ""
