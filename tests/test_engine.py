"""The shard engine: loading ranges, refusing bad input, memory residency, sampling."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import numpy as np
import pytest

from noderuntime.engine import llama as engine
from noderuntime.engine.llama import EngineError, Recipe, Rows, ShardEngine, Vocab
from noderuntime.models import artifacts
from noderuntime.models.artifacts import LayerRange
from protocol import Sampling
from tests.conftest import engine_threads

from . import buildscript

THREADS = engine_threads()

ROOT = Path(__file__).resolve().parents[1]
SMALL = Recipe(n_threads=THREADS, n_ctx_per_seq=256, n_seq_max=2, n_batch=64, n_ubatch=64)


def test_installed_kernels_carry_this_patch_series() -> None:
    info = engine.build_info()
    build = buildscript.load()
    assert info["patch_hash"] == build.patch_hash()
    assert info["llama_cpp_python"] == build.local_version()
    assert info["llama_cpp_commit"] == build.LLAMA_CPP_COMMIT
    # and was built with today's flags for this CPU: bootstrap reinstalls on any difference
    assert build.installed_marker(sys.executable) == json.loads(json.dumps(build.marker()))


def test_stock_llama_cpp_python_is_refused_with_build_instructions(tmp_path: Path) -> None:
    # A stand-in for a stock build: the same package layout, a real shared library
    # (libc) that lacks the patch's symbols.
    fake = tmp_path / "llama_cpp"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        textwrap.dedent("""
        import ctypes, ctypes.util
        __version__ = "0.3.36"
        class llama_cpp:
            _lib = ctypes.CDLL(ctypes.util.find_library("c"))
    """)
    )
    probe = "import noderuntime.engine.llama"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode != 0
    assert "PatchMissingError" in done.stderr
    assert "stock build without layer-range execution" in done.stderr
    assert "kernels_patch/build.py" in done.stderr


def test_range_outside_the_model_is_refused(tiny_model: Path) -> None:
    with pytest.raises(EngineError, match="outside the model"):
        ShardEngine(tiny_model, SMALL, LayerRange(2, 6))


def test_start_not_before_end_is_refused() -> None:
    with pytest.raises(ValueError, match="start < end"):
        LayerRange(3, 3)


def test_shard_file_must_hold_the_requested_range(tiny_model: Path, tmp_path: Path) -> None:
    (path,) = artifacts.split(tiny_model, [LayerRange(1, 3)], tmp_path)
    with pytest.raises(EngineError, match="holds layers 1:3"):
        ShardEngine(path, SMALL, LayerRange(1, 2))
    with ShardEngine(path, SMALL) as shard:
        assert shard.layers == LayerRange(1, 3)
        assert not shard.is_head and not shard.is_tail


def test_wrong_parent_fingerprint_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    (path,) = artifacts.split(tiny_model, [LayerRange(0, 2)], tmp_path)
    with pytest.raises(EngineError, match="belongs to artifact"):
        ShardEngine(path, SMALL, expected_fingerprint="0" * 64)


def test_corrupted_model_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(EngineError):
        ShardEngine(bad, SMALL)


def test_non_head_shard_refuses_token_ids(tiny_model: Path) -> None:
    with ShardEngine(tiny_model, SMALL, LayerRange(2, 4)) as shard:
        rows = Rows(
            np.zeros(2, np.int32), np.arange(2, dtype=np.int32), np.ones(2, bool), tokens=np.array([5, 6], np.int32)
        )
        with pytest.raises(EngineError, match="takes hidden rows"):
            shard.run(rows)
        # and llama.cpp itself refuses a token batch (error -1), whatever the caller does
        buffers = shard._buffers
        buffers.batch.token = buffers.tokens.ctypes.data_as(type(buffers.batch.token))
        buffers.batch.embd = None
        buffers.batch.n_tokens = 1
        assert engine.llama_cpp.llama_decode(shard.context, buffers.batch) == -1


def _three_rows_of_0_and_one_of_1() -> Rows:
    """A batch with a prefill of sequence 0 and the first row of sequence 1; the last row of each has output."""
    return Rows(
        np.array([0, 0, 0, 1], np.int32),
        np.array([0, 1, 2, 0], np.int32),
        np.array([0, 0, 1, 1], bool),
        tokens=np.array([5, 6, 7, 8], np.int32),
    )


def test_sequences_are_removed_and_kv_cells_counted(tiny_model: Path) -> None:
    with ShardEngine(tiny_model, SMALL) as whole:
        rows = _three_rows_of_0_and_one_of_1()
        result = whole.run(rows, want_logits=True)
        assert result.logits is not None and result.logits.shape == (2, whole.n_vocab)
        assert whole.kv_cells_used() == 4
        assert whole.positions(0) == (0, 2)
        whole.remove_sequence(0)
        whole.remove_sequence(0)  # idempotent
        assert whole.positions(0) is None
        assert whole.kv_cells_used() == 1
        whole.remove_sequence(1)
        assert whole.kv_cells_used() == 0


def test_sampler_chains(tiny_model: Path) -> None:
    with ShardEngine(tiny_model, SMALL) as whole:
        rows = Rows(
            np.array([0, 1], np.int32), np.zeros(2, np.int32), np.ones(2, bool), tokens=np.array([5, 9], np.int32)
        )
        greedy = whole.new_sampler(Sampling())
        result = whole.run(rows, samplers={0: greedy}, want_logits=True)
        assert result.logits is not None
        assert result.sampled[0] == int(np.argmax(result.logits[0]))
        whole.remove_sequence(0)
        whole.remove_sequence(1)
        draws = []
        for _ in range(2):
            chain = whole.new_sampler(
                Sampling(
                    temperature=1.5,
                    top_k=50,
                    top_p=0.9,
                    min_p=0.01,
                    seed=1234,
                    frequency_penalty=0.5,
                    presence_penalty=0.3,
                ),
                history=[5, 6],
            )
            draws.append(whole.run(rows, samplers={1: chain}).sampled[1])
            chain.close()
            chain.close()
            whole.remove_sequence(0)
            whole.remove_sequence(1)
        assert draws[0] == draws[1]  # same seed, same token
        greedy.close()


def _first_tokens(model: ShardEngine, prompt: list[int], chains: list[engine.SamplerChain]) -> list[int]:
    """The token each chain samples after ``prompt``, one sequence each, in one batch."""
    n, k = len(chains), len(prompt)
    rows = Rows(
        np.repeat(np.arange(n, dtype=np.int32), k),
        np.tile(np.arange(k, dtype=np.int32), n),
        np.tile(np.arange(k) == k - 1, n),
        tokens=np.tile(np.asarray(prompt, np.int32), n),
    )
    sampled = model.run(rows, samplers={i * k + k - 1: c for i, c in enumerate(chains)}).sampled
    for i, chain in enumerate(chains):
        chain.close()
        model.remove_sequence(i)
    return [sampled[i * k + k - 1] for i in range(n)]


YES_NO = 'root ::= "yes" | "no"'


def test_greedy_under_a_grammar_is_the_masked_maximum(smollm2: Path) -> None:
    """Greedy draws from all tokens and asks the grammar about the one drawn; the answer
    must be what greedy over the masked logits gives (top-k 1 masks first, then picks)."""
    vocab = Vocab(smollm2)
    text = vocab.tokenize("The capital of France is Paris. Answer with yes or no: is the sky green?")
    recipe = Recipe(n_threads=THREADS, n_ctx_per_seq=256, n_seq_max=1, n_batch=64, n_ubatch=64)
    with ShardEngine(smollm2, recipe) as model:
        for grammar in (YES_NO, 'root ::= [a-z]+ "." | "Paris"', 'root ::= "{" [ \\t\\n]* "}"'):
            prompts = [text[:cut] for cut in range(4, len(text), max(1, len(text) // 12))][:12]
            fast = [_first_tokens(model, p, [model.new_sampler(Sampling(grammar=grammar))])[0] for p in prompts]
            masked = Sampling(grammar=grammar, temperature=1.0, top_k=1)
            slow = [_first_tokens(model, p, [model.new_sampler(masked)])[0] for p in prompts]
            assert fast == slow, grammar


def test_a_draw_under_a_grammar_has_the_masked_distribution(tiny_model: Path) -> None:
    """A draw from all tokens, kept when the grammar accepts it and drawn again from the
    masked tokens when not, gives each valid token its masked probability."""
    vocab = Vocab(tiny_model)
    prompt = [5, 9, 200]
    n, runs = 64, 64
    with ShardEngine(tiny_model, Recipe(n_threads=1, n_ctx_per_seq=256, n_seq_max=n)) as model:
        rows = Rows(
            np.zeros(3, np.int32), np.arange(3, dtype=np.int32), np.arange(3) == 2, tokens=np.asarray(prompt, np.int32)
        )
        result = model.run(rows, want_logits=True)
        assert result.logits is not None
        logits = result.logits[-1].astype(np.float64)
        model.remove_sequence(0)
        draws: list[int] = []
        for run in range(runs):
            params = [Sampling(grammar="root ::= [a-e]", temperature=1.0, seed=run * n + i) for i in range(n)]
            draws += _first_tokens(model, prompt, [model.new_sampler(p) for p in params])
    # the mask, from the vocabulary's own pieces: the byte tokens a to e
    valid = np.array([t for t in range(len(logits)) if vocab.piece(t) in (b"a", b"b", b"c", b"d", b"e")])
    masked = np.exp(logits[valid] - logits[valid].max())
    masked /= masked.sum()
    share = np.exp(logits[valid] - logits.max()).sum() / np.exp(logits - logits.max()).sum()
    assert len(valid) == 5 and share < 0.1  # the test's point: nearly every first draw is refused
    assert set(draws) <= set(valid.tolist())
    seen = np.array([draws.count(t) for t in valid]) / len(draws)
    sigma = np.sqrt(masked * (1 - masked) / len(draws))
    assert np.all(np.abs(seen - masked) <= 4 * sigma), list(zip(seen.round(3), masked.round(3), strict=True))


RESIDENCY_PROBE = textwrap.dedent("""
    import json, sys, psutil
    from noderuntime.engine.llama import ShardEngine, Recipe, Rows
    import numpy as np
    recipe = Recipe(n_threads=1, n_ctx_per_seq=512, n_seq_max=4, n_batch=64, n_ubatch=64)
    before = psutil.Process().memory_info().rss
    e = ShardEngine(sys.argv[1], recipe)
    n = 8
    rows = Rows(np.zeros(n, np.int32), np.arange(n, dtype=np.int32), np.ones(n, bool),
                tokens=np.arange(5, 5 + n, dtype=np.int32) if e.is_head else None,
                hidden=None if e.is_head else np.zeros((n, e.n_embd), np.float32))
    e.run(rows)  # touch every weight page once
    after = psutil.Process().memory_info().rss
    m = e.memory()
    print(json.dumps({"rss_growth": after - before, "weights": m.weights, "kv": m.kv, "compute": m.compute}))
