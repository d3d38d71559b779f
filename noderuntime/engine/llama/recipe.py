"""How a shard runs: the :class:`Recipe` (threads, context, batch, KV type, device, flash
attention), its published description and the fingerprint every hop of a route shares."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

import attrs

from noderuntime.engine import backends
from noderuntime.engine.llama.binding import build_info
from noderuntime.engine.llama.devices import kernel_class

__all__ = [
    "KV_TYPES",
    "MAX_BATCH",
    "MAX_CONTEXT",
    "MAX_THREADS",
    "FlashAttn",
    "KvType",
    "Recipe",
    "default_flash_attn",
    "flash_attn_choice",
]

FlashAttn = Literal["on", "off"]


def default_flash_attn(device: str, kv_type: KvType = "f16") -> FlashAttn:
    """Flash attention as a node runs it on ``device`` unless told: on for the CPU, off on a GPU.

    Off with a float32 KV cache: llama.cpp's flash attention casts float32 keys and values
    to f16 at every step, which would undo what the float32 cache is for.
    """
    return "on" if device == "cpu" and kv_type != "f32" else "off"


def flash_attn_choice(choice: str, device: str = "cpu") -> FlashAttn:
    """A ``--flash-attn`` choice (``on``, ``off``, or ``auto``: the device's default) as a recipe takes it."""
    if choice == "auto":
        return default_flash_attn(device)
    if choice == "on":
        return "on"
    if choice == "off":
        return "off"
    raise ValueError(f"flash attention is 'on', 'off' or 'auto', not {choice!r}")


KvType = Literal["f16", "f32"]
KV_TYPES = {"f16": 1, "f32": 0}  # ggml_type values
MAX_THREADS = 1024
MAX_CONTEXT = 1 << 28  # KV cells of all sequences together: far beyond memory, well inside int32
MAX_BATCH = 1 << 16


@attrs.frozen
class Recipe:
    """How a shard runs. Two shards agree numerically only when their recipes match."""

    n_threads: int = 2
    n_ctx_per_seq: int = 2048
    n_seq_max: int = 8
    n_batch: int = 512
    n_ubatch: int = 512
    use_mmap: bool = True
    # llama.cpp's CPU repack (Q4_0, Q4_K, IQ4_NL, Q8_0 weights re-laid for its gemm) runs
    # each full group of 4 batch rows through a gemm kernel and the rest through a gemv
    # kernel whose sums differ in the last bits, so a row's result would depend on how
    # many rows share its tick. Off keeps a session's output independent of who else is
    # batched (tests/test_batch_invariance.py on Gemma 3 Q4_K_M fails with it on).
    repack: bool = False
    # f16 as llama.cpp defaults; f32 when a float32 route must match a float32 reference
    # (Gate F's cross-implementation check: f16 keys alone move logits by up to 0.3)
    kv_type: KvType = "f16"
    # where the layers and their KV live: "cpu", or one GPU as "<backend>:<index>" ("vulkan:0",
    # "cuda:0", "hip:0", "metal:0"); a GPU needs its backend's build loaded (engine.backends)
    device: str = "cpu"
    # on a GPU, how many local layers it holds, counted back from the end of the range as
    # llama.cpp counts; None: all of them, and the output layer. Always 0 on the CPU.
    gpu_layers: int | None = None
    # Flash attention: on for the CPU, as llama-server runs it (auto there): decode steps are
    # faster (docs/performance.md), and patch 0008 keeps a row's result independent of its
    # batch-mates, of how its prompt is cut into chunks and of the thread count, as without
    # it. Off on a GPU until measured there, and with a float32 KV cache (default_flash_attn).
    # After ``device`` and ``kv_type``, whose defaults it follows.
    flash_attn: FlashAttn = attrs.field(
        default=attrs.Factory(lambda self: default_flash_attn(self.device, self.kv_type), takes_self=True)
    )
    # One KV stream per sequence (False) keeps a session's attention sums independent of
    # who else is batched. True puts every sequence in one stream, as llama-server does:
    # a batch may then mix prefill and decode rows, and a session's output depends in its
    # low bits on the others. Only benchmarks.invariance sets it, to measure what the
    # guarantee costs; nodes always run False.
    kv_unified: bool = False

    def __attrs_post_init__(self) -> None:
        # llama.cpp takes these as 32-bit integers, and ctypes truncates silently: an n_ctx of
        # 2**32 reads as 0 there, which means "the model's own context", not what leases promise
        if not 1 <= self.n_threads <= MAX_THREADS:
            raise ValueError(f"n_threads must be between 1 and {MAX_THREADS}")
        if self.n_ctx_per_seq < 256 or self.n_ctx_per_seq % 256:
            raise ValueError("n_ctx_per_seq must be a positive multiple of 256 (llama.cpp pads to 256)")
        if not 1 <= self.n_seq_max <= 256:
            raise ValueError("n_seq_max must be between 1 and 256")
        if self.n_ctx_per_seq * self.n_seq_max > MAX_CONTEXT:
            raise ValueError(f"n_ctx_per_seq x n_seq_max must be at most {MAX_CONTEXT} cells")
        if self.n_ubatch < 1 or self.n_batch < self.n_ubatch or self.n_batch > MAX_BATCH:
            raise ValueError(f"need 1 <= n_ubatch <= n_batch <= {MAX_BATCH}")
        if self.flash_attn not in ("on", "off"):
            raise ValueError("flash_attn must be 'on' or 'off'")
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}")
        if self.kv_type == "f32" and self.flash_attn == "on":
            # measured on Gate F's float32 Qwen3-MoE route: mean KL 1.5e-2 against
            # Transformers with it on, 1.6e-9 with it off
            raise ValueError(
                "flash attention casts a float32 KV cache to f16 at every step: use it off with kv_type f32"
            )
        backends.parse_device(self.device)
        if self.gpu_layers is not None and (self.gpu_layers < 0 or (self.device == "cpu" and self.gpu_layers)):
            raise ValueError("gpu_layers must be None or a count >= 0 of layers, and 0 on the cpu device")

    def describe(self, quant: str) -> dict[str, Any]:
        """The recipe as published: kernels, quant, threads, backend, device, attention, ubatch."""
        info = build_info()
        return {
            "llama_cpp_commit": info["llama_cpp_commit"],
            "patch_hash": info["patch_hash"],
            "quant": quant,
            "threads": self.n_threads,
            "backend": info["backend"],
            "device": self.device,
            "gpu_layers": 0 if self.device == "cpu" else ("all" if self.gpu_layers is None else self.gpu_layers),
            "flash_attn": self.flash_attn,
            "n_ubatch": self.n_ubatch,
            "repack": self.repack,
            "kv_type": self.kv_type,
            "kernel_class": kernel_class(self.device),
            # only when set: every recipe nodes run leaves it out, so their fingerprints stay
            **({"kv_unified": True} if self.kv_unified else {}),
        }

    def fingerprint(self, quant: str) -> str:
        """Short stable hash of what every hop of a route must share; it travels in every frame.

        Threads are left out: they are each owner's choice and reported in :meth:`describe`,
        but they do not change a shard's interface (only, in corner cases, low-order bits).
        So is the device's index: which of a node's GPUs runs a shard is its owner's choice,
        the kind of device is not. On the CPU the device adds nothing to the backend, and
        leaving it out keeps CPU fingerprints what they were before devices existed.
        """
        shared = {k: v for k, v in self.describe(quant).items() if k != "threads"}
        if self.device == "cpu":
            del shared["device"], shared["gpu_layers"]
        else:
            shared["device"] = backends.parse_device(self.device)[0]
        blob = json.dumps(shared, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
