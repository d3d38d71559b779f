"""Random-weight GGUF models (Llama, Qwen3, Qwen3-MoE), written directly in their stored form.

Used by tests (tiny models in milliseconds) and to build models larger than one node
(multi-GB in seconds): each tensor is generated in bounded chunks of rows straight into
its quantized blocks, so no float copy of the model ever exists. The text such a model
writes is meaningless; its speed, memory and architecture are real.

A Qwen3-family file carries what the real ones do: an explicit head size
(``key_length``/``value_length``, not ``n_embd / n_head``), per-head Q and K norms, a
byte-level BPE vocabulary with Qwen's special tokens at Qwen's ids (for the real vocab
size), Qwen3's chat template and, for MoE, a router and stacked expert tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

import attrs
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, LlamaFileType, TokenType

_CHUNK_BYTES = 32 << 20
QUANTS = {
    "F32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "F16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "Q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
}
ARCHITECTURES = ("llama", "qwen3", "qwen3moe")
_LLAMA_SPECIALS = ("<unk>", "<s>", "</s>")

# Qwen's added tokens in id order from 151643; the <|...|> ones are control tokens, the
# others are matched as text by the tokenizer but are ordinary output (user-defined)
QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
_QWEN_FIRST_SPECIAL = 151643  # where Qwen's vocabulary puts them
_MIN_BPE_VOCAB = 256 + len(QWEN_SPECIALS) + 26


@attrs.frozen
class ModelShape:
    """Hyper-parameters of a Llama, Qwen3 or Qwen3-MoE model."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    arch: str = "llama"
    head_dim: int = 0  # 0: n_embd // n_head, as Llama derives it
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_expert: int = 0
    context_length: int = 4096
    rope_freq_base: float | None = None  # None: the architecture's usual base
    tied_output: bool = True

    def __attrs_post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.arch!r}; choose one of {', '.join(ARCHITECTURES)}")
        if min(self.n_layer, self.n_embd, self.n_ff, self.n_head, self.n_head_kv) <= 0:
            raise ValueError("every dimension must be positive")
        if self.n_head % self.n_head_kv:
            raise ValueError("heads must divide by kv-heads")
        if self.head_dim < 0 or (self.head_dim == 0 and self.n_embd % self.n_head):
            raise ValueError("n_embd must divide by heads, or give the head size")
        if self.head_dim_resolved % 2:
            raise ValueError("the head size must be even (rope rotates pairs)")
        if self.arch == "qwen3moe":
            if self.n_expert <= 0 or self.n_ff_expert <= 0:
                raise ValueError("qwen3moe needs experts and an expert feed-forward length")
            if not 0 < self.n_expert_used <= self.n_expert:
                raise ValueError(f"experts used must be within 1..{self.n_expert}")
        elif self.n_expert or self.n_expert_used or self.n_ff_expert:
            raise ValueError(f"{self.arch} has no experts; use --arch qwen3moe")
        if self.n_vocab < self.min_vocab:
            raise ValueError(f"vocab must hold at least {self.min_vocab} tokens (specials and bytes)")

    @property
    def min_vocab(self) -> int:
        """The smallest vocabulary this architecture's tokenizer can be written with."""
        return len(_LLAMA_SPECIALS) + 256 if self.arch == "llama" else _MIN_BPE_VOCAB

    @property
    def head_dim_resolved(self) -> int:
        """The size of one attention head."""
        return self.head_dim or self.n_embd // self.n_head

    @property
    def n_embd_kv(self) -> int:
        """Width of the K and V projections."""
        return self.head_dim_resolved * self.n_head_kv

    @property
    def rope_base(self) -> float:
        """The rope frequency base written to the file."""
        if self.rope_freq_base is not None:
            return self.rope_freq_base
        return 10000.0 if self.arch == "llama" else 1_000_000.0

    @property
    def is_qwen(self) -> bool:
        """Qwen3 or Qwen3-MoE: Q/K norms, explicit head size, Qwen's tokenizer and template."""
        return self.arch in ("qwen3", "qwen3moe")

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(name, numpy-order shape) of every tensor, in file order."""
        e, f, kv = self.n_embd, self.n_ff, self.n_embd_kv
        q = self.head_dim_resolved * self.n_head
        yield "token_embd.weight", (self.n_vocab, e)
        for i in range(self.n_layer):
            yield f"blk.{i}.attn_norm.weight", (e,)
            yield f"blk.{i}.attn_q.weight", (q, e)
            yield f"blk.{i}.attn_k.weight", (kv, e)
            yield f"blk.{i}.attn_v.weight", (kv, e)
            yield f"blk.{i}.attn_output.weight", (e, q)
            if self.is_qwen:
                yield f"blk.{i}.attn_q_norm.weight", (self.head_dim_resolved,)
                yield f"blk.{i}.attn_k_norm.weight", (self.head_dim_resolved,)
            yield f"blk.{i}.ffn_norm.weight", (e,)
            if self.arch == "qwen3moe":
                x, fe = self.n_expert, self.n_ff_expert
                yield f"blk.{i}.ffn_gate_inp.weight", (x, e)
                yield f"blk.{i}.ffn_gate_exps.weight", (x, fe, e)
                yield f"blk.{i}.ffn_up_exps.weight", (x, fe, e)
                yield f"blk.{i}.ffn_down_exps.weight", (x, e, fe)
            else:
                yield f"blk.{i}.ffn_gate.weight", (f, e)
                yield f"blk.{i}.ffn_up.weight", (f, e)
                yield f"blk.{i}.ffn_down.weight", (e, f)
        yield "output_norm.weight", (e,)
        if not self.tied_output:
            yield "output.weight", (self.n_vocab, e)


# Tiny Qwen3-family shapes for tests and quick lanes, with their features: a head size that is not n_embd / n_head,
# Q/K norms, an untied head (qwen3) or a tied one and 8 experts of which 2 are used (MoE)
TINY_SHAPES: dict[str, ModelShape] = {
    "qwen3": ModelShape(
        arch="qwen3",
        n_layer=4,
        n_embd=64,
        n_ff=128,
        n_head=4,
        n_head_kv=2,
        head_dim=32,
        n_vocab=512,
        context_length=1024,
        tied_output=False,
    ),
    "qwen3moe": ModelShape(
        arch="qwen3moe",
        n_layer=4,
        n_embd=64,
        n_ff=192,
        n_head=4,
        n_head_kv=1,
        head_dim=32,
        n_expert=8,
        n_expert_used=2,
        n_ff_expert=32,
        n_vocab=512,
        context_length=1024,
    ),
}


def qwen3_8b_shape(n_layer: int) -> ModelShape:
    """Qwen3-8B's per-layer shape (4096 wide, 12288 FFN, 32/8 heads of 128, untied) with ``n_layer`` layers."""
    return ModelShape(
        arch="qwen3",
        n_layer=n_layer,
        n_embd=4096,
        n_ff=12288,
        n_head=32,
        n_head_kv=8,
        head_dim=128,
        n_vocab=151936,
        context_length=40960,
        tied_output=False,
    )


