"""Turning a stream of token pieces into text, stopping at stop strings (pure, no I/O).

Token pieces are bytes that may split a UTF-8 character; text is released only when
it is whole. Text that could be the beginning of a stop string is held back until
it is clear whether it is one, so a client never sees part of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Feed pieces with :meth:`push`; read what may be shown now; :attr:`stopped` once a stop string matched."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = [s for s in stop if s]
        self._pending = b""  # an incomplete UTF-8 sequence
        self._held = ""  # decoded text not yet released (a possible stop-string prefix)
        self.text = ""  # everything released so far
        self.stopped = False

    def push(self, piece: bytes) -> str:
        """Add a token's bytes; returns the text that can be released now."""
        if self.stopped:
            return ""
        self._pending += piece
        decoded, used = _decode_prefix(self._pending)
        self._pending = self._pending[used:]
        self._held += decoded
        return self._release(final=False)

    def finish(self) -> str:
        """The generation ended: release what is held (a dangling partial character as U+FFFD)."""
        if self.stopped:
            return ""
        if self._pending:
            self._held += self._pending.decode("utf-8", errors="replace")
            self._pending = b""
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        # the stop string that starts first wins, whatever its place in the list
        hits = [at for at in (self._held.find(stop) for stop in self.stop) if at >= 0]
        if hits:
            out = self._held[: min(hits)]
            self._held = ""
            self.stopped = True
            self.text += out
            return out
        keep = 0 if final else max((overlap(self._held, s) for s in self.stop), default=0)
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        self.text += out
        return out


def overlap(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``: text to hold back."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _decode_prefix(data: bytes) -> tuple[str, int]:
    """Text of the longest decodable prefix of ``data`` and the bytes it used.

    An incomplete character at the end waits for the next piece; a genuinely
    invalid byte becomes U+FFFD.
    """
    text = []
    used = 0
    while used < len(data):
        try:
            text.append(data[used:].decode("utf-8"))
            return "".join(text), len(data)
        except UnicodeDecodeError as exc:
            text.append(data[used : used + exc.start].decode("utf-8"))
            if exc.reason == "unexpected end of data":
                return "".join(text), used + exc.start
            text.append("\ufffd")
            used += exc.end
    return "".join(text), used
