"""Hard memory caps for node processes: a cgroup each, v2 ``memory.max`` or v1 ``memory.limit_in_bytes``.

Used to show that a memory-limited node really stays under its limit: a process started
in a :class:`MemoryCap` that outgrows it is killed by the kernel's OOM killer, whatever the
process believes about itself. Needs a writable cgroup hierarchy (root, or a delegated
subtree); :func:`available` says why not otherwise.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(RuntimeError):
    """No writable cgroup memory controller here."""


def own_path(version: int, controller: str = "memory") -> str:
    """This process's cgroup path in hierarchy v2, or in v1's hierarchy of ``controller``."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        ident, controllers, path = line.split(":", 2)
        if version == 2 and ident == "0" and controllers == "":
            return path
        if version == 1 and controller in controllers.split(","):
            return path
    return "/"


def _v2_parent() -> Path | None:
    for mount in (ROOT, ROOT / "unified"):
        controllers = mount / "cgroup.controllers"
        if controllers.exists() and "memory" in controllers.read_text().split():
            # a new child of our own cgroup, under which the memory controller is enabled
            parent = mount / own_path(2).lstrip("/")
            with contextlib.suppress(OSError):
                subtree = parent / "cgroup.subtree_control"
                if "memory" not in subtree.read_text().split():
                    subtree.write_text("+memory")
                return parent
    return None


def _v1_parent() -> Path | None:
    mount = ROOT / "memory"
    if not (mount / "memory.limit_in_bytes").exists():
        return None
    own = mount / own_path(1).lstrip("/")
    return own if own.is_dir() else mount


class MemoryCap:
    """One cgroup with a hard memory limit; processes join it before they exec."""

    def __init__(self, limit: int, name: str = "node") -> None:
        """Create the cgroup (raises :class:`CgroupUnavailable` with the reason)."""
        self.limit = limit
        leaf = f"noderuntime-{name}-{uuid.uuid4().hex[:8]}"
        errors = []
        for version, parent in ((2, _v2_parent()), (1, _v1_parent())):
            if parent is None:
                continue
            path = parent / leaf
            try:
                path.mkdir()
                if version == 2:
                    (path / "memory.max").write_text(str(limit))
                    with contextlib.suppress(OSError):  # no swap to fall back on
                        (path / "memory.swap.max").write_text("0")
                else:
                    (path / "memory.limit_in_bytes").write_text(str(limit))
                    with contextlib.suppress(OSError):  # only where swap accounting is on
                        (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            except OSError as exc:
                errors.append(f"v{version} {path}: {exc}")
                with contextlib.suppress(OSError):
                    path.rmdir()
                continue
            self.version = version
            self.path = path
            return
        reason = "; ".join(errors) or "no cgroup memory controller is mounted"
        raise CgroupUnavailable(f"cannot make a memory cgroup: {reason}")

    def join(self) -> None:
        """Move the calling process in (for ``preexec_fn``: the child joins before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        """The most memory the group has held (v2 ``memory.peak`` where the kernel has it)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        """How many processes the kernel killed for going over the limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with contextlib.suppress(OSError):
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone; idempotent."""
        with contextlib.suppress(OSError):
            self.path.rmdir()


def available() -> str | None:
    """``None`` when a memory cap can be made here, else why not."""
    try:
        MemoryCap(64 << 20, "probe").remove()
    except CgroupUnavailable as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot make a memory cgroup: {exc}"
    return None


__all__ = ["CgroupUnavailable", "MemoryCap", "available", "own_path"]
