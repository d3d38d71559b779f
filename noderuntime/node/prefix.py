"""A node's prefix cache: the KV of finished sessions, found again by the tokens they began with.

Plain synchronous bookkeeping, no I/O and no engine: the session saves a finished
sequence's KV (the engine's state bytes) and its token ids here, and a new session asks
for the longest cached prefix of its prompt. Entries are found by a chained hash of
their token blocks (:data:`BLOCK` tokens each, as vLLM's automatic prefix caching keys
its blocks): the hash of block *i* covers every token before it, so one lookup per
block boundary of the prompt finds the deepest match. Everything this node computed is
for one artifact, recipe and layer range, so those key the cache by being the node's.

Within ``budget`` bytes of state, least recently used entries go first, and an entry goes
at once when a newer one begins with all its tokens (a conversation's previous turn). A
hit is found by whole blocks and then goes on token by token as far as the entry and the
prompt agree (a chat's next turn shares its previous turn up to where the reply's text
was tokenized differently or the new message begins); never the prompt's last token: the
tail must compute its logits.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from collections.abc import Sequence

import attrs

BLOCK = 16


def block_hashes(tokens: Sequence[int], blocks: int | None = None) -> list[bytes]:
    """The chained hash after each whole block of ``tokens`` (the first ``blocks`` of them)."""
    count = len(tokens) // BLOCK if blocks is None else min(blocks, len(tokens) // BLOCK)
    out = []
    digest = b""
    for i in range(count):
        block = struct.pack(f"<{BLOCK}I", *tokens[i * BLOCK : (i + 1) * BLOCK])
        digest = hashlib.sha256(digest + block).digest()[:16]
        out.append(digest)
    return out


@attrs.define(eq=False)
class Entry:
    """One finished sequence: its tokens and the KV state that holds them."""

    tokens: tuple[int, ...]
    state: bytes
    hashes: list[bytes]


@attrs.frozen
class PrefixStatistics:
    """A snapshot of the cache."""

    budget_bytes: int
    bytes: int
    entries: int
    hits: int
    misses: int
    hit_tokens: int
    stored: int
    evictions: int
    too_large: int
    superseded: int  # entries dropped because a newer one begins with all their tokens


class PrefixCache:
    """See the module docstring; ``budget`` 0 keeps nothing."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError("a prefix cache budget is a number of bytes, 0 or more")
        self.budget = budget
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # oldest first
        self._by_hash: dict[bytes, list[int]] = {}  # block hash -> the entries holding it, newest last
        self._next = 0
        self._bytes = 0
        self._hits = self._misses = self._hit_tokens = self._stored = self._evictions = self._too_large = 0
        self._superseded = 0

    def lookup(self, prompt: Sequence[int], limit: int | None = None) -> tuple[int, bytes | None]:
        """(positions, state): the longest cached prefix of ``prompt``, at most ``limit`` positions.

        Found by whole blocks (a prompt must share one with an entry), then token by token
        with the entry that matches longest past them, as llama-server's slots match;
        ``positions`` is below ``len(prompt)``; ``state`` the entry's (which holds at least
        that many positions), or ``(0, None)`` on a miss.
        """
        most = len(prompt) - 1 if limit is None else min(limit, len(prompt) - 1)
        hashes = block_hashes(prompt, max(0, most) // BLOCK)
        for i in range(len(hashes) - 1, -1, -1):
            whole = (i + 1) * BLOCK
            best: tuple[int, int] | None = None  # (positions, key): the entry that goes on matching longest
            for key in reversed(self._by_hash.get(hashes[i], ())):  # the newest first
                entry = self._entries[key]
                if tuple(entry.tokens[:whole]) != tuple(prompt[:whole]):
                    continue  # a hash collision: the tokens say no
                # past the last whole block, token by token, as far as the entry and the prompt agree
                positions = whole
                stop = min(len(entry.tokens), most)
                while positions < stop and entry.tokens[positions] == prompt[positions]:
                    positions += 1
                if best is None or positions > best[0]:
                    best = (positions, key)
            if best is None:
                continue
            positions, key = best
            self._entries.move_to_end(key)
            self._hits += 1
            self._hit_tokens += positions
            return positions, self._entries[key].state
        self._misses += 1
        return 0, None

    def store(self, tokens: Sequence[int], state: bytes) -> bool:
        """Keep ``state`` (the KV of ``tokens``); False when it does not fit the budget at all."""
        if len(tokens) < BLOCK:
            return False
        if len(state) > self.budget:
            self._too_large += 1
            return False
        hashes = block_hashes(tokens)
        # an entry all of whose tokens begin this one (the conversation's previous turn) can
        # answer nothing this one cannot: it goes, rather than hold its KV twice
        for older in {key for digest in hashes for key in self._by_hash.get(digest, ())}:
            entry = self._entries[older]
            if len(entry.tokens) <= len(tokens) and tuple(tokens[: len(entry.tokens)]) == entry.tokens:
                self._remove(older)
                self._superseded += 1
        while self._bytes + len(state) > self.budget:
            self._evict()
        key = self._next
        self._next += 1
        self._entries[key] = Entry(tuple(tokens), state, hashes)
        self._bytes += len(state)
        for digest in hashes:
            self._by_hash.setdefault(digest, []).append(key)
        self._stored += 1
        return True

    def _evict(self) -> None:
        self._remove(next(iter(self._entries)))  # the least recently used
        self._evictions += 1

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._bytes -= len(entry.state)
        for digest in entry.hashes:
            holders = self._by_hash[digest]
            holders.remove(key)
            if not holders:
                del self._by_hash[digest]

    def statistics(self) -> PrefixStatistics:
        """An immutable snapshot."""
        return PrefixStatistics(
            self.budget,
            self._bytes,
            len(self._entries),
            self._hits,
            self._misses,
            self._hit_tokens,
            self._stored,
            self._evictions,
            self._too_large,
            self._superseded,
        )
