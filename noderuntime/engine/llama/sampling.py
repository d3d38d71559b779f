"""Sampling on the tail: a session's llama.cpp sampler chain (:class:`SamplerChain`), with
logit biases, penalties, top-k/top-p/min-p, temperature, a position-seeded draw, and a grammar."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from noderuntime.engine.base import EngineError, draw_seed
from noderuntime.engine.llama.binding import llama_cpp, quiet
from noderuntime.engine.llama.grammar import grammar_sampler
from protocol import Sampling

__all__ = ["RETRY_DRAWS", "RETRY_GREEDY", "SamplerChain"]


# a token the grammar refuses is retried this many times before the whole vocabulary is
# masked: asks cost microseconds, the mask milliseconds
RETRY_DRAWS = 8
RETRY_GREEDY = 64
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data, 12 bytes


class SamplerChain:
    """A per-session llama.cpp sampler chain. Free it with :meth:`close` (idempotent).

    A grammar sees only sampled tokens: the prompt history primes the penalties alone (a
    grammar fed the prompt would reject it), ``generated`` tokens prime both. It masks the
    logits before the rest of the chain, as llama.cpp's own chain would with it first,
    except where masking commutes with the rest; see :meth:`sample`. The seeded draw at
    each position is a fresh llama.cpp ``dist`` sampler seeded by ``draw_seed(seed,
    position)``: one generator for the session would make a draw depend on every draw
    before it, which a chain rebuilt after a route repair could not replay.
    """

    def __init__(
        self,
        params: Sampling,
        vocab: Any,
        n_vocab: int,
        history: Sequence[int] = (),
        *,
        generated: Sequence[int] = (),
        live: set[int] | None = None,
    ) -> None:
        """``live``, if given, holds the ids of chains not yet closed (the engine's count of them)."""
        self.params = params
        self._chain: Any = None
        self._grammar: Any = None
        self._live = live
        self._vocab = vocab  # the model's, which outlives its sessions' chains
        self._n_vocab = n_vocab
        grammar = grammar_sampler(vocab, params.grammar) if params.grammar else None
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if not chain:
            if grammar is not None:
                llama_cpp.llama_sampler_free(grammar)
            raise EngineError("could not create a sampler chain")
        self._chain, self._grammar = chain, grammar
        add = llama_cpp.llama_sampler_chain_add  # the chain owns what is added to it
        if params.logit_bias:
            biases = (llama_cpp.llama_logit_bias * len(params.logit_bias))()
            for slot, (token, bias) in enumerate(params.logit_bias):
                biases[slot].token, biases[slot].bias = token, bias
            # llama.cpp copies the array: it need not outlive this call
            add(chain, llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
        penalties = (params.repeat_penalty, params.frequency_penalty, params.presence_penalty)
        if penalties != (1.0, 0.0, 0.0):
            penalty = llama_cpp.llama_sampler_init_penalties(n_vocab, params.penalty_last_n, *penalties)
            for token in (*history, *generated):
                llama_cpp.llama_sampler_accept(penalty, int(token))
            add(chain, penalty)
        # Biases, penalties and temperature move each logit on its own, and greedy and the draw
        # read what they are given: masking commutes with them. Top-k, top-p and min-p choose
        # among the candidates, so once one is in the chain the grammar must mask first.
        choosers = []
        if params.temperature <= 0.0:
            add(chain, llama_cpp.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                choosers.append(llama_cpp.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                choosers.append(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                choosers.append(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
            for chooser in choosers:
                add(chain, chooser)
            add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
            # a placeholder: sample() puts in the draw of each position before it draws
            add(chain, llama_cpp.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))
        self._grammar_last = grammar is not None and not choosers
        # the chain's last sampler: greedy, or the seeded draw that _retry asks again
        self._draw = llama_cpp.llama_sampler_chain_get(chain, llama_cpp.llama_sampler_chain_n(chain) - 1)
        self._candidates = np.empty(n_vocab if grammar is not None else 0, dtype=_TOKEN_DATA)
        self._ids = np.arange(n_vocab if grammar is not None else 0, dtype=np.int32)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        if live is not None:
            live.add(id(self))
        if grammar is not None:
            for token in generated:  # the grammar is where the first chain left it
                llama_cpp.llama_sampler_accept(grammar, int(token))

    def _draw_for(self, position: int) -> None:
        """Make the chain's draw the one of ``position`` (greedy has none)."""
        if self.params.temperature <= 0.0:
            return
        last = llama_cpp.llama_sampler_chain_n(self._chain) - 1
        llama_cpp.llama_sampler_free(llama_cpp.llama_sampler_chain_remove(self._chain, last))
        llama_cpp.llama_sampler_chain_add(
            self._chain, llama_cpp.llama_sampler_init_dist(draw_seed(self.params.seed, position))
        )
        self._draw = llama_cpp.llama_sampler_chain_get(self._chain, last)

    def sample(self, ctx: Any, index: int, position: int) -> int:
        """Sample the token after ``position`` from the context's logits row ``index`` (and accept it).

        With a grammar whose mask commutes with the chain, the chain first draws from all the
        tokens, and the grammar is asked about the one token drawn: llama.cpp's grammar checks
        every token of the vocabulary against its stacks, which costs more than the rest of a
        step on a small model (8 ms for SmolLM2's 49,152 tokens under a JSON schema's grammar,
        on the engine thread, so every session of the tick waits). Drawn as it is, a token the
        grammar accepts is the token greedy decoding of the masked logits would pick (the first
        maximum is a valid one); for a draw, accepting it or else drawing again from the masked
        tokens gives each valid token the masked probability exactly (p + (1 - V) p / V = p / V,
        V the valid tokens' share). A refused token is first retried cheaply, one token at a
        time (:meth:`_retry`); only when that finds none is the whole vocabulary masked.
        """
        if self._chain is None:
            raise EngineError("sampler chain is closed")
        self._draw_for(position)
        if self._grammar is None:
            return int(llama_cpp.llama_sampler_sample(self._chain, ctx, index))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(self._n_vocab,))
        token = -1
        if self._grammar_last:
            view = self._offer(logits, self._chain)
            drawn = self._select(view)
            if not llama_cpp.llama_vocab_is_eog(self._vocab, drawn):
                token = drawn if self._grammar_accepts(drawn) else self._retry(view, drawn)
            else:
                # offered alone, the end of generation passes any grammar (patch 0006 lets it
                # through when every candidate is refused): ask with the whole vocabulary
                masked = self._offer(logits, self._grammar)
                if np.isfinite(self._candidates["logit"][drawn]):  # the grammar keeps their order
                    token = drawn
                else:
                    llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(masked))
                    token = self._select(masked)
        if token < 0:
            token = self._select(self._offer(logits, self._grammar, self._chain))
        llama_cpp.llama_sampler_accept(self._grammar, token)
        llama_cpp.llama_sampler_accept(self._chain, token)
        return token

    def _retry(self, view: Any, refused: int) -> int:
        """After ``refused``, the token the masked chain would pick, found by asking the grammar
        about one token at a time; -1 where a few asks do not settle it.

        ``view`` is the chain's output over every token (its logits biased, penalised and
        tempered in place). Greedy: the valid token of the highest logit, the lowest id among
        equals, is the masked maximum; only logits above the ``RETRY_GREEDY``-th highest are
        asked about, as every token above it is among them. A draw: the refused token is
        taken out and the chain's own sampler draws again (its seeded generator, so a
        session's tokens stay its own); a valid token drawn from all but refused tokens has
        the masked probability, however many were refused first (conditioned on being valid,
        each draw is proportional to p), as has the whole-vocabulary mask it falls back to.
        """
        candidates = self._candidates
        logit = candidates["logit"]
        if self.params.temperature <= 0.0:
            k = min(RETRY_GREEDY, self._n_vocab)
            top = np.argpartition(logit, self._n_vocab - k)[self._n_vocab - k :]
            above = top[logit[top] > logit[top].min()]
            for token in above[np.lexsort((above, -logit[above]))]:  # descending, then by id
                token = int(token)
                if token != refused and not llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    if self._grammar_accepts(token):
                        return token
                elif token != refused:
                    return -1  # an end of generation ranks here: the whole mask decides (patch 0006)
            return -1
        draw = self._draw
        for _ in range(RETRY_DRAWS):
            logit[refused] = -np.inf
            llama_cpp.llama_sampler_apply(draw, ctypes.byref(view))
            drawn = self._select(view)
            if not np.isfinite(logit[drawn]) or llama_cpp.llama_vocab_is_eog(self._vocab, drawn):
                return -1
            if self._grammar_accepts(drawn):
                return drawn
            refused = drawn
        return -1

    def _offer(self, logits: np.ndarray, *samplers: Any) -> Any:
        """Every token with its logit, through ``samplers`` in order; the llama_token_data_array."""
        candidates = self._candidates
        candidates["id"] = self._ids
        candidates["logit"] = logits
        candidates["p"] = 0.0
        view = llama_cpp.llama_token_data_array(
            candidates.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), self._n_vocab, -1, False
        )
        for sampler in samplers:
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(view))
        return view

    @staticmethod
    def _select(view: Any) -> int:
        if not 0 <= view.selected < view.size:
            raise EngineError("the sampler chain selected no token")
        return int(view.data[view.selected].id)

    def _grammar_accepts(self, token: int) -> bool:
        one = self._one
        one["id"], one["logit"] = token, 0.0
        view = llama_cpp.llama_token_data_array(
            one.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), 1, -1, False
        )
        quiet.on = True
        try:
            llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(view))
        finally:
            quiet.on = False
        return bool(np.isfinite(one["logit"][0]))

    def close(self) -> None:
        """Free the chain and its grammar state; safe to call twice."""
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
            if self._live is not None:
                self._live.discard(id(self))

    def __del__(self) -> None:
        self.close()
