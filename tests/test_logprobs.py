"""Logprobs end to end: computed on the tail from its logits, carried up the route in
the Tokens frames (schema 1.2), shaped by the gateway as OpenAI does.

The official ``openai`` client talks to a real local system (tracker, relay, two SmolLM2
shard nodes, gateway): the head passes the tail's logprobs on to the gateway.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import numpy as np
import pytest
from openai import OpenAI

from noderuntime.engine.base import LOGPROB_FLOOR, token_logprob
from noderuntime.services import localsystem
from protocol import Sampling, StatusCode, TokenLogprob
from tests.protocol_helpers import older_peers_refusal

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def system(smol_system: localsystem.LocalSystem) -> localsystem.LocalSystem:
    return smol_system


@pytest.fixture
def client(system: localsystem.LocalSystem) -> OpenAI:
    return OpenAI(base_url=system.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(client: OpenAI, model: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=24, temperature=0, logprobs=True, top_logprobs=5, **extra
    )


def test_greedy_tokens_have_the_highest_logprob_and_repeat(client: OpenAI, system: localsystem.LocalSystem) -> None:
    reply = _chat(client, system.model_id)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert content and "".join(e.token for e in content) == choice.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 5
        best = entry.top_logprobs[0]
        # greedy: the chosen token is the most likely one, and its logprob is that one's
        assert best.token == entry.token and best.logprob == entry.logprob
        assert all(a.logprob >= b.logprob for a, b in zip(entry.top_logprobs, entry.top_logprobs[1:], strict=False))
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        # a distribution: the top five's probabilities sum to at most 1
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-5
    again = _chat(client, system.model_id)
    assert [(e.token, e.logprob) for e in again.choices[0].logprobs.content] == [(e.token, e.logprob) for e in content]


def test_streamed_logprobs_are_those_of_the_whole_reply(client: OpenAI, system: localsystem.LocalSystem) -> None:
    whole = _chat(client, system.model_id).choices[0].logprobs.content
    streamed = []
    for chunk in _chat(client, system.model_id, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in whole
    ]


def test_no_logprobs_unless_asked(client: OpenAI, system: localsystem.LocalSystem) -> None:
    reply = client.chat.completions.create(model=system.model_id, messages=QUESTION, max_tokens=4, temperature=0)
    assert reply.choices[0].logprobs is None


def test_echo_scores_the_prompt_as_generation_would(client: OpenAI, system: localsystem.LocalSystem) -> None:
    """What evaluation harnesses do for log-likelihood: echo the prompt with its logprobs."""
    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    scored = client.completions.create(
        model=system.model_id, prompt=prompt, max_tokens=1, temperature=0, logprobs=3, echo=True
    )
    choice = scored.choices[0]
    assert choice.text.startswith(prompt)
    tokens = httpx.post(system.gateway_url + "/tokenize", json={"content": prompt, "add_special": True}).json()
    n_prompt = len(tokens["tokens"])
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    # the prompt's token at place i, scored in the prompt, has the logprob it has when a
    # shorter prompt ends before it and logit_bias makes it the next token
    ids = tokens["tokens"]
    for i in (3, n_prompt // 2, n_prompt - 1):
        forced = client.completions.create(
            model=system.model_id,
            prompt=ids[:i],
            max_tokens=1,
            temperature=0,
            logprobs=0,
            logit_bias={str(ids[i]): 100},
        )
        assert forced.choices[0].logprobs.tokens[0] == lp.tokens[i]
        assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[i], abs=1e-4)


def test_streamed_echo_leads_with_the_prompt(client: OpenAI, system: localsystem.LocalSystem) -> None:
    prompt = "One, two, three,"
    chunks = list(
        client.completions.create(
            model=system.model_id, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.token_logprobs[0] is None
    whole = client.completions.create(
        model=system.model_id, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ],
)
def test_bad_logprob_requests_are_400(
    system: localsystem.LocalSystem, path: str, extra: dict[str, Any], param: str
) -> None:
    body = {"model": system.model_id, "max_tokens": 2, **extra}
    body.update({"messages": QUESTION} if "chat" in path else {"prompt": "x"})
    refused = httpx.post(system.gateway_url + path, json=body, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param


def test_a_peer_that_predates_logprobs_is_refused_for_a_logprobs_session() -> None:
    for sampling, refused in (
        (Sampling(logprobs=True), True),
        (Sampling(prompt_logprobs=True), True),
        (Sampling(), False),
    ):
        refusal = older_peers_refusal(sampling, minor=1)
        if refused:
            assert refusal is not None and refusal.code is StatusCode.UNIMPLEMENTED and "1.2" in refusal.message
        else:
            assert refusal is None


def test_token_logprob_is_the_log_softmax_of_the_logits() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 4, 5000).astype(np.float32)
    logits[17] = logits.max() + 3  # the most likely
    logits[42] = -1e30  # ruled out
    exact = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64) - logits.max()).sum()) - logits.max()
    entry = token_logprob(logits, 99, 5)
    assert entry.token == 99 and entry.logprob == pytest.approx(exact[99], abs=1e-6)
    assert [t for t, _ in entry.top] == list(np.argsort(-exact)[:5]) and entry.top[0][0] == 17
    assert all(lp == pytest.approx(exact[t], abs=1e-6) for t, lp in entry.top)
    assert token_logprob(logits, 42, 0) == TokenLogprob(42, LOGPROB_FLOOR, ())
    assert token_logprob(np.array([0.0, -200.0], np.float32), 0, 1).logprob == 0.0  # never above 0
