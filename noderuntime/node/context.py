"""What a route session is given and keeps of itself: the narrow context its node builds, its
key, what it did, and its deadline (plain data, no event loop)."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from noderuntime.node.batcher import StepOutput, StepRequest
from noderuntime.node.draftmodel import DraftModel
from noderuntime.node.prefix import PrefixCache
from noderuntime.transport import FrameStream
from protocol import Encoding, Hop, Limits, OpenRoute


@attrs.frozen
class SessionContext:
    """What a route session needs of its node: built once by the node, never the node itself."""

    node_id: bytes
    step: Callable[[StepRequest], Awaitable[StepOutput]]  # one step through the batcher
    retire: Callable[[int, Any], None]  # free a sequence (and its sampler) between ticks
    last_step: Callable[[int], None]  # a sequence hands in no more steps: no tick waits for it
    connect: Callable[[Hop, OpenRoute], Awaitable[FrameStream]]  # a stream to the next hop
    sign: Callable[[bytes], bytes]  # the node's signature over a usage record
    count_frame: Callable[[str, str, int], None]  # (transport, direction, bytes) into the metrics
    seam_round_trip: Callable[[str, float], None]  # (transport, seconds) of a decode step's round trip
    limits: Limits
    encoding: Encoding  # of the hidden states sent downstream
    prefill_chunk: int
    idle_timeout: float
    n_embd: int
    n_vocab: int
    # a next hop silent this long (no frame, no heartbeat) is hung; heartbeats go out 4 times as often
    hang_timeout: float = 2.0
    # the node's prefix cache, and the engine calls that save a finished sequence's KV and put one back
    prefix_cache: PrefixCache | None = None
    save_state: Callable[[int, int], Awaitable[bytes]] | None = None
    restore_state: Callable[[int, bytes, int], Awaitable[None]] | None = None
    # speculative decoding (node/drafting.py): the most drafted tokens a window may carry on
    # this node (0: its engine's rows are not exact in a window, so it takes none); and at the
    # head, the draft rows one session may add to a tick now (the node's budget shared by its
    # sessions)
    max_window: int = 0
    max_ahead: int = 0  # windows that may follow one in flight through this node
    windows_ahead: Callable[[str], None] = lambda outcome: None  # one such window "sent", "run" or "stale"
    draft_rows: Callable[[], int] = lambda: 0
    eager_windows: bool = False  # every draft offered goes, whatever it costs (WindowPolicy.eager)
    draft_model: DraftModel | None = None  # drafts at the head where prompt lookup has none (up --draft)


@attrs.frozen
class SessionKey:
    """A route session: its id and epoch."""

    session_id: bytes
    epoch: int

    def __str__(self) -> str:
        return f"{self.session_id.hex()[:12]}/{self.epoch}"


@attrs.define
class SessionUsage:
    """What this node did for the session."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0  # prompt positions restored from the prefix cache, not computed
    compute_seconds: float = 0.0
    started: float = attrs.Factory(time.time)


def deadline_from_unix_ms(deadline_unix_ms: int, default_seconds: float) -> float:
    """The trio deadline for a session: the client's, but no later than ``default_seconds``
    from now (the node's bound, and the deadline of a client that set none)."""
    if deadline_unix_ms <= 0:
        return trio.current_time() + default_seconds
    remaining = deadline_unix_ms / 1000.0 - time.time()
    return trio.current_time() + min(remaining, default_seconds) if math.isfinite(remaining) else math.inf
