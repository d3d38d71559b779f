"""Gate C: many route sessions share each shard, isolated, cancellable, bounded."""

from __future__ import annotations

import atexit
import random
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import trio

from noderuntime.engine.llama import Recipe, Rows, ShardEngine
from noderuntime.seams.client import GenerationRequest, RouteError, open_route_generation, over_stream
from noderuntime.services.localroute import LocalRoute, open_local_route
from protocol import StatusCode
from tests.conftest import engine_threads

THREADS = engine_threads()

pytestmark = pytest.mark.slow

RECIPE = Recipe(n_threads=THREADS, n_ctx_per_seq=512, n_seq_max=16, n_batch=256, n_ubatch=256)


def requests(n: int, seed: int) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(5, 150)
        prompt = tuple(rng.randrange(100, 40000) for _ in range(length))
        out.append(GenerationRequest(prompt, rng.randint(6, 20), request_id=f"r{i}"))
    return out


_SOLO_ENGINES: dict[str, ShardEngine] = {}
_SOLO_RUNS: dict[tuple[str, tuple[int, ...], int], tuple[int, ...]] = {}
_SOLO_LOCK = threading.Lock()


@atexit.register
def _close_solo_engines() -> None:
    for engine in _SOLO_ENGINES.values():
        engine.close()


def solo_greedy(model: Path, request: GenerationRequest) -> tuple[int, ...]:
    """The whole model, alone, through the engine directly.

    One engine a model for the whole test session (its sequence removed after each run),
    and each answer remembered: it is the same every time it is asked for.
    """
    key = (str(model), tuple(request.prompt_tokens), request.max_tokens)
    with _SOLO_LOCK:
        if key not in _SOLO_RUNS:
            engine = _SOLO_ENGINES.get(str(model))
            if engine is None:
                recipe = Recipe(n_threads=THREADS, n_ctx_per_seq=512, n_seq_max=1, n_batch=256, n_ubatch=256)
                engine = _SOLO_ENGINES[str(model)] = ShardEngine(model, recipe)
            try:
                _SOLO_RUNS[key] = _greedy_alone(engine, request)
            finally:
                engine.remove_sequence(0)
        return _SOLO_RUNS[key]


def _greedy_alone(engine: ShardEngine, request: GenerationRequest) -> tuple[int, ...]:
    prompt = np.array(request.prompt_tokens, np.int32)
    logits = None
    for start in range(0, len(prompt), 128):  # the route's prefill chunks
        piece = prompt[start : start + 128]
        out = np.zeros(len(piece), bool)
        out[-1] = True
        positions = np.arange(start, start + len(piece), dtype=np.int32)
        logits = engine.run(Rows(np.zeros(len(piece), np.int32), positions, out, tokens=piece), want_logits=True).logits
    tokens: list[int] = []
    position = len(prompt)
    while True:
        assert logits is not None
        token = int(np.argmax(logits[-1]))
        tokens.append(token)
        if len(tokens) == request.max_tokens:
            return tuple(tokens)
        logits = engine.run(
            Rows(
                np.zeros(1, np.int32),
                np.array([position], np.int32),
                np.ones(1, bool),
                tokens=np.array([token], np.int32),
            ),
            want_logits=True,
        ).logits
        position += 1


async def assert_idle(route: LocalRoute) -> None:
    """Every shard: no session, no slot, no KV cell, no task but the batcher."""
    with trio.fail_after(10):
        while any(node.sessions for node in route.nodes):
            await trio.sleep(0.01)
    for node in route.nodes:
        stats = node.statistics()
        assert stats.leases.slots_leased == 0 and stats.leases.slots_draining == 0, stats
        assert node._nursery is not None and len(node._nursery.child_tasks) == 1  # the batcher
    assert await route.kv_cells_used() == [0] * len(route.nodes)


@pytest.mark.parametrize("cuts", [[0, 15, 30], [0, 10, 20, 30]], ids=["2-shard", "3-shard"])
async def test_16_concurrent_sessions_equal_their_solo_runs(smollm2: Path, cuts: list[int]) -> None:
    # the same requests for every split: their solo runs are computed once (see solo_greedy)
    reqs = requests(16, seed=2)
    expected = [await trio.to_thread.run_sync(solo_greedy, smollm2, r) for r in reqs]
    results: dict[int, tuple[int, ...]] = {}
    async with open_local_route(smollm2, cuts, RECIPE) as route:

        async def one(i: int) -> None:
            results[i] = (await route.generate(reqs[i])).tokens

        async with trio.open_nursery() as nursery:
            for i in range(len(reqs)):
                nursery.start_soon(one, i)
        batch_sizes = [node.statistics().batcher for node in route.nodes]
        await assert_idle(route)
    assert [results[i] for i in range(len(reqs))] == expected
    # the sessions really were batched together
    assert all(stats.rows > stats.ticks * 2 for stats in batch_sizes)


