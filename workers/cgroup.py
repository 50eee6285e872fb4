"""The memory limit that applies to this process, and how much of it is used, as the kernel
and the kubelet count it before they kill.

Why: the files at the root of the cgroup mount are this process's own only when a container
runtime mounts its group there; in a nested group, under systemd or on a host they are
someone else's (or nobody's), and a pod's limit sits on the parent of the container's group.
So the probe finds its own group from ``/proc/self/cgroup`` (cgroup v1: the memory
controller's line; v2: the ``0::`` line), the controller's mount from
``/proc/self/mountinfo``, and walks the path up to the mount's root: every group with a limit
(v1 ``memory.limit_in_bytes``, v2 ``memory.max``) bounds what may be used, and its headroom is
its limit minus its working set (usage minus ``inactive_file``: page cache the kernel reclaims
before it kills; v1 ``memory.usage_in_bytes`` - ``total_inactive_file``, v2
``memory.current`` - ``inactive_file``). The free memory is the least headroom on the path,
and never more than the host's ``MemAvailable``.

Every path is taken relative to ``fs_root`` and ``proc`` so that tests read recorded files.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from core.lru import LRU

UNLIMITED = 1 << 62  # cgroup v1 reports "no limit" as a number close to 2**63


def parse_limit(text: str) -> int | None:
    """A cgroup limit file's content: a number of bytes, or None for no limit."""
    text = text.strip()
    if not text or text == "max":
        return None
    value = int(text)
    return None if value >= UNLIMITED else value


def parse_meminfo(text: str, key: str = "MemAvailable") -> int | None:
    """A field of /proc/meminfo in bytes (found, not every line split: read per batch)."""
    at = text.find(key + ":")
    while at > 0 and text[at - 1] != "\n":  # the key inside another line's name
        at = text.find(key + ":", at + 1)
    if at < 0:
        return None
    end = text.find("\n", at)
    parts = text[at:end if end >= 0 else len(text)].split()
    return int(parts[1]) * (1024 if len(parts) > 2 and parts[2] == "kB" else 1)


def _headroom(limit: int, working_set: int) -> int:
    """What may still be used under ``limit``."""
    return max(0, limit - working_set)


def parse_stat(text: str) -> dict[str, int]:
    """A ``memory.stat`` file: key -> value."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def own_groups(text: str) -> tuple[str | None, str | None]:
    """``/proc/self/cgroup``: this process's v1 memory group and its v2 group (None where the
    file has no such line)."""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


@dataclass(frozen=True)
class Mount:
    """A cgroup mount: the group at its root (``root``) and where it is mounted."""

    root: str
    point: str
    version: int


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def memory_mounts(text: str) -> tuple[Mount | None, Mount | None]:
    """``/proc/self/mountinfo``: the v1 memory controller's mount and the v2 mount."""
    v1 = v2 = None
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        root, point, fstype = _unescape(fields[3]), _unescape(fields[4]), tail[0]
        options = tail[2].split(",") if len(tail) > 2 else []
        if fstype == "cgroup" and "memory" in options and v1 is None:
            v1 = Mount(root, point, 1)
        elif fstype == "cgroup2" and v2 is None:
            v2 = Mount(root, point, 2)
    return v1, v2


@dataclass(frozen=True)
class GroupReading:
    """One group on the path: its limit (None: none), usage and working set (bytes)."""

    path: str               # the group's path in its hierarchy ("/" for the mount's root)
    limit: int | None
    usage: int
    working_set: int        # usage minus inactive file pages
    peak: int | None        # v1 memory.max_usage_in_bytes, v2 memory.peak (None: not kept)

    @property
    def headroom(self) -> int | None:
        return None if self.limit is None else _headroom(self.limit, self.working_set)


@dataclass(frozen=True)
class CgroupMemory:
    """The memory limit that applies to this process and its use (see the module doc)."""

    version: int                     # 1 or 2
    group: str                       # this process's group (as /proc/self/cgroup names it)
    groups: tuple[GroupReading, ...]  # its group first, then each parent up to the mount root

    @property
    def bound(self) -> GroupReading | None:
        """The group whose limit leaves the least headroom (None: no limit on the path)."""
        limited = [g for g in self.groups if g.limit is not None]
        return min(limited, key=lambda g: g.headroom or 0) if limited else None

    @property
    def limit(self) -> int | None:
        """The tightest limit on the path (bytes), None when there is none."""
        limits = [g.limit for g in self.groups if g.limit is not None]
        return min(limits) if limits else None

    @property
    def free(self) -> int | None:
        """The least headroom on the path: bytes that may still be used (None: no limit)."""
        bound = self.bound
        return None if bound is None else bound.headroom

    @property
    def working_set(self) -> int:
        """The working set of the group that binds (of this group when none does)."""
        bound = self.bound
        return (bound or self.groups[0]).working_set

    def to_json(self) -> dict[str, object]:
        bound = self.bound
        return {"cgroup_version": self.version, "group": self.group,
                "limit_bytes": self.limit, "limit_group": bound.path if bound else None,
                "working_set_bytes": self.working_set, "free_bytes": self.free}


