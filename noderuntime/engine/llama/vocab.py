"""A model's tokenizer (:class:`Vocab`), loaded vocab-only through llama.cpp: what the gateway
tokenizes prompts, detokenizes replies and reads the chat template with."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

from noderuntime.engine.base import EngineError
from noderuntime.engine.llama.binding import llama_cpp
from noderuntime.models import artifacts
from noderuntime.models.artifacts import ArtifactError

__all__ = ["Vocab"]


class Vocab:
    """A model's tokenizer, loaded vocab-only (no weights): tokenize, detokenize, template."""

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        self._model: Any = None  # so that a load that fails leaves nothing for close() to trip on
        try:
            self.info = artifacts.inspect(model_path, verify=False)  # the header: no weight is read
        except ArtifactError as exc:
            raise EngineError(str(exc)) from None
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(str(self.info.path).encode(), params)
        if not model:
            raise EngineError(f"llama.cpp could not load the vocabulary of {self.info.path}")
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(self._vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self._vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        template = llama_cpp.llama_model_chat_template(model, None)
        self.chat_template: str | None = template.decode("utf-8") if template else None
        self.eog_tokens = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t))
        # the tokens llama.cpp matches as whole strings before it tokenizes the rest:
        # control and unknown ones when special tokens are parsed, user-defined ones always
        self.special_tokens: dict[int, tuple[str, bool, bool]] = {}  # id -> (text, lstrip, rstrip)
        matched = (
            llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
            | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
            | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        )
        for t in range(self.n_vocab):
            attr = llama_cpp.llama_vocab_get_attr(self._vocab, t)
            if attr & matched:
                text = self.piece(t, special=True).decode("utf-8", "replace")
                lstrip, rstrip = attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP, attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP
                self.special_tokens[t] = (text, bool(lstrip), bool(rstrip))

    @property
    def handle(self) -> Any:
        """llama.cpp's vocabulary (for a grammar sampler to compile against)."""
        return self._vocab

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text to token ids; ``parse_special`` turns ``<|im_start|>`` and the like into their ids."""
        data = text.encode("utf-8")
        capacity = len(data) + 8  # enough for real vocabularies; byte-fallback ones may need more
        for _ in range(2):
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            capacity = -n  # llama.cpp says how many it needs
        raise EngineError(f"the tokenizer did not fit {len(data)} bytes in {capacity} tokens")

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token (may be a partial UTF-8 sequence)."""
        if not 0 <= token < self.n_vocab:
            raise EngineError(f"token id {token} outside the vocabulary of {self.n_vocab}")
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        """Token ids to text."""
        return b"".join(self.piece(t, special=special) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends a generation (EOS, EOT, ...)."""
        return token in self.eog_tokens

    def close(self) -> None:
        """Free the vocabulary; idempotent."""
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()