def qwen3_30b_a3b_shape(n_layer: int) -> ModelShape:
    """Qwen3-30B-A3B's per-layer shape (2048 wide, 8 of 128 experts of 768, 32/4 heads of 128) with ``n_layer``."""
    return ModelShape(
        arch="qwen3moe",
        n_layer=n_layer,
        n_embd=2048,
        n_ff=6144,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        n_expert=128,
        n_expert_used=8,
        n_ff_expert=768,
        n_vocab=151936,
        context_length=40960,
        tied_output=False,
    )


def _tensor_type(name: str, shape: tuple[int, ...], quant: GGMLQuantizationType) -> GGMLQuantizationType:
    block = GGML_QUANT_SIZES[quant][0]
    # norms and the MoE router stay float, as llama.cpp's quantizer keeps them
    if len(shape) == 1 or shape[-1] % block or "ffn_gate_inp" in name:
        return GGMLQuantizationType.F32
    return quant


# Qwen-family scales, measured on 4- and 36-layer files of 64 and 1024 embd
# (tests/test_gate_f.py checks the deep ones): the layers' writes into the residual
# add up to as much as 18 layers of fan-in-scaled projections at any depth, and the
# Q/K norms sharpen attention as trained models' do. Together the residual keeps its
# token and its position; with plain scales every position of a deep model predicted
# the same 4 tokens, and a tied head copied its input token.
_RESIDUAL_LAYERS = 18
_QK_NORM_GAIN = 3.0


def weight_std(shape: ModelShape, name: str, row_len: int) -> float:
    """The std of one tensor's random weights.

    Llama files keep 0.5/sqrt(fan-in) everywhere (the scales their recorded fingerprints
    and benchmarks were made with). Qwen-family files also scale for depth the
    projections that write into the residual stream, and size the embedding (also the
    tied head) for logits of std about 3.
    """
    std = 0.5 / np.sqrt(row_len)
    if shape.arch == "llama":
        return float(std)
    if name in ("token_embd.weight", "output.weight"):
        return float(3.0 / np.sqrt(shape.n_embd))
    if name.endswith(("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight")):
        return float(std * np.sqrt(_RESIDUAL_LAYERS / shape.n_layer))
    return float(std)