async def test_random_starts_ends_and_cancellations_leave_nothing_behind(smollm2: Path) -> None:
    rng = random.Random(7)
    reqs = requests(24, seed=11)
    outcome: dict[int, str] = {}
    async with open_local_route(smollm2, [0, 10, 20, 30], RECIPE, prefill_chunk=32) as route:

        async def one(i: int) -> None:
            await trio.sleep(rng.uniform(0, 0.5))
            mode = rng.choice(["complete", "cancel", "cancel", "drop"])
            stream = await route.network.connect(route.hops[0])
            if mode == "drop":  # the client vanishes without a word
                await trio.sleep(rng.uniform(0, 0.3))
                await stream.aclose()
                outcome[i] = "dropped"
                return
            try:
                with trio.move_on_after(rng.uniform(0.0, 0.6) if mode == "cancel" else 60) as scope:
                    async with open_route_generation(
                        over_stream(stream), route.hops, reqs[i], artifact=route.artifact, recipe=route.recipe
                    ) as gen:
                        while await gen.next() is not None:
                            pass
            except RouteError as exc:  # more sessions than slots at a peak: refused at once
                assert exc.code == StatusCode.RESOURCE_EXHAUSTED
                outcome[i] = "refused"
                return
            outcome[i] = "cancelled" if scope.cancelled_caught else "completed"

        async with trio.open_nursery() as nursery:
            for i in range(len(reqs)):
                nursery.start_soon(one, i)
        await assert_idle(route)
        ended = {}
        for node in route.nodes:
            for reason, count in node.statistics().sessions_ended.items():
                ended[reason] = ended.get(reason, 0) + count
        assert "cancelled" in outcome.values() and "completed" in outcome.values()
        # the route still serves correct output afterwards
        fresh = requests(3, seed=99)
        got = [(await route.generate(r)).tokens for r in fresh]
        await assert_idle(route)
    assert got == [await trio.to_thread.run_sync(solo_greedy, smollm2, r) for r in fresh]
    assert ended.get("released", 0) >= 3
    # every session ended in a way the storm explains: a release, a cancel or a peer that went
    # away or refused; never a defect, an engine or protocol failure, a stall or a deadline
    expected = {
        "released",
        "cancelled",
        "upstream_closed",
        "downstream_closed",
        "downstream_cancelled",
        "downstream_error",
    }
    assert set(ended) <= expected, ended


async def test_a_full_node_refuses_at_once_and_admits_after_a_session_ends(smollm2: Path) -> None:
    recipe = Recipe(n_threads=THREADS, n_ctx_per_seq=512, n_seq_max=2, n_batch=256, n_ubatch=256)
    reqs = requests(3, seed=5)
    long = [GenerationRequest(r.prompt_tokens, 200) for r in reqs]
    async with open_local_route(smollm2, [0, 15, 30], recipe) as route:
        async with trio.open_nursery() as nursery:
            holders = []
            for r in long[:2]:
                stream = await route.network.connect(route.hops[0])
                cm = open_route_generation(
                    over_stream(stream), route.hops, r, artifact=route.artifact, recipe=route.recipe
                )
                holders.append((cm, await cm.__aenter__()))
            for _, gen in holders:
                assert await gen.next() is not None  # both admitted and generating
            with trio.fail_after(10):
                with pytest.raises(RouteError) as refused:
                    await route.generate(reqs[2])
            assert refused.value.code == StatusCode.RESOURCE_EXHAUSTED
            assert "node full" in str(refused.value)
            assert route.nodes[0].statistics().admissions_refused == 1
            cm, gen = holders.pop()
            await cm.__aexit__(None, None, None)  # released: the slot drains and frees
            with trio.fail_after(30):
                # the release travels down the route: the tail frees its slot after the head
                while any(node.statistics().leases.slots_free == 0 for node in route.nodes):
                    await trio.sleep(0.01)
            admitted = await route.generate(reqs[2])
            assert len(admitted.tokens) == reqs[2].max_tokens
            for cm, _ in holders:
                await cm.__aexit__(None, None, None)
            nursery.cancel_scope.cancel()
        await assert_idle(route)


def _sorted(values: Sequence[int]) -> list[int]:
    return sorted(values)
