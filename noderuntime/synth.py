"""Random-weight Llama GGUF models, written directly in their stored form.

Used by tests (tiny models in milliseconds) and to build models larger than one node
(multi-GB in seconds): each tensor is generated in bounded chunks of rows straight into
its quantized blocks, so no float copy of the model ever exists. The text such a model
writes is meaningless; its speed and memory are real.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
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
_SPECIALS = ("<unk>", "<s>", "</s>")


@attrs.frozen
class LlamaShape:
    """Hyper-parameters of a Llama-architecture model."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    context_length: int = 4096
    rope_freq_base: float = 10000.0
    tied_output: bool = True

    def __attrs_post_init__(self) -> None:
        if min(self.n_layer, self.n_embd, self.n_ff, self.n_head, self.n_head_kv) <= 0:
            raise ValueError("every dimension must be positive")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError("n_embd must divide by heads and heads by kv-heads")
        if self.n_vocab < len(_SPECIALS) + 256:
            raise ValueError(f"vocab must hold at least {len(_SPECIALS) + 256} tokens (specials and bytes)")

    @property
    def n_embd_kv(self) -> int:
        """Width of the K and V projections."""
        return self.n_embd // self.n_head * self.n_head_kv

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(name, numpy-order shape) of every tensor, in file order."""
        e, f, kv = self.n_embd, self.n_ff, self.n_embd_kv
        yield "token_embd.weight", (self.n_vocab, e)
        for i in range(self.n_layer):
            yield f"blk.{i}.attn_norm.weight", (e,)
            yield f"blk.{i}.attn_q.weight", (e, e)
            yield f"blk.{i}.attn_k.weight", (kv, e)
            yield f"blk.{i}.attn_v.weight", (kv, e)
            yield f"blk.{i}.attn_output.weight", (e, e)
            yield f"blk.{i}.ffn_norm.weight", (e,)
            yield f"blk.{i}.ffn_gate.weight", (f, e)
            yield f"blk.{i}.ffn_up.weight", (f, e)
            yield f"blk.{i}.ffn_down.weight", (e, f)
        yield "output_norm.weight", (e,)
        if not self.tied_output:
            yield "output.weight", (self.n_vocab, e)


def _tensor_type(name: str, shape: tuple[int, ...], quant: GGMLQuantizationType) -> GGMLQuantizationType:
    block = GGML_QUANT_SIZES[quant][0]
    if len(shape) == 1 or shape[-1] % block:
        return GGMLQuantizationType.F32  # norms stay float, as converters keep them
    return quant


def _rows(rng: np.random.Generator, qtype: GGMLQuantizationType, n_rows: int, row_len: int) -> np.ndarray:
    """``n_rows`` rows of ``row_len`` weights with std about 0.5/sqrt(row_len), as stored bytes."""
    std = 0.5 / np.sqrt(row_len)
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


def _vocab(n_vocab: int) -> tuple[list[bytes], list[float], list[int]]:
    tokens = [s.encode() for s in _SPECIALS] + [f"<0x{b:02X}>".encode() for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    filler = n_vocab - len(tokens)
    tokens += [f"▁t{i}".encode() for i in range(filler)]
    types += [TokenType.NORMAL] * filler
    scores = [0.0] * len(_SPECIALS) + [0.0] * 256 + [-float(i) for i in range(filler)]
    return tokens, scores, [int(t) for t in types]


def write_llama(
    path: str | os.PathLike[str],
    shape: LlamaShape,
    *,
    quant: str = "Q8_0",
    embedding_quant: str | None = None,
    seed: int = 0,
    name: str = "synthetic-llama",
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a random-weight Llama GGUF; ``progress(done_bytes, total_bytes)`` as it goes.

    ``embedding_quant`` stores the token embedding (also the output with ``tied_output``)
    in another type, as converters often keep it at Q8_0 in a 4-bit file.
    """
    for q in (quant, embedding_quant or quant):
        if q not in QUANTS:
            raise ValueError(f"unsupported quant {q!r}; choose one of {', '.join(QUANTS)}")
    qtype, file_type = QUANTS[quant]
    embedding_qtype = QUANTS[embedding_quant or quant][0]
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(tmp, arch="llama", use_temp_file=False)
    writer.add_name(name)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(2)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.n_embd // shape.n_head)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.n_vocab)
    tokens, scores, types = _vocab(shape.n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_key_value("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)

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
        if tensor_name.endswith("norm.weight"):
            np.ones(row_len, dtype=np.float32).tofile(fout)
        else:
            row_bytes = nbytes // n_rows
            step = max(1, _CHUNK_BYTES // row_bytes)
            for first in range(0, n_rows, step):
                chunk = _rows(rng, ttype, min(step, n_rows - first), row_len)
                chunk.tofile(fout)
                done += chunk.nbytes
                if progress is not None:
                    progress(done, total)
        writer.write_padding(fout, nbytes)
    writer.close()
    os.replace(tmp, path)
    return path
