"""The shard engine: the only module that imports ``llama_cpp``.

A :class:`ShardEngine` loads one layer range of a GGUF model through the patched
llama.cpp (see ``kernels_patch/``) and runs batches of rows, each row being
(sequence id, position, token id or hidden row, wants output). A non-tail shard
returns the pre-norm residual of every row; the tail returns logits of the rows that
asked for output, and can sample them with per-session llama.cpp sampler chains.

Everything here is synchronous and unlocked: its calls never overlap because one owner
makes them, the node's batcher, which runs batches and probes on the engine's one thread
(:mod:`noderuntime.engine.thread`) and removes KV between them on the event loop's.
``llama_decode`` releases the GIL.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from noderuntime.engine import backends
from noderuntime.engine.backends import BackendMismatchError, NoDeviceError
from noderuntime.engine.base import EngineError, GrammarError, Rows, StepResult, draw_seed, token_logprob
from noderuntime.models import artifacts
from noderuntime.models.artifacts import ArtifactError, ArtifactInfo, LayerRange
from protocol import Sampling, TokenLogprob

__all__ = [
    "EngineError",
    "GrammarError",
    "MemoryReport",
    "PatchMissingError",
    "Recipe",
    "Rows",
    "SamplerChain",
    "ShardEngine",
    "StepResult",
    "Vocab",
    "build_info",
    "check_grammar",
    "describe_device",
    "device_report",
    "json_schema_grammar",
    "quantize",
]

log = logging.getLogger(__name__)

_BUILD_HINT = (
    "build and install it with `python3 kernels_patch/build.py --python <venv>/bin/python --install` "
    "(or run `make test`, which does it)"
)


class PatchMissingError(EngineError):
    """The installed llama-cpp-python lacks the layer-range patch."""


# libgomp's default spin-wait keeps idle OpenMP threads busy for a long while after each
# parallel region; on a small machine those spinning cores are exactly what the event
# loop, the gRPC thread and the other shards of a route need. A short spin keeps
# barriers inside one op fast (whole-model decode got faster too: 100 -> 118 tok/s on
# this 2-core machine) and frees the cores between ops (2-shard route: 47 -> 79 tok/s).
# It must be set before libgomp loads; an operator's own value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")


def _import_llama_cpp() -> tuple[Any, dict[str, Any]]:
    try:
        import llama_cpp
    except ImportError as exc:
        raise PatchMissingError(f"llama-cpp-python is not installed ({exc}); {_BUILD_HINT}") from None
    lib = llama_cpp.llama_cpp._lib
    if not hasattr(lib, "llama_model_shard_range") or not hasattr(lib, "llama_context_memory_totals"):
        raise PatchMissingError(
            f"the installed llama-cpp-python {llama_cpp.__version__} is a stock build without layer-range "
            f"execution; {_BUILD_HINT}"
        )
    import llama_cpp._ggml  # the ggml library, for its device list

    marker_path = Path(llama_cpp.__file__).with_name("_noderuntime_patch.json")
    marker: dict[str, Any] = {}
    if marker_path.exists():
        marker = json.loads(marker_path.read_text())
    lib.llama_model_shard_range.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_int32),
        ctypes.POINTER(ctypes.c_int32),
    ]
    lib.llama_model_shard_range.restype = ctypes.c_bool
    size_p = ctypes.POINTER(ctypes.c_size_t)
    for name in ("llama_context_memory_totals", "llama_context_memory_host"):
        function = getattr(lib, name)
        function.argtypes, function.restype = [ctypes.c_void_p, size_p, size_p, size_p], None
    return llama_cpp, marker


llama_cpp, _PATCH_MARKER = _import_llama_cpp()
_lib = llama_cpp.llama_cpp._lib

# ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous line)
_LOG_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_llama_log = logging.getLogger("noderuntime.llama_cpp")


_last_level = [logging.DEBUG]
# set on a thread while it asks a grammar about one token: a refusal is then an answer, not
# the "allows no token" warning llama.cpp gives when it refuses every candidate offered
_quiet = threading.local()


@llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
def _on_llama_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # llama.cpp is chatty at INFO; keep its warnings and errors, the rest at debug
    if getattr(_quiet, "on", False):
        return
    py_level = _last_level[0] if level == 5 else _LOG_LEVELS.get(level, logging.DEBUG)
    _last_level[0] = py_level
    if _llama_log.isEnabledFor(py_level):
        message = text.decode("utf-8", "replace").rstrip()
        if message:
            _llama_log.log(py_level, "%s", message)


llama_cpp.llama_log_set(_on_llama_log, ctypes.c_void_p(0))
llama_cpp.llama_backend_init()


def build_info() -> dict[str, Any]:
    """What the loaded kernels are: llama.cpp commit, patch hash, wheel version, backend."""
    return {
        "llama_cpp_python": importlib.metadata.version("llama_cpp_python"),
        "llama_cpp_commit": _PATCH_MARKER.get("llama_cpp_commit", "unknown"),
        "patch_hash": _PATCH_MARKER.get("patch_hash", "unknown"),
        "cmake_args": _PATCH_MARKER.get("cmake_args", []),
        # the CPU wheel's marker predates backends and names none
        "backend": _PATCH_MARKER.get("backend", "cpu"),
    }


def _bind_ggml_devices() -> Any:
    # ggml's device registry (ggml-backend.h), which llama-cpp-python does not bind
    ggml = llama_cpp._ggml.libggml
    ptr, size_p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
    for name, argtypes, restype in (
        ("ggml_backend_dev_count", [], ctypes.c_size_t),
        ("ggml_backend_dev_get", [ctypes.c_size_t], ptr),
        ("ggml_backend_dev_name", [ptr], ctypes.c_char_p),
        ("ggml_backend_dev_description", [ptr], ctypes.c_char_p),
        ("ggml_backend_dev_type", [ptr], ctypes.c_int),
        ("ggml_backend_dev_memory", [ptr, size_p, size_p], None),
        ("ggml_backend_dev_backend_reg", [ptr], ptr),
        ("ggml_backend_reg_name", [ptr], ctypes.c_char_p),
    ):
        function = getattr(ggml, name)
        function.argtypes, function.restype = argtypes, restype
    return ggml


_ggml = _bind_ggml_devices()


_MAX_CORES = 512  # GGML_MAX_N_THREADS: the cores a ggml threadpool's mask can name


class _ThreadpoolParams(ctypes.Structure):
    # struct ggml_threadpool_params (ggml.h)
    _fields_ = [
        ("cpumask", ctypes.c_bool * _MAX_CORES),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),  # enum ggml_sched_priority
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


def _bind_threadpools() -> tuple[Any, Any]:
    # ggml's CPU threadpool (ggml-cpu.h) and llama_attach_threadpool, which llama-cpp-python
    # does not bind; the CPU backend's library sits beside ggml's in every build
    ptr = ctypes.c_void_p
    base = llama_cpp._ggml.libggml_base_path
    ggml_base = ctypes.CDLL(str(base / "libggml-base.so"))
    ggml_cpu = ctypes.CDLL(str(base / "libggml-cpu.so"))
    ggml_base.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
    ggml_base.ggml_threadpool_params_default.restype = _ThreadpoolParams
    ggml_cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(_ThreadpoolParams)]
    ggml_cpu.ggml_threadpool_new.restype = ptr
    ggml_cpu.ggml_threadpool_free.argtypes = [ptr]
    ggml_cpu.ggml_threadpool_free.restype = None
    _lib.llama_attach_threadpool.argtypes = [ptr, ptr, ptr]
    _lib.llama_attach_threadpool.restype = None
    return ggml_base, ggml_cpu


_ggml_base, _ggml_cpu = _bind_threadpools()


def _pinned_threadpool(n_threads: int, cores: Sequence[int]) -> Any:
    """A ggml threadpool whose ``n_threads`` threads each keep to one of ``cores``, in order.

    With OpenMP, ggml pins every thread of the team to its core at the start of each graph
    (the calling thread too, which :meth:`ShardEngine.run` then lets go).
    """
    if len(cores) < n_threads or min(cores) < 0 or max(cores) >= _MAX_CORES:
        raise EngineError(f"cannot pin {n_threads} threads one to a core on cores {list(cores)}")
    params = _ggml_base.ggml_threadpool_params_default(n_threads)
    for core in cores[:n_threads]:
        params.cpumask[core] = True
    params.strict_cpu = True
    pool = _ggml_cpu.ggml_threadpool_new(ctypes.byref(params))
    if not pool:
        raise EngineError(f"ggml could not make a threadpool of {n_threads} threads on cores {list(cores)}")
    return pool


def pinned_cores(n_threads: int, cores: Sequence[int]) -> tuple[int, ...] | None:
    """The cores to pin a CPU team of ``n_threads`` to (one each), or ``None`` to leave it free.

    Free, the kernel may stack both threads of a 2-thread team on one core for a while when
    another process wakes on the other: the thread left there spins at the barrier its
    partner, waiting behind it, has not reached, and a 6 ms decode step took 20 ms at the
    90th percentile beside a process busy 1.2 ms in every 7 (SmolLM2, AMD EPYC, 2 vCPUs;
    9 ms pinned). Pinned only when the team has a thread for each of ``cores``: with cores
    to spare the kernel has somewhere else to put a thread, and a team of one has no
    barrier to wait at.
    """
    if n_threads < 2 or n_threads != len(cores) or max(cores) >= _MAX_CORES:
        return None
    if not hasattr(os, "sched_setaffinity"):  # ggml pins on Linux and Windows; this code restores on Linux
        return None
    return tuple(cores)


_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}  # enum ggml_backend_dev_type


def _device_handles() -> list[tuple[Any, str, str]]:
    """(handle, name, registry name) of every device this build of ggml sees."""
    found = []
    for i in range(_ggml.ggml_backend_dev_count()):
        dev = _ggml.ggml_backend_dev_get(i)
        name = _ggml.ggml_backend_dev_name(dev).decode()
        registry = _ggml.ggml_backend_reg_name(_ggml.ggml_backend_dev_backend_reg(dev)).decode()
        found.append((dev, name, registry))
    return found


def device_report() -> list[dict[str, Any]]:
    """The devices the loaded build sees, as JSON-able dicts: what ``backends`` asks in a subprocess."""
    report = []
    for dev, name, registry in _device_handles():
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        _ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        report.append(
            {
                "name": name,
                "description": _ggml.ggml_backend_dev_description(dev).decode("utf-8", "replace"),
                "kind": _DEVICE_KINDS.get(_ggml.ggml_backend_dev_type(dev), "unknown"),
                "registry": registry,
                "memory_free": free.value,
                "memory_total": total.value,
            }
        )
    return report


def _find_device(device: str) -> Any:
    """The ggml device handle for ``"vulkan:0"`` and the like; typed errors when it is not here."""
    kind, index = backends.parse_device(device)
    loaded = build_info()["backend"]
    if loaded != kind:
        raise BackendMismatchError(
            f"device {device} needs the {kind} build of llama-cpp-python, and this process loaded the {loaded} "
            f"build: run it with noderuntime.engine.backends.runtime({kind!r}) (its folder first on PYTHONPATH)"
        )
    own = [dev for dev, _name, registry in _device_handles() if registry in backends.REGISTRY_NAMES[kind]]
    if index >= len(own):
        raise NoDeviceError(f"device {device} is not here: the {kind} build sees {len(own)} {kind} device(s)")
    return own[index]


def device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of ``device``'s own memory, as its backend reports them; typed errors as
    :func:`describe_device`. Not asked of the CPU, whose memory a node plans with ``--memory-limit``."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    _ggml.ggml_backend_dev_memory(_find_device(device), ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


# switches llama.cpp's system info lists that are no kernel: how threads wait, not what they compute
_NOT_KERNELS = frozenset({"OPENMP"})


def kernel_class(device: str = "cpu") -> str:
    """The drift class of this build on ``device``: what decides a shard's bits beyond its recipe's settings.

    On the CPU, the instruction sets the loaded wheel was compiled for (``GGML_NATIVE``: an
    AVX2 build and an AVX-512 build of one commit sum in other orders) and its CPU kernels
    (llamafile's, repacking), as llama.cpp's system info lists them: ``x86_64:avx,avx2,...``.
    On a GPU, the backend and the device's own description (another GPU model runs other
    kernels). Routes, repairs and audits that claim bit-exactness stay within one class.
    """
    kind = backends.parse_device(device)[0]
    if kind != "cpu":
        # only a process that loaded the device's own build sees it (a node on it always does)
        return f"{kind}:{describe_device(device)}" if build_info()["backend"] == kind else kind
    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    flags: set[str] = set()
    for section in info.split("CPU :")[1:2]:
        for item in section.split("|"):
            name, _, value = item.partition("=")
            if value.strip() == "1" and name.strip() not in _NOT_KERNELS:
                flags.add(name.strip().lower())
    return f"{platform.machine()}:{','.join(sorted(flags))}"


def describe_device(device: str) -> str:
    """What ``device`` is here: ``"cpu"``, or the GPU's own description ("NVIDIA GeForce RTX 4090",
    "llvmpipe (LLVM 15.0.6, 256 bits)"); :class:`BackendMismatchError` when this process loaded
    another backend's build, :class:`NoDeviceError` when the device is not there."""
    if backends.parse_device(device)[0] == "cpu":
        return "cpu"
    description: bytes = _ggml.ggml_backend_dev_description(_find_device(device))
    return description.decode("utf-8", "replace")


