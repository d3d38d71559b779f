"""Speculative decoding across a route: a reply is the plain reply, byte for byte.

The head drafts from the session's own tokens; the tail keeps the drafts its own sampler
picks; every hop drops the KV of the rows it did not keep. Each case runs the same request
with windows and without, on real llama.cpp, and checks the tokens (and their logprobs)
are the same and that windows were really sent and really cut short.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from noderuntime.engine.llama import Recipe, Rows, ShardEngine, Vocab
from noderuntime.node.drafting import EXPLORE, SHADOW_EVERY, STEP_IN_DRAFTS, HeadDrafts, PromptLookup, WindowPolicy
from noderuntime.node.draftmodel import READ_PIECE, DraftModel
from noderuntime.seams.client import GenerationRequest, open_route_generation, over_stream
from noderuntime.services.localroute import Completion, LocalRoute, open_local_route
from protocol import Sampling, Tokens
from tests.conftest import engine_threads

THREADS = engine_threads()

pytestmark = pytest.mark.slow

RECIPE = Recipe(n_threads=THREADS, n_ctx_per_seq=1024, n_seq_max=4, n_batch=256, n_ubatch=256)

PASSAGE = (
    "the river runs past the old mill and under the stone bridge, where the children of the "
    "village wait for the ferry every morning; the ferry comes at seven and leaves at eight"
)


def _grounded(model: Path) -> tuple[int, ...]:
    """A chat prompt asking to repeat a passage: most of the reply is in the prompt."""
    text = f"<|im_start|>user\nRepeat this text exactly, twice:\n{PASSAGE}<|im_end|>\n<|im_start|>assistant\n"
    return tuple(Vocab(model).tokenize(text, add_special=False))


async def _both(route: LocalRoute, request: GenerationRequest) -> tuple[Completion, Completion]:
    """``request`` with windows and without, on the same route."""
    plain = await route.generate(GenerationRequest(request.prompt_tokens, request.max_tokens, request.sampling))
    windows = await route.generate(request)
    return plain, windows


SAMPLINGS = {
    "greedy": Sampling(temperature=0.0),
    "seeded": Sampling(temperature=0.7, top_k=40, seed=1234),
    "grammar": Sampling(temperature=0.0, grammar='root ::= [a-z ,;]+ "."'),
    "logprobs": Sampling(temperature=0.0, logprobs=True, top_logprobs=3),
}


@pytest.mark.parametrize("cuts", [[0, 30], [0, 15, 30], [0, 10, 20, 30]], ids=["one-node", "2-shard", "3-shard"])
async def test_a_reply_with_windows_is_the_plain_reply(smollm2: Path, cuts: list[int]) -> None:
    prompt = await trio.to_thread.run_sync(_grounded, smollm2)
    async with open_local_route(smollm2, cuts, RECIPE) as route:
        for name, sampling in SAMPLINGS.items():
            request = GenerationRequest(prompt, 32, sampling, speculate=8)
            plain, windows = await _both(route, request)
            assert windows.tokens == plain.tokens, name
            assert plain.drafted == 0
            # the reply repeats its prompt: the adaptive policy sent windows, and drafts were kept
            assert windows.drafted > 0 and windows.accepted > 0, (name, windows.drafted, windows.accepted)


async def _frames(route: LocalRoute, request: GenerationRequest) -> list[Tokens]:
    """The Tokens frames of ``request`` on ``route``, as its client gets them."""
    stream = await route.network.connect(route.hops[0])
    frames = []
    async with open_route_generation(
        over_stream(stream), route.hops, request, artifact=route.artifact, recipe=route.recipe
    ) as gen:
        while (event := await gen.next()) is not None:
            frames.append(event)
    return frames


async def test_logprobs_of_a_window_are_those_of_single_steps(smollm2: Path) -> None:
    prompt = await trio.to_thread.run_sync(_grounded, smollm2)
    sampling = SAMPLINGS["logprobs"]
    async with open_local_route(smollm2, [0, 15, 30], RECIPE) as route:
        for speculate in (0, 8):
            frames = await _frames(route, GenerationRequest(prompt, 32, sampling, speculate=speculate))
            logprobs = [lp for frame in frames for lp in frame.logprobs]
            assert len(logprobs) == sum(len(f.token_ids) for f in frames) == 32
            if speculate == 0:
                plain = logprobs
            else:
                assert any(len(f.token_ids) > 1 for f in frames)  # some window kept several
                assert logprobs == plain  # float for float


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3moe"])
async def test_rejected_windows_roll_back_exactly_on_every_architecture(
    arch: str, tiny_model: Path, tiny_models: dict[str, Path]
) -> None:
    """Random weights, every window sent (eager): drafts are often wrong, so windows are cut
    short and every hop drops rows it computed."""
    model = tiny_model if arch == "llama" else tiny_models[arch]
    prompt = tuple(range(100, 140)) * 2 + tuple(range(200, 220))
    drafted = accepted = 0
    async with open_local_route(model, [0, 2, 4], RECIPE, eager_windows=True) as route:
        first = await route.generate(GenerationRequest(prompt, 24, SAMPLINGS["greedy"]))
        # the prompt, the model's own reply to it, and the prompt again: the drafts offer that reply,
        # which the model's reply to the longer prompt follows only in part
        echo = prompt + first.tokens + prompt
        for sampling in (SAMPLINGS["greedy"], SAMPLINGS["seeded"]):
            plain, windows = await _both(route, GenerationRequest(echo, 64, sampling, speculate=6))
            assert windows.tokens == plain.tokens
            drafted, accepted = drafted + windows.drafted, accepted + windows.accepted
    assert drafted > accepted, (drafted, accepted)  # windows were cut short: rolled back


async def test_windows_that_follow_windows_in_flight_give_the_plain_reply(smollm2: Path) -> None:
    """Every window sent, and behind each in flight the next (eager): with a passage to repeat,
    some are live and run at every hop, others go stale when the one before was cut short, and
    every sampler's reply is the plain one, byte for byte."""
    prompt = await trio.to_thread.run_sync(_grounded, smollm2)
    async with open_local_route(smollm2, [0, 10, 20, 30], RECIPE, eager_windows=True) as route:
        for name, sampling in SAMPLINGS.items():
            plain, windows = await _both(route, GenerationRequest(prompt, 40, sampling, speculate=8))
            assert windows.tokens == plain.tokens, name
        replies = [
            await _frames(route, GenerationRequest(prompt, 40, SAMPLINGS["logprobs"], speculate=k)) for k in (0, 8)
        ]
        plain_lp, windows_lp = ([lp for frame in frames for lp in frame.logprobs] for frames in replies)
        assert len(plain_lp) == 40 and windows_lp == plain_lp  # float for float
        ahead = {outcome: _windows_ahead(route.nodes, outcome) for outcome in ("sent", "run", "stale")}
    assert ahead["sent"] > 0 and ahead["run"] > 0 and ahead["stale"] > 0, ahead


