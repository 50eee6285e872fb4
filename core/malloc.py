"""glibc's allocator, set for a server whose memory is counted: the one owner of its knobs.

Why: under a cgroup limit what the allocator keeps after a free counts as used (the ledger
reads the group), so large blocks are mapped alone and unmapped when freed
(``map_large_blocks``), and the free pages it keeps are given back when the server is idle
(``trimmer``). A mapped block is faulted in again, page by page, each time it is allocated;
with transparent huge pages (the kernel's ``madvise`` mode, most distributions' default)
glibc can advise its mappings huge (its ``glibc.malloc.hugetlb=1`` tunable, read only when a
process starts): a 2 MiB page is one fault where 4 KiB pages are 512. ``hugepages_env`` gives
the environment to start a process with it. Every function is a no-op where malloc is not
glibc's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

M_MMAP_THRESHOLD = -3  # mallopt's parameter: blocks of at least this many bytes are mapped alone
# what is mapped alone, where memory is counted: request bodies and samples, ONNX Runtime's
# arena blocks. By default glibc raises its threshold to the largest block freed (up to 32
# MiB), so such blocks end up in the heaps of its per-thread arenas, which keep them after
# they are freed: memory nothing holds, that a limit's ledger sees only as use. Not lower:
# every block mapped alone is faulted in again each time; at 128 KiB the socket's reads and
# every chunk of a body were mappings of their own, and under a limit the event loop spent
# four times the CPU a request spends without one (docs/benchmarks.md, section 11)
LARGE_BLOCK = 1 << 20
HUGETLB = "glibc.malloc.hugetlb"
HUGETLB_SINCE = (2, 35)  # the glibc that reads the tunable
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def _libc() -> Any:
    """glibc, or None where the C library is another."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def map_large_blocks(threshold: int) -> bool:
    """Blocks of at least ``threshold`` bytes mapped alone and unmapped when freed, from now
    on (process-wide). By default glibc raises the threshold to the largest block freed (up
    to 32 MiB), so buffers below it stay on its heaps after they are freed. False where it
    cannot be set."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))


def trimmer() -> Callable[[], None]:
    """``malloc_trim(0)``: the free pages glibc keeps go back to the kernel."""
    libc = _libc()
    if libc is None:
        return lambda: None
    return lambda: libc.malloc_trim(0) and None


def transparent_hugepages(path: Path = THP_MODE) -> str | None:
    """The kernel's transparent huge page mode (always, madvise, never), None if unknown."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def hugepages_env(env: Mapping[str, str], *, mode: str | None = None,
                  libc: tuple[str, str] | None = None) -> dict[str, str] | None:
    """``env`` with glibc's huge-page tunable added, to start a process with; None where it
    is set already (on or off: the user's choice stands), glibc is not one that reads it, or
    the kernel gives no transparent huge pages on advice. ``mode`` and ``libc`` default to
    this machine's."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if any(t.split("=", 1)[0] == HUGETLB for t in tunables.split(":") if t):
        return None
    name, version = libc if libc is not None else platform.libc_ver()
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    if name != "glibc" or release < HUGETLB_SINCE:
        return None
    if (mode if mode is not None else transparent_hugepages()) not in ("always", "madvise"):
        return None
    return {**env, "GLIBC_TUNABLES": ":".join(filter(None, (tunables, f"{HUGETLB}=1")))}
