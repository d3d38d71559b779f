"""Regenerate ``protocol/_generated`` from ``protocol/seam.proto``.

    python -m protocol.generate [--check]

Runs protoc from grpcio-tools with the betterproto2 plugin. ``--check`` only
compares and exits 1 when the committed code is stale.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "seam.proto"
TARGET = HERE / "_generated"


def generate(out: Path) -> None:
    """Run protoc into ``out``."""
    env = dict(os.environ)
    # protoc finds its plugin on PATH: the one installed beside this interpreter
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{HERE}", f"--python_betterproto2_out={out}", str(PROTO)],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def stale(committed: Path = TARGET) -> list[str]:
    """Files whose committed version differs from what protoc produces now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        new, old = _files(fresh), _files(committed)
        return sorted(
            name
            for name in set(new) | set(old)
            if name not in new or name not in old or not filecmp.cmp(new[name], old[name], shallow=False)
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed code is stale")
    args = parser.parse_args(argv)
    if args.check:
        differ = stale()
        if differ:
            print("stale generated code: " + ", ".join(differ) + "; run python -m protocol.generate", file=sys.stderr)
            return 1
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        shutil.rmtree(TARGET, ignore_errors=True)
        shutil.copytree(tmp, TARGET)
    print(f"regenerated {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
