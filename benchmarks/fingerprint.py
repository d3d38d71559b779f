"""What fingerprinting a model over every byte costs: seconds and GB/s, hashed and kept.

The artifact fingerprint covers the sha256 of each tensor's whole bytes
(:mod:`noderuntime.models.artifacts`). This writes random-weight GGUF files of the Llama
3.2 1B and Llama 3.1 8B shapes (``noderuntime models synth``'s writer), then times
:func:`artifacts.inspect` three ways: hashed from the disk (the file's pages dropped
from the page cache first, where the kernel lets them go), hashed from the page cache,
and answered from the digest cache (no tensor byte read). ``--quick`` writes the 1B file
only and gives the 8B figures by the measured GB/s, saying so in the JSON.

    python -m benchmarks.fingerprint [--quick] [--out PATH] [--dir DIR]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _common, seams
from noderuntime.models import artifacts, synth
from noderuntime.models import gguf as ggufio

NAME = "fingerprint"
QUANT = "Q4_0"
# Llama-3.2-1B's and Llama-3.1-8B's shapes, as the seams benchmark writes them
SHAPES = {"1B": synth.ModelShape(**seams.LARGER_SHAPE), "8B": synth.ModelShape(**seams.LARGEST_SHAPE)}


def _tensor_bytes(shape: synth.ModelShape) -> int:
    """What the tensors of ``shape`` weigh in :data:`QUANT` (norms in F32, as the writer stores them)."""
    total = 0
    for _name, dims in shape.tensors():
        ggml_dims = tuple(reversed(dims))
        quantized = len(dims) >= 2
        total += ggufio.tensor_nbytes(ggml_dims, 2 if quantized else 0)  # 2: Q4_0, 0: F32
    return total


def _drop_page_cache(path: Path) -> bool:
    """Ask the kernel to let go of ``path``'s cached pages; whether it could be asked."""
    try:
        with path.open("rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        return False
    return True


def _measure(path: Path, folder: Path) -> dict[str, Any]:
    then = time.time_ns() - 3_600_000_000_000  # written an hour ago: its digests may be kept
    os.utime(path, ns=(then, then))
    size = artifacts.inspect(path, verify=False).tensor_bytes
    figures: dict[str, Any] = {"tensor_bytes": size, "file_bytes": path.stat().st_size}
    runs: list[tuple[str, bool]] = [("from_disk", True), ("from_page_cache", False)]
    for how, drop in runs:
        cache = artifacts.DigestCache(folder / f"digests-{how}")
        dropped = _drop_page_cache(path) if drop else False
        started = time.perf_counter()
        info = artifacts.inspect(path, cache=cache)
        seconds = time.perf_counter() - started
        assert cache.statistics().misses == 1
        figures[how] = {"seconds": round(seconds, 3), "GB_per_s": round(size / seconds / 1e9, 3)}
        if drop:
            figures[how]["page_cache_dropped"] = dropped
        started = time.perf_counter()
        again = artifacts.inspect(path, cache=cache)
        kept = time.perf_counter() - started
        assert again.fingerprint == info.fingerprint and cache.statistics().hits == 1
        figures["digest_cache_hit"] = {"seconds": round(kept, 4)}
    return figures


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; the exit status."""
    p = _common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=None, help="where the model files are written (default: a temp dir)")
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="fingerprint-", dir=args.dir))
    workers = max(1, min(8, os.cpu_count() or 1))
    figures: dict[str, Any] = {}
    try:
        for label, shape in SHAPES.items():
            if args.quick and label != "1B":
                measured = figures["1B"]
                size = _tensor_bytes(shape)
                figures[label] = {
                    "tensor_bytes": size,
                    "extrapolated_from": "1B",
                    "note": "not written (--quick): seconds are this shape's tensor bytes at the 1B file's GB/s",
                    **{
                        how: {
                            "seconds": round(size / measured[how]["GB_per_s"] / 1e9, 2),
                            "GB_per_s": measured[how]["GB_per_s"],
                        }
                        for how in ("from_disk", "from_page_cache")
                    },
                    "digest_cache_hit": measured["digest_cache_hit"],
                }
                continue
            path = synth.write_model(folder / f"llama-{label}.gguf", shape, quant=QUANT, seed=1)
            figures[label] = _measure(path, folder)
            path.unlink()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    recipe = {
        "shapes": {
            label: {k: getattr(s, k) for k in ("n_layer", "n_embd", "n_ff", "n_vocab")} for label, s in SHAPES.items()
        },
        "quant": QUANT,
        "hash": "sha256 of each tensor's bytes, 16 MiB reads, one thread per tensor in flight",
        "hash_threads": workers,
        "digest_cache": "artifacts.DigestCache: one JSON per file, against (device, inode, size, mtime_ns)",
    }
    path = _common.out_path(NAME, args)
    _common.write(path, NAME, args, recipe, figures)
    rows = []
    for label, f in figures.items():
        mark = " (extrapolated)" if "extrapolated_from" in f else ""
        rows.append(
            [
                label + mark,
                f"{f['tensor_bytes'] / 1e9:.2f}",
                f["from_disk"]["seconds"],
                f["from_disk"]["GB_per_s"],
                f["from_page_cache"]["seconds"],
                f["from_page_cache"]["GB_per_s"],
                f["digest_cache_hit"]["seconds"],
            ]
        )
    headers = ["shape", "GB", "disk s", "disk GB/s", "page cache s", "page cache GB/s", "kept s"]
    print(_common.table(headers, rows))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
