"""How fast one client may take route grants: token buckets by address and by key; plain synchronous code.

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
