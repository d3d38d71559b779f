"""The Transformers shard engine and the Gate A lanes: real weights, real torch, real processes.

Tolerances, measured on the demo model's F32 lane: a route of engines (any split, any
prefill chunking) differs from the whole Transformers model by at most 1e-4 in any
logit (7.2e-5 seen over 13 positions; logits span about ±31), and greedy tokens are
equal. Batching sessions at different positions changes the matrix shapes and so the
low bits: at most 1e-4 as well (5e-5 seen). The tests allow 1e-3.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from noderuntime.engine.base import Rows
from noderuntime.engine.llama import EngineError, Vocab
from noderuntime.models import catalogue as models
from noderuntime.models.artifacts import LayerRange
from noderuntime.verify import lanes
from protocol import Sampling

torchengine = pytest.importorskip("noderuntime.engine.torch_backend", reason="the transformers extra is not installed")

TOLERANCE = 1e-3
PROMPT = "<|im_start|>user\nWhat is the tallest mountain in the world?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def built() -> dict[str, lanes.Lane]:
    return lanes.build(models.pull(progress=False), say=lambda _text: None)


@pytest.fixture(scope="module")
def prompt_tokens() -> list[int]:
    vocab = Vocab(models.pull(progress=False))
    return vocab.tokenize(PROMPT, add_special=vocab.add_bos)


def rows(seq: int, start: int, tokens: list[int] | None = None, hidden: np.ndarray | None = None) -> Rows:
    n = len(tokens) if tokens is not None else len(hidden)  # type: ignore[arg-type]
    return Rows(
        np.full(n, seq, dtype=np.int32),
        np.arange(start, start + n, dtype=np.int32),
        np.ones(n, dtype=bool),
        tokens=None if tokens is None else np.asarray(tokens, dtype=np.int32),
        hidden=hidden,
    )


def test_float_lanes_hold_the_same_numbers(built: dict[str, lanes.Lane]) -> None:
    from gguf import GGUFReader
    from safetensors import safe_open

    gguf = {t.name: t for t in GGUFReader(built["gguf-f32"].path).tensors}
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
        "blk.17.ffn_down.weight": "model.layers.17.mlp.down_proj.weight",
        "output_norm.weight": "model.norm.weight",
    }
    with (
        safe_open(str(built["hf-f32"].path / "model.safetensors"), "np") as f32,
        safe_open(str(built["hf-bf16"].path / "model.safetensors"), "pt") as bf16,
    ):
        for gguf_name, hf_name in pairs.items():
            assert np.array_equal(np.asarray(gguf[gguf_name].data), f32.get_tensor(hf_name)), gguf_name
            assert bf16.get_tensor(hf_name).dtype == torchengine.torch.bfloat16
    sizes = {name: lane.size_bytes() for name, lane in built.items()}
    assert sizes["gguf-q4_k_m"] < sizes["gguf-q8_0"] < sizes["gguf-f16"] < sizes["gguf-f32"]
    assert sizes["hf-bf16"] * 2 == pytest.approx(sizes["hf-f32"], rel=0.01)


def test_a_chain_of_ranges_equals_the_whole_transformers_model(
    built: dict[str, lanes.Lane], prompt_tokens: list[int]
) -> None:
    path = built["hf-f32"].path
    reference = torchengine.whole_model_logits(path, prompt_tokens)
    recipe = torchengine.TorchRecipe()
    with (
        torchengine.TorchEngine(path, recipe, LayerRange(0, 11)) as head,
        torchengine.TorchEngine(path, recipe, LayerRange(11, 30)) as tail,
    ):
        assert head.is_head and not head.is_tail and tail.is_tail
        parts = []
        n = len(prompt_tokens)
        for lo, hi in ((0, 5), (5, n - 3), (n - 3, n)):  # uneven prefill chunks
            hidden = head.run(rows(0, lo, prompt_tokens[lo:hi])).hidden
            assert hidden is not None and hidden.dtype == np.float32
            parts.append(tail.run(rows(0, lo, hidden=hidden), want_logits=True).logits)
        logits = np.concatenate(parts)
        assert np.abs(logits - reference).max() < TOLERANCE
        assert np.array_equal(logits.argmax(axis=1), reference.argmax(axis=1))
        assert head.kv_cells_used() == n and tail.positions(0) == (0, n - 1)
        head.remove_sequence(0)
        head.remove_sequence(0)  # idempotent
        assert head.kv_cells_used() == 0


def test_decode_steps_of_sessions_at_different_positions_batch_together(
    built: dict[str, lanes.Lane], prompt_tokens: list[int]
) -> None:
    path = built["hf-f32"].path
    with torchengine.TorchEngine(path, torchengine.TorchRecipe()) as engine:
        # alone: sequence 0 takes 9 tokens, sequence 1 the whole prompt
        engine.run(rows(0, 0, prompt_tokens[:9]))
        alone = engine.run(rows(0, 9, prompt_tokens[9:10]), want_logits=True).logits
        engine.run(rows(1, 0, prompt_tokens[:-1]))
        alone_1 = engine.run(rows(1, len(prompt_tokens) - 1, prompt_tokens[-1:]), want_logits=True).logits
        for seq in (0, 1):
            engine.remove_sequence(seq)
        engine.run(rows(2, 0, prompt_tokens[:9]))
        engine.run(rows(3, 0, prompt_tokens[:-1]))
        both = Rows(
            np.array([3, 2], dtype=np.int32),
            np.array([len(prompt_tokens) - 1, 9], dtype=np.int32),
            np.ones(2, dtype=bool),
            tokens=np.array([prompt_tokens[-1], prompt_tokens[9]], dtype=np.int32),
        )
        sampler = engine.new_sampler(Sampling())
        result = engine.run(both, want_logits=True, samplers={0: sampler})
        assert result.logits is not None and alone is not None and alone_1 is not None
        assert np.abs(result.logits[1] - alone[0]).max() < TOLERANCE
        assert np.abs(result.logits[0] - alone_1[0]).max() < TOLERANCE
        assert result.sampled[0] == int(np.argmax(alone_1[0]))


def test_bad_input_gets_a_typed_error(built: dict[str, lanes.Lane], prompt_tokens: list[int], tmp_path) -> None:
    path = built["hf-bf16"].path
    with torchengine.TorchEngine(path, torchengine.TorchRecipe(n_ctx_per_seq=64), LayerRange(0, 4)) as engine:
        assert engine.quant == "BF16"
        engine.run(rows(0, 0, prompt_tokens[:4]))
        held = engine.memory()
        with pytest.raises(EngineError, match="must continue at 4"):
            engine.run(rows(0, 7, prompt_tokens[:1]))
        with pytest.raises(EngineError, match="token ids"):
            engine.run(rows(1, 0, [10**6]))
        with pytest.raises(EngineError, match="context is 64"):
            engine.run(rows(2, 0, list(range(65))))
        with pytest.raises(EngineError, match="sequence ids"):
            engine.run(rows(99, 0, [1]))
        # a refused batch changes nothing: no cache was made or grown
        assert engine.positions(0) == (0, 3) and engine.positions(1) is None and engine.positions(2) is None
        assert engine.memory() == held
    with pytest.raises(EngineError, match="not a directory"):
        torchengine.TorchEngine(built["gguf-q4_1"].path, torchengine.TorchRecipe())
    with pytest.raises(EngineError, match=r"no config\.json"):
        torchengine.TorchEngine(tmp_path, torchengine.TorchRecipe())
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(EngineError, match="safetensors"):
        torchengine.TorchEngine(tmp_path, torchengine.TorchRecipe())
    # headers whose entries would steer reads outside the file (an end before its start read it all)
    for entry in (
        {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]},
        {"dtype": "F32", "shape": [1]},
        {"dtype": "F32", "shape": [1], "data_offsets": [0, 1 << 40]},
        {"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]},
    ):
        header = json.dumps({"model.embed_tokens.weight": entry}).encode()
        (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
        with pytest.raises(EngineError, match="malformed or points outside"):
            torchengine.TorchEngine(tmp_path, torchengine.TorchRecipe())
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 5000) + b"[" * 5000)
    with pytest.raises(EngineError, match="malformed safetensors header"):
        torchengine.TorchEngine(tmp_path, torchengine.TorchRecipe())


def test_sampler_follows_the_chain_semantics() -> None:
    logits = np.array([1.0, 3.0, 2.0, -1.0], dtype=np.float32)
    assert torchengine.TorchSampler(Sampling()).pick(logits, 0) == 1
    # a repeat penalty on the winner hands the step to the runner-up
    penalised = torchengine.TorchSampler(Sampling(repeat_penalty=2.0), history=[1])
    assert penalised.pick(logits, 0) == 2 and penalised.history == [1, 2]
    # top-k 1 at any temperature is greedy; a seeded draw repeats
    assert torchengine.TorchSampler(Sampling(temperature=5.0, top_k=1, seed=3)).pick(logits, 0) == 1
    # a seeded draw depends on the seed and the position alone, not on the draws before it
    seeded = Sampling(temperature=1.0, seed=7)
    along = torchengine.TorchSampler(seeded)
    in_turn = [along.pick(logits, position) for position in range(40)]
    assert in_turn == [torchengine.TorchSampler(seeded).pick(logits, position) for position in range(40)]
    assert len(set(in_turn)) > 1


@pytest.mark.slow
async def test_a_two_process_safetensors_route_equals_the_whole_transformers_model(
    built: dict[str, lanes.Lane], tmp_path
) -> None:
    import trio

    from noderuntime.seams.client import GenerationRequest
    from noderuntime.seams.dialer import open_dialer
    from noderuntime.testing.clusters import running_cluster

    vocab = Vocab(models.pull(progress=False))
    questions = ["What is the tallest mountain?", "Name three colours.", "Say hello in French.", "What is 2+2?"]
    prompts = [
        vocab.tokenize(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", add_special=vocab.add_bos)
        for q in questions
    ]
    n = 16
    path = built["hf-f32"].path
    expected = await trio.to_thread.run_sync(lambda: torchengine.whole_model_greedy(path, prompts, n))
    with running_cluster(
        path, [0, 15, 30], tmp_path, extra=["--backend", "transformers"], slots=4, threads=1
    ) as cluster:
        assert cluster.infos[0].artifact == torchengine.inspect(path).fingerprint
        got: dict[int, tuple[int, ...]] = {}
        async with open_dialer() as dialer:

            async def one(i: int) -> None:
                got[i] = await cluster.generate(dialer, GenerationRequest(tuple(prompts[i]), n))

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
        assert [list(got[i]) for i in range(len(prompts))] == expected
        await cluster.wait_idle()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_qwen3_family_ranges_equal_the_whole_transformers_model(
    arch: str, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """The Transformers backend serves Qwen3 and Qwen3-MoE ranges (Q/K norms, routed experts)."""
    exported = tmp_path / "hf"
    torchengine.export_safetensors(tiny_models[arch], exported, "F32")
    assert torchengine.inspect(exported).architecture == arch
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, 480, 40)]
    reference = torchengine.whole_model_logits(exported, tokens)
    recipe = torchengine.TorchRecipe()
    with (
        torchengine.TorchEngine(exported, recipe, LayerRange(0, 1)) as head,
        torchengine.TorchEngine(exported, recipe, LayerRange(1, 4)) as tail,
    ):
        parts = []
        for lo, hi in ((0, 7), (7, 39), (39, 40)):  # uneven prefill chunks, then one decode row
            hidden = head.run(rows(0, lo, tokens[lo:hi])).hidden
            parts.append(tail.run(rows(0, lo, hidden=hidden), want_logits=True).logits)
    logits = np.concatenate(parts)
    assert np.abs(logits - reference).max() < TOLERANCE
    assert np.array_equal(logits.argmax(axis=1), reference.argmax(axis=1))


def test_a_lane_being_made_elsewhere_is_waited_for_not_made_twice(tiny_model: Path, tmp_path: Path) -> None:
    """Two makers of one cache folder (two benchmarks, a benchmark and a test) take turns."""
    root = tmp_path / "lanes"
    path = root / "gguf-f32.gguf"
    holding = threading.Event()
    theirs: dict[str, float | int] = {}

    def other_maker() -> None:  # another process, in effect: its own open file, its own lock
        with models.folder_turn(root):
            holding.set()
            time.sleep(0.5)
            lanes.float_gguf(tiny_model, path)
            theirs["inode"], theirs["done"] = path.stat().st_ino, time.monotonic()

    other = threading.Thread(target=other_maker)
    other.start()
    holding.wait()
    assert lanes.float_copy(tiny_model, root=root) == path
    returned = time.monotonic()
    other.join()
    # it waited for the other maker, then took its file instead of writing its own over it
    assert returned >= theirs["done"] and path.stat().st_ino == theirs["inode"]
    assert not list(root.glob("*.partial"))
