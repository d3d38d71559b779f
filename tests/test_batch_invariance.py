"""A session's results do not depend on who else the node serves.

Sessions with random prefill chunks and decode steps, at KV lengths into the hundreds,
run concurrently through one :class:`Batcher` over a real middle shard; every step's
hidden rows must equal, bit for bit, the same session's steps run alone on a second
engine. (The scheduler never batches a prefill chunk with decode steps: llama.cpp computes
it in other ubatch shapes, and before patches 0008 and 0009 about one step in ten then
differed. With them, such batches were measured exact on the CPU too, 9-13 mixed ticks in
each case here with the scheduler swapped for one that mixes, at 1a500ca. Chunks of one
length batched together keep their shapes and must stay exact.) How a prompt is cut into
prefill chunks changes nothing either, with flash attention on or off.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio

from noderuntime.engine.base import Rows
from noderuntime.engine.llama import FlashAttn, Recipe, ShardEngine
from noderuntime.models.artifacts import LayerRange
from noderuntime.node import batcher as batcher_module
from noderuntime.node import scheduler
from noderuntime.node.batcher import Batcher, StepRequest
from noderuntime.node.leases import LeaseManager
from noderuntime.node.scheduler import BatchPlan

# two threads, as a node runs on this machine (flash attention on, as on every CPU)
RECIPE = Recipe(n_threads=2, n_ctx_per_seq=1024, n_seq_max=6, n_batch=512, n_ubatch=512)


@pytest.mark.parametrize("flash_attn", ["on", "off"])
async def test_batched_steps_equal_the_same_steps_alone(
    flash_attn: FlashAttn, smollm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # on: past 512 KV cells llama.cpp split a lone decode row's attention across threads (a
    # batch of several rows never), which patch 0008 stops; off: as nodes on a GPU run.
    # Four middle layers: each computes its rows with the same kernels, so a step that
    # differs differs from the first layer on (ten took 25 s a case, four 10 s)
    recipe = attrs.evolve(RECIPE, flash_attn=flash_attn)
    await _check_batch_invariance(smollm2, LayerRange(10, 14), 576, monkeypatch, recipe)


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_a_prompt_gives_the_same_logits_however_it_is_cut_into_chunks(flash_attn: FlashAttn, smollm2: Path) -> None:
    # on: llama.cpp computed batches of 64 query rows or more on a tiled path and smaller
    # ones row by row, with other sums (logits up to 2.0 apart) until patch 0008
    recipe = attrs.evolve(RECIPE, n_seq_max=3, flash_attn=flash_attn)
    tokens = np.random.default_rng(1).integers(100, 40_000, 300).astype(np.int32)
    logits = {}
    with ShardEngine(smollm2, recipe) as engine:
        for seq, chunk in enumerate((32, 128, 300)):
            parts = []
            for start in range(0, len(tokens), chunk):
                piece = tokens[start : start + chunk]
                positions = np.arange(start, start + len(piece), dtype=np.int32)
                rows = Rows(np.full(len(piece), seq, np.int32), positions, np.ones(len(piece), bool), piece)
                parts.append(engine.run(rows, want_logits=True).logits)
            logits[chunk] = np.concatenate(parts)
    for chunk in (128, 300):
        difference = float(np.abs(logits[32] - logits[chunk]).max())
        assert np.array_equal(logits[32], logits[chunk]), f"chunks of 32 and {chunk} differ by {difference}"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
async def test_batch_invariance_on_qwen3_family(
    arch: str, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    await _check_batch_invariance(tiny_models[arch], LayerRange(1, 3), 64, monkeypatch)


async def test_batch_invariance_on_gemma3(gemma3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # KV lengths pass the 512-token sliding window of five layers in six
    await _check_batch_invariance(gemma3, LayerRange(3, 9), 640, monkeypatch)


@pytest.mark.parametrize(("n_rows", "n_seqs"), [(3, 3), (1, 8)])
def test_k_quant_rows_equal_alone_and_in_a_batch_of_eight_or_more(gemma3: Path, n_rows: int, n_seqs: int) -> None:
    # Gemma 3's Q4_K_M has K-quant attn_output and ffn_down; llama.cpp computed them on
    # a tiled kernel from 8 rows of a batch on and on vec_dot below, with other sums, so
    # three 3-row prefill chunks together, or 8 decode steps, differed from each alone
    # (every time, by up to 6e-4) until patch 0009
    recipe = attrs.evolve(RECIPE, n_seq_max=n_seqs, n_ctx_per_seq=256)
    hidden = np.random.default_rng(5).standard_normal((n_rows * n_seqs, 640), dtype=np.float32)
    positions = np.tile(np.arange(n_rows, dtype=np.int32), n_seqs)
    with ShardEngine(gemma3, recipe, LayerRange(3, 9)) as engine:
        alone = engine.run(
            Rows(np.zeros(n_rows, np.int32), positions[:n_rows], np.ones(n_rows, bool), hidden=hidden[:n_rows])
        )
        engine.remove_sequence(0)
        seqs = np.repeat(np.arange(n_seqs, dtype=np.int32), n_rows)
        batched = engine.run(Rows(seqs, positions, np.ones(len(seqs), bool), hidden=hidden))
    difference = float(np.abs(alone.hidden - batched.hidden[:n_rows]).max())
    assert np.array_equal(alone.hidden, batched.hidden[:n_rows]), f"differs by {difference}"


async def _check_batch_invariance(
    model: Path, layers: LayerRange, n_embd: int, monkeypatch: pytest.MonkeyPatch, recipe: Recipe = RECIPE
) -> None:
    grouped: list[tuple[int, ...]] = []  # ticks that ran several prefill chunks (of one length) together

    def recording(*args: Any, **kwargs: Any) -> BatchPlan:
        plan = scheduler.schedule(*args, **kwargs)
        if plan.n_decode == 0 and len(plan.steps) > 1:
            grouped.append(tuple(step.n_rows for step in plan.steps))
        return plan

    monkeypatch.setattr(batcher_module, "schedule", recording)
    rng = random.Random(3)
    sessions = []
    for seq in range(6):
        steps: list[np.ndarray] = []
        length = 0
        while length < 700:
            # a long prefill, then decode steps with more prefill chunks among them
            n = rng.choice((200, 256)) if length < 256 else rng.choice((1, 1, 1, 3, 17, 64, 200))
            steps.append(np.random.default_rng([seq, length]).standard_normal((n, n_embd), dtype=np.float32))
            length += n
        sessions.append(steps)

    with ShardEngine(model, recipe, layers) as batched, ShardEngine(model, recipe, layers) as alone:
        expected = []
        for seq, steps in enumerate(sessions):
            start, outputs = 0, []
            for hidden in steps:
                n = len(hidden)
                positions = np.arange(start, start + n, dtype=np.int32)
                outputs.append(
                    alone.run(Rows(np.full(n, seq, np.int32), positions, np.ones(n, bool), hidden=hidden)).hidden
                )
                start += n
            alone.remove_sequence(seq)
            expected.append(outputs)

        batcher = Batcher(batched, LeaseManager(6, 6 * 1024), max_batch_tokens=512)
        got: list[list[np.ndarray]] = [[] for _ in sessions]

        async def session(seq: int) -> None:
            start = 0
            for hidden in sessions[seq]:
                await trio.sleep(rng.random() * 0.002)  # arrive in every order
                request = StepRequest(seq, start, hidden=hidden, decode=len(hidden) == 1)
                output = await batcher.step(request)
                got[seq].append(output.hidden)
                start += len(hidden)

        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            async with trio.open_nursery() as clients:
                for seq in range(len(sessions)):
                    clients.start_soon(session, seq)
            nursery.cancel_scope.cancel()
        stats = batcher.statistics()
        assert stats.rows > 2 * stats.ticks  # steps really shared ticks
        # the engine's own time is counted apart from the hop to its thread, within the ticks' time; what
        # share of a tick it is, is a benchmark's figure (benchmarks.seams: decode_engine_ms, decode_tick_ms)
        assert 0 < stats.engine_seconds <= stats.busy_seconds
    # prefill chunks of one length shared ticks too, at different KV lengths (first chunks and later ones)
    assert len(grouped) >= 3 and any(sizes[0] < 200 for sizes in grouped), grouped

    for seq in range(len(sessions)):
        for k, (a, b) in enumerate(zip(got[seq], expected[seq], strict=True)):
            assert np.array_equal(a, b), f"session {seq} step {k} differs by {float(np.abs(a - b).max())}"
