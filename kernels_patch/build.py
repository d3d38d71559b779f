"""Build (or take from the cache) the patched llama-cpp-python wheel and install it.

Standard library only: this runs before the project's virtual environment has
anything in it.

    python3 kernels_patch/build.py --python .venv/bin/python [--install]
    python3 kernels_patch/build.py --python .venv/bin/python --server   # llama-server, the serving baseline
    python3 kernels_patch/build.py --python .venv/bin/python --backend vulkan --install
    python3 kernels_patch/build.py --python .venv/bin/python --backend vulkan --locate   # JSON, builds nothing

Steps: download the pinned sdist with pip, verify its sha256, apply the patch
series in ``kernels_patch/patches`` (and ``patches/<backend>/`` for a GPU backend)
to its vendored llama.cpp, give the package a local version label carrying the
patch hash (and the backend), build the wheel with explicit CMake flags, and keep
it in a cache outside the clone. The cache key is the sdist hash + patch hash +
flags + CPU features (+ backend), so a second run does not build.

``--backend cpu`` (the default) installs into the environment. A GPU backend's
``--install`` unpacks the wheel into its own folder, ``<cache>/backends/<key>/site``:
the environment keeps the CPU wheel, and a process that serves on the GPU runs with
that folder first on ``PYTHONPATH`` (see docs/gates.md, "Backends").
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
PATCH_DIR = HERE / "patches"

SDIST_NAME = "llama_cpp_python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# the llama.cpp commit vendored by that sdist
LLAMA_CPP_COMMIT = "0c1e57098"

# Build tools, pinned; installed into the target environment (no build isolation).
BUILD_REQUIREMENTS = ["scikit-build-core==1.1.2", "cmake==4.4.5", "ninja==1.13.2"]

CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # the cache key carries the CPU features for this reason
    "-DGGML_OPENMP=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_BLAS=OFF",
    "-DGGML_RPC=OFF",
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
]
if platform.machine() in ("x86_64", "AMD64"):
    # -march=native compiles ggml's AMX matmul in on CPUs that have AMX, and that kernel
    # segfaults on some models (a known, unfixed upstream bug; the tests' own models hit
    # it); the AVX-512 kernels serve those CPUs instead
    _NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_ARGS += [f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]

# CPU flags that change what GGML_NATIVE compiles; other cpuinfo flags do not matter.
_CPU_FLAG_PREFIXES = (
    "avx",
    "fma",
    "f16c",
    "sse",
    "ssse",
    "amx",
    "bmi",
    "vnni",
    "sve",
    "neon",
    "asimd",
    "i8mm",
    "dotprod",
)

MARKER_NAME = "_noderuntime_patch.json"

BACKENDS = ("cpu", "vulkan", "cuda", "hip", "metal")
# Turing, Ampere (A100 and RTX 30), Ada (RTX 40), Blackwell (RTX 50); a plain number is
# SASS plus PTX, so newer cards JIT from the highest below them (Hopper from 89). The
# pinned CMake turns 120 into 120a (needs CUDA 12.8).
DEFAULT_CUDA_ARCH = "75;80;86;89;120"
# RDNA2 (RX 6000), RDNA3 (RX 7000: Navi 31, 32, 33), RDNA4 (RX 9000)
DEFAULT_HIP_TARGETS = "gfx1030;gfx1100;gfx1101;gfx1102;gfx1200;gfx1201"
# the ggml switch each GPU backend turns on
_SWITCH = {"vulkan": "GGML_VULKAN", "cuda": "GGML_CUDA", "hip": "GGML_HIP", "metal": "GGML_METAL"}


class BuildError(RuntimeError):
    """The wheel could not be produced; the message says why and what to do."""


# a NamedTuple, not a dataclass: tests load this file by path, outside sys.modules, where a
# dataclass with postponed annotations cannot be made
class Target(NamedTuple):
    """What a build is for: the ggml backend, for CUDA and HIP the GPU architectures, and
    for the CPU the instruction sets its kernels use (``native``: this machine's own)."""

    backend: str = "cpu"
    cuda_arch: str = DEFAULT_CUDA_ARCH
    hip_targets: str = DEFAULT_HIP_TARGETS
    cpu_isa: str = "native"

    @property
    def is_cpu(self) -> bool:
        """The default build, installed into the environment itself."""
        return self.backend == "cpu" and self.cpu_isa == "native"

    @property
    def label(self) -> str:
        """The build's name beside the CPU wheel's: ``vulkan``, ``cpu-avx2``."""
        return self.backend if self.backend != "cpu" else f"cpu-{self.cpu_isa}"


CPU = Target()

# CPU builds other than GGML_NATIVE's, by the instruction sets their kernels may use: the
# same sources compiled for an older CPU, which sums in other orders (a drift class of its
# own), for measuring what a node built on another machine computes
CPU_ISAS: dict[str, list[str]] = {
    "native": [],
    "avx2": [
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_BMI2=ON",
        "-DGGML_AVX_VNNI=OFF",
        "-DGGML_AVX512=OFF",
        "-DGGML_AVX512_VBMI=OFF",
        "-DGGML_AVX512_VNNI=OFF",
        "-DGGML_AVX512_BF16=OFF",
    ],
}


def patch_files(target: Target = CPU) -> list[Path]:
    """The patch series, in the order it applies: the shared ones, then the backend's own."""
    files = sorted(PATCH_DIR.glob("*.patch"))
    if not files:
        raise BuildError(f"no patches found in {PATCH_DIR}")
    # a backend's patches touch only its own sources; kept apart so the CPU wheel's
    # patch hash (and so its cache key and version) does not move when they change
    return files + sorted((PATCH_DIR / target.backend).glob("*.patch")) if not target.is_cpu else files


def _patch_name(path: Path) -> str:
    """``0003-x.patch`` for a shared patch, ``vulkan/0007-y.patch`` for a backend's."""
    return path.relative_to(PATCH_DIR).as_posix()


def patch_hash(target: Target = CPU) -> str:
    """A short hash over the names and contents of the patch series."""
    digest = hashlib.sha256()
    for path in patch_files(target):
        digest.update(_patch_name(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def local_version(target: Target = CPU) -> str:
    """The version the patched wheel carries: ``0.3.36+nr.1a2b3c4d5e6f``, ``...+nr.<hash>.vulkan``."""
    label = f"{SDIST_VERSION}+nr.{patch_hash(target)}"
    return label if target.is_cpu else f"{label}.{target.label}"


def cmake_args(target: Target = CPU) -> list[str]:
    """The CMake flags of a build: the CPU wheel's, with the backend's switch on and its architectures."""
    if target.is_cpu:
        return list(CMAKE_ARGS)
    if target.backend == "cpu":
        if target.cpu_isa not in CPU_ISAS:
            raise BuildError(f"unknown CPU instruction sets {target.cpu_isa!r}; choose one of {', '.join(CPU_ISAS)}")
        return [arg for arg in CMAKE_ARGS if arg != "-DGGML_NATIVE=ON"] + CPU_ISAS[target.cpu_isa]
    if target.backend not in _SWITCH:
        raise BuildError(f"unknown backend {target.backend!r}; choose one of {', '.join(BACKENDS)}")
    switch = _SWITCH[target.backend]
    args = [f"-D{switch}=ON" if arg == f"-D{switch}=OFF" else arg for arg in CMAKE_ARGS]
    if f"-D{switch}=ON" not in args:
        args.append(f"-D{switch}=ON")
    if target.backend == "cuda":
        # explicit: GGML_NATIVE would otherwise ask for the build machine's own GPU ("native")
        args.append(f"-DCMAKE_CUDA_ARCHITECTURES={target.cuda_arch}")
    elif target.backend == "hip":
        args.append(f"-DGPU_TARGETS={target.hip_targets}")  # the pinned CMake also reads AMDGPU_TARGETS
    return args


def _found(patterns: list[str]) -> bool:
    return any(glob.glob(pattern) for pattern in patterns)


def missing_toolchain(target: Target = CPU) -> list[str]:
    """What the backend's build needs and this machine lacks, each with the package that has it.

    Checked before anything is downloaded or compiled, so a missing header is one clear
    line, not a CMake error ten minutes in.
    """
    missing: list[str] = []
    sdk = os.environ.get("VULKAN_SDK", "/nonexistent")
    if target.backend == "vulkan":
        if not (shutil.which("glslc") or Path(sdk, "bin", "glslc").exists()):
            missing.append("glslc, the GLSL to SPIR-V compiler (Debian: glslc)")
        if not _found([f"{d}/vulkan/vulkan.hpp" for d in (f"{sdk}/include", "/usr/include", "/usr/local/include")]):
            missing.append("the Vulkan C++ headers, vulkan/vulkan.hpp (Debian: libvulkan-dev)")
        libs = ["/usr/lib/*/libvulkan.so", "/usr/lib/libvulkan.so", "/usr/local/lib/libvulkan.*"]
        if not _found([*libs, f"{sdk}/lib/libvulkan.*"]):
            missing.append("the Vulkan loader to link against, libvulkan.so (Debian: libvulkan-dev)")
        spirv = "SPIRV-Headers/SPIRV-HeadersConfig.cmake"
        places = ["/usr/share/cmake", "/usr/lib/*/cmake", "/usr/local/share/cmake", "/usr/local/lib/cmake", sdk]
        if not _found([f"{p}/{spirv}" for p in places] + [f"{sdk}/**/{spirv}"]):
            missing.append("the SPIR-V headers' CMake package, SPIRV-HeadersConfig.cmake (Debian: spirv-headers)")
    elif target.backend == "cuda":
        cuda = os.environ.get("CUDA_PATH") or os.environ.get("CUDA_HOME") or "/usr/local/cuda"
        if not (shutil.which("nvcc") or Path(cuda, "bin", "nvcc").exists()):
            missing.append("nvcc, the CUDA Toolkit's compiler (NVIDIA CUDA Toolkit 12.8 or later for Blackwell)")
        # ggml-cuda links cuBLAS, which a toolkit installed as the compiler and runtime alone
        # lacks: CMake would fail at its generate step with "CUDA::cublas ... not found"
        roots = [cuda, "/usr/local/cuda*", "/usr"]
        libs = [f"{r}/{d}/libcublas.so*" for r in roots for d in ("lib64", "targets/*/lib", "lib/*")]
        if not _found(libs):
            missing.append("cuBLAS, which ggml's CUDA backend links (the toolkit's libcublas and its headers)")
    elif target.backend == "hip":
        if not _hipconfig():
            missing.append("hipconfig and the ROCm HIP compiler (AMD ROCm, e.g. /opt/rocm)")
    elif target.backend == "metal" and platform.system() != "Darwin":
        missing.append("macOS: the Metal backend builds only there")
    return missing


def _hipconfig() -> str | None:
    return shutil.which("hipconfig") or next(iter(glob.glob("/opt/rocm*/bin/hipconfig")), None)


def _backend_env(target: Target, env: dict[str, str]) -> None:
    """Environment a backend's CMake needs beyond its flags (HIP: which clang, where ROCm is)."""
    if target.backend == "hip":
        hipconfig = _hipconfig()
        if hipconfig:
            for name, flag in (("HIPCXX", "-l"), ("HIP_PATH", "-R")):
                if name not in env:
                    out = subprocess.run([hipconfig, flag], capture_output=True, text=True, check=True).stdout.strip()
                    env[name] = out + "/clang" if name == "HIPCXX" else out
    if target.backend == "cuda" and not shutil.which("nvcc"):
        cuda = env.get("CUDA_PATH") or env.get("CUDA_HOME") or "/usr/local/cuda"
        env["PATH"] = str(Path(cuda, "bin")) + os.pathsep + env.get("PATH", "")


def _check_toolchain(target: Target) -> None:
    missing = missing_toolchain(target)
    if missing:
        hint = ""
        if target.backend == "vulkan":
            hint = (
                "\non Debian or Ubuntu: apt-get install -y glslc libvulkan-dev spirv-headers"
                " (and mesa-vulkan-drivers vulkan-tools to run it)"
            )
        listed = "\n  - ".join(missing)
        raise BuildError(f"the {target.backend} build needs what this machine lacks:\n  - {listed}{hint}")


def cpu_features() -> str:
    """Machine architecture plus the SIMD flags that -march=native depends on."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags.update(f for f in line.split(":", 1)[1].split() if f.startswith(_CPU_FLAG_PREFIXES))
                break
    return platform.machine() + ":" + ",".join(sorted(flags))


def cache_key(target: Target = CPU) -> str:
    """Everything that changes the built binary: sdist, patches, flags, CPU (and backend)."""
    parts = [SDIST_SHA256, patch_hash(target), " ".join(cmake_args(target)), cpu_features()]
    if not target.is_cpu:  # the CPU key stays what it was before backends existed: its caches stay valid
        parts.append(f"backend={target.backend}" if target.backend != "cpu" else f"cpu_isa={target.cpu_isa}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cache_root() -> Path:
    """Where wheels and the sdist are kept, outside the clone."""
    env = os.environ.get("NODERUNTIME_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "noderuntime"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # Two `make` runs at once must not build twice or see half-written wheels.
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fetch_sdist(python: str) -> Path:
    """The pinned sdist, downloaded once into the cache and verified every time."""
    sdist_dir = cache_root() / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    path = sdist_dir / f"{SDIST_NAME}-{SDIST_VERSION}.tar.gz"
    if not path.exists():
        print(f"kernels_patch: downloading {SDIST_NAME}=={SDIST_VERSION} (sdist, ~77 MB)", flush=True)
        with tempfile.TemporaryDirectory(dir=sdist_dir) as tmp:
            subprocess.run(
                [
                    python,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "--no-build-isolation",
                    "--dest",
                    tmp,
                    f"llama-cpp-python=={SDIST_VERSION}",
                ],
                check=True,
            )
            got = list(Path(tmp).glob("*.tar.gz"))
            if len(got) != 1:
                raise BuildError(f"expected one sdist from pip download, got {got}")
            os.replace(got[0], path)
    actual = sha256_file(path)
    if actual != SDIST_SHA256:
        path.unlink()
        raise BuildError(
            f"sdist sha256 mismatch: expected {SDIST_SHA256}, got {actual}; the download was removed, run again"
        )
    return path


def apply_patches(source: Path, target: Target = CPU) -> None:
    """Apply every patch to the vendored llama.cpp; any rejected hunk is an error."""
    tree = source / "vendor" / "llama.cpp"
    for patch in patch_files(target):
        result = subprocess.run(
            ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-d", str(tree), "-i", str(patch)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise BuildError(f"{_patch_name(patch)} does not apply:\n{result.stdout}{result.stderr}")


def marker(target: Target = CPU) -> dict[str, object]:
    """What the wheel built now records about itself: patch, commit, flags, CPU, backend.

    A marker without ``backend`` is a CPU build: the CPU wheel's marker is what it was
    before backends existed, so a cached CPU wheel still matches it.
    """
    found: dict[str, object] = {
        "patch_hash": patch_hash(target),
        "patches": [_patch_name(p) for p in patch_files(target)],
        "llama_cpp_commit": LLAMA_CPP_COMMIT,
        "sdist_sha256": SDIST_SHA256,
        "cmake_args": cmake_args(target),
        "cpu_features": cpu_features(),
    }
    if target.backend != "cpu":
        found["backend"] = target.backend
    elif not target.is_cpu:
        found["cpu_isa"] = target.cpu_isa
    return found


def label_package(source: Path, target: Target = CPU) -> None:
    """Give the package the local version and a marker naming the patch."""
    init = source / "llama_cpp" / "__init__.py"
    text = init.read_text()
    stock = f'__version__ = "{SDIST_VERSION}"'
    if stock not in text:
        raise BuildError(f"cannot find {stock!r} in {init}")
    init.write_text(text.replace(stock, f'__version__ = "{local_version(target)}"'))
    (source / "llama_cpp" / MARKER_NAME).write_text(json.dumps(marker(target), indent=2) + "\n")


def build_wheel(python: str, out_dir: Path, target: Target = CPU) -> Path:
    """Build the patched wheel into ``out_dir`` and return its path."""
    _check_toolchain(target)
    # first: pip prepares the sdist's metadata even to download it, with this backend
    subprocess.run([python, "-m", "pip", "install", "--quiet", *BUILD_REQUIREMENTS], check=True)
    sdist = fetch_sdist(python)
    with tempfile.TemporaryDirectory(prefix="nr-llama-build-") as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = Path(tmp) / f"{SDIST_NAME}-{SDIST_VERSION}"
        apply_patches(source, target)
        label_package(source, target)
        env = dict(os.environ)
        _backend_env(target, env)
        flags = cmake_args(target)
        if shutil.which("ccache"):
            # a compiler cache does not change the binary, so it is not part of the key
            flags += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
            env.setdefault("CCACHE_DIR", str(cache_root() / "ccache"))
            # hits across builds from different temporary directories
            env.setdefault("CCACHE_BASEDIR", str(source))
            env.setdefault("CCACHE_NOHASHDIR", "true")
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        # scikit-build-core splits cmake.args at ";", so a CMake list (CUDA architectures,
        # HIP targets) travels in CMAKE_ARGS, which it splits like a shell; nothing else
        # may come in that way: the flags are the ones the cache key names
        listed = [flag for flag in flags if ";" in flag]
        flags = [flag for flag in flags if ";" not in flag]
        env["CMAKE_ARGS"] = " ".join(shlex.quote(flag) for flag in listed)
        started = time.monotonic()
        print(f"kernels_patch: building llama-cpp-python {local_version(target)} (several minutes)", flush=True)
        subprocess.run(
            [
                python,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "--wheel-dir",
                str(out_dir),
                "-C",
                "cmake.args=" + ";".join(flags),
                "-C",
                "cmake.build-type=Release",
                "-C",
                f"build-dir={source / 'build'}",
                str(source),
            ],
            check=True,
            env=env,
        )
        print(f"kernels_patch: built in {time.monotonic() - started:.0f} s", flush=True)
    wheels = list(out_dir.glob("llama_cpp_python-*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"expected one wheel in {out_dir}, found {wheels}")
    return wheels[0]


def _cached(slot: Path) -> Path | None:
    found = sorted(slot.glob("llama_cpp_python-*.whl"))
    digest_file = slot / "wheel.sha256"
    if found and digest_file.exists() and sha256_file(found[0]) == digest_file.read_text().strip():
        return found[0]
    return None


def cached_wheel(python: str, target: Target = CPU) -> Path:
    """The wheel for this patch, flags and CPU: from the cache, or built now."""
    slot = cache_root() / "wheels" / cache_key(target)
    with _locked(cache_root() / "wheels" / ".lock"):
        found = _cached(slot)
        if found is not None:
            return found
        shutil.rmtree(slot, ignore_errors=True)
        staging = slot.with_name(slot.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        wheel = build_wheel(python, staging, target)
        (staging / "wheel.sha256").write_text(sha256_file(wheel) + "\n")
        os.replace(staging, slot)
        return slot / wheel.name


def site_dir(target: Target) -> Path:
    """Where a GPU backend's wheel is unpacked for ``PYTHONPATH``: ``<cache>/backends/<key>/site``."""
    return cache_root() / "backends" / cache_key(target) / "site"


def _installed_site(target: Target) -> Path | None:
    site = site_dir(target)
    wheel = _cached(cache_root() / "wheels" / cache_key(target))
    stamp = site.with_name("wheel.sha256")
    if wheel is None or not stamp.exists() or not (site / "llama_cpp" / MARKER_NAME).exists():
        return None
    return site if stamp.read_text().strip() == (wheel.parent / "wheel.sha256").read_text().strip() else None


def install_site(python: str, target: Target) -> Path:
    """Unpack the backend's wheel (built now if need be) into its own folder; the environment is untouched.

    ``pip install --target`` without dependencies: the folder holds ``llama_cpp`` and its
    dist-info only, and the environment's numpy and jinja2 serve it.
    """
    wheel = cached_wheel(python, target)
    site = site_dir(target)
    with _locked(site.parent.parent / ".lock"):
        if _installed_site(target) is not None:
            return site
        staging = site.parent.with_name(site.parent.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        subprocess.run(
            [python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(staging / "site"), str(wheel)],
            check=True,
        )
        shutil.copy2(wheel.parent / "wheel.sha256", staging / "wheel.sha256")
        shutil.rmtree(site.parent, ignore_errors=True)
        os.replace(staging, site.parent)
    return site


def locate(target: Target) -> dict[str, object]:
    """Where a build is, if it is anywhere, and what its toolchain lacks; builds nothing."""
    wheel = _cached(cache_root() / "wheels" / cache_key(target))
    site = None if target.is_cpu else _installed_site(target)
    return {
        "backend": target.backend,
        "key": cache_key(target),
        "version": local_version(target),
        "patch_hash": patch_hash(target),
        "wheel": str(wheel) if wheel else None,
        "site": str(site) if site else None,
        "missing": missing_toolchain(target),
    }


def build_server(python: str, out_dir: Path, target: Target = CPU) -> Path:
    """Build llama.cpp's ``llama-server`` from the same patched sources and flags as the wheel.

    The baseline a user would run instead of this project (``benchmarks.serving``): the
    same commit, the same CMake flags, the same patches (which change nothing outside
    ranged shards, so the whole-model server is llama.cpp's own).
    """
    _check_toolchain(target)
    subprocess.run([python, "-m", "pip", "install", "--quiet", *BUILD_REQUIREMENTS], check=True)
    cmake = Path(python).parent / "cmake"
    sdist = fetch_sdist(python)
    with tempfile.TemporaryDirectory(prefix="nr-llama-server-") as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = Path(tmp) / f"{SDIST_NAME}-{SDIST_VERSION}"
        apply_patches(source, target)
        llama = source / "vendor" / "llama.cpp"
        build = Path(tmp) / "build"
        env = dict(os.environ)
        _backend_env(target, env)
        launcher: list[str] = []
        if shutil.which("ccache"):
            launcher = ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
            env.setdefault("CCACHE_DIR", str(cache_root() / "ccache"))
            env.setdefault("CCACHE_BASEDIR", str(tmp))
            env.setdefault("CCACHE_NOHASHDIR", "true")
        started = time.monotonic()
        print("kernels_patch: building llama-server (a few minutes)", flush=True)
        configure = [
            str(cmake),
            "-S",
            str(llama),
            "-B",
            str(build),
            "-G",
            "Ninja",
            *cmake_args(target),
            *launcher,
            "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_CURL=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
        ]
        env["PATH"] = str(Path(python).parent) + os.pathsep + env.get("PATH", "")  # ninja from the venv
        subprocess.run(configure, check=True, env=env, stdout=subprocess.DEVNULL)
        jobs = str(os.cpu_count() or 2)
        subprocess.run([str(cmake), "--build", str(build), "--target", "llama-server", "-j", jobs], check=True, env=env)
        binary = build / "bin" / "llama-server"
        if not binary.exists():
            raise BuildError(f"the build made no {binary}")
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(binary, out_dir / "llama-server")
        print(f"kernels_patch: built llama-server in {time.monotonic() - started:.0f} s", flush=True)
    return out_dir / "llama-server"


def cached_server(python: str, target: Target = CPU) -> Path:
    """``llama-server`` for this patch, flags and CPU: from the cache (keyed as the wheel is), or built now."""
    slot = cache_root() / "servers" / cache_key(target)
    with _locked(cache_root() / "servers" / ".lock"):
        binary = slot / "llama-server"
        digest_file = slot / "llama-server.sha256"
        if binary.exists() and digest_file.exists() and sha256_file(binary) == digest_file.read_text().strip():
            return binary
        shutil.rmtree(slot, ignore_errors=True)
        staging = slot.with_name(slot.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        built = build_server(python, staging, target)
        (staging / "llama-server.sha256").write_text(sha256_file(built) + "\n")
        (staging / "marker.json").write_text(json.dumps(marker(target), indent=2) + "\n")
        os.replace(staging, slot)
        return slot / "llama-server"


def installed_marker(python: str) -> dict[str, object] | None:
    """The marker of the llama-cpp-python installed in the target environment, if it has one."""
    probe = (
        "import importlib.util, pathlib, sys\n"
        "spec = importlib.util.find_spec('llama_cpp')\n"
        "for d in (spec.submodule_search_locations or []) if spec else []:\n"
        f"    p = pathlib.Path(d) / {MARKER_NAME!r}\n"
        "    if p.exists(): sys.stdout.write(p.read_text()); break\n"
    )
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout
    try:
        found = json.loads(out) if out else None
    except json.JSONDecodeError:
        return None
    return found if isinstance(found, dict) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="interpreter of the target environment")
    parser.add_argument(
        "--install",
        action="store_true",
        help="install the wheel: cpu into that environment, a GPU backend into <cache>/backends/<key>/site",
    )
    parser.add_argument("--print-version", action="store_true", help="print the local version and exit")
    parser.add_argument("--server", action="store_true", help="build (or take from the cache) llama-server instead")
    parser.add_argument("--backend", choices=BACKENDS, default="cpu", help="the ggml backend to build (default cpu)")
    parser.add_argument("--cuda-arch", default=DEFAULT_CUDA_ARCH, help="CMAKE_CUDA_ARCHITECTURES for --backend cuda")
    parser.add_argument("--hip-targets", default=DEFAULT_HIP_TARGETS, help="GPU_TARGETS for --backend hip")
    parser.add_argument(
        "--cpu-isa",
        choices=CPU_ISAS,
        default="native",
        help="for --backend cpu: the instruction sets of its kernels; other than native, installed as a GPU "
        "backend's is (a drift class of its own, for comparing builds)",
    )
    parser.add_argument(
        "--locate", action="store_true", help="print where the build is cached (JSON) and what its toolchain lacks"
    )
    args = parser.parse_args(argv)
    if args.cpu_isa != "native" and args.backend != "cpu":
        parser.error("--cpu-isa goes with --backend cpu")
    target = Target(args.backend, cuda_arch=args.cuda_arch, hip_targets=args.hip_targets, cpu_isa=args.cpu_isa)
    if args.print_version:
        print(local_version(target))
        return 0
    if args.locate:
        print(json.dumps(locate(target)))
        return 0
    if args.server:
        try:
            print(cached_server(args.python, target))
        except (BuildError, subprocess.CalledProcessError, OSError) as exc:
            print(f"kernels_patch: error: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        if not target.is_cpu and args.install:
            site = install_site(args.python, target)
            print(f"kernels_patch: llama-cpp-python {local_version(target)} in {site}")
            print(f"kernels_patch: a process runs this build with PYTHONPATH={site}")
            return 0
        wheel = cached_wheel(args.python, target)
        print(f"kernels_patch: wheel {wheel}")
        if args.install:
            # the same version can be built with other flags (or for another CPU): the
            # marker, not the version, says whether the installed build is this one
            if installed_marker(args.python) == json.loads(json.dumps(marker())):
                print(f"kernels_patch: llama-cpp-python {local_version()} already installed")
            else:
                subprocess.run(
                    [args.python, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--quiet", str(wheel)],
                    check=True,
                )
                print(f"kernels_patch: installed llama-cpp-python {local_version()}")
    except (BuildError, subprocess.CalledProcessError) as exc:
        print(f"kernels_patch: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
