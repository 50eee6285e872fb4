"""glibc's knobs (``core.malloc``): when the huge-page tunable is added, and that a process
started with it gets its large blocks in huge pages where one without it does not (read from
the kernel's own account, ``AnonHugePages`` of the process's mappings)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from core.malloc import HUGETLB, hugepages_env, transparent_hugepages

GLIBC = ("glibc", "2.36")


def test_added_where_glibc_reads_it_and_the_kernel_gives_them() -> None:
    env = hugepages_env({"PATH": "/bin"}, mode="madvise", libc=GLIBC)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": f"{HUGETLB}=1"}
    assert hugepages_env({}, mode="always", libc=GLIBC) == {"GLIBC_TUNABLES": f"{HUGETLB}=1"}


def test_other_tunables_kept() -> None:
    env = hugepages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, mode="madvise",
                        libc=GLIBC)
    assert env is not None
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGETLB}=1"


@pytest.mark.parametrize("tunables", [f"{HUGETLB}=1", f"{HUGETLB}=0",
                                      f"glibc.malloc.arena_max=2:{HUGETLB}=0"])
def test_a_setting_given_stands(tunables: str) -> None:
    assert hugepages_env({"GLIBC_TUNABLES": tunables}, mode="madvise", libc=GLIBC) is None


@pytest.mark.parametrize(("mode", "libc"), [
    ("never", GLIBC), (None, GLIBC),          # no transparent huge pages on advice
    ("madvise", ("glibc", "2.34")),           # a glibc that does not read the tunable
    ("madvise", ("", "")),                    # another C library
])
def test_none_where_it_would_do_nothing(mode: str | None, libc: tuple[str, str]) -> None:
    assert hugepages_env({}, mode=mode or "unknown", libc=libc) is None


def test_mode_read_from_the_kernels_file(tmp_path) -> None:
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert transparent_hugepages(path) == "madvise"
    assert transparent_hugepages(tmp_path / "absent") is None


_CHILD = """
import ctypes
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
block = libc.malloc(size)             # mapped alone, as ONNX Runtime's buffers without its arena
ctypes.memset(block, 1, size)         # faulted in
kib = sum(int(line.split()[1]) for line in open("/proc/self/smaps_rollup")
          if line.startswith("AnonHugePages:"))
print(kib)
"""


def test_a_process_started_with_it_gets_huge_pages() -> None:
    env = hugepages_env({k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"})
    if env is None:
        pytest.skip(f"no transparent huge pages on advice here ({transparent_hugepages()}, "
                    f"{platform.libc_ver()})")

    def huge_kib(child_env: dict[str, str]) -> int:
        out = subprocess.run([sys.executable, "-c", _CHILD], env=child_env, check=True,
                             capture_output=True, text=True, timeout=60).stdout
        return int(out)

    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    with_it = huge_kib(env)
    # most of the 64 MiB block in 2 MiB pages (the kernel may be short of them: at least half)
    assert with_it >= 32 << 10, with_it
    if transparent_hugepages() == "madvise":
        assert huge_kib(plain) == 0  # on advice only: without the tunable, none
