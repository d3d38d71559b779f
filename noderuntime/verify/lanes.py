"""The Gate A lanes: one source of weights, every precision the comparison needs.

From one GGUF model (the demo model, Q4_1) this makes, once, under the user cache:

- ``gguf-f32``: every tensor dequantized to float32 (the float weights every other lane
  starts from), with the source's metadata unchanged but the file type;
- ``gguf-f16``, ``gguf-q8_0``, ``gguf-q4_k_m``: that file through llama.cpp's own quantizer;
- ``hf-f32``, ``hf-bf16``: the source read by Transformers' GGUF loader (which dequantizes
  with the same block formats) and saved as safetensors with config and tokenizer;
- ``gguf-q4_1``: the source itself.

The two float forms hold the same numbers (``tests/test_lanes.py`` compares them tensor
by tensor), so the lanes differ only in precision and runtime.
"""

from __future__ import annotations

import functools
import io
import shutil
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np

from noderuntime.models import catalogue as models
from noderuntime.models import gguf as ggufio

__all__ = ["LANES", "Lane", "build", "float_copy", "float_gguf", "hf_copy", "lanes_dir"]


@attrs.frozen
class Lane:
    """One artifact of the comparison."""

    name: str
    backend: str  # "llama.cpp" or "transformers"
    precision: str  # F32, BF16, F16, Q8_0, Q4_K_M, Q4_1
    path: Path

    def size_bytes(self) -> int:
        """Bytes on disk (all weight files of a directory)."""
        if self.path.is_dir():
            return sum(p.stat().st_size for p in self.path.glob("*.safetensors"))
        return self.path.stat().st_size


# name -> (backend, precision); the reference lane first
LANES: dict[str, tuple[str, str]] = {
    "hf-f32": ("transformers", "F32"),
    "hf-bf16": ("transformers", "BF16"),
    "gguf-f32": ("llama.cpp", "F32"),
    "gguf-f16": ("llama.cpp", "F16"),
    "gguf-q8_0": ("llama.cpp", "Q8_0"),
    "gguf-q4_k_m": ("llama.cpp", "Q4_K_M"),
    "gguf-q4_1": ("llama.cpp", "Q4_1"),
}


def lanes_dir(source: Path) -> Path:
    """Where the lanes of ``source`` live: keyed by its name and contents, so a file rewritten
    with other weights (a random-weight model of the same shape) never meets another's lanes."""
    stat = source.stat()
    return models.models_dir().parent / "lanes" / f"{source.stem}-{_digest(source, stat.st_size, stat.st_mtime_ns)}"


@functools.lru_cache(maxsize=16)
def _digest(source: Path, size: int, mtime_ns: int) -> str:
    # hashed once a process for each version of a file: the lanes of one model are asked for often
    return models.sha256_file(source)[:16]


def float_gguf(source: Path, out: Path) -> None:
    """Write ``out``: ``source`` with every tensor dequantized to float32 (metadata kept, file type F32)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    parsed = ggufio.read(source)
    fields = [f.raw if f.key != "general.file_type" else ggufio.uint32_field(f.key, 0) for f in parsed.fields.values()]
    if "general.file_type" not in parsed.fields:
        fields.append(ggufio.uint32_field("general.file_type", 0))
    f32 = int(GGMLQuantizationType.F32)
    tensors: list[tuple[ggufio.TensorInfo, io.BytesIO]] = []
    with source.open("rb") as f:
        for info in parsed.tensors:
            f.seek(info.offset)
            raw = np.frombuffer(f.read(info.n_bytes), dtype=np.uint8)
            # gguf's dequantize takes rows of blocks: shape (rows, bytes per row)
            rows = raw.reshape(-1, info.n_bytes // int(np.prod(info.shape[1:], dtype=np.int64)))
            values = dequantize(rows, GGMLQuantizationType(info.ggml_type)).astype(np.float32, copy=False)
            data = values.tobytes()
            tensors.append((ggufio.TensorInfo(info.name, info.shape, f32, 0, len(data)), io.BytesIO(data)))
    partial = out.with_name(out.name + ".partial")
    ggufio.write(partial, fields, tensors, alignment=parsed.alignment)
    partial.rename(out)


def float_copy(source: Path, *, root: Path | None = None) -> Path:
    """``source`` dequantized to float32 by :func:`float_gguf`, made once under the lanes' cache.

    The Gate A lane ``gguf-f32`` of ``source`` is this file.
    """
    root = root or lanes_dir(source)
    path = root / "gguf-f32.gguf"
    # one maker at a time per lanes folder (two benchmarks, a benchmark and a test): two would
    # write the same ``.partial`` file, or one would remove a safetensors folder the other
    # is writing; float_gguf renames into place
    models.make_once(root, path.exists, lambda: float_gguf(source, path))
    return path


def hf_copy(source: Path, *, root: Path | None = None) -> Path:
    """``source`` read by Transformers' GGUF loader and saved as F32 safetensors, made once under
    the lanes' cache (the Gate A lane ``hf-f32`` of ``source``)."""
    from noderuntime.engine import torch_backend as torchengine  # torch loads only for this

    root = root or lanes_dir(source)
    path = root / "hf-f32"

    def make() -> None:
        shutil.rmtree(path, ignore_errors=True)
        torchengine.export_safetensors(source, path, "F32")

    models.make_once(root, (path / "config.json").exists, make)
    return path


def build(source: Path, *, root: Path | None = None, say: Callable[[str], None] = print) -> dict[str, Lane]:
    """Make every lane of ``source`` that is not already made; return them all by name."""
    from noderuntime.engine import llama as engine

    root = root or lanes_dir(source)
    root.mkdir(parents=True, exist_ok=True)
    lanes: dict[str, Lane] = {}
    for name, (backend, precision) in LANES.items():
        if name == "gguf-q4_1":
            path = source
        elif backend == "transformers":
            path = root / name
        else:
            path = root / f"{name}.gguf"
        lanes[name] = Lane(name, backend, precision, path)
    base = lanes["gguf-f32"].path
    if not base.exists():
        say(f"lanes: dequantizing {source.name} to float32")
        float_copy(source, root=root)
    for name in ("gguf-f16", "gguf-q8_0", "gguf-q4_k_m"):
        lane = lanes[name]

        def quantize(lane: Lane = lane) -> None:
            say(f"lanes: quantizing to {lane.precision} with llama.cpp")
            partial = lane.path.with_name(lane.path.name + ".partial")
            engine.quantize(base, partial, lane.precision)
            partial.rename(lane.path)

        models.make_once(root, lane.path.exists, quantize)
    f32, bf16 = lanes["hf-f32"].path, lanes["hf-bf16"].path
    if not (f32 / "config.json").exists():
        say("lanes: saving F32 safetensors through Transformers' GGUF loader")
        hf_copy(source, root=root)

    def cast() -> None:
        from noderuntime.engine import torch_backend as torchengine

        say("lanes: casting them to BF16")
        shutil.rmtree(bf16, ignore_errors=True)
        torchengine.cast_safetensors(f32, bf16, "BF16")

    models.make_once(root, (bf16 / "config.json").exists, cast)
    return lanes
