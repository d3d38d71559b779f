"""GPU backends: which llama.cpp build a process loads, and whether it has a device to run on.

The environment holds the CPU build of llama-cpp-python. A GPU backend's build
(``kernels_patch/build.py --backend vulkan --install``) is unpacked into a folder of its
own in the build cache; a process that serves on that backend imports ``llama_cpp`` from
there because the folder comes first on its path: :meth:`BackendRuntime.environ` for a
subprocess, :meth:`BackendRuntime.activate` at the start of a fresh process, before
anything has imported ``llama_cpp``. One process, one build: a process that already loaded
the CPU build cannot switch.

No ``llama_cpp`` here (only :mod:`noderuntime.engine.llama.binding` imports it): the question that
needs it, which devices a build sees, is asked in a subprocess.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from noderuntime.engine.base import EngineError

__all__ = [
    "BACKENDS",
    "CPU",
    "BackendError",
    "BackendMismatchError",
    "BackendNotBuiltError",
    "BackendRuntime",
    "NoDeviceError",
    "build_command",
    "locate",
    "parse_device",
    "runtime",
    "vulkan_devices",
]

BACKENDS = ("cpu", "vulkan", "cuda", "hip", "metal")
# ggml's registry name for each backend's devices (device names are these plus an index)
REGISTRY_NAMES = {"cpu": ("CPU",), "vulkan": ("Vulkan",), "cuda": ("CUDA",), "hip": ("ROCm", "HIP"), "metal": ("MTL",)}

_ROOT = Path(__file__).resolve().parents[2]
_BUILD_SCRIPT = _ROOT / "kernels_patch" / "build.py"


class BackendError(EngineError):
    """A backend cannot serve here: its build is missing, another build is loaded, or it has no device."""


class BackendNotBuiltError(BackendError):
    """The backend's llama-cpp-python is not built (or cannot be: its toolchain is missing)."""


class BackendMismatchError(BackendError):
    """This process loaded another backend's build of llama_cpp than the one asked for."""


class NoDeviceError(BackendError):
    """The build is there but sees no device of its kind (no GPU, no driver, no Vulkan ICD)."""


def parse_device(device: str) -> tuple[str, int]:
    """``"cpu"`` -> ``("cpu", 0)``; ``"vulkan:1"`` -> ``("vulkan", 1)``; anything else is a ValueError."""
    if device == "cpu":
        return "cpu", 0
    kind, sep, index = device.partition(":")
    if kind not in BACKENDS[1:] or not sep or not index.isdigit():
        raise ValueError(f"device must be 'cpu' or '<backend>:<index>' with backend one of {', '.join(BACKENDS[1:])}")
    return kind, int(index)


@attrs.frozen
class BackendRuntime:
    """How a process loads one backend's build: a folder first on its path, and environment variables."""

    backend: str
    site: Path | None  # None: the environment's own (CPU) build
    env: tuple[tuple[str, str], ...] = ()  # variables the backend reads when it loads

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (this process's environment by default) for a subprocess that runs on this backend."""
        out = dict(os.environ if base is None else base)
        out.update(self.env)
        if self.site is not None:
            rest = out.get("PYTHONPATH")
            out["PYTHONPATH"] = str(self.site) + (os.pathsep + rest if rest else "")
        return out

    def activate(self) -> None:
        """Make this (fresh) process load this backend's build; call before anything imports llama_cpp.

        A spawned multiprocessing child takes its parent's ``sys.path``, not its
        ``PYTHONPATH``, so the folder is put first here as well.
        """
        loaded = sys.modules.get("llama_cpp")
        if loaded is not None:
            where = Path(loaded.__file__ or "").resolve().parent.parent
            if self.site is None or where != self.site.resolve():
                raise BackendMismatchError(f"this process already loaded llama_cpp from {where}; {self.backend} cannot")
            return
        os.environ.update(self.env)
        if self.site is not None and str(self.site) not in sys.path[:1]:
            sys.path.insert(0, str(self.site))

    def devices(self) -> list[dict[str, Any]]:
        """The devices this build sees (ggml's list: name, description, kind, registry, memory)."""
        probe = "import json; from noderuntime.engine import llama; print(json.dumps(llama.device_report()))"
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env=self.environ(), timeout=300
        )
        if done.returncode != 0:
            raise NoDeviceError(f"the {self.backend} build did not load: {done.stderr.strip()[-2000:]}")
        found: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
        return found


