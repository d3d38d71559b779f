"""From an OpenAI request to what a route runs: the prompt checked against the context, the
sampler, the stop tokens and the deadline (pure)."""

from __future__ import annotations

import os
import time
import uuid

from noderuntime.gateway.errors import ApiError
from noderuntime.gateway.schema import ChatCompletionRequest, SamplingFields
from noderuntime.gateway.served import ServedModel
from noderuntime.seams.client import GenerationRequest
from protocol import Sampling

# A request without max_tokens asks for a route with room for at least this many tokens
# after its prompt, then may run to the end of the context that route holds (as OpenAI's
# API does: the reply ends at a stop, or when the context is full).
DEFAULT_MAX_TOKENS = 256
# a prompt whose logprobs are echoed: they travel back in one frame (about 70 bytes a token)
MAX_SCORED_PROMPT = 32768


def generation_request(
    model: ServedModel,
    body: SamplingFields,
    prompt: list[int],
    max_tokens: int | None,
    grammar: str,
    *,
    timeout: float,
    speculate: int = 0,
) -> GenerationRequest:
    """What a route runs for ``body``: its prompt checked against the context, its sampler, and a
    deadline ``timeout`` seconds away; :class:`ApiError` for what no route could serve."""
    if not prompt:
        where = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise ApiError(400, "the prompt is empty after tokenization", param=where)
    room = model.n_ctx - len(prompt)
    if room <= 0:
        raise ApiError(
            400,
            f"the prompt has {len(prompt)} tokens; the context is {model.n_ctx}",
            code="context_length_exceeded",
        )
    wanted = max_tokens if max_tokens is not None else min(DEFAULT_MAX_TOKENS, room)
    if wanted > room:
        raise ApiError(
            400,
            f"prompt ({len(prompt)}) + max_tokens ({wanted}) exceeds the context of {model.n_ctx}",
            code="context_length_exceeded",
            param="max_tokens",
        )
    _, stop_ids = body.stop_lists()
    if any(not 0 <= t < model.vocab.n_vocab for t in stop_ids):
        raise ApiError(400, "stop token ids must lie inside the vocabulary", param="stop")
    biases = body.logit_biases()
    if any(token >= model.vocab.n_vocab for token, _ in biases):
        raise ApiError(400, f"logit_bias token ids must lie in [0, {model.vocab.n_vocab})", param="logit_bias")
    temperature = 1.0 if body.temperature is None else body.temperature
    if body.top_p == 0.0:
        temperature = 0.0  # the nucleus of p = 0 is the most likely token alone: greedy
    seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(8), "little")
    logprobs, top_logprobs, prompt_logprobs = body.logprob_request()
    if prompt_logprobs and len(prompt) > MAX_SCORED_PROMPT:
        # they come back in one frame: a bound keeps it inside the frame limit
        raise ApiError(400, f"echo with logprobs takes prompts of at most {MAX_SCORED_PROMPT} tokens", param="echo")
    sampling = Sampling(
        temperature=temperature,
        top_k=body.top_k or 0,
        top_p=body.top_p or 1.0,
        min_p=body.min_p or 0.0,
        seed=seed & 0xFFFFFFFFFFFFFFFF,
        repeat_penalty=body.repeat_penalty or 1.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        grammar=grammar,
        logit_bias=biases,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    deadline = int((time.time() + timeout) * 1000)
    return GenerationRequest(
        tuple(prompt),
        wanted,
        sampling,
        tuple(sorted(set(model.stop_tokens()) | set(stop_ids))),
        deadline,
        f"req-{uuid.uuid4().hex[:16]}",
        reuse_prefix=body.cache_prompt is not False,
        speculate=speculate,
    )
