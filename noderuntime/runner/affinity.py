"""Prefix affinity: which route last served a prefix, so that a conversation sticks to the nodes
that keep its KV in their prefix caches (plain bookkeeping, bounded)."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from noderuntime.node.prefix import block_hashes
from noderuntime.tracker.client import RouteGrant

MAX_SERVED_PREFIXES = 100_000  # block hashes of served prefixes remembered (16 B each, and nodes)


class PrefixAffinity:
    """The block hash of a prefix a route served -> that route's nodes, least recently used first out."""

    def __init__(self, limit: int = MAX_SERVED_PREFIXES) -> None:
        self.limit = limit
        self._served: collections.OrderedDict[bytes, tuple[bytes, ...]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._served)

    def holders(self, prompt: Sequence[int]) -> list[bytes]:
        """The nodes of the route that last served the longest prefix of ``prompt`` seen here."""
        for digest in reversed(block_hashes(prompt)):
            nodes = self._served.get(digest)
            if nodes is not None:
                self._served.move_to_end(digest)
                return list(nodes)
        return []

    def served(self, tokens: Sequence[int], grant: RouteGrant) -> None:
        """Remember that ``grant``'s nodes now hold ``tokens`` (a finished session's prompt and reply)."""
        nodes = tuple(h.node_id for h in grant.hops)
        for digest in block_hashes(tokens):
            self._served[digest] = nodes
            self._served.move_to_end(digest)
        while len(self._served) > self.limit:
            self._served.popitem(last=False)