def _windows_ahead(nodes: Any, outcome: str) -> float:
    """Windows that follow one in flight: sent by the head, or run or passed over (stale) by the hops."""
    return sum(
        node.metrics.registry.get_sample_value("noderuntime_node_windows_ahead_total", {"outcome": outcome}) or 0.0
        for node in nodes
    )


def _logits(engine: ShardEngine, seq: int, start: int, rows: np.ndarray) -> np.ndarray:
    """The logits of ``rows`` run as one step of sequence ``seq`` from position ``start``."""
    n = len(rows)
    out = engine.run(
        Rows(np.full(n, seq, np.int32), np.arange(start, start + n, dtype=np.int32), np.ones(n, bool), rows),
        want_logits=True,
    )
    assert out.logits is not None
    return out.logits


async def test_gemma3_windows_past_its_sliding_window_are_the_plain_reply(gemma3: Path) -> None:
    """A prompt longer than Gemma 3 270M's 512-position sliding window: every window lies past it."""
    text = "Repeat: " + "\n".join([PASSAGE] * 15)
    prompt = await trio.to_thread.run_sync(lambda: tuple(Vocab(gemma3).tokenize(text)))
    assert len(prompt) > 512
    async with open_local_route(gemma3, [0, 9, 18], RECIPE, eager_windows=True) as route:
        plain, windows = await _both(route, GenerationRequest(prompt, 32, SAMPLINGS["greedy"], speculate=6))
    assert windows.tokens == plain.tokens
    assert windows.drafted > 0


