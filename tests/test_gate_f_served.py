"""Gate F through the system: each architecture served over a 2-shard route, one shard behind the relay.

The local system (tracker with probes required, relay, two shard nodes, gateway) runs
a tiny Qwen3 and Qwen3-MoE with Qwen3's own chat template, and Gemma 3 270M on its real
weights; the official ``openai`` client talks to the gateway.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from openai import OpenAI

from noderuntime.engine.base import Rows
from noderuntime.engine.llama import Recipe, ShardEngine, Vocab
from noderuntime.gateway.requests import DEFAULT_MAX_TOKENS
from noderuntime.services import localsystem
from tests.conftest import engine_threads

THREADS = engine_threads()

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 16}


def _serve(model: str, root: Path) -> Iterator[localsystem.LocalSystem]:
    running = localsystem.start(model_name=model, listen="127.0.0.1:0", data_root=root, slots=4, ctx=512, quiet=True)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(params=["qwen3", "qwen3moe"], scope="module")
def qwen_system(
    request: pytest.FixtureRequest, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[localsystem.LocalSystem]:
    yield from _serve(str(tiny_models[request.param]), tmp_path_factory.mktemp(f"system-{request.param}"))


def _client(system: localsystem.LocalSystem) -> OpenAI:
    return OpenAI(base_url=system.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_qwen3_family_chat_streams_as_it_answers(qwen_system: localsystem.LocalSystem) -> None:
    client = _client(qwen_system)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=qwen_system.model_id, messages=messages, **GREEDY)  # type: ignore[arg-type]
    text = whole.choices[0].message.content
    assert text is not None and whole.choices[0].finish_reason in ("stop", "length")
    # Qwen3's template wrapped both turns: system and user text, the markers, the assistant header
    assert whole.usage is not None and whole.usage.prompt_tokens > 10
    streamed = client.chat.completions.create(
        model=qwen_system.model_id,
        messages=messages,  # type: ignore[arg-type]
        stream=True,
        **GREEDY,
    )
    pieces = [choice.delta.content or "" for chunk in streamed for choice in chunk.choices]
    assert "".join(pieces) == text


def test_qwen3_family_text_completions_are_greedy_and_repeatable(qwen_system: localsystem.LocalSystem) -> None:
    client = _client(qwen_system)
    first = client.completions.create(model=qwen_system.model_id, prompt="hello world", **GREEDY)  # type: ignore[arg-type]
    again = client.completions.create(model=qwen_system.model_id, prompt="hello world", **GREEDY)  # type: ignore[arg-type]
    assert first.choices[0].text == again.choices[0].text
    assert first.usage is not None and first.usage.completion_tokens >= 1


def test_a_reply_without_max_tokens_may_fill_the_routes_context(
    qwen_system: localsystem.LocalSystem, tiny_models: dict[str, Path]
) -> None:
    """As in OpenAI's API, an open-ended reply ends at a stop or a full context, not at a fixed count.

    On a tiny model's route of 512 tokens of context, its ends of generation biased away: the
    demo model's 1,024 take up to a minute to fill on two cores.
    """
    never_end = {str(t): -100 for t in Vocab(tiny_models[qwen_system.model_id]).eog_tokens}
    done = _client(qwen_system).completions.create(
        model=qwen_system.model_id, prompt="1, 2, 3, 4, 5, 6, 7, 8,", temperature=0, logit_bias=never_end
    )
    assert done.usage is not None
    assert done.usage.completion_tokens > DEFAULT_MAX_TOKENS, done.choices[0].text[-200:]
    assert done.usage.prompt_tokens + done.usage.completion_tokens == 512  # the nodes' context, all of it
    assert done.choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def gemma3_system(gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[localsystem.LocalSystem]:
    yield from _serve("gemma3-270m", tmp_path_factory.mktemp("system-gemma3"))


def _whole_model_greedy(model: Path, prompt: list[int], n: int) -> list[int]:
    with ShardEngine(model, Recipe(n_threads=THREADS, n_ctx_per_seq=512, n_seq_max=1)) as engine:
        tokens = np.array(prompt, np.int32)
        position = 0
        out: list[int] = []
        while len(out) < n:
            k = len(tokens)
            result = engine.run(
                Rows(
                    np.zeros(k, np.int32),
                    np.arange(position, position + k, dtype=np.int32),
                    np.arange(k) == k - 1,
                    tokens=tokens,
                ),
                want_logits=True,
            )
            assert result.logits is not None
            position += k
            out.append(int(np.argmax(result.logits[-1])))
            tokens = np.array(out[-1:], np.int32)
    return out


def test_gemma3_route_completes_as_the_whole_model_does(gemma3_system: localsystem.LocalSystem, gemma3: Path) -> None:
    client = _client(gemma3_system)
    prompt = "The capital of France is"
    done = client.completions.create(model=gemma3_system.model_id, prompt=prompt, max_tokens=12, temperature=0)
    vocab = Vocab(gemma3)
    expected = vocab.detokenize(_whole_model_greedy(gemma3, vocab.tokenize(prompt), 12))
    assert done.choices[0].text == expected
    # the real weights: " the capital of the French Republic. ..." (the low bits of the
    # kernels a recipe picks decide between this and "... of the country of France")
    assert "France" in expected or "French" in expected
