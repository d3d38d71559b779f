"""Where a shard runs: the devices the loaded build of llama.cpp sees, and the CPU cores its threads keep to.

A device is named ``"cpu"`` or ``"<backend>:<index>"`` (``engine.backends``); these
functions answer what it is here, how much memory it has, what drift class of kernels
runs on it, and hand the shard engine its ggml device handle and pinned threadpool.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Sequence
from typing import Any

from noderuntime.engine import backends
from noderuntime.engine.backends import BackendMismatchError, NoDeviceError
from noderuntime.engine.base import EngineError
from noderuntime.engine.llama.binding import MAX_CORES, build_info, ggml, ggml_base, ggml_cpu, llama_cpp

__all__ = [
    "describe_device",
    "device_memory",
    "device_report",
    "find_device",
    "kernel_class",
    "pinned_cores",
    "pinned_threadpool",
]


def pinned_threadpool(n_threads: int, cores: Sequence[int]) -> Any:
    """A ggml threadpool whose ``n_threads`` threads each keep to one of ``cores``, in order.

    With OpenMP, ggml pins every thread of the team to its core at the start of each graph
    (the calling thread too, which :meth:`ShardEngine.run` then lets go).
    """
    if len(cores) < n_threads or min(cores) < 0 or max(cores) >= MAX_CORES:
        raise EngineError(f"cannot pin {n_threads} threads one to a core on cores {list(cores)}")
    params = ggml_base.ggml_threadpool_params_default(n_threads)
    for core in cores[:n_threads]:
        params.cpumask[core] = True
    params.strict_cpu = True
    pool = ggml_cpu.ggml_threadpool_new(ctypes.byref(params))
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
    if n_threads < 2 or n_threads != len(cores) or max(cores) >= MAX_CORES:
        return None
    if not hasattr(os, "sched_setaffinity"):  # ggml pins on Linux and Windows; this code restores on Linux
        return None
    return tuple(cores)


_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}  # enum ggml_backend_dev_type


def _device_handles() -> list[tuple[Any, str, str]]:
    """(handle, name, registry name) of every device this build of ggml sees."""
    found = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        name = ggml.ggml_backend_dev_name(dev).decode()
        registry = ggml.ggml_backend_reg_name(ggml.ggml_backend_dev_backend_reg(dev)).decode()
        found.append((dev, name, registry))
    return found


def device_report() -> list[dict[str, Any]]:
    """The devices the loaded build sees, as JSON-able dicts: what ``backends`` asks in a subprocess."""
    report = []
    for dev, name, registry in _device_handles():
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        report.append(
            {
                "name": name,
                "description": ggml.ggml_backend_dev_description(dev).decode("utf-8", "replace"),
                "kind": _DEVICE_KINDS.get(ggml.ggml_backend_dev_type(dev), "unknown"),
                "registry": registry,
                "memory_free": free.value,
                "memory_total": total.value,
            }
        )
    return report


def find_device(device: str) -> Any:
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
    ggml.ggml_backend_dev_memory(find_device(device), ctypes.byref(free), ctypes.byref(total))
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
    description: bytes = ggml.ggml_backend_dev_description(find_device(device))
    return description.decode("utf-8", "replace")
