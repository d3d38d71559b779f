"""What a hop commits to: running digests of what it took in and gave out, row by row.

Every hop of every session keeps two: its input (the head: the token ids of the rows it
computed; any other hop: the hidden-state rows it received) and its output (the tail: the
tokens it drew; any other hop: the rows it sent), from the session's first computed
position on. Both go into its signed usage record. Rows arrive and leave in position
order, each step continuing the last, so a digest over the rows' bytes in order is the
same however the rows were cut into steps: one prefill of the whole session gives it too.
That is what makes an audit a single teacher-forced recomputation (``runner/audits.py``),
and why it can compare exactly: for one recipe and kernel class a row's bits do not
depend on what else was batched (Gate C) or on how the prompt was chunked.

The downstream hop's input digest must equal the upstream hop's output digest: a
difference names that seam at once. Plain BLAKE2b over the rows' little-endian bytes (a
few microseconds for a decode step's row: ``benchmarks.audit``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from protocol import Encoding
from protocol import encodings as wire_encodings

_PERSON = b"nr-commit-v1"


class Commitment:
    """A running digest of rows (or tokens) at positions ``start`` and on, taken in position order."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.rows = 0
        self._next = start  # the position the next committed row must have
        self._hash = hashlib.blake2b(start.to_bytes(4, "little"), digest_size=32, person=_PERSON)

    def add_rows(self, first: int, rows: np.ndarray) -> None:
        """Rows of float32 values at positions ``first``, ``first + 1``, ...; those before ``start`` are skipped."""
        skip = max(0, self.start - first)
        if skip >= len(rows):
            return
        self._take(first + skip, len(rows) - skip)
        self._hash.update(np.ascontiguousarray(rows[skip:], dtype="<f4").data)

    def add_tokens(self, first: int, tokens: Sequence[int] | np.ndarray) -> None:
        """Token ids at positions ``first``, ``first + 1``, ...; those before ``start`` are skipped."""
        skip = max(0, self.start - first)
        if skip >= len(tokens):
            return
        self._take(first + skip, len(tokens) - skip)
        self._hash.update(np.asarray(tokens[skip:], dtype="<i4").tobytes())

    def _take(self, first: int, count: int) -> None:
        # a gap or a repeat would make the digest mean something else than "these rows, in order"
        if first != self._next:
            raise ValueError(f"rows at position {first}, where {self._next} was next")
        self._next += count
        self.rows += count

    def hexdigest(self) -> str:
        """The digest so far (the commitment stays open)."""
        return self._hash.copy().hexdigest()


def as_received(rows: np.ndarray, encoding: Encoding) -> np.ndarray:
    """``rows`` as the next hop will decode them: a sender commits to what its peer receives."""
    if encoding == Encoding.F32:
        return rows
    decoded = wire_encodings.decode(wire_encodings.encode(rows, encoding), rows.size, encoding)
    return decoded.reshape(rows.shape)


def tokens_digest(start: int, tokens: Sequence[int]) -> str:
    """The digest of ``tokens`` at positions ``start``, ``start + 1``, ... (a route's ends are checked with it)."""
    commitment = Commitment(start)
    commitment.add_tokens(start, tokens)
    return commitment.hexdigest()
