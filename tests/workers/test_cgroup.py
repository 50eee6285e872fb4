"""The memory limit probe (``workers.cgroup``) on recorded files: a temporary directory stands
in for /proc and /sys/fs/cgroup, laid out as cgroup v1 (a hybrid host, as this project's CI
machine), v2, nested groups whose parent holds the tighter limit, a container whose own group
is mounted at the root, and no limit at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers import cgroup
from workers.cgroup import memory_mounts, own_groups, parse_limit, parse_meminfo, parse_stat, \
    read_cgroup
from workers.device_memory import DeviceMemory
from workers.memory import MemoryProbe, cgroup_free, cpu_free

MiB = 2**20

V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTS = """\
25 20 0:23 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
"""
MEMINFO = "MemTotal:       24683520 kB\nMemFree: 100 kB\nMemAvailable:   20000000 kB\n"


def _proc(tmp: Path, cgroup: str, mountinfo: str, meminfo: str = MEMINFO) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    (proc / "meminfo").write_text(meminfo)
    return proc


def _v1_group(directory: Path, limit: int | None, usage: int, inactive: int,
              peak: int | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "memory.limit_in_bytes").write_text(
        f"{limit if limit is not None else 9223372036854771712}\n")
    (directory / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (directory / "memory.max_usage_in_bytes").write_text(f"{peak or usage}\n")
    # the group's own inactive_file is small; total_ counts its children too (what counts)
    (directory / "memory.stat").write_text(f"cache 1\nrss 2\ninactive_file 7\n"
                                           f"total_inactive_file {inactive}\n")


def _v2_group(directory: Path, limit: int | None, usage: int, inactive: int,
              peak: int | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "memory.max").write_text(f"{limit if limit is not None else 'max'}\n")
    (directory / "memory.current").write_text(f"{usage}\n")
    if peak is not None:
        (directory / "memory.peak").write_text(f"{peak}\n")
    (directory / "memory.stat").write_text(f"anon 5\nfile 9\ninactive_file {inactive}\n"
                                           "active_file 3\n")


def test_parsers() -> None:
    assert parse_limit("max\n") is None and parse_limit("1048576\n") == 1048576
    assert parse_limit(str(2**63 - 4096)) is None  # cgroup v1's "no limit"
    assert parse_stat("cache 10\nrss 20\nbad line here\n") == {"cache": 10, "rss": 20}
    meminfo = "MemTotal: 5 kB\nXMemAvailable: 7 kB\nMemAvailable:   20 kB\nFoo: 1\n"
    assert parse_meminfo(meminfo) == 20 * 1024  # the field, not one whose name ends with it
    assert parse_meminfo("MemAvailable: 3 kB") == 3072 and parse_meminfo("MemFree: 3 kB") is None
    v1, v2 = own_groups("9:name=systemd:/\n4:memory:/a/b\n3:cpuset:/\n0::/c\n")
    assert (v1, v2) == ("/a/b", "/c")
    assert own_groups("4:cpu,memory:/x\n") == ("/x", None)  # controllers mounted together
    m1, m2 = memory_mounts(V1_MOUNTS)
    assert m1 is not None and (m1.root, m1.point, m1.version) == ("/", "/sys/fs/cgroup/memory", 1)
    assert m2 is not None and m2.point == "/sys/fs/cgroup/unified" and m2.version == 2
    spaced = "35 31 0:32 / /mnt/cg\\040mem rw - cgroup cgroup rw,memory\n"
    found, _ = memory_mounts(spaced)
    assert found is not None and found.point == "/mnt/cg mem"


def test_v1_own_group_not_the_mount_root(tmp_path: Path) -> None:
    """The hybrid host: v1 memory controller, v2 mounted without it; the process sits in a
    child group, and the files at the mount root are not its own (the old probe's mistake)."""
    proc = _proc(tmp_path, "9:name=systemd:/\n4:memory:/job/w1\n0::/\n", V1_MOUNTS)
    mem = tmp_path / "sys/fs/cgroup/memory"
    _v1_group(mem, None, 8000 * MiB, 3000 * MiB)                  # the host: no limit
    _v1_group(mem / "job", None, 900 * MiB, 100 * MiB)
    _v1_group(mem / "job/w1", 512 * MiB, 300 * MiB, 40 * MiB, peak=350 * MiB)
    (tmp_path / "sys/fs/cgroup/unified").mkdir(parents=True)  # no memory files in v2 here
    group = read_cgroup(proc, tmp_path)
    assert group is not None and group.version == 1 and group.group == "/job/w1"
    assert [g.path for g in group.groups] == ["/job/w1", "/job", "/"]
    assert group.limit == 512 * MiB
    assert group.working_set == 260 * MiB  # usage - total_inactive_file
    assert group.free == 252 * MiB
    assert group.groups[0].peak == 350 * MiB
    assert group.to_json()["limit_group"] == "/job/w1"
    assert cgroup_free(proc, tmp_path) == 252 * MiB
    assert cpu_free(proc, tmp_path) == 252 * MiB  # under MemAvailable


def test_nested_parent_limit_binds(tmp_path: Path) -> None:
    """A pod's limit sits on the parent of the container's group: the least headroom on the
    path wins, whichever group it is."""
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n", V2_MOUNTS)
    root = tmp_path / "sys/fs/cgroup"
    root.mkdir(parents=True)  # the v2 root has no memory.max / memory.current
    _v2_group(root / "kubepods", None, 5000 * MiB, 0)
    _v2_group(root / "kubepods/pod1", 1024 * MiB, 900 * MiB, 100 * MiB, peak=950 * MiB)
    _v2_group(root / "kubepods/pod1/ctr", 2048 * MiB, 700 * MiB, 50 * MiB)
    group = read_cgroup(proc, tmp_path)
    assert group is not None and group.version == 2
    assert [g.path for g in group.groups] == ["/kubepods/pod1/ctr", "/kubepods/pod1", "/kubepods"]
    assert group.limit == 1024 * MiB
    bound = group.bound
    assert bound is not None and bound.path == "/kubepods/pod1" and bound.peak == 950 * MiB
    assert group.working_set == 800 * MiB
    assert group.free == 224 * MiB  # 1024 - (900 - 100); the child's own: 2048 - 650
    assert cgroup_free(proc, tmp_path) == 224 * MiB  # the lean read a worker makes per batch
    # a child whose own limit leaves less headroom binds instead
    _v2_group(root / "kubepods/pod1/ctr", 768 * MiB, 700 * MiB, 50 * MiB)
    again = read_cgroup(proc, tmp_path)
    assert again is not None and again.free == 118 * MiB and again.limit == 768 * MiB
    assert cgroup_free(proc, tmp_path) == 118 * MiB


def test_no_limit_falls_back_to_mem_available(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/user.slice/session-1.scope\n", V2_MOUNTS)
    root = tmp_path / "sys/fs/cgroup"
    _v2_group(root / "user.slice/session-1.scope", None, 100 * MiB, 0)
    _v2_group(root / "user.slice", None, 400 * MiB, 0)
    group = read_cgroup(proc, tmp_path)
    assert group is not None and group.limit is None and group.free is None
    assert cgroup_free(proc, tmp_path) is None
    assert cpu_free(proc, tmp_path) == 20000000 * 1024


def test_host_mem_available_caps_a_loose_limit(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/big\n", V2_MOUNTS, meminfo="MemAvailable: 1024 kB\n")
    _v2_group(tmp_path / "sys/fs/cgroup/big", 64 * MiB, 1 * MiB, 0)
    assert cgroup_free(proc, tmp_path) == 63 * MiB
    assert cpu_free(proc, tmp_path) == 1024 * 1024


def test_container_with_its_group_at_the_mount_root(tmp_path: Path) -> None:
    """A cgroup namespace (or a runtime mounting the container's own group at the root):
    /proc/self/cgroup names a path the mount does not show; the mount's root is its group."""
    mounts = "40 30 0:35 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    proc = _proc(tmp_path, "0::/../other\n", mounts)
    _v2_group(tmp_path / "sys/fs/cgroup", 256 * MiB, 56 * MiB, 6 * MiB)
    group = read_cgroup(proc, tmp_path)
    assert group is not None and group.limit == 256 * MiB and group.free == 206 * MiB
    # the same runtime without a namespace: the group is named as the mount's root
    proc2 = _proc(tmp_path / "b", "0::/docker/abc\n", mounts)
    _v2_group(tmp_path / "b/sys/fs/cgroup", 256 * MiB, 56 * MiB, 6 * MiB)
    group2 = read_cgroup(proc2, tmp_path / "b")
    assert group2 is not None and group2.groups[0].path == "/docker/abc"
    assert group2.free == 206 * MiB
    assert cgroup_free(proc, tmp_path) == cgroup_free(proc2, tmp_path / "b") == 206 * MiB


def test_no_cgroup_files(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/\n", "")
    assert read_cgroup(proc, tmp_path) is None
    assert read_cgroup(tmp_path / "missing", tmp_path) is None
    assert cpu_free(proc, tmp_path) == 20000000 * 1024


def test_probe_reads_this_machine_and_the_owner_keeps_the_one_margin() -> None:
    assert cpu_free() > 0
    probe = MemoryProbe("cpu", limit=10_000_000)
    assert probe.free() == 10_000_000  # this machine has far more than 10 MB free
    memory = DeviceMemory("cpu", limit=10_000_000, margin=1_000_000, read=lambda: None)
    assert memory.plan_free() == 9_000_000 and memory.margin() == 1_000_000
    memory.probe.limit = 500_000
    assert memory.plan_free() == 0


def test_files_read_before_each_batch_stay_open_and_show_what_is_there_now(tmp_path: Path
                                                                           ) -> None:
    """The probe keeps its files open and reads them from offset 0: a value rewritten is seen
    on the next read, a file that appears later is read once it exists, and no more than
    ``size`` descriptors stay open."""
    import os

    from workers.cgroup import _OpenFiles

    files = _OpenFiles(size=2)
    usage = tmp_path / "memory.current"
    assert files.read(usage) is None  # not there yet: nothing kept
    usage.write_text("100\n")
    assert files.read(usage) == "100\n"
    usage.write_text("250\n")  # the kernel's files change under an open descriptor too
    assert files.read(usage) == "250\n"
    held = len(os.listdir("/proc/self/fd"))
    for name in ("a", "b", "c"):
        (tmp_path / name).write_text(name)
        assert files.read(tmp_path / name) == name
    assert len(os.listdir("/proc/self/fd")) <= held + 1  # two kept in all, the oldest closed
    assert files.read(usage) == "250\n"  # closed with the oldest, opened again


def test_a_moved_process_is_located_again_after_locate_s_and_limits_are_read_each_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reading before each batch locates the process's group at most every ``LOCATE_S``
    (/proc/self/cgroup is the costly file), but reads the limits and use on its path every
    time: a changed limit counts at once, a move once the group is located again."""
    proc = _proc(tmp_path, "0::/a\n", V2_MOUNTS)
    root = tmp_path / "sys/fs/cgroup"
    _v2_group(root / "a", 100 * MiB, 10 * MiB, 0)
    _v2_group(root / "b", 50 * MiB, 10 * MiB, 0)
    assert cgroup_free(proc, tmp_path) == 90 * MiB
    (proc / "self" / "cgroup").write_text("0::/b\n")  # moved to b
    _v2_group(root / "a", 80 * MiB, 20 * MiB, 0)     # and a's limit and use changed
    assert cgroup_free(proc, tmp_path) == 60 * MiB   # a's, read again
    monkeypatch.setattr(cgroup, "LOCATE_S", 0.0)
    assert cgroup_free(proc, tmp_path) == 40 * MiB   # b's


def test_a_file_longer_than_one_read_is_read_whole(tmp_path: Path) -> None:
    """memory.stat and meminfo are read in one system call when shorter than a chunk; a longer
    file is read to its end."""
    text = "".join(f"line_{i} {i}\n" for i in range(3 * cgroup._CHUNK // 10))
    assert len(text) > 2 * cgroup._CHUNK
    path = tmp_path / "long"
    path.write_text(text)
    assert cgroup._read(path) == text
    path.write_text("short 1\n")
    assert cgroup._read(path) == "short 1\n"