def test_a_window_across_the_end_of_a_window_sized_cache_gives_the_bits_of_single_steps(gemma3: Path) -> None:
    """Gemma 3's local layers with 2048 positions a sequence and ubatches of 256: a cache sized to
    its 512-position window would hold 768 cells, and positions 765..768 would fill its last
    three cells and its first. A window over them whose last two rows are not kept frees cells
    767 and 0; single steps would then fill 767 first, a window-sized cache fills 0 first, and
    every later row differs. The engine keeps every position's KV: the bits of single steps."""
    recipe = Recipe(n_threads=THREADS, n_ctx_per_seq=2048, n_seq_max=2, n_batch=256, n_ubatch=256)
    rng = np.random.default_rng(3)
    prompt = rng.integers(1000, 20000, 765).astype(np.int32)
    tokens = rng.integers(1000, 20000, 8).astype(np.int32)
    with ShardEngine(gemma3, recipe) as engine:
        for seq in (0, 1):
            for start in range(0, len(prompt), 256):
                chunk = prompt[start : start + 256]
                n = len(chunk)
                at = np.arange(start, start + n, dtype=np.int32)
                engine.run(Rows(np.full(n, seq, np.int32), at, np.zeros(n, bool), chunk))  # no logits: KV only
        p = len(prompt)
        single = np.stack([_logits(engine, 0, p + i, tokens[i : i + 1])[0] for i in range(len(tokens))])
        window = _logits(engine, 1, p, np.array([*tokens[:2], 7, 8], np.int32))  # positions 765..768
        engine.truncate_sequence(1, p + 2)
        rest = np.stack([_logits(engine, 1, p + i, tokens[i : i + 1])[0] for i in range(2, len(tokens))])
        assert np.array_equal(window[:2], single[:2])
        assert np.array_equal(rest, single[2:])  # bit for bit, every row after the rollback


def _held(node: Any) -> int:
    """Slots a node holds: leased, or released with their KV not yet removed."""
    leases = node.statistics().leases
    return int(leases.slots_leased + leases.slots_draining)


def test_a_window_after_a_rollback_gives_the_bits_of_single_steps(smollm2: Path) -> None:
    """The engine: rows run as a window, cut back and run again equal the same rows run one by one."""
    recipe = Recipe(n_threads=THREADS, n_ctx_per_seq=512, n_seq_max=2, n_batch=256, n_ubatch=256)
    with ShardEngine(smollm2, recipe) as engine:
        prompt = np.arange(400, 460, dtype=np.int32)
        tokens = np.array([11, 22, 33, 44, 55, 66], np.int32)

        for seq in (0, 1):
            _logits(engine, seq, 0, prompt)
        # sequence 0: single steps through all six tokens
        single = np.stack([_logits(engine, 0, len(prompt) + i, tokens[i : i + 1])[0] for i in range(len(tokens))])
        # sequence 1: a window of four rows whose last two drafts were wrong, cut back, then the rest
        p = len(prompt)
        window = _logits(engine, 1, p, np.array([11, 22, 99, 98], np.int32))
        engine.truncate_sequence(1, p + 2)
        rest = _logits(engine, 1, p + 2, tokens[2:])
        assert np.array_equal(window[:2], single[:2])  # bit for bit
        assert np.array_equal(rest, single[2:])


def _greedy(engine: ShardEngine, seq: int, tokens: list[int], n: int) -> list[int]:
    """The ``n`` tokens a greedy decode of ``tokens`` draws in a fresh ``seq``: the prompt in
    pieces of 32 (rows are the same bits however positions are cut), then one position a step."""
    engine.remove_sequence(seq)
    for start in range(0, len(tokens), 32):
        logits = _logits(engine, seq, start, np.asarray(tokens[start : start + 32], np.int32))
    out = [int(np.argmax(logits[-1]))]
    while len(out) < n:
        row = np.array(out[-1:], np.int32)
        out.append(int(np.argmax(_logits(engine, seq, len(tokens) + len(out) - 1, row)[-1])))
    return out


