"""Giving memory back after a flood: maps rebuilt at their size, and free pages returned to the system.

A Python dict or set never shrinks its table as entries are deleted: a tracker map that
held 100,000 throwaway registrations keeps a table for 100,000 (about 5 MB) once they
expired. :func:`compacted` rebuilds such a map at the size of what it holds. And glibc
keeps the pages of freed blocks in its heap: :func:`give_back` collects a flood's cycles and
asks it to give the free pages back, which a sweep that dropped many entries calls.

A process that strangers can grow (the tracker) runs its Python objects on the C allocator
(:func:`system_allocator_environ`), not on pymalloc. pymalloc returns a 1 MiB arena only when
every object in it is freed, and a few objects that outlive a flood (a record kept, a
connection's state) hold the arenas it filled: after 30,000 throwaway registrations had
expired, a tracker's RSS stayed 1.17x what it was before them on pymalloc, and came back to
1.02x on glibc's malloc, which ``malloc_trim`` empties page by page (4 KiB), for 5 % fewer
registrations a second.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import platform
import sys
from collections.abc import Callable
from typing import Any, TypeVar

Map = TypeVar("Map", bound=dict[Any, Any] | set[Any])

# Below this a map's table is not worth a copy; above it a map is rebuilt when its table is over
# ~4 times what its entries need (a compact dict or set takes 30 to 60 bytes an entry with its table)
COMPACT_FLOOR_BYTES = 64 * 1024
COMPACT_BYTES_PER_ENTRY = 4 * 64

ALLOCATOR_ENV = "PYTHONMALLOC"


def oversized(table: dict[Any, Any] | set[Any]) -> bool:
    """Whether ``table``'s allocation is far over what its entries need (it held many more once)."""
    return sys.getsizeof(table) > max(COMPACT_FLOOR_BYTES, COMPACT_BYTES_PER_ENTRY * len(table))


def compacted(table: Map) -> Map:
    """``table`` itself, or a copy at the size of its entries where it kept the table of a larger past.

    A dict, an OrderedDict or a set (a defaultdict's copy would lose its factory). The
    caller puts the copy in the original's place: nothing else may hold the original.
    O(1) when nothing is to be done; a copy costs O(len), and is made only once the map
    has lost three quarters of what it held, so it is paid for by the deletions before it.
    """
    if not oversized(table):
        return table
    return type(table)(table)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    # glibc only: musl and other C libraries have no malloc_trim (and give free pages back themselves)
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    return trim


def release_free_pages() -> bool:
    """Ask the C allocator to return the free pages of its heaps to the system; False where it cannot.

    glibc returns only the free memory at the top of its main heap by itself; pages freed
    in the middle (where a flood's tables and objects lay, under what stayed) stay in the
    process until ``malloc_trim``. It walks the heap (milliseconds at a few hundred MB), so
    callers ask after a sweep that dropped many entries, not on every one.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def give_back() -> bool:
    """After a sweep that dropped a flood: collect its reference cycles, then :func:`release_free_pages`.

    A full collection of a tracker's heap takes tens of milliseconds, so callers ask once a
    map was rebuilt at its size (three quarters of it went), not on every sweep.
    """
    gc.collect()
    return release_free_pages()


def system_allocator_environ() -> dict[str, str] | None:
    """This process's environment with its Python objects on the C allocator, for a process it
    starts or becomes; None where an allocator is chosen already (``PYTHONMALLOC`` set: by an
    operator, or by this re-execution) or where the C library cannot give pages back (not glibc).
    """
    if ALLOCATOR_ENV in os.environ or _malloc_trim() is None:
        return None
    return {**os.environ, ALLOCATOR_ENV: "malloc"}