CPU = BackendRuntime("cpu", None)


def build_command(backend: str, python: str = sys.executable) -> list[str]:
    """The command that builds and installs ``backend``'s llama-cpp-python."""
    return [python, str(_BUILD_SCRIPT), "--python", python, "--backend", backend, "--install"]


def locate(backend: str, python: str = sys.executable) -> dict[str, Any]:
    """``kernels_patch/build.py --locate``: the cache key, wheel, site folder and missing tools of a build."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if not _BUILD_SCRIPT.exists():
        raise BackendNotBuiltError(f"no {_BUILD_SCRIPT}: GPU builds are made from a checkout of the project")
    command = [python, str(_BUILD_SCRIPT), "--python", python, "--backend", backend, "--locate"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def vulkan_devices() -> list[dict[str, str]]:
    """The Vulkan physical devices the loader lists, in its order (``vulkaninfo --summary``).

    Each has ``index``, ``name`` and ``type`` (``PHYSICAL_DEVICE_TYPE_CPU`` for a software
    renderer such as Mesa's llvmpipe). ggml numbers devices in this order too.
    """
    if shutil.which("vulkaninfo") is None:
        raise NoDeviceError("vulkaninfo is not installed (Debian: vulkan-tools); it lists the Vulkan devices")
    done = subprocess.run(["vulkaninfo", "--summary"], capture_output=True, text=True, timeout=60)
    devices: list[dict[str, str]] = []
    for line in done.stdout.splitlines():
        head = re.match(r"^GPU(\d+):\s*$", line)
        if head:
            devices.append({"index": head.group(1), "name": "", "type": ""})
        elif devices and "=" in line:
            key, _, value = (part.strip() for part in line.partition("="))
            if key == "deviceName":
                devices[-1]["name"] = value
            elif key == "deviceType":
                devices[-1]["type"] = value
    return devices


def runtime(backend: str, *, build: bool = False, software: bool = False) -> BackendRuntime:
    """The runtime of ``backend``, checked: its build is in the cache and it sees at least one device.

    ``build`` builds it when it is missing (minutes; cached after). ``software`` lets
    Vulkan use a software renderer (llvmpipe), which ggml skips unless told: a machine
    without a GPU can then run the real Vulkan code path on its CPU (tests). Raises
    :class:`BackendNotBuiltError` or :class:`NoDeviceError`.
    """
    return _runtime(backend, build, software)


@functools.cache
def _runtime(backend: str, build: bool, software: bool) -> BackendRuntime:
    if backend == "cpu":
        return CPU
    found = locate(backend)
    if found["site"] is None:
        command = " ".join(build_command(backend))
        if found["missing"]:
            lacks = "; ".join(found["missing"])
            raise BackendNotBuiltError(
                f"the {backend} build is not in the cache and cannot be built here: {lacks}; "
                f"with that installed, build it with `{command}`"
            )
        if not build:
            raise BackendNotBuiltError(f"the {backend} build is not in the cache; build it with `{command}`")
        done = subprocess.run(build_command(backend), capture_output=True, text=True)
        if done.returncode != 0:
            raise BackendNotBuiltError(f"`{command}` failed:\n{(done.stdout + done.stderr)[-4000:]}")
        found = locate(backend)
        if found["site"] is None:
            raise BackendNotBuiltError(f"`{command}` succeeded but left no site folder")
    env: tuple[tuple[str, str], ...] = ()
    if backend == "vulkan" and software:
        indices = [device["index"] for device in vulkan_devices()]
        if not indices:
            raise NoDeviceError("the Vulkan loader lists no device (Debian: mesa-vulkan-drivers has llvmpipe)")
        env = (("GGML_VK_VISIBLE_DEVICES", ",".join(indices)),)
    result = BackendRuntime(backend, Path(found["site"]), env)
    own = [d for d in result.devices() if d["registry"] in REGISTRY_NAMES[backend]]
    if not own:
        hint = " (a software renderer counts only with software=True)" if backend == "vulkan" and not software else ""
        raise NoDeviceError(f"the {backend} build sees no {backend} device{hint}")
    return result
