"""Build (or take from the cache) the patched llama-cpp-python wheel and install it.

Standard library only: this runs before the project's virtual environment has
anything in it.

    python3 kernels_patch/build.py --python .venv/bin/python [--install]
    python3 kernels_patch/build.py --python .venv/bin/python --server   # llama-server, the serving baseline

Steps: download the pinned sdist with pip, verify its sha256, apply the patch
series in ``kernels_patch/patches`` to its vendored llama.cpp, give the package
a local version label carrying the patch hash, build the wheel with explicit
CMake flags, and keep it in a cache outside the clone. The cache key is the
sdist hash + patch hash + flags + CPU features, so a second run does not build.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

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


class BuildError(RuntimeError):
    """The wheel could not be produced; the message says why and what to do."""


def patch_files() -> list[Path]:
    """The patch series, in the order it applies."""
    files = sorted(PATCH_DIR.glob("*.patch"))
    if not files:
        raise BuildError(f"no patches found in {PATCH_DIR}")
    return files


def patch_hash() -> str:
    """A short hash over the names and contents of the patch series."""
    digest = hashlib.sha256()
    for path in patch_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def local_version() -> str:
    """The version the patched wheel carries, e.g. ``0.3.36+nr.1a2b3c4d5e6f``."""
    return f"{SDIST_VERSION}+nr.{patch_hash()}"


def cpu_features() -> str:
    """Machine architecture plus the SIMD flags that -march=native depends on."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags.update(f for f in line.split(":", 1)[1].split() if f.startswith(_CPU_FLAG_PREFIXES))
                break
    return platform.machine() + ":" + ",".join(sorted(flags))


def cache_key() -> str:
    """Everything that changes the built binary: sdist, patches, flags, CPU."""
    parts = [SDIST_SHA256, patch_hash(), " ".join(CMAKE_ARGS), cpu_features()]
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


def apply_patches(source: Path) -> None:
    """Apply every patch to the vendored llama.cpp; any rejected hunk is an error."""
    target = source / "vendor" / "llama.cpp"
    for patch in patch_files():
        result = subprocess.run(
            ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-d", str(target), "-i", str(patch)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise BuildError(f"{patch.name} does not apply:\n{result.stdout}{result.stderr}")


def marker() -> dict[str, object]:
    """What the wheel built now records about itself: patch, commit, flags, CPU."""
    return {
        "patch_hash": patch_hash(),
        "patches": [p.name for p in patch_files()],
        "llama_cpp_commit": LLAMA_CPP_COMMIT,
        "sdist_sha256": SDIST_SHA256,
        "cmake_args": CMAKE_ARGS,
        "cpu_features": cpu_features(),
    }


def label_package(source: Path) -> None:
    """Give the package the local version and a marker naming the patch."""
    init = source / "llama_cpp" / "__init__.py"
    text = init.read_text()
    stock = f'__version__ = "{SDIST_VERSION}"'
    if stock not in text:
        raise BuildError(f"cannot find {stock!r} in {init}")
    init.write_text(text.replace(stock, f'__version__ = "{local_version()}"'))
    (source / "llama_cpp" / MARKER_NAME).write_text(json.dumps(marker(), indent=2) + "\n")


def build_wheel(python: str, out_dir: Path) -> Path:
    """Build the patched wheel into ``out_dir`` and return its path."""
    # first: pip prepares the sdist's metadata even to download it, with this backend
    subprocess.run([python, "-m", "pip", "install", "--quiet", *BUILD_REQUIREMENTS], check=True)
    sdist = fetch_sdist(python)
    with tempfile.TemporaryDirectory(prefix="nr-llama-build-") as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = Path(tmp) / f"{SDIST_NAME}-{SDIST_VERSION}"
        apply_patches(source)
        label_package(source)
        env = dict(os.environ)
        cmake_args = list(CMAKE_ARGS)
        if shutil.which("ccache"):
            # a compiler cache does not change the binary, so it is not part of the key
            cmake_args += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
            env.setdefault("CCACHE_DIR", str(cache_root() / "ccache"))
            # hits across builds from different temporary directories
            env.setdefault("CCACHE_BASEDIR", str(source))
            env.setdefault("CCACHE_NOHASHDIR", "true")
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        started = time.monotonic()
        print(f"kernels_patch: building llama-cpp-python {local_version()} (several minutes)", flush=True)
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
                "cmake.args=" + ";".join(cmake_args),
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


def cached_wheel(python: str) -> Path:
    """The wheel for this patch, flags and CPU: from the cache, or built now."""
    slot = cache_root() / "wheels" / cache_key()
    with _locked(cache_root() / "wheels" / ".lock"):
        found = sorted(slot.glob("llama_cpp_python-*.whl"))
        digest_file = slot / "wheel.sha256"
        if found and digest_file.exists() and sha256_file(found[0]) == digest_file.read_text().strip():
            return found[0]
        shutil.rmtree(slot, ignore_errors=True)
        staging = slot.with_name(slot.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        wheel = build_wheel(python, staging)
        (staging / "wheel.sha256").write_text(sha256_file(wheel) + "\n")
        os.replace(staging, slot)
        return slot / wheel.name


def build_server(python: str, out_dir: Path) -> Path:
    """Build llama.cpp's ``llama-server`` from the same patched sources and flags as the wheel.

    The baseline a user would run instead of this project (``benchmarks.serving``): the
    same commit, the same CMake flags, the same patches (which change nothing outside
    ranged shards, so the whole-model server is llama.cpp's own).
    """
    subprocess.run([python, "-m", "pip", "install", "--quiet", *BUILD_REQUIREMENTS], check=True)
    cmake = Path(python).parent / "cmake"
    sdist = fetch_sdist(python)
    with tempfile.TemporaryDirectory(prefix="nr-llama-server-") as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = Path(tmp) / f"{SDIST_NAME}-{SDIST_VERSION}"
        apply_patches(source)
        llama = source / "vendor" / "llama.cpp"
        build = Path(tmp) / "build"
        env = dict(os.environ)
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
            *CMAKE_ARGS,
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


def cached_server(python: str) -> Path:
    """``llama-server`` for this patch, flags and CPU: from the cache (keyed as the wheel is), or built now."""
    slot = cache_root() / "servers" / cache_key()
    with _locked(cache_root() / "servers" / ".lock"):
        binary = slot / "llama-server"
        digest_file = slot / "llama-server.sha256"
        if binary.exists() and digest_file.exists() and sha256_file(binary) == digest_file.read_text().strip():
            return binary
        shutil.rmtree(slot, ignore_errors=True)
        staging = slot.with_name(slot.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        built = build_server(python, staging)
        (staging / "llama-server.sha256").write_text(sha256_file(built) + "\n")
        (staging / "marker.json").write_text(json.dumps(marker(), indent=2) + "\n")
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
    parser.add_argument("--install", action="store_true", help="install the wheel into that environment")
    parser.add_argument("--print-version", action="store_true", help="print the local version and exit")
    parser.add_argument("--server", action="store_true", help="build (or take from the cache) llama-server instead")
    args = parser.parse_args(argv)
    if args.print_version:
        print(local_version())
        return 0
    if args.server:
        try:
            print(cached_server(args.python))
        except (BuildError, subprocess.CalledProcessError, OSError) as exc:
            print(f"kernels_patch: error: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        wheel = cached_wheel(args.python)
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
