"""``kernels_patch/build.py`` as a module, for the tests that read its keys, flags and versions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load() -> ModuleType:
    """Import the build script (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("nr_build", ROOT / "kernels_patch" / "build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
