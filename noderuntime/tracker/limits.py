"""How fast one client may take route grants, and how many it may hold: by address and by key; plain
synchronous code.

Anyone may ask the tracker for routes, and every grant counts against its nodes' free
slots until their next heartbeat. A client takes one token per grant from each bucket
it is known by (the address it connects from; the key its ticket names, when it names
one); a bucket holds ``burst`` tokens and refills at ``rate`` a second. A client whose
bucket is empty is refused (429) until it refills, and no other client notices.

The buckets a stranger can create are bounded: past ``max_clients`` the full ones (which
are as good as none) are dropped, then the least recently used.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

import attrs

MAX_CLIENTS = 65_536


@attrs.define
class _Bucket:
    tokens: float
    updated: float


class RateLimits:
    """Token buckets by client name (see the module's docstring)."""

    def __init__(self, *, rate: float, burst: float, max_clients: int = MAX_CLIENTS) -> None:
        """``rate``: grants a second one client may take in the long run; ``burst``: at once."""
        if not (rate > 0 and burst >= 1 and max_clients > 0):
            raise ValueError("a rate limit needs a positive rate, a burst of one or more and room for clients")
        self.rate = rate
        self.burst = burst
        self.max_clients = max_clients
        self._buckets: collections.OrderedDict[str, _Bucket] = collections.OrderedDict()
        self.refused = 0

    def take(self, clients: Iterable[str], now: float) -> float:
        """Take one token from each of ``clients``' buckets: 0.0 when every one had it, else (and
        taking none) the seconds until the emptiest refills one."""
        buckets = [self._bucket(name, now) for name in dict.fromkeys(clients)]
        short = max((1.0 - b.tokens for b in buckets), default=0.0)
        if short > 0:
            self.refused += 1
            return short / self.rate
        for bucket in buckets:
            bucket.tokens -= 1.0
        return 0.0

    def _bucket(self, name: str, now: float) -> _Bucket:
        bucket = self._buckets.get(name)
        if bucket is None:
            self._make_room(now)
            bucket = self._buckets[name] = _Bucket(self.burst, now)
        else:
            self._buckets.move_to_end(name)
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
            bucket.updated = now
        return bucket

    def _make_room(self, now: float) -> None:
        if len(self._buckets) < self.max_clients:
            return
        for name, bucket in list(self._buckets.items()):
            if bucket.tokens + (now - bucket.updated) * self.rate >= self.burst:
                del self._buckets[name]
        while len(self._buckets) >= self.max_clients:
            self._buckets.popitem(last=False)

    def __len__(self) -> int:
        return len(self._buckets)


class Outstanding:
    """Route grants a client holds at once: granted, and their tickets not yet expired.

    The tracker cannot see a session end (nodes report how many sessions they run, not
    which), so a grant counts until its ticket expires, which the tracker itself bounded.
    Expiries are kept rounded up to ``granularity`` seconds, a count each: what one client
    costs is bounded by the tickets' longest lifetime, not by how many it took. Clients are
    bounded like :class:`RateLimits`' (those holding nothing dropped first, then the least
    recently seen: forgetting one only lets it take more, never another less).
    """

    def __init__(self, *, limit: int, granularity: float = 60.0, max_clients: int = MAX_CLIENTS) -> None:
        """``limit``: grants one client name may hold at once."""
        if not (limit >= 1 and granularity > 0 and max_clients > 0):
            raise ValueError("a concurrency limit needs a limit of one or more, a granularity and room for clients")
        self.limit = limit
        self.granularity = granularity
        self.max_clients = max_clients
        self._held: collections.OrderedDict[str, dict[int, int]] = collections.OrderedDict()
        self.refused = 0

    def held(self, client: str, now: float) -> int:
        """How many grants ``client`` holds at ``now``."""
        slots = self._held.get(client)
        if slots is None:
            return 0
        for slot in [s for s in slots if s * self.granularity <= now]:
            del slots[slot]
        return sum(slots.values())

    def take(self, clients: Iterable[str], now: float, expires: float) -> bool:
        """Count one grant, held until ``expires``, against each of ``clients``: False (counting none) when
        one of them already holds ``limit``."""
        names = list(dict.fromkeys(clients))
        if any(self.held(name, now) >= self.limit for name in names):
            self.refused += 1
            return False
        slot = math.ceil(expires / self.granularity)
        for name in names:
            slots = self._held.get(name)
            if slots is None:
                self._make_room(now)
                slots = self._held[name] = {}
            else:
                self._held.move_to_end(name)
            slots[slot] = slots.get(slot, 0) + 1
        return True

    def _make_room(self, now: float) -> None:
        if len(self._held) < self.max_clients:
            return
        for name in [n for n in self._held if not self.held(n, now)]:
            del self._held[name]
        while len(self._held) >= self.max_clients:
            self._held.popitem(last=False)

    def __len__(self) -> int:
        return len(self._held)
