"""The binding to llama.cpp: the only module of the project that imports ``llama_cpp``.

It loads llama-cpp-python, refuses a stock build without the project's patches (see
``kernels_patch/``), binds the few C functions the bindings leave out (the patch's shard
range and memory totals, ggml's device registry and CPU threadpools), routes llama.cpp's
log into Python's logging and initialises the backend, once, at import. The rest of the
engine takes the library from here: :data:`llama_cpp`, :data:`lib`, :data:`ggml`.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from noderuntime.engine.base import EngineError

__all__ = [
    "MAX_CORES",
    "PatchMissingError",
    "build_info",
    "ggml",
    "ggml_base",
    "ggml_cpu",
    "grammar_converter",
    "lib",
    "llama_cpp",
    "quiet",
]

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
lib = llama_cpp.llama_cpp._lib

# ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous line)
_LOG_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_llama_log = logging.getLogger("noderuntime.llama_cpp")


_last_level = [logging.DEBUG]
# set on a thread while it asks a grammar about one token: a refusal is then an answer, not
# the "allows no token" warning llama.cpp gives when it refuses every candidate offered
quiet = threading.local()


@llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
def _on_llama_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # llama.cpp is chatty at INFO; keep its warnings and errors, the rest at debug
    if getattr(quiet, "on", False):
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


ggml = _bind_ggml_devices()


MAX_CORES = 512  # GGML_MAX_N_THREADS: the cores a ggml threadpool's mask can name


class _ThreadpoolParams(ctypes.Structure):
    # struct ggml_threadpool_params (ggml.h)
    _fields_ = [
        ("cpumask", ctypes.c_bool * MAX_CORES),
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
    lib.llama_attach_threadpool.argtypes = [ptr, ptr, ptr]
    lib.llama_attach_threadpool.restype = None
    return ggml_base, ggml_cpu


ggml_base, ggml_cpu = _bind_threadpools()


def grammar_converter() -> Any:
    """llama-cpp-python's ``llama_grammar`` module, its JSON-schema-to-GBNF converter (pure Python,
    loaded when first asked for)."""
    from llama_cpp import llama_grammar

    return llama_grammar