# what `quantize` makes, by llama.cpp's file-type names
QUANT_TYPES = {
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
}


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], kind: str, *, threads: int = 2) -> None:
    """Write ``dst``, the GGUF model ``src`` quantized to ``kind`` by llama.cpp's own quantizer.

    ``src`` should hold float weights (F32 or F16); llama.cpp picks the per-tensor types
    of the mixed kinds (Q4_K_M keeps some tensors at Q6_K, and falls back where a row
    length is not a multiple of 256).
    """
    try:
        ftype = QUANT_TYPES[kind]
    except KeyError:
        raise EngineError(f"unknown quantization {kind!r}; choose one of {', '.join(QUANT_TYPES)}") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = ftype
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if status != 0:
        raise EngineError(f"llama.cpp could not quantize {src} to {kind} (status {status}; see the log)")


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
_KV_TYPES = {"f16": 1, "f32": 0}  # ggml_type values
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
        if self.kv_type not in _KV_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(_KV_TYPES)}")
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


@attrs.frozen
class MemoryReport:
    """Bytes a loaded shard holds, by llama.cpp's own accounting: all of it, and of that the
    part in host memory (all of it on the CPU; on a GPU, what stays behind, such as the token
    embeddings and the host's side of the compute buffers)."""

    weights: int
    kv: int
    compute: int
    host_weights: int
    host_kv: int
    host_compute: int

    @property
    def total(self) -> int:
        """All three together."""
        return self.weights + self.kv + self.compute

    @property
    def host(self) -> int:
        """What of the total lives in host memory."""
        return self.host_weights + self.host_kv + self.host_compute

    @property
    def device(self) -> int:
        """What of the total lives in a device's own memory."""
        return self.total - self.host


