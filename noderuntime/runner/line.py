"""The line of requests waiting for a free sequence slot: bounded, and fair between API keys.

When every route is full, a request waits here rather than failing at once: round-robin
between API keys (one key's burst cannot starve another's single request), first come
first served within a key. The line is bounded in total and per key; a request that finds
it full is refused at once.

Only the request at the head of the line asks for a route: the others wait for their
turn, so a burst does not poll the tracker as a herd. The head tries again when a session
of this gateway ends (:meth:`WaitLine.slot_freed`), or after a bounded back-off, for slots
that sessions of other gateways freed. A request served leaves the line, and the next key
in turn heads it and tries at once: the slot that woke the last one may not be the only one.

Bookkeeping is plain synchronous code; only :meth:`WaitLine.wait_turn` blocks.
"""

from __future__ import annotations

import collections

import attrs
import trio

FIRST_BACKOFF_SECONDS = 0.05
# the head's longest wait without news: about half the interval at which nodes report
# their free slots to the tracker, so a slot another gateway freed is seen soon after
MAX_BACKOFF_SECONDS = 1.0


class LineFull(Exception):
    """The line (or this key's share of it) is full: the request is refused at once."""


@attrs.define(eq=False)
class Waiter:
    """One request's place in the line."""

    key: str
    backoff: float = FIRST_BACKOFF_SECONDS
    _wake: trio.Event = attrs.field(factory=trio.Event, repr=False)
    inside: bool = True


@attrs.frozen
class LineStatistics:
    """A snapshot of the line."""

    waiting: int
    keys: int
    limit: int
    per_key: int
    joined: int  # requests that ever joined
    served: int  # left with a slot
    refused: int  # found it full


class WaitLine:
    """Requests waiting for a slot, by API key (see the module's docstring)."""

    def __init__(self, *, limit: int, per_key: int) -> None:
        """``limit``: requests waiting at most, in all; ``per_key``: of them, under one API key."""
        if limit < 0 or per_key < 0:
            raise ValueError("the line's bounds must not be negative")
        self.limit = limit
        self.per_key = per_key
        # keys in their turn's order; within a key, its requests in arrival order
        self._keys: collections.OrderedDict[str, collections.deque[Waiter]] = collections.OrderedDict()
        self._waiting = 0
        self._joined = 0
        self._served = 0
        self._refused = 0

    @property
    def waiting(self) -> int:
        """Requests in the line now."""
        return self._waiting

    def head(self) -> Waiter | None:
        """Whose turn it is: the first request of the key whose turn it is."""
        for waiters in self._keys.values():
            return waiters[0]
        return None

    def join_nowait(self, key: str) -> Waiter:
        """A place at the end of ``key``'s part of the line; :class:`LineFull` when there is none."""
        waiters = self._keys.get(key)
        mine = len(waiters) if waiters is not None else 0
        if self._waiting >= self.limit or mine >= self.per_key:
            self._refused += 1
            raise LineFull(
                f"{self._waiting} requests wait for a slot (at most {self.limit}, {self.per_key} under one key;"
                f" this key has {mine})"
            )
        waiter = Waiter(key)
        if waiters is None:
            waiters = self._keys[key] = collections.deque()
        waiters.append(waiter)
        self._waiting += 1
        self._joined += 1
        return waiter

    def leave(self, waiter: Waiter, *, served: bool) -> None:
        """``waiter`` leaves the line: ``served`` (it has its slot) or not (timed out, gone). Idempotent.

        A served key goes to the end of the turns; whoever heads the line next tries at once.
        """
        if not waiter.inside:
            return
        waiter.inside = False
        was_head = self.head() is waiter
        waiters = self._keys[waiter.key]
        waiters.remove(waiter)
        self._waiting -= 1
        if served:
            self._served += 1
        if not waiters:
            del self._keys[waiter.key]
        elif served:
            self._keys.move_to_end(waiter.key)
        if was_head:
            self._wake_head()

    def slot_freed(self) -> None:
        """A session ended: the head of the line tries for its slot now."""
        self._wake_head()

    def _wake_head(self) -> None:
        head = self.head()
        if head is not None:
            head._wake.set()

    async def wait_turn(self, waiter: Waiter) -> None:
        """Return when ``waiter`` heads the line and a slot may be free: one freed, or its back-off passed.

        The caller bounds the wait (its queue deadline, its client leaving) with a cancel scope.
        """
        if not waiter.inside:
            raise ValueError("this request is no longer in the line")
        while True:
            if self.head() is waiter:
                with trio.move_on_after(waiter.backoff):
                    await waiter._wake.wait()
            else:
                await waiter._wake.wait()
            woken = waiter._wake.is_set()
            waiter._wake = trio.Event()
            if self.head() is waiter:
                # woken: a slot freed, so the next wait starts short; else, back off further
                waiter.backoff = FIRST_BACKOFF_SECONDS if woken else min(waiter.backoff * 2, MAX_BACKOFF_SECONDS)
                return

    def statistics(self) -> LineStatistics:
        """An immutable snapshot."""
        return LineStatistics(
            waiting=self._waiting,
            keys=len(self._keys),
            limit=self.limit,
            per_key=self.per_key,
            joined=self._joined,
            served=self._served,
            refused=self._refused,
        )


class RunningSessions:
    """Sessions running now, by key: one key may run at most ``per_key`` at once (0: no cap).

    The line shares the wait fairly; this shares what is served. Without it one key could
    hold every slot it ever won for as long as its sessions run.
    """

    def __init__(self, per_key: int) -> None:
        """``per_key``: sessions one key may run at once; 0 for no cap."""
        if per_key < 0:
            raise ValueError("the running sessions' cap must not be negative")
        self.per_key = per_key
        self._running: collections.Counter[str] = collections.Counter()

    def start_nowait(self, key: str) -> None:
        """Count a session of ``key`` as running; :class:`LineFull` when the key runs its cap already."""
        if self.per_key and self._running[key] >= self.per_key:
            raise LineFull(f"this key runs {self._running[key]} sessions already, at most {self.per_key} at once")
        self._running[key] += 1

    def finish(self, key: str) -> None:
        """A session of ``key`` ended (once per :meth:`start_nowait` that succeeded)."""
        self._running[key] -= 1
        if self._running[key] <= 0:
            del self._running[key]

    def running(self, key: str) -> int:
        """Sessions of ``key`` running now."""
        return self._running.get(key, 0)
