"""Gate B on Vulkan: shards in separate processes equal the whole model on Vulkan, bit for bit.

The chain's processes and the whole model's each load the Vulkan build of llama.cpp from
its own folder (``noderuntime.engine.backends``); this process keeps the CPU build. On a
machine without a GPU the device is Mesa's llvmpipe, a software renderer that runs ggml's
real Vulkan shaders on the CPU. The Vulkan tests skip, saying why, when this machine cannot
build the backend (glslc, libvulkan-dev, spirv-headers) or has no Vulkan device (listed by
vulkan-tools' vulkaninfo; mesa-vulkan-drivers has llvmpipe); the first run builds the wheel
into the cache (minutes), later runs take it from there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from noderuntime.engine import memplan
from noderuntime.engine.backends import BackendMismatchError, BackendRuntime
from noderuntime.engine.llama import Recipe, ShardEngine
from noderuntime.models import gguf
from noderuntime.verify.parity import check_parity

from . import buildscript

ROOT = Path(__file__).resolve().parents[1]
VULKAN = Recipe(n_threads=2, n_ctx_per_seq=512, n_seq_max=2, n_batch=512, n_ubatch=512, device="vulkan:0")


def test_the_vulkan_build_has_its_own_patches_key_and_version() -> None:
    build = buildscript.load()
    cpu, vulkan = build.Target("cpu"), build.Target("vulkan")
    # the Vulkan-only patch stays out of the CPU series: the CPU wheel's key is what it was
    assert not any("vulkan" in path.as_posix() for path in build.patch_files())
    assert build.patch_files(vulkan)[-1].name == "0008-vulkan-without-layer-settings.patch"
    assert build.cache_key() == build.cache_key(cpu) != build.cache_key(vulkan)
    assert build.local_version(vulkan) == f"0.3.36+nr.{build.patch_hash(vulkan)}.vulkan"
    assert "-DGGML_VULKAN=ON" in build.cmake_args(vulkan) and "-DGGML_VULKAN=OFF" in build.cmake_args()
    assert "backend" not in build.marker() and build.marker(vulkan)["backend"] == "vulkan"
    cuda = build.cmake_args(build.Target("cuda", cuda_arch="86;89"))
    assert "-DGGML_CUDA=ON" in cuda and "-DCMAKE_CUDA_ARCHITECTURES=86;89" in cuda
    assert "-DGPU_TARGETS=gfx1100" in build.cmake_args(build.Target("hip", hip_targets="gfx1100"))


def test_a_cpu_build_for_other_instruction_sets_is_kept_apart() -> None:
    build = buildscript.load()
    avx2 = build.Target("cpu", cpu_isa="avx2")
    assert not avx2.is_cpu and build.Target("cpu").is_cpu  # installed apart, as a GPU backend's build
    assert build.patch_files(avx2) == build.patch_files()  # the same sources and patches
    flags = build.cmake_args(avx2)
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags and "-DGGML_AVX512=OFF" in flags
    assert "-DGGML_NATIVE=ON" not in flags and "-DGGML_NATIVE=ON" in build.cmake_args()
    assert build.cache_key(avx2) not in (build.cache_key(), build.cache_key(build.Target("vulkan")))
    assert build.local_version(avx2) == f"0.3.36+nr.{build.patch_hash()}.cpu-avx2"
    # a CPU build to the engine (no backend named), which says which instruction sets it has
    assert "backend" not in build.marker(avx2) and build.marker(avx2)["cpu_isa"] == "avx2"
    with pytest.raises(build.BuildError, match="instruction sets"):
        build.cmake_args(build.Target("cpu", cpu_isa="avx9"))


def test_the_device_is_part_of_the_recipe_and_its_fingerprint() -> None:
    cpu, gpu = Recipe(), Recipe(device="vulkan:0")
    assert cpu.describe("Q4_1")["device"] == "cpu" and gpu.describe("Q4_1")["gpu_layers"] == "all"
    assert cpu.fingerprint("Q4_1") != gpu.fingerprint("Q4_1")
    # which GPU of a node runs a shard is its owner's choice, as threads are; how many layers it holds is not
    assert gpu.fingerprint("Q4_1") == Recipe(device="vulkan:1").fingerprint("Q4_1")
    assert gpu.fingerprint("Q4_1") != Recipe(device="vulkan:0", gpu_layers=2).fingerprint("Q4_1")
    for bad in ({"device": "gpu"}, {"device": "vulkan"}, {"device": "cpu", "gpu_layers": 3}):
        with pytest.raises(ValueError):
            Recipe(**bad)  # type: ignore[arg-type]


def test_a_gpu_device_needs_its_backends_build(tiny_model: Path) -> None:
    # this process loaded the CPU build: a Vulkan shard here is a typed error, not a CPU shard
    with pytest.raises(BackendMismatchError, match="needs the vulkan build"):
        ShardEngine(tiny_model, VULKAN)


def test_a_vulkan_shard_holds_its_layers_and_kv_on_the_device(vulkan: BackendRuntime, tiny_model: Path) -> None:
    probe = textwrap.dedent(f"""
        import json, logging
        records = []
        class Keep(logging.Handler):
            def emit(self, record): records.append(record.getMessage())
        log = logging.getLogger("noderuntime.llama_cpp")
        log.setLevel(logging.DEBUG)
        log.addHandler(Keep())
        from noderuntime.engine.llama import Recipe, ShardEngine, build_info
        from noderuntime.models.artifacts import LayerRange
        recipe = Recipe(n_threads=2, n_ctx_per_seq=256, n_seq_max=1, n_batch=64, n_ubatch=64, device="vulkan:0")
        with ShardEngine({str(tiny_model)!r}, recipe, LayerRange(1, 3)) as engine:
            print(json.dumps({{"backend": build_info()["backend"], "log": records}}))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=vulkan.environ())
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["backend"] == "vulkan"
    log = "\n".join(report["log"])
    assert "Vulkan0 model buffer size" in log, log
    assert "Vulkan0 KV buffer size" in log, log
    assert "CPU KV buffer size" not in log, log