async def test_a_draft_model_drafts_the_greedy_continuation_after_every_rollback(smollm2: Path) -> None:
    """The draft engine keeps what each sequence holds: after a window cut short, or a new
    session in the same sequence, it drafts what a fresh greedy decode would, running only the
    tokens it does not hold yet."""
    recipe = Recipe(n_threads=THREADS, n_ctx_per_seq=256, n_seq_max=4, n_batch=64, n_ubatch=64)

    async def inline(fn: Any) -> Any:
        return fn()

    with ShardEngine(smollm2, recipe) as engine:
        drafter = DraftModel(engine, inline, n_seq=3, n_ctx_per_seq=256, n_batch=64)
        prompt = list(range(300, 380))  # longer than a batch: run in two pieces
        expected = _greedy(engine, 3, prompt, 6)
        assert await drafter.draft(0, prompt, 6) == (expected, 80)
        # the tail kept two drafts and drew another token than the third: the draft engine drops
        # what it ran past the two and runs the new token alone
        tokens = [*prompt, *expected[:2], 7]
        assert await drafter.draft(0, tokens, 4) == (_greedy(engine, 3, tokens, 4), 1)
        # every draft kept, and the token after them: only those two are new to it
        longer = [*tokens, *_greedy(engine, 3, tokens, 5)]
        assert await drafter.draft(0, longer, 3) == (_greedy(engine, 3, longer, 3), 2)
        # a session whose prompt shares only a beginning with what the sequence held
        other = [*prompt[:40], 9, 10, 11]
        assert await drafter.draft(0, other, 2) == (_greedy(engine, 3, other, 2), 3)
        # no room: beyond a sequence's positions, or a sequence the engine does not have
        assert await drafter.draft(0, list(range(250)), 8) == ([], 0)
        assert await drafter.draft(3, prompt, 2) == ([], 0)
        assert drafter.drafted == 6 + 4 + 3 + 2
        # a prompt read a piece at a time while the route computes, stopped after the first
        # piece (the first token came): the first draft reads the rest
        long = list(range(500, 600))
        assert await drafter.read(1, long, lambda: True) is None
        assert await drafter.draft(1, long, 2) == (_greedy(engine, 3, long, 2), len(long) - READ_PIECE)
        # read whole, its guess at the first token is the greedy one, and a draft runs only that
        assert await drafter.read(2, prompt, lambda: False) == expected[0]
        assert await drafter.draft(2, prompt, 1) == (expected[:1], 1)
        # a step the engine refuses (here: closed, as when the node stops) drafts nothing,
        # forgets what the sequence held and raises nothing into the session
        engine.close()
        assert await drafter.draft(2, [*prompt, 5], 3) == ([], 1)
        assert drafter.failures == 1 and drafter.drafted == 6 + 4 + 3 + 2 + 2 + 1
        assert await drafter.draft(2, prompt, 1) == ([], len(prompt))  # it holds nothing since


def test_a_session_whose_model_drafts_miss_measures_one_window_then_drafts_a_token_in_eight_steps() -> None:
    """Acceptance that fell to nothing costs one unsent draft in SHADOW_EVERY plain steps (where a
    draft is cheap), and is measured again: windows come back when drafts start to be kept. The
    session's tokens count up and never repeat, so prompt lookup offers nothing."""

    class Model:
        seconds_per_draft = 0.0

        def __init__(self, right: bool) -> None:
            self.calls: list[int] = []
            self.right = right  # drafts the tokens that come (they count up), or a token that never does

        async def draft(self, seq_id: int, tokens: Any, k: int) -> tuple[list[int], int]:
            self.calls.append(k)
            return [tokens[-1] + 1 + i if self.right else 0 for i in range(k)], 1

    def steps(drafts: HeadDrafts, n: int) -> list[tuple[int, ...]]:
        sent = []
        for _ in range(n):
            sent.append(trio.run(drafts.draft, 8, 8))
            drafts.sending(0, sent[-1], 0.0)
            last = drafts.lookup.tokens[-1] if drafts.lookup else 0
            kept = len(sent[-1]) if drafts.model.right else 0  # type: ignore[union-attr]
            # answered as fast as the policy measured: a plain step 20 ms, each further row 3 ms
            drafts.answered(list(range(last + 1, last + 2 + kept)), 0.02 + 0.003 * len(sent[-1]))
        return sent

    # no draft where a step is too short beside a draft for windows to pay; where it is long
    # enough and no window was measured yet, one short window measures what a row costs
    dear = Model(right=False)
    dear.seconds_per_draft = 0.02 / STEP_IN_DRAFTS
    costly = HeadDrafts([1, 2, 3], 8, model=dear)  # type: ignore[arg-type]
    costly.policy.timed(1, 0.02)
    assert trio.run(costly.draft, 8, 8) == () and dear.calls == []

    model = Model(right=False)
    drafts = HeadDrafts([1, 2, 3], 8, model=model)  # type: ignore[arg-type]
    drafts.policy.timed(1, 0.02)
    for _ in range(40):
        drafts.policy.shadow(False)
    assert steps(drafts, 1) == [(0,) * EXPLORE] and model.calls == [EXPLORE]
    drafts.policy.timed(3, 0.026)
    model.calls.clear()
    assert steps(drafts, 3 * SHADOW_EVERY) == [()] * 3 * SHADOW_EVERY and model.calls == [1, 1, 1]
    model.right = True  # the drafts start to be kept: windows come back
    assert max(len(sent) for sent in steps(drafts, 12 * SHADOW_EVERY)) > 1