def _grammar_sampler(vocab: Any, grammar: str) -> Any:
    """llama.cpp's grammar sampler, or :class:`GrammarError` (llama.cpp returns NULL on a bad grammar)."""
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
    if not sampler:
        raise GrammarError("the grammar does not compile (GBNF with a 'root' rule expected)")
    return sampler


def check_grammar(vocab: Vocab, grammar: str) -> None:
    """Raise :class:`GrammarError` unless ``grammar`` compiles against ``vocab``: what a tail would build."""
    llama_cpp.llama_sampler_free(_grammar_sampler(vocab._vocab, grammar))


def json_schema_grammar(schema: Any) -> str:
    """The GBNF that accepts exactly the JSON documents ``schema`` allows (``None``: any JSON object).

    llama-cpp-python's converter is pure Python; it lives here because importing it loads
    the llama_cpp package, which only this module does.
    """
    from llama_cpp import llama_grammar

    if schema is None:
        return llama_grammar.JSON_GBNF

    base: Any = llama_grammar.SchemaConverter  # untyped upstream

    class Converter(base):  # type: ignore[misc]
        """The converter, with integer bounds, which it leaves unchecked."""

        def _add_primitive(self, name: str, rule: Any) -> Any:
            # upstream's string character admits raw control characters, which JSON forbids
            # (RFC 8259, 7): a model that wrote a newline inside a string broke the client's parser
            if name == "char":
                rule = llama_grammar.BuiltinRule(_JSON_CHAR, [])
            return super()._add_primitive(name, rule)

        def visit(self, schema: Any, name: str) -> Any:
            bounds = _integer_bounds(schema) if isinstance(schema, dict) else None
            if bounds is None:
                return super().visit(schema, name)
            rule = name + "-" if name in llama_grammar.RESERVED_NAMES else name or "root"
            return self._add_rule(rule, integer_range_gbnf(*bounds) + " space")

    try:
        converter: Any = Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        converter.visit(converter.resolve_refs(json.loads(json.dumps(schema)), "stdin"), "")
        return str(converter.format_grammar())
    except (ValueError, TypeError, KeyError, AssertionError, RecursionError, NotImplementedError) as exc:
        # the converter asserts and raises on schemas it does not handle: all are the client's
        raise GrammarError(f"the JSON schema cannot be turned into a grammar: {type(exc).__name__}: {exc}") from None


_JSON_CHAR = r'[^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
_INT_DIGITS = 16  # the converter's own bound on an integer's digits


