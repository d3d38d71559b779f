"""What the whole model says alone: the reference a route's temperature-0 reply through a gateway must equal.

A route that answers at all may still be composed wrongly (a range served twice or not at
all, hops out of order, a stale range after a move): its reply is text, only not the
model's. The whole model, run here on one engine, greedy, as the gateway would prompt it
(its chat template, or a text prompt as ``/v1/completions`` tokenizes it), gives the text
that reply must be, to the byte.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from noderuntime.engine.base import Rows
from noderuntime.engine.llama import Recipe, ShardEngine, Vocab
from noderuntime.models.chat import ChatTemplate, prompt_tokens
from tests.conftest import engine_threads

THREADS = engine_threads()

_LOCK = threading.Lock()
_ENGINES: dict[tuple[str, int], ShardEngine] = {}
_VOCABS: dict[str, Vocab] = {}
_REPLIES: dict[tuple[Any, ...], str] = {}
CHUNK = 128  # prefill rows per step, as a route's head sends them


@atexit.register
def _close() -> None:
    for engine in _ENGINES.values():
        engine.close()


def chat_reply(
    model: Path, messages: Sequence[Mapping[str, Any]], max_tokens: int, *, banned: Collection[int] = ()
) -> str:
    """The text of the whole model's greedy chat reply to ``messages`` (its end-of-turn token left out).

    ``banned``: tokens it never draws, as a request's ``logit_bias`` of -100 on them has it.
    """
    vocab = vocabulary(model)
    bos = vocab.piece(vocab.bos, special=True).decode("utf-8", "replace") if vocab.bos >= 0 else ""
    eos = vocab.piece(vocab.eos, special=True).decode("utf-8", "replace") if vocab.eos >= 0 else ""
    assert vocab.chat_template, f"{model} has no chat template"
    template = ChatTemplate(vocab.chat_template, bos_token=bos, eos_token=eos)  # as the gateway loads it
    return _reply(model, prompt_tokens(template, vocab, [dict(m) for m in messages]), max_tokens, banned)


def completion(model: Path, prompt: str, max_tokens: int, *, banned: Collection[int] = ()) -> str:
    """The text of the whole model's greedy completion of ``prompt``, tokenized as ``/v1/completions`` does."""
    vocab = vocabulary(model)
    return _reply(model, vocab.tokenize(prompt, add_special=vocab.add_bos, parse_special=False), max_tokens, banned)


def vocabulary(model: Path) -> Vocab:
    """The model's tokenizer (loaded once)."""
    with _LOCK:
        if str(model) not in _VOCABS:
            _VOCABS[str(model)] = Vocab(model)
        return _VOCABS[str(model)]


def _reply(model: Path, prompt: list[int], max_tokens: int, banned: Collection[int]) -> str:
    key = (str(model), tuple(prompt), max_tokens, tuple(sorted(banned)))
    vocab = vocabulary(model)
    with _LOCK:
        if key not in _REPLIES:
            tokens = _greedy(model, prompt, max_tokens, vocab.eog_tokens, banned)
            _REPLIES[key] = b"".join(vocab.piece(t) for t in tokens).decode("utf-8", "replace")
        return _REPLIES[key]


def _greedy(
    model: Path, prompt: list[int], max_tokens: int, stop: Collection[int], banned: Collection[int]
) -> list[int]:
    """Up to ``max_tokens`` greedy tokens after ``prompt``, without the stop token that ends them."""
    ctx = -(-(len(prompt) + max_tokens) // 512) * 512
    engine = _ENGINES.get((str(model), ctx))
    if engine is None:
        recipe = Recipe(n_threads=THREADS, n_ctx_per_seq=ctx, n_seq_max=1, n_batch=256, n_ubatch=256)
        engine = _ENGINES[(str(model), ctx)] = ShardEngine(model, recipe)
    never = np.array(sorted(banned), np.int64)
    tokens: list[int] = []
    try:
        rows = np.array(prompt, np.int32)
        position = 0
        while True:
            logits = None
            for start in range(0, len(rows), CHUNK):
                piece = rows[start : start + CHUNK]
                last = np.arange(len(piece)) == len(piece) - 1
                positions = np.arange(position, position + len(piece), dtype=np.int32)
                run = Rows(np.zeros(len(piece), np.int32), positions, last, tokens=piece)
                logits = engine.run(run, want_logits=True).logits
                position += len(piece)
            assert logits is not None
            scores = logits[-1].copy()
            scores[never] = -np.inf
            token = int(np.argmax(scores))
            if token in stop:
                return tokens
            tokens.append(token)
            if len(tokens) == max_tokens:
                return tokens
            rows = np.array([token], np.int32)
    finally:
        engine.remove_sequence(0)
