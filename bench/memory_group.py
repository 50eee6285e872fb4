"""A memory cgroup made for a measurement (v1 or v2, whichever the machine mounts): the
memory-limit bench puts each server in one, the cgroup test one `vbs serve`. Root only."""

from __future__ import annotations

import time
from pathlib import Path

from workers.cgroup import memory_mounts


class NoGroup(Exception):
    """No memory cgroup can be made here; the message says why."""


class MemoryGroup:
    """A memory cgroup under the controller's root, with its limit and its counters."""

    def __init__(self, path: Path, version: int) -> None:
        self.path, self.version = path, version

    @classmethod
    def create(cls, name: str) -> MemoryGroup:
        """A new group ``name`` (NoGroup saying why where none can be made)."""
        v1, v2 = memory_mounts(Path("/proc/self/mountinfo").read_text())
        if v1 is not None:
            path, version = Path(v1.point) / name, 1
        elif v2 is not None and "memory" in (Path(v2.point) / "cgroup.subtree_control") \
                .read_text().split():
            path, version = Path(v2.point) / name, 2
        else:
            raise NoGroup("no writable memory cgroup controller here (v1 memory not mounted, "
                          "v2 without memory in the root's cgroup.subtree_control)")
        try:
            path.mkdir()
        except OSError as exc:
            raise NoGroup(f"cannot create a memory cgroup at {path}: {exc}") from exc
        return cls(path, version)

    def command(self, cmd: list[str]) -> list[str]:
        """``cmd`` started inside this group: a shell joins it, then becomes ``cmd``, so that
        the server and every process it starts count in the group from the first byte."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path), *cmd]

    def _read(self, name: str) -> int:
        return int((self.path / name).read_text())

    def set_limit(self, limit: int) -> None:
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        (self.path / name).write_text(str(limit))

    def usage(self) -> int:
        return self._read("memory.usage_in_bytes" if self.version == 1 else "memory.current")

    def working_set(self) -> int:
        """Usage less inactive file pages, as the kernel and the kubelet count it."""
        stat = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines())
        inactive = stat["total_inactive_file"] if self.version == 1 else stat["inactive_file"]
        return self.usage() - int(inactive)

    def reset_peak(self) -> None:
        if self.version == 1:
            (self.path / "memory.max_usage_in_bytes").write_text("0")

    def peak(self) -> int | None:
        """The kernel's peak since the last reset (v1) or since the group was made (v2 has
        ``memory.peak`` from Linux 5.19; None before)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return self._read(name) if (self.path / name).exists() else None

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Remove the group once its processes are gone (they leave it as they exit)."""
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
