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
    DOWNSTREAM_SILENT = "downstream_silent"  # the next hop sent nothing, not even a heartbeat: hung
    SEAM_CORRUPTED = "seam_corrupted"  # a seam's bytes failed their integrity check: altered on the way
    DEFECT = "defect"  # a defect of ours, met while serving (the node serves on)
    NODE_STOPPED = "node_stopped"  # the node is shutting down


class Blame(enum.Enum):
    """Whom an ending is about: the node an Error frame names, so that a repair avoids it."""

    NONE = "none"  # nobody failed (a release, a cancel, a deadline)
    SELF = "self"  # this node (its engine, a defect, it is leaving)
    NEXT = "next"  # the next hop (gone, silent, broken), or the seam to it
    PREVIOUS = "previous"  # the previous hop


# reason -> (status the peers hear, tell the previous hop, tell the next hop, whom it is
# about); a status of None comes with the ending (a peer's own code, or the watchdog's
# blame), and so does the blame of None
ENDINGS: dict[EndReason, tuple[StatusCode | None, bool, bool, Blame | None]] = {
    EndReason.RELEASED: (StatusCode.OK, False, False, Blame.NONE),
    EndReason.CANCELLED: (StatusCode.CANCELLED, False, True, Blame.NONE),
    EndReason.DOWNSTREAM_CANCELLED: (StatusCode.CANCELLED, True, False, Blame.NONE),
    EndReason.UPSTREAM_CLOSED: (StatusCode.CANCELLED, False, True, Blame.PREVIOUS),
    EndReason.DOWNSTREAM_CLOSED: (StatusCode.UNAVAILABLE, True, False, Blame.NEXT),
    EndReason.DOWNSTREAM_ERROR: (None, True, False, Blame.NEXT),  # the node its Error names, when it names one
    EndReason.CONNECT_FAILED: (StatusCode.UNAVAILABLE, True, False, Blame.NEXT),
    EndReason.DEADLINE: (StatusCode.DEADLINE_EXCEEDED, True, True, Blame.NONE),
    EndReason.IDLE: (None, True, True, None),
    EndReason.ENGINE_ERROR: (StatusCode.INTERNAL, True, True, Blame.SELF),
    EndReason.UPSTREAM_PROTOCOL_ERROR: (None, False, True, Blame.PREVIOUS),
    EndReason.DOWNSTREAM_PROTOCOL_ERROR: (StatusCode.UNAVAILABLE, True, False, Blame.NEXT),
    # the hung hop hears the Cancel when it wakes, and frees what it holds
    EndReason.DOWNSTREAM_SILENT: (StatusCode.UNAVAILABLE, True, True, Blame.NEXT),
    # both peers hear it: the one across the tampered seam may still be listening on its other side
    EndReason.SEAM_CORRUPTED: (StatusCode.DATA_LOSS, True, True, None),
    EndReason.DEFECT: (StatusCode.INTERNAL, True, True, Blame.SELF),
    # leaving (SIGTERM, `noderuntime down`) or failing: either way its neighbours go on without it
    EndReason.NODE_STOPPED: (StatusCode.UNAVAILABLE, True, True, Blame.SELF),
}


@attrs.frozen
class SessionEnd:
    """Why a session ended, and whom to tell (make one with :func:`ending`)."""

    reason: EndReason
    code: StatusCode = StatusCode.OK
    message: str = ""
    tell_upstream: bool = False
    tell_downstream: bool = False
    node_id: bytes = b""  # the node the error is about, when forwarded from another hop
    blame: Blame = Blame.NONE

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
        blame = Blame.PREVIOUS if upstream else Blame.NEXT
        return ending(EndReason.SEAM_CORRUPTED, f"the seam {side} failed its integrity check: {detail}", blame=blame)
    if upstream:
        return ending(EndReason.UPSTREAM_CLOSED, f"the upstream peer went away: {detail}")
    return ending(EndReason.DOWNSTREAM_CLOSED, f"the next hop went away: {detail}")


def ending(
    reason: EndReason,
    message: str = "",
    code: StatusCode | None = None,
    node_id: bytes = b"",
    *,
    blame: Blame | None = None,
) -> SessionEnd:
    """The :class:`SessionEnd` of ``reason``, from the table.

    ``code`` and ``blame`` only where the table leaves them open.
    """
    fixed, upstream, downstream, table_blame = ENDINGS[reason]
    if fixed is None and code is None:
        raise ValueError(f"{reason.value} needs a status code")
    if fixed is not None and code not in (None, fixed):
        raise ValueError(f"{reason.value} ends with {fixed.name}, not {code}")
    if table_blame is None and blame is None:
        raise ValueError(f"{reason.value} needs to be told whom it blames")
    status = fixed if fixed is not None else code
    assert status is not None
    return SessionEnd(
        reason, status, message or reason.value, upstream, downstream, node_id, blame or table_blame or Blame.NONE
    )


def idle_blame(idle: float, *, sends_up: int, awaiting_downstream: bool) -> tuple[StatusCode, str, Blame]:
    """(status, message, whom it is about) of a session that made no progress for ``idle`` seconds."""
    if sends_up:
        # the previous hop (or the client behind it) stopped reading: not the next hop's fault,
        # though its tokens wait behind the blocked send
        return StatusCode.DEADLINE_EXCEEDED, f"the previous hop read nothing for {idle:.0f} s", Blame.PREVIOUS
    if awaiting_downstream:
        # a hung or cut-off next hop: the route failed, not the request (it may be retried)
        return StatusCode.UNAVAILABLE, f"the next hop made no progress for {idle:.0f} s", Blame.NEXT
    return StatusCode.DEADLINE_EXCEEDED, f"no progress for {idle:.0f} s", Blame.NONE


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