def _integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None] | None:
    """(lowest, highest) an integer schema allows, when it bounds it; else None."""
    if schema.get("type") != "integer" or any(k in schema for k in ("enum", "const", "$ref", "anyOf", "oneOf")):
        return None
    low, high = schema.get("minimum"), schema.get("maximum")
    ex_low, ex_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if isinstance(ex_low, bool) or isinstance(ex_high, bool):  # draft 4: flags beside the bounds
        low = low + 1 if ex_low is True and low is not None else low
        high = high - 1 if ex_high is True and high is not None else high
        ex_low = ex_high = None
    bounds = [low, high, ex_low, ex_high]
    if all(b is None for b in bounds):
        return None
    if any(b is not None and (isinstance(b, bool) or not isinstance(b, int | float)) for b in bounds):
        raise ValueError("integer bounds must be numbers")
    lows = [math.ceil(low)] if low is not None else []
    lows += [math.floor(ex_low) + 1] if ex_low is not None else []
    highs = [math.floor(high)] if high is not None else []
    highs += [math.ceil(ex_high) - 1] if ex_high is not None else []
    lo, hi = (max(lows) if lows else None), (min(highs) if highs else None)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"no integer lies between {lo} and {hi}")
    return lo, hi


def integer_range_gbnf(lo: int | None, hi: int | None) -> str:
    """A GBNF expression for the decimal integers in [lo, hi] (None: unbounded), no leading zeros."""
    limit = 10**_INT_DIGITS - 1
    lo = -limit if lo is None else max(lo, -limit)
    hi = limit if hi is None else min(hi, limit)
    parts = []
    if lo < 0:  # the negative ones: "-" and a positive range
        parts.append('"-" ' + _natural_range(max(1, -hi), -lo))
    if hi >= 0:
        parts.append(_natural_range(max(0, lo), hi))
    return parts[0] if len(parts) == 1 else "(" + " | ".join(parts) + ")"


def _natural_range(lo: int, hi: int) -> str:
    """Decimal strings of the integers in [lo, hi], 0 <= lo <= hi."""
    options = []
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        first = max(lo, 10 ** (digits - 1) if digits > 1 else 0)
        last = min(hi, 10**digits - 1)
        if first <= last:
            options.append(_same_length(str(first), str(last)))
    return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"


def _same_length(a: str, b: str) -> str:
    """Decimal strings between a and b, which have as many digits."""
    if not a:
        return ""
    if a[0] == b[0]:
        rest = _same_length(a[1:], b[1:])
        return f'"{a[0]}"' + (" " + rest if rest else "")
    n = len(a) - 1
    any_rest = " [0-9]" * n
    if a[1:] == "0" * n and b[1:] == "9" * n:
        return f"[{a[0]}-{b[0]}]" + any_rest
    options = [f'"{a[0]}"' + (" " + _same_length(a[1:], "9" * n) if n else "")]
    if int(a[0]) + 1 <= int(b[0]) - 1:
        options.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}]" + any_rest)
    options.append(f'"{b[0]}"' + (" " + _same_length("0" * n, b[1:]) if n else ""))
    return "(" + " | ".join(options) + ")"


# a token the grammar refuses is retried this many times before the whole vocabulary is
# masked: asks cost microseconds, the mask milliseconds
RETRY_DRAWS = 8
RETRY_GREEDY = 64
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data, 12 bytes