def test_a_vulkan_shards_plan_puts_its_layers_on_the_device_and_sizes_both_sides_exactly(
    vulkan: BackendRuntime, smollm2: Path
) -> None:
    probe = textwrap.dedent(f"""
        import json
        from noderuntime.engine import memplan
        from noderuntime.engine.llama import Recipe, ShardEngine
        from noderuntime.models.artifacts import LayerRange
        recipe = Recipe(n_threads=2, n_ctx_per_seq=512, n_seq_max=2, n_batch=64, n_ubatch=64, device="vulkan:0")
        out = {{}}
        for layers in (LayerRange(0, 12), LayerRange(12, 30)):
            planned = memplan.needs({str(smollm2)!r}, layers, recipe)
            with ShardEngine({str(smollm2)!r}, memplan.capped(recipe), layers) as engine:
                real = engine.memory()
            out[str(layers)] = {{
                "planned": [planned.weights, planned.kv, planned.compute, planned.on_device, planned.host],
                "real": [real.weights, real.kv, real.compute, real.device, real.host],
                "real_kv_on_host": real.host_kv,
                "real_weights_on_host": real.host_weights,
            }}
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=vulkan.environ())
    assert done.returncode == 0, done.stderr[-3000:]
    embeddings = next(t.n_bytes for t in gguf.read(smollm2).tensors if t.name == "token_embd.weight")
    for layers, report in json.loads(done.stdout.strip().splitlines()[-1]).items():
        weights, kv, compute, on_device, host = report["planned"]
        # the dry run sizes what the load allocates: the device's side exactly, the host's to
        # within the alignment padding of its buffers (32 bytes each seen on llvmpipe)
        assert on_device == report["real"][3], layers
        for planned, real in zip(report["planned"][:3], report["real"][:3], strict=True):
            assert abs(planned - real) <= 256, (layers, report)
        assert abs(host - memplan.RUNTIME_BYTES - report["real"][4]) <= 256, (layers, report)
        # the KV and the layers are the device's; the host keeps the token embeddings only
        # (a head shard's input lookup; the tied output copy sits on the device)
        assert report["real_kv_on_host"] == 0 and kv < on_device <= weights + kv + compute
        on_host = embeddings if layers.startswith("0:") else 0
        assert abs(report["real_weights_on_host"] - on_host) <= 256, (layers, report)


def test_tiny_random_model_shards_equal_whole_model_on_vulkan(vulkan: BackendRuntime, tiny_model: Path) -> None:
    report = check_parity(tiny_model, [0, 1, 3, 4], n_tokens=32, prompt_lengths=(5, 17), recipe=VULKAN, runtime=vulkan)
    assert report["recipe"]["backend"] == "vulkan" and report["recipe"]["device"] == "vulkan:0"
    assert report["parity"], report


def test_smollm2_shards_equal_whole_model_on_vulkan(vulkan: BackendRuntime, smollm2: Path) -> None:
    # llvmpipe decodes SmolLM2 at about 1 token/s, so one cut (one-layer shards at both ends and
    # a 28-layer middle: three seams) and 4 tokens after each prompt, not the CPU gate's three
    # cuts of 32 tokens: a decode step's bits are compared four times a prompt (8 took 6 s more)
    cuts = [0, 1, 29, 30]
    report = check_parity(smollm2, cuts, n_tokens=4, prompt_lengths=(9, 15), recipe=VULKAN, runtime=vulkan)
    assert report["recipe"]["backend"] == "vulkan"
    assert report["max_abs_diff_logits"] == 0.0
    assert report["max_abs_diff_hidden"] == 0.0
    assert report["greedy_tokens_equal"]
    assert report["generated_whole"][0] != report["generated_whole"][1]
