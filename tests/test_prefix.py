"""Prefix reuse: the cache's bookkeeping, and a reused prefix's bits against a cold run.

The engine tests run real llama.cpp: a sequence's KV is saved after a session (prompt and
reply), restored into another sequence cut to a shorter prefix, and the rest prefilled
there; the logits and the tokens that follow must equal, bit for bit, those of the same
prompt run cold. Every architecture the project serves is checked: Llama (SmolLM2),
Qwen3 and Qwen3-MoE (random weights at small shapes) and Gemma 3 (real weights, whose
sliding-window layers keep a second cache).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from noderuntime.engine.base import Rows
from noderuntime.engine.llama import Recipe, ShardEngine
from noderuntime.node.prefix import BLOCK, PrefixCache, block_hashes
from protocol import Sampling
from tests.conftest import engine_threads

THREADS = engine_threads()

# --- the cache's bookkeeping


def test_the_longest_cached_prefix_is_found_by_blocks_then_tokens_and_never_the_last_token() -> None:
    cache = PrefixCache(1 << 20)
    first = list(range(100, 100 + 5 * BLOCK + 3))
    assert cache.store(first, b"a" * 100)
    assert cache.lookup([*first[: 3 * BLOCK], 1, 2, 3]) == (3 * BLOCK, b"a" * 100)
    # past the last whole block it matches token by token: here 5 tokens into the fourth
    assert cache.lookup([*first[: 3 * BLOCK + 5], 1, 2, 3])[0] == 3 * BLOCK + 5
    # a prompt that is exactly the cached tokens keeps its last token to compute
    assert cache.lookup(first[: 4 * BLOCK])[0] == 4 * BLOCK - 1
    assert cache.lookup(first, limit=2 * BLOCK + 5)[0] == 2 * BLOCK + 5
    assert cache.lookup([*first, 9, 9])[0] == len(first)  # all the entry holds, and no more
    assert cache.lookup([7, *first[1:]]) == (0, None)  # the first block differs: nothing
    assert cache.lookup([*first[: BLOCK - 1], 1, 2]) == (0, None)  # not one whole block in common
    stats = cache.statistics()
    assert (stats.hits, stats.misses) == (5, 2)
    assert stats.hit_tokens == 3 * BLOCK + (3 * BLOCK + 5) + (4 * BLOCK - 1) + (2 * BLOCK + 5) + len(first)


def test_the_newest_entry_answers_and_the_least_recently_used_goes_first() -> None:
    cache = PrefixCache(250)
    common = list(range(2 * BLOCK))
    cache.store(common + [1] * BLOCK, b"1" * 100)
    cache.store(common + [2] * BLOCK, b"2" * 100)
    assert cache.lookup(common + [9] * BLOCK)[1] == b"2" * 100  # both hold the common blocks alike: the newer
    assert cache.lookup(common + [1] * BLOCK + [0])[1] == b"1" * 100  # and now the first is the fresher
    cache.store(list(range(500, 500 + 2 * BLOCK)), b"3" * 100)  # over the budget: the second goes
    stats = cache.statistics()
    assert (stats.entries, stats.bytes, stats.evictions) == (2, 200, 1)
    assert cache.lookup(common + [2] * BLOCK + [0])[0] == 2 * BLOCK  # the common blocks, from the first
    assert not cache.store(list(range(3 * BLOCK)), b"x" * 300)  # larger than the whole budget
    assert cache.statistics().too_large == 1


def test_a_conversations_next_turn_replaces_its_previous_one() -> None:
    cache = PrefixCache(1 << 20)
    turn = list(range(2 * BLOCK + 5))
    cache.store(turn, b"1" * 100)
    cache.store(list(range(900, 900 + 2 * BLOCK)), b"o" * 100)  # another conversation stays
    cache.store([*turn, *range(50, 50 + BLOCK)], b"2" * 150)  # the next turn: all of the first, and more
    stats = cache.statistics()
    assert (stats.entries, stats.bytes, stats.superseded, stats.evictions) == (2, 250, 1, 0)
    assert cache.lookup([*turn, 1])[1] == b"2" * 150
    cache.store([*turn[: 2 * BLOCK], 7, 7], b"3" * 100)  # a branch: shares blocks, is no prefix of it
    assert cache.statistics().entries == 3


def test_an_empty_budget_keeps_nothing_and_hashes_chain() -> None:
    cache = PrefixCache(0)
    assert not cache.store(list(range(3 * BLOCK)), b"x")
    assert cache.lookup(list(range(3 * BLOCK))) == (0, None)
    a, b = block_hashes(list(range(2 * BLOCK))), block_hashes([0, *list(range(1, 2 * BLOCK))])
    assert a == b and len(a) == 2
    # a block's hash covers every token before it: the same second block after another first differs
    assert block_hashes([5] * BLOCK + list(range(BLOCK)))[1] != block_hashes([6] * BLOCK + list(range(BLOCK)))[1]
    with pytest.raises(ValueError):
        PrefixCache(-1)


# --- a reused prefix against a cold run, on the engine


def _generate(
    engine: ShardEngine, seq: int, prompt: list[int], start: int, params: Sampling, n: int
) -> tuple[np.ndarray, list[int]]:
    """Prefill ``prompt[start:]`` on ``seq`` (its first ``start`` positions are in KV) and decode ``n``
    tokens; (the logits of the prompt's last position, the tokens)."""
    sampler = engine.new_sampler(params, history=prompt)
    rows = prompt[start:]
    last = len(rows) - 1
    result = engine.run(
        Rows(
            np.full(len(rows), seq, np.int32),
            np.arange(start, len(prompt), dtype=np.int32),
            np.arange(len(rows)) == last,
            tokens=np.asarray(rows, np.int32),
        ),
        samplers={last: sampler},
        want_logits=True,
    )
    assert result.logits is not None
    logits, token = result.logits[-1].copy(), result.sampled[last]
    tokens = [token]
    for position in range(len(prompt), len(prompt) + n - 1):
        step = Rows(np.array([seq], np.int32), np.array([position], np.int32), np.ones(1, bool), np.array([token]))
        token = engine.run(step, samplers={0: sampler}).sampled[0]
        tokens.append(token)
    sampler.close()
    return logits, tokens


def _check_reuse(model: Path, vocab_size: int, keep: int = 2 * BLOCK) -> None:
    rng = np.random.default_rng(4)
    first = rng.integers(10, vocab_size, 3 * BLOCK + 5).tolist()  # a turn: prompt and reply
    second = first[:keep] + rng.integers(10, vocab_size, 20).tolist()  # the next turn shares its start
    recipe = Recipe(n_threads=THREADS, n_ctx_per_seq=256, n_seq_max=3, n_batch=64, n_ubatch=64)
    for params in (Sampling(), Sampling(temperature=0.9, top_k=40, seed=3)):
        with ShardEngine(model, recipe) as engine:
            _generate(engine, 0, first, 0, params, 8)  # the first session
            state = engine.save_sequence(0)
            engine.remove_sequence(0)
            engine.restore_sequence(1, state, keep)
            assert engine.positions(1) == (0, keep - 1)
            reused = _generate(engine, 1, second, keep, params, 12)
            cold = _generate(engine, 2, second, 0, params, 12)
            assert np.array_equal(reused[0], cold[0]), float(np.abs(reused[0] - cold[0]).max())
            assert reused[1] == cold[1]
            for seq in (1, 2):
                engine.remove_sequence(seq)
            assert engine.kv_cells_used() == 0


def test_a_reused_prefix_gives_the_bits_of_a_cold_run_llama(smollm2: Path) -> None:
    _check_reuse(smollm2, 40_000)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_a_reused_prefix_gives_the_bits_of_a_cold_run_qwen3(tiny_models: dict[str, Path], arch: str) -> None:
    _check_reuse(tiny_models[arch], 300)


def test_a_reused_prefix_gives_the_bits_of_a_cold_run_gemma3(gemma3: Path) -> None:
    _check_reuse(gemma3, 200_000)