class SamplerChain:
    """A per-session llama.cpp sampler chain. Free it with :meth:`close` (idempotent).

    A grammar sees only sampled tokens: the prompt history primes the penalties alone (a
    grammar fed the prompt would reject it), ``generated`` tokens prime both. It masks the
    logits before the rest of the chain, as llama.cpp's own chain would with it first,
    except where masking commutes with the rest; see :meth:`sample`. The seeded draw at
    each position is a fresh llama.cpp ``dist`` sampler seeded by ``draw_seed(seed,
    position)``: one generator for the session would make a draw depend on every draw
    before it, which a chain rebuilt after a route repair could not replay.
    """

    def __init__(
        self,
        params: Sampling,
        vocab: Any,
        n_vocab: int,
        history: Sequence[int] = (),
        *,
        generated: Sequence[int] = (),
        live: set[int] | None = None,
    ) -> None:
        """``live``, if given, holds the ids of chains not yet closed (the engine's count of them)."""
        self.params = params
        self._chain: Any = None
        self._grammar: Any = None
        self._live = live
        self._vocab = vocab  # the model's, which outlives its sessions' chains
        self._n_vocab = n_vocab
        grammar = _grammar_sampler(vocab, params.grammar) if params.grammar else None
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if not chain:
            if grammar is not None:
                llama_cpp.llama_sampler_free(grammar)
            raise EngineError("could not create a sampler chain")
        self._chain, self._grammar = chain, grammar
        add = llama_cpp.llama_sampler_chain_add  # the chain owns what is added to it
        if params.logit_bias:
            biases = (llama_cpp.llama_logit_bias * len(params.logit_bias))()
            for slot, (token, bias) in enumerate(params.logit_bias):
                biases[slot].token, biases[slot].bias = token, bias
            # llama.cpp copies the array: it need not outlive this call
            add(chain, llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
        penalties = (params.repeat_penalty, params.frequency_penalty, params.presence_penalty)
        if penalties != (1.0, 0.0, 0.0):
            penalty = llama_cpp.llama_sampler_init_penalties(n_vocab, params.penalty_last_n, *penalties)
            for token in (*history, *generated):
                llama_cpp.llama_sampler_accept(penalty, int(token))
            add(chain, penalty)
        # Biases, penalties and temperature move each logit on its own, and greedy and the draw
        # read what they are given: masking commutes with them. Top-k, top-p and min-p choose
        # among the candidates, so once one is in the chain the grammar must mask first.
        choosers = []
        if params.temperature <= 0.0:
            add(chain, llama_cpp.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                choosers.append(llama_cpp.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                choosers.append(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                choosers.append(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
            for chooser in choosers:
                add(chain, chooser)
            add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
            # a placeholder: sample() puts in the draw of each position before it draws
            add(chain, llama_cpp.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))
        self._grammar_last = grammar is not None and not choosers
        # the chain's last sampler: greedy, or the seeded draw that _retry asks again
        self._draw = llama_cpp.llama_sampler_chain_get(chain, llama_cpp.llama_sampler_chain_n(chain) - 1)
        self._candidates = np.empty(n_vocab if grammar is not None else 0, dtype=_TOKEN_DATA)
        self._ids = np.arange(n_vocab if grammar is not None else 0, dtype=np.int32)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        if live is not None:
            live.add(id(self))
        if grammar is not None:
            for token in generated:  # the grammar is where the first chain left it
                llama_cpp.llama_sampler_accept(grammar, int(token))

    def _draw_for(self, position: int) -> None:
        """Make the chain's draw the one of ``position`` (greedy has none)."""
        if self.params.temperature <= 0.0:
            return
        last = llama_cpp.llama_sampler_chain_n(self._chain) - 1
        llama_cpp.llama_sampler_free(llama_cpp.llama_sampler_chain_remove(self._chain, last))
        llama_cpp.llama_sampler_chain_add(
            self._chain, llama_cpp.llama_sampler_init_dist(draw_seed(self.params.seed, position))
        )
        self._draw = llama_cpp.llama_sampler_chain_get(self._chain, last)

    def sample(self, ctx: Any, index: int, position: int) -> int:
        """Sample the token after ``position`` from the context's logits row ``index`` (and accept it).

        With a grammar whose mask commutes with the chain, the chain first draws from all the
        tokens, and the grammar is asked about the one token drawn: llama.cpp's grammar checks
        every token of the vocabulary against its stacks, which costs more than the rest of a
        step on a small model (8 ms for SmolLM2's 49,152 tokens under a JSON schema's grammar,
        on the engine thread, so every session of the tick waits). Drawn as it is, a token the
        grammar accepts is the token greedy decoding of the masked logits would pick (the first
        maximum is a valid one); for a draw, accepting it or else drawing again from the masked
        tokens gives each valid token the masked probability exactly (p + (1 - V) p / V = p / V,
        V the valid tokens' share). A refused token is first retried cheaply, one token at a
        time (:meth:`_retry`); only when that finds none is the whole vocabulary masked.
        """
        if self._chain is None:
            raise EngineError("sampler chain is closed")
        self._draw_for(position)
        if self._grammar is None:
            return int(llama_cpp.llama_sampler_sample(self._chain, ctx, index))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(self._n_vocab,))
        token = -1
        if self._grammar_last:
            view = self._offer(logits, self._chain)
            drawn = self._select(view)
            if not llama_cpp.llama_vocab_is_eog(self._vocab, drawn):
                token = drawn if self._grammar_accepts(drawn) else self._retry(view, drawn)
            else:
                # offered alone, the end of generation passes any grammar (patch 0006 lets it
                # through when every candidate is refused): ask with the whole vocabulary
                masked = self._offer(logits, self._grammar)
                if np.isfinite(self._candidates["logit"][drawn]):  # the grammar keeps their order
                    token = drawn
                else:
                    llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(masked))
                    token = self._select(masked)
        if token < 0:
            token = self._select(self._offer(logits, self._grammar, self._chain))
        llama_cpp.llama_sampler_accept(self._grammar, token)
        llama_cpp.llama_sampler_accept(self._chain, token)
        return token

    def _retry(self, view: Any, refused: int) -> int:
        """After ``refused``, the token the masked chain would pick, found by asking the grammar
        about one token at a time; -1 where a few asks do not settle it.

        ``view`` is the chain's output over every token (its logits biased, penalised and
        tempered in place). Greedy: the valid token of the highest logit, the lowest id among
        equals, is the masked maximum; only logits above the ``RETRY_GREEDY``-th highest are
        asked about, as every token above it is among them. A draw: the refused token is
        taken out and the chain's own sampler draws again (its seeded generator, so a
        session's tokens stay its own); a valid token drawn from all but refused tokens has
        the masked probability, however many were refused first (conditioned on being valid,
        each draw is proportional to p), as has the whole-vocabulary mask it falls back to.
        """
        candidates = self._candidates
        logit = candidates["logit"]
        if self.params.temperature <= 0.0:
            k = min(RETRY_GREEDY, self._n_vocab)
            top = np.argpartition(logit, self._n_vocab - k)[self._n_vocab - k :]
            above = top[logit[top] > logit[top].min()]
            for token in above[np.lexsort((above, -logit[above]))]:  # descending, then by id
                token = int(token)
                if token != refused and not llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    if self._grammar_accepts(token):
                        return token
                elif token != refused:
                    return -1  # an end of generation ranks here: the whole mask decides (patch 0006)
            return -1
        draw = self._draw
        for _ in range(RETRY_DRAWS):
            logit[refused] = -np.inf
            llama_cpp.llama_sampler_apply(draw, ctypes.byref(view))
            drawn = self._select(view)
            if not np.isfinite(logit[drawn]) or llama_cpp.llama_vocab_is_eog(self._vocab, drawn):
                return -1
            if self._grammar_accepts(drawn):
                return drawn
            refused = drawn
        return -1

    def _offer(self, logits: np.ndarray, *samplers: Any) -> Any:
        """Every token with its logit, through ``samplers`` in order; the llama_token_data_array."""
        candidates = self._candidates
        candidates["id"] = self._ids
        candidates["logit"] = logits
        candidates["p"] = 0.0
        view = llama_cpp.llama_token_data_array(
            candidates.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), self._n_vocab, -1, False
        )
        for sampler in samplers:
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(view))
        return view

    @staticmethod
    def _select(view: Any) -> int:
        if not 0 <= view.selected < view.size:
            raise EngineError("the sampler chain selected no token")
        return int(view.data[view.selected].id)

    def _grammar_accepts(self, token: int) -> bool:
        one = self._one
        one["id"], one["logit"] = token, 0.0
        view = llama_cpp.llama_token_data_array(
            one.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), 1, -1, False
        )
        _quiet.on = True
        try:
            llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(view))
        finally:
            _quiet.on = False
        return bool(np.isfinite(one["logit"][0]))

    def close(self) -> None:
        """Free the chain and its grammar state; safe to call twice."""
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
            if self._live is not None:
                self._live.discard(id(self))

    def __del__(self) -> None:
        self.close()