def test_a_window_follows_one_in_flight_where_the_round_trip_is_long_and_chains_hold() -> None:
    """The head of a route that repeats a passage: behind a window in flight it drafts on as if
    that window were kept whole, a window led by its guess at the last draw, where that pays.
    It does not on a short round trip, nor once windows stop chaining into the next."""
    passage = list(range(100, 160))
    for _ in range(2):
        assert HeadDrafts(passage, 8).ahead(9, 9, 3) == ()  # nothing in flight: nothing to follow

    def head(step: float, row: float) -> HeadDrafts:
        drafts = HeadDrafts([*passage, 7, *passage[:6]], 8)  # the reply has begun to repeat it
        drafts.policy.timed(1, step)
        drafts.policy.timed(9, step + 8 * row)
        for _ in range(10):
            drafts.policy.judged(8, 8)  # its windows were kept whole
            drafts.policy.chain_judged(True)  # and drew what the drafter guessed after them
        return drafts

    far = head(0.120, 0.002)  # 3 seams at 20 ms, rows of a small model
    window = trio.run(far.draft, 8, 8)
    assert window == tuple(passage[6:14])
    far.sending(200, window, 0.0)
    assert far.ahead(9, 9, 3) == tuple(passage[14:23])  # the guess (what follows the window) first
    far.sending(209, far.ahead(9, 9, 3), 0.0, follows=True)
    assert len(far.flight) == 2 and far.ahead(9, 9, 1) == ()  # the route takes one ahead at most
    # the answer keeps the first whole and draws the guess: the second stays in flight
    far.answered(passage[6:15], 0.13)
    assert [sent.step.start for sent in far.flight] == [209]
    # the next answer is cut short: nothing in flight is live; it came 110 ms after the one
    # before, nearly a whole step: the route computes more than it waits, and none pays now
    far.answered([*passage[15:17], 1], 0.24)
    assert not far.flight and far.policy.fixed is not None and far.policy.fixed > 0.09
    far.sending(218, trio.run(far.draft, 8, 8), 0.0)
    assert far.ahead(9, 9, 3) == ()
    # on one machine a round trip is all computing: one window that follows goes, and its answer,
    # a whole step after the one before, stops the next
    near = head(0.020, 0.005)
    near.sending(200, trio.run(near.draft, 8, 8), 0.0)
    tried = near.ahead(9, 9, 3)
    assert tried == tuple(passage[14:23])
    near.sending(209, tried, 0.0, follows=True)
    near.answered(passage[6:15], 0.06)
    near.answered(passage[15:24], 0.06 + 0.020 + 9 * 0.005)
    near.sending(227, trio.run(near.draft, 8, 8), 0.13)
    assert near.ahead(9, 9, 3) == ()
    broken = head(0.120, 0.002)
    for _ in range(30):
        broken.policy.chain_judged(False)  # windows cut short, or the guess missed, every time
    broken.sending(200, trio.run(broken.draft, 8, 8), 0.0)
    assert broken.ahead(9, 9, 3) == ()


