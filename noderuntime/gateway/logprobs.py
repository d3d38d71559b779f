"""Log-probabilities in OpenAI's two shapes (pure: no I/O).

The tail computes them from the logits it already has (``protocol.TokenLogprob``); here
they become chat's ``logprobs.content`` entries or the text completions' parallel lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from protocol import TokenLogprob

Piece = Callable[[int], bytes]  # a token's bytes (``Vocab.piece``)


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", "replace")


def chat_entries(piece: Piece, entries: Sequence[TokenLogprob], top: int) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: each token with its bytes and its ``top`` most likely alternatives."""
    out = []
    for e in entries:
        data = piece(e.token)
        alternatives = [{"token": _text(piece(t)), "logprob": lp, "bytes": list(piece(t))} for t, lp in e.top[:top]]
        out.append({"token": _text(data), "logprob": e.logprob, "bytes": list(data), "top_logprobs": alternatives})
    return out


class CompletionLogprobs:
    """Text completions' ``logprobs``: parallel lists, each token's offset into the choice's text.

    Fed in order (the echoed prompt first, when there is one); :meth:`take` returns what was
    added since the last call, for one streamed chunk, or everything, for a whole reply.
    """

    def __init__(self, piece: Piece, top: int) -> None:
        self.piece = piece
        self.top = top
        self.offset = 0  # characters of the choice's text so far
        self._tokens: list[str] = []
        self._logprobs: list[float | None] = []
        self._top: list[dict[str, float] | None] = []
        self._offsets: list[int] = []

    def add(self, token: int, entry: TokenLogprob | None) -> None:
        """One token of the text; ``entry`` None for the prompt's first (it has no context)."""
        text = _text(self.piece(token))
        self._tokens.append(text)
        self._offsets.append(self.offset)
        self.offset += len(text)
        if entry is None:
            self._logprobs.append(None)
            self._top.append(None)
            return
        self._logprobs.append(entry.logprob)
        alternatives: dict[str, float] = {}
        for t, lp in entry.top[: self.top]:
            alternatives.setdefault(_text(self.piece(t)), lp)  # two tokens may read the same
        self._top.append(alternatives)

    def take(self) -> dict[str, Any]:
        """The lists added since the last call."""
        taken = {
            "tokens": self._tokens,
            "token_logprobs": self._logprobs,
            "top_logprobs": self._top,
            "text_offset": self._offsets,
        }
        self._tokens, self._logprobs, self._top, self._offsets = [], [], [], []
        return taken
