"""The Transformers shard engine: the only module that imports ``torch`` and ``transformers``.

A :class:`TorchEngine` runs one layer range of a Hugging Face Llama, Qwen3 or Qwen3-MoE
model saved as safetensors, on the CPU, behind the same surface as the llama.cpp
:class:`~noderuntime.engine.llama.ShardEngine`: batches of rows (sequence id, position, token
or hidden row, wants output) in, residual rows or logits out. So a route can be built
from safetensors shards with the same protocol, seams, batcher and scheduler.

Only the range's tensors are read from the file. The blocks are Transformers' own
modules (``LlamaDecoderLayer``, ``Qwen3DecoderLayer``, ``Qwen3MoeDecoderLayer``: their
norms, projections, per-head Q/K norms and MLP or routed experts, with Transformers'
rotary embedding); the attention step is done here, over a cache owned by the engine,
one per sequence, because Transformers' caches batch sequences of one length while a
node batches decode steps of sessions at different positions. The projections and the
MLP of all rows of a batch run as one matrix product; each sequence then attends over
its own keys. Parity with the whole Transformers model is tested, with the tolerance
stated in ``tests/test_torchengine.py``.

The module also turns a GGUF file into a safetensors directory (``export_safetensors``),
through Transformers' own GGUF loader, for the Gate A lanes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
)

from noderuntime.engine.base import (
    EngineError,
    GrammarError,
    MemoryReport,
    Rows,
    StepResult,
    draw_seed,
    draws_to_keep,
    token_logprob,
    transformers_versions,
)
from noderuntime.models.artifacts import ArtifactInfo, LayerRange
from protocol import Sampling, TokenLogprob

__all__ = [
    "DTYPES",
    "TorchEngine",
    "TorchRecipe",
    "TorchSampler",
    "cast_safetensors",
    "export_safetensors",
    "inspect",
    "transformers_logits",
    "whole_model_greedy",
    "whole_model_logits",
]

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}
_SAMPLE = 1 << 16  # bytes of each tensor's head and tail hashed into the fingerprint


@attrs.frozen
class TorchRecipe:
    """How a Transformers shard runs (the fields admission measurement reads match the llama.cpp recipe)."""

    n_threads: int = 2
    n_ctx_per_seq: int = 2048
    n_seq_max: int = 8
    n_batch: int = 512

    def __attrs_post_init__(self) -> None:
        if self.n_threads < 1:
            raise ValueError("n_threads must be at least 1")
        if self.n_ctx_per_seq < 1 or not 1 <= self.n_seq_max <= 256 or self.n_batch < 1:
            raise ValueError("n_ctx_per_seq, n_seq_max (<= 256) and n_batch must be positive")

    def describe(self, quant: str) -> dict[str, Any]:
        """The recipe as published."""
        return {"backend": "transformers", **transformers_versions(), "dtype": quant, "threads": self.n_threads}

    def fingerprint(self, quant: str) -> str:
        """What every hop of a safetensors route must share (threads left out, as for llama.cpp)."""
        shared = {k: v for k, v in self.describe(quant).items() if k != "threads"}
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise EngineError(f"{path} is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        if size > min(100 << 20, path.stat().st_size - 8):
            raise EngineError(f"{path} is not a safetensors file (header of {size} bytes)")
        try:
            header = json.loads(f.read(size))
        except (ValueError, RecursionError) as exc:  # bad UTF-8 and JSONDecodeError are ValueErrors
            raise EngineError(f"{path} has a malformed safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise EngineError(f"{path} has a malformed safetensors header")
    header.pop("__metadata__", None)
    data_bytes = path.stat().st_size - 8 - size
    for name, entry in header.items():
        # the offsets steer reads of a multi-gigabyte file: an end before its start would read it all
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("dtype"), str)
            or not isinstance(entry.get("shape"), list)
            or not all(type(d) is int and d >= 0 for d in entry["shape"])
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise EngineError(f"{path}: safetensors entry {name!r:.80} is malformed or points outside the file")
    return header, 8 + size


def _weight_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{index} is malformed: {exc}") from None
        return [directory / n for n in names]
    raise EngineError(f"{directory} has no model.safetensors (nor an index of shards)")


@attrs.frozen
class _Architecture:
    """Transformers' modules for one model type, and the name routes use for it."""

    name: str  # as GGUF names it: what ArtifactInfo.architecture says
    block: type[torch.nn.Module]
    norm: type[torch.nn.Module]
    rotary: type[torch.nn.Module]