""")


@pytest.mark.slow
def test_middle_shard_resides_in_well_under_half_the_memory(smollm2: Path, tmp_path: Path) -> None:
    (middle,) = artifacts.split(smollm2, [LayerRange(10, 20)], tmp_path)

    def probe(path: Path) -> dict[str, int]:
        out = subprocess.run(
            [sys.executable, "-c", RESIDENCY_PROBE, str(path)],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        )
        result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
        return result

    whole, shard = probe(smollm2), probe(middle)
    assert shard["weights"] <= 0.45 * whole["weights"], (shard, whole)
    assert shard["kv"] <= 0.45 * whole["kv"], (shard, whole)
    assert shard["rss_growth"] <= 0.45 * whole["rss_growth"], (shard, whole)


def test_a_vocabulary_that_fails_to_load_leaves_nothing_to_trip_on(tmp_path: Path) -> None:
    """A typed error, and the half-made object's finalizer raises nothing of its own."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    unraisable: list[object] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with pytest.raises(EngineError):
            engine.Vocab(bad)
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert unraisable == []


DEAD_GRAMMAR = textwrap.dedent("""
    import sys
    import numpy as np
    from noderuntime.engine.llama import Recipe, Rows, ShardEngine
    from protocol import Sampling
    with ShardEngine(sys.argv[1], Recipe(n_threads=1, n_ctx_per_seq=256, n_seq_max=1)) as e:
        chain = e.new_sampler(Sampling(grammar=sys.argv[2]))
        tokens, position = np.array([1, 2, 3, 4], np.int32), 0
        for _ in range(4):
            n = len(tokens)
            rows = Rows(np.zeros(n, np.int32), np.arange(position, position + n, dtype=np.int32),
                        np.arange(n) == n - 1, tokens=tokens)
            token = e.run(rows, samplers={n - 1: chain}).sampled[n - 1]
            position, tokens = position + n, np.array([token], np.int32)
            print(token, e.n_vocab)
        chain.close()
""")