def norm_gain(shape: ModelShape, name: str) -> float:
    """The value every weight of a norm tensor holds."""
    if shape.is_qwen and name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
        return _QK_NORM_GAIN
    return 1.0


def _rows(rng: np.random.Generator, qtype: GGMLQuantizationType, n_rows: int, row_len: int, std: float) -> np.ndarray:
    """``n_rows`` rows of ``row_len`` weights with about the given std, as stored bytes."""
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        dtype = np.float32 if qtype == GGMLQuantizationType.F32 else np.float16
        return rng.normal(0.0, std, size=(n_rows, row_len)).astype(dtype).view(np.uint8)
    n_blocks = n_rows * row_len // 32
    if qtype == GGMLQuantizationType.Q8_0:
        blocks = np.empty((n_blocks, 34), dtype=np.uint8)
        scale = std / 73.3  # uniform int8 in [-127, 127] has std ~73.3
        blocks[:, 2:] = rng.integers(-127, 128, size=(n_blocks, 32), dtype=np.int8).view(np.uint8)
    elif qtype == GGMLQuantizationType.Q4_0:
        blocks = np.empty((n_blocks, 18), dtype=np.uint8)
        scale = std / 4.6  # uniform nibble minus 8 has std ~4.6
        blocks[:, 2:] = rng.integers(0, 256, size=(n_blocks, 16), dtype=np.uint8)
    elif qtype == GGMLQuantizationType.Q4_1:
        # scale, then minimum, then nibbles: a minimum of -7.5 scales centres the weights on zero
        blocks = np.empty((n_blocks, 20), dtype=np.uint8)
        scale = std / 4.6
        blocks[:, 2:4] = np.full((n_blocks, 1), -7.5 * scale, dtype=np.float16).view(np.uint8)
        blocks[:, 4:] = rng.integers(0, 256, size=(n_blocks, 16), dtype=np.uint8)
    else:
        raise ValueError(f"unsupported quant {qtype.name}")
    blocks[:, :2] = np.full((n_blocks, 1), scale, dtype=np.float16).view(np.uint8)
    return blocks.reshape(n_rows, -1)


def _llama_vocab(n_vocab: int) -> tuple[list[bytes], list[float], list[int]]:
    tokens = [s.encode() for s in _LLAMA_SPECIALS] + [f"<0x{b:02X}>".encode() for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    filler = n_vocab - len(tokens)
    tokens += [f"▁t{i}".encode() for i in range(filler)]
    types += [TokenType.NORMAL] * filler
    scores = [0.0] * len(_LLAMA_SPECIALS) + [0.0] * 256 + [-float(i) for i in range(filler)]
    return tokens, scores, [int(t) for t in types]


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest from U+0100 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def _bpe_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str], int]:
    """A byte-level BPE vocabulary: (tokens, types, merges, id of the first special token).

    Bytes first, then merged tokens a tokenizer really produces (a leading-space letter,
    letter pairs, leading-space letter pairs), unreachable fillers, Qwen's specials at
    Qwen's ids when the vocabulary is large enough (else right after the fillers), and
    padding rows after them as real Qwen files have.
    """
    alphabet = _byte_alphabet()
    space = alphabet[ord(" ")]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    candidates = [(space, a) for a in letters] + [(a, b) for a in letters for b in letters]
    candidates += [(space + a, b) for a in letters for b in letters]
    first_special = min(_QWEN_FIRST_SPECIAL, n_vocab - len(QWEN_SPECIALS))
    merges = candidates[: first_special - 256]
    tokens = alphabet + [left + right for left, right in merges]
    tokens += [f"{space}w{i}" for i in range(first_special - len(tokens))]
    types = [int(TokenType.NORMAL)] * len(tokens)
    for text in QWEN_SPECIALS:
        tokens.append(text)
        types.append(int(TokenType.CONTROL if text.startswith("<|") else TokenType.USER_DEFINED))
    pads = n_vocab - len(tokens)
    tokens += [f"[PAD{len(tokens) + i}]" for i in range(pads)]
    types += [int(TokenType.UNUSED)] * pads
    return tokens, types, [f"{left} {right}" for left, right in merges], first_special