class _OpenFiles:
    """Descriptors of the small kernel files read before every batch, kept open and read
    again from offset 0 (``pread``: the kernel generates them anew on each read). Opening a
    file walks its path, and right after a model's call has churned the caches that walk is
    what costs (about 0.1 ms a file where the read itself is a few us). A file that can no
    longer be read (its group removed) is opened again, once. At most ``size`` are kept open,
    the least recently used closed first (not ``core.lru``: a descriptor must be closed when
    it is dropped). Reads hold the lock: a descriptor is never closed, and its number reused
    by another file, while a read uses it."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, path: Path | str) -> str | None:
        key = os.fspath(path)
        with self._lock:
            for _attempt in range(2):
                fd = self._fds.get(key)
                if fd is None:
                    fd = self._open(key)
                    if fd is None:
                        return None
                else:
                    self._fds.move_to_end(key)
                try:
                    return _pread_all(fd)
                except OSError:
                    del self._fds[key]
                    os.close(fd)
            return None

    def _open(self, key: str) -> int | None:
        try:
            fd = os.open(key, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        self._fds[key] = fd
        while len(self._fds) > self.size:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd


_CHUNK = 65536


def _pread_all(fd: int) -> str:
    """The whole file from offset 0: one read where it is shorter than a chunk (a short read
    of these files is their end; a read at the end costs a system call per file per batch)."""
    chunk = os.pread(fd, _CHUNK, 0)
    if len(chunk) < _CHUNK:
        return chunk.decode("ascii", "replace")
    parts, offset = [chunk], len(chunk)
    while chunk := os.pread(fd, _CHUNK, offset):
        parts.append(chunk)
        offset += len(chunk)
    return b"".join(parts).decode("ascii", "replace")


_FILES_OPEN = _OpenFiles()


def _read(path: Path | str) -> str | None:
    """A small file's text (None: it cannot be read), through the open descriptors."""
    return _FILES_OPEN.read(path)


def _inside(mount: Mount, group: str, fs_root: Path) -> Path | None:
    """The directory of ``group`` under ``mount`` (None when it is not visible there)."""
    base = fs_root / mount.point.lstrip("/")
    root = mount.root.rstrip("/")
    if root and group != root and not group.startswith(root + "/"):
        # a cgroup namespace or a runtime that mounts the container's own group at the root
        return base if base.is_dir() else None
    rel = group[len(root):].strip("/")
    found = base / rel if rel else base
    return found if found.is_dir() else None


# (limit, usage, inactive file pages in memory.stat, peak) by cgroup version
_FILES = {1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file",
              "memory.max_usage_in_bytes"),
          2: ("memory.max", "memory.current", "inactive_file", "memory.peak")}


def _working_set(usage: int, stat_text: str | None, version: int) -> int:
    """Usage minus the inactive file pages ``memory.stat`` counts."""
    return max(0, usage - parse_stat(stat_text or "").get(_FILES[version][2], 0))


def _group_reading(directory: Path, path: str, version: int) -> GroupReading | None:
    limit_file, usage_file, _inactive, peak_file = _FILES[version]
    usage_text = _read(directory / usage_file)
    if usage_text is None:  # the v2 root group has no memory files
        return None
    limit_text = _read(directory / limit_file)
    limit = parse_limit(limit_text) if limit_text is not None else None
    usage = int(usage_text.strip())
    working_set = _working_set(usage, _read(directory / "memory.stat"), version)
    peak_text = _read(directory / peak_file)
    peak = int(peak_text.strip()) if peak_text and peak_text.strip().isdigit() else None
    return GroupReading(path, limit, usage, working_set, peak)


def read_cgroup(proc: Path = Path("/proc"), fs_root: Path = Path("/")) -> CgroupMemory | None:
    """This process's memory cgroup and every group above it (None: no memory controller
    mounted, or this process's group not visible). Where the groups are is found once per
    group this process is in (``_locate``); their limits and usage are read every call."""
    groups_text = _read(proc / "self" / "cgroup")
    if groups_text is None:
        return None
    located = _locate(groups_text, proc, fs_root)
    if located is None:
        return None
    version, group, chain = located
    readings = tuple(r for directory, path in chain
                     if (r := _group_reading(directory, path, version)) is not None)
    return CgroupMemory(version, group, readings) if readings else None