def test_prompt_lookup_drafts_what_followed_the_latest_match() -> None:
    drafter = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8])
    drafter.extend([2, 3])
    # "2 3" last followed by 4 7 8 (the latest occurrence), not 4 5
    assert drafter.draft(3) == [4, 7, 8]
    assert drafter.draft(0) == []
    drafter.extend([4, 7])
    assert drafter.draft(5) == [8, 2, 3, 4, 7]  # "2 3 4 7" occurred once: what followed, up to now
    assert PromptLookup([5, 6]).draft(4) == []  # nothing to match


def test_the_window_policy_sends_none_when_drafts_miss_and_grows_when_they_are_kept() -> None:
    policy = WindowPolicy(8)
    assert policy.size(8, 8) == 0  # no plain step measured yet
    for _ in range(5):
        policy.timed(1, 0.020)
    for _ in range(20):
        policy.shadow(False)
    assert policy.size(8, 8) == 0  # drafts that miss cost rows and bring nothing
    for _ in range(30):
        policy.shadow(True)
    assert policy.size(8, 8) > 2
    policy.timed(5, 0.020 + 4 * 0.001)  # rows are cheap: long windows pay
    assert policy.size(8, 8) == 8 and policy.size(8, 3) == 3 and policy.size(2, 8) == 2
    policy.judged(8, 1)
    policy.judged(8, 0)
    policy.judged(8, 0)
    assert policy.size(8, 8) < 8


FREE = "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"


async def test_a_route_drafting_with_a_model_gives_the_plain_reply(smollm2: Path) -> None:
    """The model drafts for itself at the head of a 2-shard route where prompt lookup has nothing
    to offer, every window as long as it may be (eager): greedily, every draft the model makes is
    kept (the route's bits are the whole model's); sampled or under a grammar, many are not; and
    the replies are the plain ones, on free text."""
    prompt = await trio.to_thread.run_sync(lambda: tuple(Vocab(smollm2).tokenize(FREE, add_special=False)))
    async with open_local_route(smollm2, [0, 15, 30], RECIPE, draft=smollm2, eager_windows=True) as route:
        model = route.nodes[0].draft_model
        assert model is not None and route.nodes[1].draft_model is None
        for name, sampling in SAMPLINGS.items():
            before = model.drafted
            plain, windows = await _both(route, GenerationRequest(prompt, 40, sampling, speculate=6))
            assert windows.tokens == plain.tokens, name
            by_model = model.drafted - before
            assert by_model > 0, name
            if name in ("greedy", "logprobs"):  # kept: the model's drafts, and perhaps some of lookup's
                assert windows.accepted >= by_model, (name, by_model, windows.drafted, windows.accepted)
            else:  # a draw or a grammar the drafts do not know: windows cut short and rolled back
                assert windows.accepted < windows.drafted, (name, windows.drafted, windows.accepted)


async def test_sessions_cancelled_mid_window_leave_nothing_held(smollm2: Path) -> None:
    """Clients that leave while windows are in flight: every hop ends with no session, slot or KV cell."""
    prompt = await trio.to_thread.run_sync(_grounded, smollm2)
    async with open_local_route(smollm2, [0, 10, 20, 30], RECIPE, eager_windows=True) as route:

        async def leave_after(seconds: float) -> None:
            stream = await route.network.connect(route.hops[0])
            request = GenerationRequest(prompt, 200, SAMPLINGS["greedy"], speculate=8)
            with trio.move_on_after(seconds):
                async with open_route_generation(
                    over_stream(stream), route.hops, request, artifact=route.artifact, recipe=route.recipe
                ) as gen:
                    while await gen.next() is not None:
                        pass

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(leave_after, 0.3 + 0.15 * i)
        # a step already in the engine when its session ended finishes there; its KV goes after it
        with trio.fail_after(10):
            while any(node.sessions or _held(node) for node in route.nodes):
                await trio.sleep(0.01)
        assert await route.kv_cells_used() == [0, 0, 0]
        # and the route still answers as it did
        plain, windows = await _both(route, GenerationRequest(prompt, 24, SAMPLINGS["greedy"], speculate=8))
        assert windows.tokens == plain.tokens and windows.drafted > 0