# Transformers' rotate-half rope is the same function for the three (NEOX order)
_ARCHITECTURES = {
    "llama": _Architecture("llama", LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding),
    "qwen3": _Architecture("qwen3", Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding),
    "qwen3_moe": _Architecture("qwen3moe", Qwen3MoeDecoderLayer, Qwen3MoeRMSNorm, Qwen3MoeRotaryEmbedding),
}


def _config(directory: Path) -> PretrainedConfig:
    path = directory / "config.json"
    if not path.exists():
        raise EngineError(f"{directory} is not a Transformers model directory (no config.json)")
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(str(directory))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise EngineError(f"{path} is not a usable Transformers config: {exc}") from None
    if config.model_type not in _ARCHITECTURES:
        known = ", ".join(sorted(_ARCHITECTURES))
        raise EngineError(f"{path} describes a {config.model_type!r} model; this engine runs {known} models")
    return config


def inspect(path: str | os.PathLike[str]) -> ArtifactInfo:
    """Identity and shape of a safetensors model directory, for routing (no weights loaded).

    The fingerprint hashes the config's shape and numerics, every tensor's name, dtype and shape, and
    the first and last 64 KiB of its data: cheap on a large model, and any re-export or
    different precision changes it.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise EngineError(f"{directory} is not a directory (the Transformers backend takes a safetensors directory)")
    config: Any = _config(directory)
    digest = hashlib.sha256()
    # what changes the computation besides the tensors (not versions or names)
    shape_keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "rms_norm_eps",
        "rope_parameters",
        "tie_word_embeddings",
        "head_dim",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
    )
    digest.update(json.dumps({k: getattr(config, k, None) for k in shape_keys}, sort_keys=True, default=str).encode())
    dtypes: dict[str, int] = {}
    total = 0
    n_tensors = 0
    files = _weight_files(directory)
    for file in files:
        header, base = _read_header(file)
        with file.open("rb") as f:
            for name in sorted(header):
                entry = header[name]
                start, end = entry["data_offsets"]
                digest.update(f"{name}\t{entry['dtype']}\t{entry['shape']}\n".encode())
                for offset in (start, max(start, end - _SAMPLE)):
                    f.seek(base + offset)
                    digest.update(f.read(min(_SAMPLE, end - offset)))
                dtypes[entry["dtype"]] = dtypes.get(entry["dtype"], 0) + end - start
                total += end - start
                n_tensors += 1
    quant = max(dtypes, key=lambda d: dtypes[d]) if dtypes else "?"
    fingerprint = digest.hexdigest()
    n_layer = int(config.num_hidden_layers)
    return ArtifactInfo(
        path=directory,
        fingerprint=fingerprint,
        file_fingerprint=fingerprint,
        architecture=_ARCHITECTURES[config.model_type].name,
        name=str(getattr(config, "_name_or_path", "") or directory.name),
        n_layer=n_layer,
        n_embd=int(config.hidden_size),
        n_vocab=int(config.vocab_size),
        n_head=int(config.num_attention_heads),
        n_head_kv=int(config.num_key_value_heads),
        context_length=int(config.max_position_embeddings),
        file_type=-1,
        quant=quant,
        n_tensors=n_tensors,
        tensor_bytes=total,
        file_bytes=sum(f.stat().st_size for f in files),
        layer_range=LayerRange(0, n_layer),
        has_chat_template=(directory / "tokenizer_config.json").exists(),
    )


class TorchSampler:
    """Per-session sampling from a logits row, with llama.cpp's chain semantics.

    Penalties (repeat, frequency, presence over the last ``penalty_last_n`` tokens), then
    greedy, or top-k, top-p, min-p, temperature and a seeded draw, which depends on the seed
    and the position alone (:func:`~noderuntime.engine.base.draw_seed`).
    """

    def __init__(
        self,
        params: Sampling,
        history: Sequence[int] = (),
        *,
        generated: Sequence[int] = (),
        live: set[int] | None = None,
    ) -> None:
        self.params = params
        self.history: list[int] = [int(t) for t in (*history, *generated)]
        self._live = live
        if live is not None:
            live.add(id(self))

    def pick(self, logits: np.ndarray, position: int) -> int:
        """Choose the token after ``position`` from ``logits`` (float32 [n_vocab]) and remember it."""
        p = self.params
        row = logits.astype(np.float64)
        for token, bias in p.logit_bias:
            row[token] += bias
        if (p.repeat_penalty, p.frequency_penalty, p.presence_penalty) != (1.0, 0.0, 0.0) and self.history:
            recent = self.history[-p.penalty_last_n :] if p.penalty_last_n > 0 else self.history
            tokens, counts = np.unique(np.asarray(recent), return_counts=True)
            values = row[tokens]
            values = np.where(values > 0, values / p.repeat_penalty, values * p.repeat_penalty)
            row[tokens] = values - counts * p.frequency_penalty - p.presence_penalty
        if p.temperature <= 0.0:
            token = int(np.argmax(row))
        else:
            keep = np.ones(row.shape, dtype=bool)
            if 0 < p.top_k < row.size:
                keep[np.argsort(row)[: row.size - p.top_k]] = False
            probs = np.exp(row - row[keep].max()) * keep
            probs /= probs.sum()
            if p.top_p < 1.0:
                order = np.argsort(-probs)
                cut = int(np.searchsorted(np.cumsum(probs[order]), p.top_p)) + 1
                keep[order[cut:]] = False
            if p.min_p > 0.0:
                keep &= probs >= p.min_p * probs[keep].max()
            scaled = np.where(keep, row / p.temperature, -np.inf)
            final = np.exp(scaled - scaled.max())
            final /= final.sum()
            rng = np.random.default_rng(draw_seed(p.seed, position))
            token = int(rng.choice(row.size, p=final))
        self.history.append(token)
        return token

    def close(self) -> None:
        """Nothing to free but its place in the engine's count (the batcher closes every session's sampler)."""
        if self._live is not None:
            self._live.discard(id(self))


@attrs.define
class _SequenceCache:
    keys: torch.Tensor  # [n_layers, n_kv, capacity, head_dim]
    values: torch.Tensor
    length: int = 0


class TorchEngine:
    """One loaded layer range of a Transformers Llama, Qwen3 or Qwen3-MoE model and its per-sequence caches."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        recipe: TorchRecipe,
        layers: LayerRange | None = None,
        *,
        expected_fingerprint: str | None = None,
        output_hidden: bool = False,
    ) -> None:
        """Load ``layers`` (all when ``None``); the other arguments mean what they mean for ``ShardEngine``."""
        self.recipe = recipe
        self.info = inspect(model_dir)
        if expected_fingerprint is not None and expected_fingerprint != self.info.fingerprint:
            raise EngineError(f"{model_dir} has fingerprint {self.info.fingerprint}, not {expected_fingerprint}")
        if layers is None:
            layers = self.info.layer_range
        try:
            layers.check_within(self.info.n_layer)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        self.layers = layers
        self.is_head = layers.start == 0
        self.is_tail = layers.end == self.info.n_layer
        self.n_embd = self.info.n_embd
        self.n_vocab = self.info.n_vocab
        self.output_hidden = output_hidden and self.is_tail
        config: Any = _config(Path(model_dir))
        self.config = config
        self.architecture = _ARCHITECTURES[config.model_type]
        self.n_head = int(config.num_attention_heads)
        self.n_kv = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or self.n_embd // self.n_head)
        torch.set_num_threads(recipe.n_threads)
        self._caches: dict[int, _SequenceCache] = {}
        self._live_samplers: set[int] = set()
        self._closed = False
        self._load(Path(model_dir), config)

    def _wanted(self, name: str) -> str | None:
        """The local module path of checkpoint tensor ``name``, or None when another shard holds it."""
        if name.startswith("model.layers."):
            index_text, _, rest = name[len("model.layers.") :].partition(".")
            index = int(index_text)
            return f"blocks.{index - self.layers.start}.{rest}" if index in self.layers else None
        if name == "model.embed_tokens.weight":
            tied = self.is_tail and bool(self.config.tie_word_embeddings)
            return "embed.weight" if self.is_head or tied else None
        if name == "model.norm.weight":
            return "norm.weight" if self.is_tail else None
        if name == "lm_head.weight":
            return "lm_head.weight" if self.is_tail else None
        return None

    def _load(self, directory: Path, config: PretrainedConfig) -> None:
        from safetensors import safe_open

        state: dict[str, torch.Tensor] = {}
        for file in _weight_files(directory):
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                        local = self._wanted(name)
                        if local is not None:
                            state[local] = f.get_tensor(name)
            except Exception as exc:  # noqa: BLE001 - SafetensorError derives from Exception only
                raise EngineError(f"{file} cannot be read as safetensors: {exc}") from None
        if not state:
            raise EngineError(f"{directory} holds no tensors of layers {self.layers}")
        self.dtype = next(iter(state.values())).dtype
        if self.dtype not in _NAMES:
            raise EngineError(f"{directory}: unsupported weight dtype {self.dtype}")
        # modules are built without memory and take the file's tensors as they are
        with torch.device("meta"):
            arch = self.architecture
            self.blocks = torch.nn.ModuleList(arch.block(config, i) for i in range(*attrs.astuple(self.layers)))
            self.norm = arch.norm(self.n_embd, eps=config.rms_norm_eps) if self.is_tail else None
        for offset in range(len(self.layers)):
            if not any(k.startswith(f"blocks.{offset}.") for k in state):
                raise EngineError(f"{directory} lacks the weights of layer {self.layers.start + offset}")
        try:
            self.blocks.load_state_dict(
                {k[len("blocks.") :]: v for k, v in state.items() if k.startswith("blocks.")}, strict=True, assign=True
            )
        except RuntimeError as exc:  # missing, unexpected or misshapen weights for the config
            raise EngineError(f"{directory}: the weights do not fit its config.json: {exc}") from None
        self.embed = state.get("embed.weight")
        if self.is_head and self.embed is None:
            raise EngineError(f"{directory} lacks model.embed_tokens.weight")
        if self.norm is not None:
            if "norm.weight" not in state:
                raise EngineError(f"{directory} lacks model.norm.weight")
            self.norm.load_state_dict({"weight": state["norm.weight"]}, assign=True)
        self.lm_head = state.get("lm_head.weight", self.embed if self.is_tail else None)
        if self.is_tail and self.lm_head is None:
            raise EngineError(f"{directory} lacks lm_head.weight (and the embeddings are not tied)")
        self.rotary = self.architecture.rotary(config)
        self.blocks.eval()
        self._weight_bytes = sum(t.numel() * t.element_size() for t in state.values())

    @property
    def quant(self) -> str:
        """The weights' precision name (``F32``, ``BF16``, ``F16``)."""
        return _NAMES[self.dtype]

    # --- running

    def _cache(self, seq_id: int, needed: int) -> _SequenceCache:
        """The cache of ``seq_id``, grown to hold ``needed`` positions (the caller checked the context)."""
        cache = self._caches.get(seq_id)
        capacity = 0 if cache is None else cache.keys.shape[2]
        if needed > capacity:
            # grow by doubling so a long generation copies its cache O(log n) times
            new_capacity = min(self.recipe.n_ctx_per_seq, max(needed, 2 * capacity, 64))
            shape = (len(self.layers), self.n_kv, new_capacity, self.head_dim)
            keys, values = torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)
            if cache is not None:
                keys[:, :, : cache.length] = cache.keys[:, :, : cache.length]
                values[:, :, : cache.length] = cache.values[:, :, : cache.length]
                cache.keys, cache.values = keys, values
            else:
                cache = self._caches[seq_id] = _SequenceCache(keys, values)
        assert cache is not None
        return cache

    def run(
        self,
        rows: Rows,
        *,
        samplers: Mapping[int, TorchSampler] | None = None,
        want_logits: bool = False,
        scores: Mapping[int, tuple[int, int]] | None = None,
    ) -> StepResult:
        """Run one batch. Each sequence's rows must continue its cache at consecutive positions.

        ``scores``: as :meth:`ShardEngine.run` takes them.
        """
        if self._closed:
            raise EngineError("engine is closed")
        n = len(rows)
        if not 0 < n <= self.recipe.n_batch:
            raise EngineError(f"batch of {n} rows; this engine takes 1 to {self.recipe.n_batch}")
        if np.any(rows.seq_ids < 0) or np.any(rows.seq_ids >= self.recipe.n_seq_max):
            raise EngineError(f"sequence ids must lie in [0, {self.recipe.n_seq_max})")
        if self.is_head:
            if rows.tokens is None:
                raise EngineError("the head shard takes token ids")
            if np.any(rows.tokens < 0) or np.any(rows.tokens >= self.n_vocab):
                raise EngineError(f"token ids must lie in [0, {self.n_vocab})")
        elif rows.hidden is None or rows.hidden.shape != (n, self.n_embd):
            raise EngineError(f"shard {self.layers} takes hidden rows of shape ({n}, {self.n_embd})")
        started = time.perf_counter()
        # every check before any cache grows: a refused batch changes nothing
        spans: list[tuple[int, np.ndarray, int]] = []
        for seq in np.unique(rows.seq_ids).tolist():
            index = np.flatnonzero(rows.seq_ids == seq)
            held = self._caches[seq].length if seq in self._caches else 0
            if not np.array_equal(rows.positions[index], np.arange(held, held + len(index))):
                raise EngineError(f"sequence {seq} holds {held} positions; its rows must continue at {held}, in order")
            if held + len(index) > (context := self.recipe.n_ctx_per_seq):
                raise EngineError(f"sequence {seq} would hold {held + len(index)} positions; the context is {context}")
            spans.append((seq, index, held))
        groups = [(self._cache(seq, held + len(index)), torch.from_numpy(index), held) for seq, index, held in spans]
        with torch.inference_mode():
            if self.is_head:
                assert self.embed is not None and rows.tokens is not None
                h = F.embedding(torch.from_numpy(rows.tokens.astype(np.int64)), self.embed)
            else:
                assert rows.hidden is not None
                h = torch.from_numpy(np.ascontiguousarray(rows.hidden, dtype=np.float32)).to(self.dtype)
            positions = torch.from_numpy(rows.positions.astype(np.int64))[None]
            cos, sin = self.rotary(h[None], positions)
            for local, block in enumerate(self.blocks):
                h = self._block(local, block, h, cos, sin, groups)
            for cache, rows_of_seq, held in groups:
                cache.length = held + len(rows_of_seq)
            hidden = logits = None
            sampled: dict[int, int] = {}
            logprobs: dict[int, TokenLogprob] = {}
            if not self.is_tail:
                hidden = h.float().numpy().copy()
            else:
                assert self.norm is not None and self.lm_head is not None
                normed = self.norm(h)
                if self.output_hidden:
                    hidden = normed.float().numpy().copy()
                out_rows = np.flatnonzero(rows.outputs)
                if len(out_rows) and (want_logits or samplers or scores):
                    all_logits = F.linear(normed[torch.from_numpy(out_rows)], self.lm_head).float().numpy()
                    if want_logits:
                        logits = all_logits.copy()
                    where = {int(r): k for k, r in enumerate(out_rows)}
                    ended: set[int] = set()  # samplers whose draw left their drafts
                    for row, sampler in (samplers or {}).items():
                        if row not in where:
                            raise EngineError(f"row {row} has a sampler but asked for no output")
                        if id(sampler) in ended:
                            continue
                        sampled[row] = sampler.pick(all_logits[where[row]], int(rows.positions[row]))
                        if not draws_to_keep(rows, row, sampled[row]):
                            ended.add(id(sampler))
                        if sampler.params.logprobs:
                            top = sampler.params.top_logprobs
                            logprobs[row] = token_logprob(all_logits[where[row]], sampled[row], top)
                    for row, (token, top) in (scores or {}).items():
                        if row not in where:
                            raise EngineError(f"row {row} is scored but asked for no output")
                        logprobs[row] = token_logprob(all_logits[where[row]], token, top)
        return StepResult(
            hidden=hidden, logits=logits, sampled=sampled, seconds=time.perf_counter() - started, logprobs=logprobs
        )

    def _block(
        self,
        local: int,
        block: Any,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        groups: list[tuple[_SequenceCache, torch.Tensor, int]],
    ) -> torch.Tensor:
        n = h.shape[0]
        attn = block.self_attn
        x = block.input_layernorm(h)
        # the projections of every row of the batch at once: this is what batching buys
        q = attn.q_proj(x).view(n, self.n_head, self.head_dim)
        k = attn.k_proj(x).view(n, self.n_kv, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMS norm of each head before rope
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
        v = attn.v_proj(x).view(n, self.n_kv, self.head_dim).transpose(0, 1)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = torch.empty((self.n_head, n, self.head_dim), dtype=h.dtype)
        for cache, index, held in groups:
            m = len(index)
            end = held + m
            cache.keys[local, :, held:end] = k[0][:, index]
            cache.values[local, :, held:end] = v[:, index]
            # row i of the chunk sees the held positions and the chunk's rows up to itself
            mask = None if m == 1 else torch.ones((m, end), dtype=torch.bool).tril(diagonal=held)
            out[:, index] = F.scaled_dot_product_attention(
                q[:, :, index],
                cache.keys[local, :, :end][None],
                cache.values[local, :, :end][None],
                attn_mask=mask,
                enable_gqa=True,
            )[0]
        h = h + attn.o_proj(out.transpose(0, 1).reshape(n, self.n_head * self.head_dim))
        # a batch of one sequence of n rows: the MoE block routes (batch, seq, hidden)
        mlp: torch.Tensor = block.mlp(block.post_attention_layernorm(h)[None])[0]
        return h + mlp

    def new_sampler(self, params: Sampling, history: Sequence[int] = (), generated: Sequence[int] = ()) -> TorchSampler:
        """A sampler for one session (see :meth:`Engine.new_sampler`)."""
        if params.grammar:
            raise GrammarError("the transformers backend has no grammar sampler: serve structured output from GGUF")
        return TorchSampler(params, history, generated=generated, live=self._live_samplers)

    @property
    def live_samplers(self) -> int:
        """Samplers made by :meth:`new_sampler` and not yet closed."""
        return len(self._live_samplers)

    def remove_sequence(self, seq_id: int) -> None:
        """Drop the cache of ``seq_id``; idempotent."""
        self._caches.pop(seq_id, None)

    def truncate_sequence(self, seq_id: int, keep: int) -> None:
        """Drop the cache of ``seq_id`` from position ``keep`` on."""
        cache = self._caches.get(seq_id)
        if cache is not None:
            cache.length = min(cache.length, max(0, keep))

    def positions(self, seq_id: int) -> tuple[int, int] | None:
        """(first, last) position held for ``seq_id``, or ``None`` when empty."""
        cache = self._caches.get(seq_id)
        if cache is None or cache.length == 0:
            return None
        return 0, cache.length - 1

    def kv_cells_used(self) -> int:
        """Positions held by all sequences together."""
        return sum(c.length for c in self._caches.values())

    def memory(self) -> MemoryReport:
        """Weights and cache bytes (the compute buffers are torch's own, not counted)."""
        kv = sum(c.keys.numel() * c.keys.element_size() * 2 for c in self._caches.values())
        return MemoryReport(self._weight_bytes, kv, 0, self._weight_bytes, kv, 0)  # all in host memory

    def recipe_description(self) -> dict[str, Any]:
        """The recipe plus the weights' precision."""
        return self.recipe.describe(self.quant)

    def close(self) -> None:
        """Free the caches and weights; idempotent."""
        self._closed = True
        self._caches.clear()

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def export_safetensors(gguf_path: Path, out_dir: Path, dtype: str) -> None:
    """Write ``out_dir``: the GGUF model's weights dequantized by Transformers, as safetensors in ``dtype``.

    Config and tokenizer files go beside them, so the directory is a complete
    Transformers model. Written into a temporary directory and renamed, so a crash
    leaves no half-written lane.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise EngineError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs = {"gguf_file": gguf_path.name}
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), dtype=DTYPES[dtype], **kwargs, **_config_gaps(gguf_path)
    )
    from safetensors.torch import save_file

    # Transformers marks a model read from GGUF as "quantized" and will not save it; its
    # tensors are plain floats by now, so write them and a config without that mark
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs).save_pretrained(str(tmp))
    tmp.rename(out_dir)


def cast_safetensors(src: Path, out_dir: Path, dtype: str) -> None:
    """Write ``out_dir``: the safetensors model ``src`` with every floating tensor cast to ``dtype``."""
    from safetensors.torch import load_file, save_file

    if dtype not in DTYPES:
        raise EngineError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix == ".safetensors":
            state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
            save_file(state, str(tmp / path.name), metadata={"format": "pt"})
        elif path.name == "config.json":
            config = json.loads(path.read_text())
            config["dtype"] = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[dtype]
            (tmp / path.name).write_text(json.dumps(config, indent=2) + "\n")
        elif path.is_file():
            shutil.copy2(path, tmp / path.name)
    tmp.rename(out_dir)


def whole_model_logits(model_dir: Path, tokens: Sequence[int], *, threads: int = 2) -> np.ndarray:
    """Logits of every position of ``tokens`` from the whole Transformers model, as Transformers runs it."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir))
    model.eval()
    with torch.inference_mode():
        out = model(torch.tensor([list(tokens)], dtype=torch.long))
    result: np.ndarray = out.logits[0].float().numpy()
    return result


def whole_model_greedy(
    model_dir: Path, prompts: Sequence[Sequence[int]], n: int, *, threads: int = 2
) -> list[list[int]]:
    """``n`` greedy tokens after each prompt, from the whole Transformers model and its own cache."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir))
    model.eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            # a plain argmax loop over Transformers' own cache: `generate` would stop at, or
            # (with a minimum length) suppress, end-of-generation tokens, which a route does not
            step = model(torch.tensor([list(prompt)], dtype=torch.long), use_cache=True)
            tokens: list[int] = []
            while True:
                tokens.append(int(step.logits[0, -1].argmax()))
                if len(tokens) == n:
                    break
                step = model(torch.tensor([[tokens[-1]]]), cache=step.cache, use_cache=True)
            out.append(tokens)
    return out


# Config fields Transformers' GGUF loader does not read for these architectures, as
# (GGUF key suffix, config field): without them it falls back to the config class's
# defaults (Qwen3's head_dim of 128, Qwen3-MoE's expert width of 768) and fails on shapes.
_GGUF_CONFIG_GAPS = {
    "qwen3": (("attention.key_length", "head_dim"),),
    "qwen3moe": (("attention.key_length", "head_dim"), ("expert_feed_forward_length", "moe_intermediate_size")),
}


def _config_gaps(gguf_path: Path) -> dict[str, int]:
    """The config fields of :data:`_GGUF_CONFIG_GAPS`, read from the file."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    arch = str(reader.fields["general.architecture"].contents())
    return {
        field: int(reader.fields[f"{arch}.{key}"].contents())
        for key, field in _GGUF_CONFIG_GAPS.get(arch, ())
        if f"{arch}.{key}" in reader.fields
    }


def transformers_logits(gguf_path: Path, tokens: Sequence[int], *, threads: int = 2) -> np.ndarray:
    """Logits of every position of ``tokens`` from Transformers' own model class for the file.

    The weights come through Transformers' GGUF loader (dequantized to float32), so
    ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` or ``Gemma3ForCausalLM`` compute the
    architecture as Transformers implements it: the independent reference that Gate F's
    cross-implementation check compares a route with. ``gguf_path`` may also be a folder
    that :func:`export_safetensors` wrote in F32: the same weights, without the loader's
    minute of dequantizing in Python.
    """
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    if gguf_path.is_dir():
        model: Any = AutoModelForCausalLM.from_pretrained(str(gguf_path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, **_config_gaps(gguf_path)
        )
    model.eval()
    with torch.inference_mode():
        out = model(torch.tensor([list(tokens)], dtype=torch.long))
    result: np.ndarray = out.logits[0].float().numpy()
    return result