class _BatchBuffers:
    """A llama_batch over arrays this engine owns, so filling it is numpy writes."""

    def __init__(self, capacity: int, n_embd: int, takes_hidden: bool) -> None:
        self.capacity = capacity
        self.tokens = np.zeros(capacity, dtype=np.int32)
        self.hidden = np.zeros((capacity, n_embd), dtype=np.float32) if takes_hidden else None
        self.positions = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq_ids = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        base = self.seq_ids.ctypes.data
        seq_ptr_t = ctypes.POINTER(llama_cpp.llama_seq_id)
        self._seq_ptrs = (seq_ptr_t * capacity)(*(ctypes.cast(base + 4 * i, seq_ptr_t) for i in range(capacity)))
        self.batch = llama_cpp.llama_batch()
        self.batch.token = self.tokens.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        self.batch.embd = (
            self.hidden.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if self.hidden is not None else None
        )
        if self.hidden is not None:
            self.batch.token = None
        self.batch.pos = self.positions.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos))
        self.batch.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.batch.seq_id = self._seq_ptrs
        self.batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))


class ShardEngine:
    """One loaded layer range of a model and its context (KV for ``n_seq_max`` sequences)."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        recipe: Recipe,
        layers: LayerRange | None = None,
        *,
        expected_fingerprint: str | None = None,
        output_hidden: bool = False,
        dry_run: bool = False,
        cores: Sequence[int] | None = None,
    ) -> None:
        """Load ``layers`` of the model (all of them when ``None``).

        ``model_path`` may be the whole model or a shard file cut by ``noderuntime shard
        split``; a shard file must hold exactly ``layers``. ``expected_fingerprint`` makes
        the load fail unless the file is (a slice of) that artifact. ``output_hidden`` on a
        tail shard also returns the normed final hidden state of every row (for parity
        checks; it makes every row an output). ``dry_run`` reads only the file's index and
        lets llama.cpp size every buffer without allocating one: :meth:`memory` is then its
        estimate, and nothing can run (see :func:`estimate_memory`).

        ``cores`` pins the CPU team's threads one to a core, in order (see :func:`pinned_cores`);
        where it runs, not what it computes: the recipe and every result are the same.
        """
        self._model: Any = None
        self._ctx: Any = None
        self._threadpool: Any = None
        self._cores = tuple(cores) if cores is not None else None
        self.recipe = recipe
        try:
            info = artifacts.inspect(model_path)
        except ArtifactError as exc:
            raise EngineError(str(exc)) from None
        if expected_fingerprint is not None:
            try:
                artifacts.verify_parent(info, expected_fingerprint)
            except ArtifactError as exc:
                raise EngineError(str(exc)) from None
        if layers is None:
            layers = info.layer_range
        try:
            layers.check_within(info.n_layer)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if info.is_shard_file and layers != info.layer_range:
            raise EngineError(f"{info.path} holds layers {info.layer_range}, not the requested {layers}")
        is_range = layers != LayerRange(0, info.n_layer)
        if is_range and info.architecture not in artifacts.SUPPORTED_ARCHITECTURES:
            raise EngineError(f"layer ranges are not supported for architecture {info.architecture!r}")
        self.info: ArtifactInfo = info
        self.layers = layers
        self.is_head = layers.start == 0
        self.is_tail = layers.end == info.n_layer
        self.n_embd = info.n_embd
        self.output_hidden = output_hidden and self.is_tail
        self.dry_run = dry_run
        self._load(is_range and not info.is_shard_file, dry_run)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model)))
        self._buffers = _BatchBuffers(recipe.n_batch, self.n_embd, takes_hidden=not self.is_head)
        # set add/discard are atomic: a chain dropped unclosed closes in __del__, on the collector's thread
        self._live_samplers: set[int] = set()

    def _gpu_layers(self) -> int:
        """llama.cpp's ``n_gpu_layers`` for this range: it offloads layers ``il >= n_layer + 1 - n``."""
        if self.recipe.device == "cpu":
            return 0
        local = self.recipe.gpu_layers
        if local is None or local >= len(self.layers):
            return self.info.n_layer + 1  # every layer and the output layer (the tail's lm_head)
        return self.info.n_layer + 1 - self.layers.end + local

    def _load(self, override_range: bool, dry_run: bool) -> None:
        mparams = llama_cpp.llama_model_default_params()
        # an explicit, NULL-terminated device list: none on the CPU (a GPU build then keeps
        # every op on the CPU too), the one named device otherwise
        devices = (ctypes.c_void_p * 2)()
        if self.recipe.device != "cpu":
            devices[0] = _find_device(self.recipe.device)
        self._devices = devices  # read during load only; kept alive until then
        mparams.devices = ctypes.addressof(devices)
        mparams.n_gpu_layers = self._gpu_layers()
        mparams.no_alloc = dry_run
        mparams.use_extra_bufts = self.recipe.repack
        # a dry run with a mapping aborts in llama.cpp; it reads no tensor data anyway
        mapped = self.recipe.use_mmap and not dry_run
        mparams.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP if mapped else llama_cpp.LLAMA_LOAD_MODE_NONE
        overrides = None
        if override_range:
            overrides = (llama_cpp.llama_model_kv_override * 3)()
            for slot, (key, value) in enumerate(
                ((artifacts.SHARD_START_KEY, self.layers.start), (artifacts.SHARD_END_KEY, self.layers.end))
            ):
                overrides[slot].key = key.encode()
                overrides[slot].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT
                overrides[slot].value.val_i64 = value
            overrides[2].key = b""
            mparams.kv_overrides = overrides
        self._overrides = overrides  # llama.cpp reads them during load only; keep them alive until then
        model = llama_cpp.llama_model_load_from_file(str(self.info.path).encode(), mparams)
        if not model:
            raise EngineError(f"llama.cpp could not load layers {self.layers} of {self.info.path} (see the log)")
        self._model = model
        start, end = ctypes.c_int32(), ctypes.c_int32()
        _lib.llama_model_shard_range(model, ctypes.byref(start), ctypes.byref(end))
        if (start.value, end.value) != (self.layers.start, self.layers.end):
            self.close()
            raise EngineError(f"llama.cpp loaded layers {start.value}:{end.value}, expected {self.layers}")

        r = self.recipe
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = r.n_ctx_per_seq * r.n_seq_max
        cparams.n_batch = r.n_batch
        cparams.n_ubatch = r.n_ubatch
        cparams.n_seq_max = r.n_seq_max
        cparams.n_threads = r.n_threads
        cparams.n_threads_batch = r.n_threads
        cparams.kv_unified = r.kv_unified  # False: one KV stream per sequence, sessions never see each other
        cparams.type_k = cparams.type_v = _KV_TYPES[r.kv_type]
        cparams.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if r.flash_attn == "on"
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.embeddings = self.output_hidden or not self.is_tail
        cparams.offload_kqv = True  # a GPU layer's KV lives on its GPU (no effect on the CPU)
        cparams.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise EngineError(f"llama.cpp could not create a context for {self.info.path} with {r}")
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        if self._cores is not None and not dry_run:
            try:
                self._threadpool = _pinned_threadpool(r.n_threads, self._cores)
            except EngineError:
                self.close()
                raise
            _lib.llama_attach_threadpool(ctx, self._threadpool, self._threadpool)

    @property
    def context(self) -> Any:
        """The llama.cpp context (for sampler chains)."""
        return self._ctx

    def run(
        self,
        rows: Rows,
        *,
        samplers: Mapping[int, SamplerChain] | None = None,
        want_logits: bool = False,
        scores: Mapping[int, tuple[int, int]] | None = None,
    ) -> StepResult:
        """Run one batch. ``samplers`` maps row index -> chain for output rows to sample.

        ``scores`` maps output rows to (token, top): that token's log-probability at the row
        is wanted, with the ``top`` most likely (a prompt's, for OpenAI's ``echo``).
        """
        if self._ctx is None:
            raise EngineError("engine is closed")
        if self.dry_run:
            raise EngineError("a dry-run engine sizes memory only; it cannot run")
        n = len(rows)
        buf = self._buffers
        if not 0 < n <= buf.capacity:
            raise EngineError(f"batch of {n} rows; this engine takes 1 to {buf.capacity}")
        if self.is_head:
            if rows.tokens is None:
                raise EngineError("the head shard takes token ids")
            buf.tokens[:n] = rows.tokens
        else:
            if rows.hidden is None or rows.hidden.shape != (n, self.n_embd):
                raise EngineError(f"shard {self.layers} takes hidden rows of shape ({n}, {self.n_embd})")
            assert buf.hidden is not None
            buf.hidden[:n] = rows.hidden
        if np.any(rows.seq_ids < 0) or np.any(rows.seq_ids >= self.recipe.n_seq_max):
            raise EngineError(f"sequence ids must lie in [0, {self.recipe.n_seq_max})")
        buf.seq_ids[:n] = rows.seq_ids
        buf.positions[:n] = rows.positions
        outputs = np.ones(n, dtype=bool) if (self.output_hidden or not self.is_tail) else rows.outputs
        buf.logits[:n] = outputs
        buf.batch.n_tokens = n
        started = time.perf_counter()
        if self._threadpool is None:
            status = llama_cpp.llama_decode(self._ctx, buf.batch)
        else:
            # ggml pins the calling thread to the team's first core: give it back its own
            own = os.sched_getaffinity(0)
            try:
                status = llama_cpp.llama_decode(self._ctx, buf.batch)
            finally:
                os.sched_setaffinity(0, own)
        if status != 0:
            raise EngineError(f"llama_decode failed with status {status}" + (" (no KV slot)" if status == 1 else ""))
        hidden = None
        if self.output_hidden or not self.is_tail:
            ptr = llama_cpp.llama_get_embeddings(self._ctx)
            hidden = np.ctypeslib.as_array(ptr, shape=(n, self.n_embd)).copy()
        logits = None
        sampled: dict[int, int] = {}
        logprobs: dict[int, TokenLogprob] = {}
        if self.is_tail:
            out_rows = np.flatnonzero(rows.outputs)
            if want_logits and len(out_rows):
                logits = np.empty((len(out_rows), self.n_vocab), dtype=np.float32)
                for k, out_row in enumerate(out_rows.tolist()):
                    ptr = llama_cpp.llama_get_logits_ith(self._ctx, out_row)
                    logits[k] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
            for row, chain in (samplers or {}).items():
                if not rows.outputs[row]:
                    raise EngineError(f"row {row} has a sampler but asked for no output")
                sampled[row] = chain.sample(self._ctx, row, int(rows.positions[row]))
                if chain.params.logprobs:
                    logprobs[row] = token_logprob(self._logits_row(row), sampled[row], chain.params.top_logprobs)
            for row, (token, top) in (scores or {}).items():
                if not rows.outputs[row]:
                    raise EngineError(f"row {row} is scored but asked for no output")
                logprobs[row] = token_logprob(self._logits_row(row), token, top)
        return StepResult(
            hidden=hidden, logits=logits, sampled=sampled, seconds=time.perf_counter() - started, logprobs=logprobs
        )

    def _logits_row(self, row: int) -> np.ndarray:
        # a view of llama.cpp's buffer, valid until the next decode: read at once
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def new_sampler(self, params: Sampling, history: Sequence[int] = (), generated: Sequence[int] = ()) -> SamplerChain:
        """A sampler chain for this model's vocabulary (see :meth:`Engine.new_sampler`)."""
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        return SamplerChain(params, vocab, self.n_vocab, history, generated=generated, live=self._live_samplers)

    @property
    def live_samplers(self) -> int:
        """Sampler chains made by :meth:`new_sampler` and not yet closed (grammar states included)."""
        return len(self._live_samplers)

    def remove_sequence(self, seq_id: int) -> None:
        """Drop all KV of ``seq_id``; idempotent."""
        if self._ctx is not None:
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)

    def save_sequence(self, seq_id: int) -> bytes:
        """The KV ``seq_id`` holds, as llama.cpp writes a sequence's state (its cells, this shard's layers).

        What a prefix cache keeps of a finished session: :meth:`restore_sequence` puts it back.
        """
        if self._ctx is None:
            raise EngineError("the engine is closed")
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, seq_id))
        buffer = (ctypes.c_uint8 * size)()
        written = int(llama_cpp.llama_state_seq_get_data(self._ctx, buffer, size, seq_id))
        if written != size:
            raise EngineError(f"llama.cpp wrote {written} of the {size} bytes of sequence {seq_id}'s state")
        return bytes(buffer)

    def restore_sequence(self, seq_id: int, state: bytes, keep: int) -> None:
        """Put a saved sequence's KV into ``seq_id`` (which must hold none), keeping its first ``keep`` positions."""
        if self._ctx is None:
            raise EngineError("the engine is closed")
        if self.positions(seq_id) is not None:
            raise EngineError(f"sequence {seq_id} is not empty")
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if int(llama_cpp.llama_state_seq_set_data(self._ctx, buffer, len(state), seq_id)) == 0:
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
            raise EngineError(f"llama.cpp could not restore a saved state into sequence {seq_id}")
        span = self.positions(seq_id)
        if span is None or span[0] != 0 or span[1] < keep - 1:
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
            raise EngineError(f"the saved state holds positions {span}, not the first {keep}")
        llama_cpp.llama_memory_seq_rm(self._memory, seq_id, keep, -1)

    def copy_sequence(self, source: int, target: int, keep: int) -> None:
        """Give the empty ``target`` the first ``keep`` positions of ``source``'s KV, in place.

        The other way to reuse a prefix (the node keeps :meth:`save_sequence`'s bytes instead,
        ``benchmarks.prefix`` compares them). With one KV stream per sequence, as here, llama.cpp
        copies only whole streams (a partial range aborts the process), at the next batch: the
        copy is ``n_ctx_per_seq`` cells of every layer, whatever ``keep`` is.
        """
        if self._ctx is None:
            raise EngineError("the engine is closed")
        if self.positions(target) is not None:
            raise EngineError(f"sequence {target} is not empty")
        llama_cpp.llama_memory_seq_cp(self._memory, source, target, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._memory, target, keep, -1)

    def positions(self, seq_id: int) -> tuple[int, int] | None:
        """(first, last) position held in KV for ``seq_id``, or ``None`` when empty."""
        if self._ctx is None:
            return None
        last = int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id))
        if last < 0:
            return None
        return int(llama_cpp.llama_memory_seq_pos_min(self._memory, seq_id)), last

    def kv_cells_used(self) -> int:
        """KV cells held by all sequences together (0 once every session released)."""
        total = 0
        for seq in range(self.recipe.n_seq_max):
            span = self.positions(seq)
            if span is not None:
                total += span[1] - span[0] + 1
        return total

    def memory(self) -> MemoryReport:
        """Weights, KV and compute buffer bytes, by llama.cpp's memory breakdown."""
        if self._ctx is None:
            return MemoryReport(0, 0, 0, 0, 0, 0)
        sums = []
        for function in (_lib.llama_context_memory_totals, _lib.llama_context_memory_host):
            model, context, compute = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
            function(self._ctx, ctypes.byref(model), ctypes.byref(context), ctypes.byref(compute))
            sums += [model.value, context.value, compute.value]
        return MemoryReport(*sums)

    def recipe_description(self) -> dict[str, Any]:
        """The recipe plus the quant of the loaded artifact."""
        return self.recipe.describe(self.info.quant)

    def close(self) -> None:
        """Free context and model; safe to call twice."""
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._threadpool is not None:  # after the context that uses it
            _ggml_cpu.ggml_threadpool_free(self._threadpool)
            self._threadpool = None
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> ShardEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class Vocab:
    """A model's tokenizer, loaded vocab-only (no weights): tokenize, detokenize, template."""

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        self._model: Any = None  # so that a load that fails leaves nothing for close() to trip on
        try:
            self.info = artifacts.inspect(model_path)
        except ArtifactError as exc:
            raise EngineError(str(exc)) from None
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(str(self.info.path).encode(), params)
        if not model:
            raise EngineError(f"llama.cpp could not load the vocabulary of {self.info.path}")
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(self._vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self._vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        template = llama_cpp.llama_model_chat_template(model, None)
        self.chat_template: str | None = template.decode("utf-8") if template else None
        self.eog_tokens = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t))
        # the tokens llama.cpp matches as whole strings before it tokenizes the rest:
        # control and unknown ones when special tokens are parsed, user-defined ones always
        self.special_tokens: dict[int, tuple[str, bool, bool]] = {}  # id -> (text, lstrip, rstrip)
        matched = (
            llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
            | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
            | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        )
        for t in range(self.n_vocab):
            attr = llama_cpp.llama_vocab_get_attr(self._vocab, t)
            if attr & matched:
                text = self.piece(t, special=True).decode("utf-8", "replace")
                lstrip, rstrip = attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP, attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP
                self.special_tokens[t] = (text, bool(lstrip), bool(rstrip))

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text to token ids; ``parse_special`` turns ``<|im_start|>`` and the like into their ids."""
        data = text.encode("utf-8")
        capacity = len(data) + 8  # enough for real vocabularies; byte-fallback ones may need more
        for _ in range(2):
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            capacity = -n  # llama.cpp says how many it needs
        raise EngineError(f"the tokenizer did not fit {len(data)} bytes in {capacity} tokens")

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token (may be a partial UTF-8 sequence)."""
        if not 0 <= token < self.n_vocab:
            raise EngineError(f"token id {token} outside the vocabulary of {self.n_vocab}")
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        """Token ids to text."""
        return b"".join(self.piece(t, special=special) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends a generation (EOS, EOT, ...)."""
        return token in self.eog_tokens

    def close(self) -> None:
        """Free the vocabulary; idempotent."""
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()