@functools.lru_cache(maxsize=16)
def _proc_file(proc: Path, name: str) -> str:
    """``proc/name`` as a string, joined once: read before every batch, where building a
    path object costs more than the read (right after a model's call, on cold caches)."""
    return os.path.join(proc, name)


def read_headroom(proc: Path = Path("/proc"), fs_root: Path = Path("/")) -> int | None:
    """``read_cgroup(...).free`` read with the fewest files: every group's limit, and usage
    and ``memory.stat`` only where there is one (None: no limit on the path). What a worker
    reads before each batch, so it costs a few small reads, not the whole path's figures."""
    located = _located(proc, fs_root)
    if located is None:
        return None
    version, files = located
    least: int | None = None
    for limit_file, usage_file, stat_file in files:
        limit_text = _read(limit_file)
        limit = parse_limit(limit_text) if limit_text is not None else None
        usage_text = None if limit is None else _read(usage_file)
        if limit is None or usage_text is None:
            continue
        working_set = _working_set(int(usage_text.strip()), _read(stat_file), version)
        headroom = _headroom(limit, working_set)
        least = headroom if least is None else min(least, headroom)
    return least


LOCATE_S = 1.0  # the process's group is located again at most this often
GroupFiles = tuple[tuple[str, str, str], ...]  # limit, usage, memory.stat of each group up
_LOCATED: LRU[tuple[float, tuple[int, GroupFiles] | None]] = LRU(16)  # by (proc, fs_root)


def _located(proc: Path, fs_root: Path) -> tuple[int, GroupFiles] | None:
    """The controller version and the files of every group on this process's path
    (``_locate``), found again at most every ``LOCATE_S``: the kernel writes /proc/self/cgroup
    out for every controller on each read (40 us right after a model's call, the largest part
    of the reading before a batch), and a process moves to another group seldom (a
    container's never); the limits on the path are read every time."""
    key = (proc, fs_root)
    now = time.monotonic()
    known = _LOCATED.get(key)
    if known is not None and now - known[0] < LOCATE_S:
        return known[1]
    groups_text = _read(_proc_file(proc, "self/cgroup"))
    located = None if groups_text is None else _locate(groups_text, proc, fs_root)
    found = None if located is None else (located[0], _group_files(located))
    _LOCATED.put(key, (now, found))
    return found


def _group_files(located: tuple[int, str, tuple[tuple[Path, str], ...]]) -> GroupFiles:
    """The limit, usage and memory.stat files of every group on a located path."""
    limit_file, usage_file = _FILES[located[0]][:2]
    return tuple((os.path.join(d, limit_file), os.path.join(d, usage_file),
                  os.path.join(d, "memory.stat")) for d, _path in located[2])


@functools.lru_cache(maxsize=16)
def _locate(groups_text: str, proc: Path, fs_root: Path
            ) -> tuple[int, str, tuple[tuple[Path, str], ...]] | None:
    """The controller version, this process's group and the directories from it up to the
    mount's root, each with its name as /proc/self/cgroup gives it (in a namespace, from the
    mount's root); the first choice (v1 memory first: on a hybrid host v2 has no memory)
    whose group has memory files."""
    mounts_text = _read(proc / "self" / "mountinfo")
    if mounts_text is None:
        return None
    own_v1, own_v2 = own_groups(groups_text)
    mount_v1, mount_v2 = memory_mounts(mounts_text)
    choices: list[tuple[Mount, str]] = []
    if own_v1 is not None and mount_v1 is not None:
        choices.append((mount_v1, own_v1))
    if own_v2 is not None and mount_v2 is not None:
        choices.append((mount_v2, own_v2))
    for mount, group in choices:
        directory = _inside(mount, group, fs_root)
        if directory is None:
            continue
        top = fs_root / mount.point.lstrip("/")
        rel = directory.relative_to(top)
        root = mount.root.rstrip("/")
        under = group == root or group.startswith(root + "/")
        path = ((root if under else "") + ("" if rel == Path(".") else "/" + rel.as_posix())
                or "/")
        chain = []
        while True:
            chain.append((directory, path))
            if directory == top or top not in directory.parents:
                break
            directory = directory.parent
            path = path.rsplit("/", 1)[0] or "/"
        if any(_group_reading(d, p, mount.version) is not None for d, p in chain):
            return mount.version, group, tuple(chain)
    return None


def mem_available(proc: Path = Path("/proc")) -> int | None:
    """The host's MemAvailable (bytes)."""
    return parse_meminfo(_read(_proc_file(proc, "meminfo")) or "")


__all__ = ["CgroupMemory", "GroupReading", "Mount", "UNLIMITED", "mem_available",
           "memory_mounts", "own_groups", "parse_limit", "parse_meminfo", "parse_stat",
           "read_cgroup", "read_headroom"]