@pytest.mark.parametrize(
    "which, grammar",
    [("smollm2", 'root ::= "\\x00"'), ("smollm2", 'root ::= "a" "\\x00"'), ("tiny", 'root ::= "\\x00"')],
    ids=["end-of-text-first", "after-a-token", "another-token-first"],
)
def test_a_grammar_that_allows_no_token_ends_generation_not_the_process(
    smollm2: Path, tiny_model: Path, which: str, grammar: str
) -> None:
    """Through the C API a C++ throw or GGML_ABORT would end the node (patch 0006).

    With every candidate rejected, greedy takes the first token id: the end of text in
    SmolLM2 (llama.cpp aborted), ``<unk>`` in the tiny model (llama.cpp threw).
    """
    model = smollm2 if which == "smollm2" else tiny_model
    done = subprocess.run(
        [sys.executable, "-c", DEAD_GRAMMAR, str(model), grammar],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    vocab = Vocab(model)
    sampled = [int(line.split()[0]) for line in done.stdout.split("\n") if line.strip()]
    assert sampled[-1] in vocab.eog_tokens  # only the end of generation remains


def test_a_unified_kv_is_only_for_measuring_and_leaves_fingerprints_alone(tiny_model: Path) -> None:
    """benchmarks.invariance runs one KV stream for every sequence; nodes never do."""
    assert "kv_unified" not in SMALL.describe("Q4_1")
    unified = attrs.evolve(SMALL, kv_unified=True)
    assert unified.describe("Q4_1")["kv_unified"] is True
    assert unified.fingerprint("Q4_1") != SMALL.fingerprint("Q4_1")
    with ShardEngine(tiny_model, unified) as whole:
        # a prefill of one sequence and a row of another in one batch: one stream holds both
        rows = _three_rows_of_0_and_one_of_1()
        result = whole.run(rows, want_logits=True)
        assert result.logits is not None and result.logits.shape == (2, whole.n_vocab)
        assert whole.kv_cells_used() == 4


RESUMED = {
    "greedy": Sampling(),
    "seeded": Sampling(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=77, repeat_penalty=1.1),
    "penalties": Sampling(temperature=1.2, seed=5, frequency_penalty=0.7, presence_penalty=0.4, penalty_last_n=16),
    "grammar": Sampling(
        temperature=0.8, seed=11, grammar='root ::= "{\\"name\\": \\"" [a-z]+ "\\", \\"legs\\": " [0-9]+ "}"'
    ),
}


def _continue(
    model: ShardEngine, seq: int, tokens: list[int], chain: engine.SamplerChain, n: int, stop: frozenset[int]
) -> list[int]:
    """Prefill ``tokens`` in one piece on ``seq``, then sample up to ``n`` tokens one decode step at a time."""
    last = len(tokens) - 1
    rows = Rows(
        np.full(len(tokens), seq, np.int32),
        np.arange(len(tokens), dtype=np.int32),
        np.arange(len(tokens)) == last,
        tokens=np.asarray(tokens, np.int32),
    )
    token = model.run(rows, samplers={last: chain}).sampled[last]
    out = [token]
    for position in range(len(tokens), len(tokens) + n - 1):
        if token in stop:
            break
        step = Rows(
            np.array([seq], np.int32),
            np.array([position], np.int32),
            np.ones(1, bool),
            tokens=np.array([token], np.int32),
        )
        token = model.run(step, samplers={0: chain}).sampled[0]
        out.append(token)
    return out


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_a_chain_rebuilt_over_the_tokens_so_far_goes_on_as_the_first_would_have(smollm2: Path, name: str) -> None:
    """A route repair resumes a session on another tail: its chain, built over the prompt and the
    tokens generated so far (penalties, grammar) and drawing at each position from the seed and
    the position alone, must pick what the lost chain would have, after the prefix's KV is
    recomputed in one prefill rather than token by token."""
    params = RESUMED[name]
    vocab = Vocab(smollm2)
    prompt = vocab.tokenize("Describe a cat as JSON with its name and number of legs:")
    recipe = Recipe(n_threads=THREADS, n_ctx_per_seq=256, n_seq_max=2, n_batch=256, n_ubatch=256)
    with ShardEngine(smollm2, recipe) as model:
        first = model.new_sampler(params, history=prompt)
        reference = _continue(model, 0, prompt, first, 24, vocab.eog_tokens)
        first.close()
        model.remove_sequence(0)
        assert len(reference) >= 12, reference
        for cut in (1, 5, len(reference) - 2):
            chain = model.new_sampler(params, history=prompt, generated=reference[:cut])
            resumed = _continue(model, 1, prompt + reference[:cut], chain, len(reference) - cut, vocab.eog_tokens)
            chain.close()
            model.remove_sequence(1)
            assert resumed == reference[cut:], (name, cut)