def qwen3_chat_template() -> str:
    """Qwen3's chat template (thinking, tools), as its instruct models ship it."""
    return resources.files("noderuntime.models").joinpath("templates/qwen3.jinja").read_text(encoding="utf-8")


def _write_tokenizer(writer: GGUFWriter, shape: ModelShape) -> None:
    if shape.arch == "llama":
        tokens, scores, types = _llama_vocab(shape.n_vocab)
        writer.add_tokenizer_model("llama")
        writer.add_key_value("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        return
    texts, types, merges, first_special = _bpe_vocab(shape.n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(texts)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    end_of_text = first_special + QWEN_SPECIALS.index("<|endoftext|>")
    writer.add_eos_token_id(first_special + QWEN_SPECIALS.index("<|im_end|>"))
    writer.add_pad_token_id(end_of_text)
    writer.add_bos_token_id(end_of_text)
    writer.add_add_bos_token(False)
    writer.add_chat_template(qwen3_chat_template())


def write_model(
    path: str | os.PathLike[str],
    shape: ModelShape,
    *,
    quant: str = "Q8_0",
    embedding_quant: str | None = None,
    seed: int = 0,
    name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    weights: bool = True,
) -> Path:
    """Write a random-weight GGUF of ``shape``; ``progress(done_bytes, total_bytes)`` as it goes.

    ``embedding_quant`` stores the token embedding (also the output with ``tied_output``)
    in another type, as converters often keep it at Q8_0 in a 4-bit file. ``weights=False``
    writes the header alone and leaves the tensor data a hole of its size (a sparse file):
    what the memory planner's dry run reads, for shapes larger than the disk holds, and
    nothing a node can serve.
    """
    for q in (quant, embedding_quant or quant):
        if q not in QUANTS:
            raise ValueError(f"unsupported quant {q!r}; choose one of {', '.join(QUANTS)}")
    qtype, file_type = QUANTS[quant]
    embedding_qtype = QUANTS[embedding_quant or quant][0]
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(tmp, arch=shape.arch, use_temp_file=False)
    writer.add_name(name or f"synthetic-{shape.arch}")
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(2)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.head_dim_resolved)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-5 if shape.arch == "llama" else 1e-6)
    if shape.is_qwen:
        writer.add_key_length(shape.head_dim_resolved)
        writer.add_value_length(shape.head_dim_resolved)
    if shape.arch == "qwen3moe":
        writer.add_expert_count(shape.n_expert)
        writer.add_expert_used_count(shape.n_expert_used)
        writer.add_expert_feed_forward_length(shape.n_ff_expert)
    writer.add_vocab_size(shape.n_vocab)
    _write_tokenizer(writer, shape)

    plan = []
    for tensor_name, tshape in shape.tensors():
        ttype = _tensor_type(tensor_name, tshape, embedding_qtype if tensor_name == "token_embd.weight" else qtype)
        block, type_size = GGML_QUANT_SIZES[ttype]
        row_len = tshape[-1]
        n_rows = int(np.prod(tshape[:-1])) if len(tshape) > 1 else 1
        nbytes = n_rows * (row_len // block) * type_size
        writer.add_tensor_info(tensor_name, tshape, np.dtype(np.float32), nbytes, raw_dtype=ttype)
        plan.append((ttype, n_rows, row_len, nbytes))
    total = sum(p[3] for p in plan)

    rng = np.random.default_rng(seed)
    done = 0
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    fout = writer.fout[0]
    for (tensor_name, _), (ttype, n_rows, row_len, nbytes) in zip(shape.tensors(), plan, strict=True):
        writer.write_padding(fout, fout.tell())
        if not weights:
            fout.seek(nbytes, os.SEEK_CUR)
        elif tensor_name.endswith("norm.weight"):
            np.full(row_len, norm_gain(shape, tensor_name), dtype=np.float32).tofile(fout)
        else:
            row_bytes = nbytes // n_rows
            step = max(1, _CHUNK_BYTES // row_bytes)
            std = weight_std(shape, tensor_name, row_len)
            for first in range(0, n_rows, step):
                chunk = _rows(rng, ttype, min(step, n_rows - first), row_len, std)
                chunk.tofile(fout)
                done += chunk.nbytes
                if progress is not None:
                    progress(done, total)
        writer.write_padding(fout, nbytes)
    fout.truncate()  # a header alone ends in a hole as long as its tensors
    writer.close()
    os.replace(tmp, path)
    return path
