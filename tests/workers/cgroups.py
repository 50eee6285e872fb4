"""A cgroup recorded in a temporary directory (laid out as /proc and /sys/fs/cgroup, v2), whose
files a test rewrites as the group's use changes; and plan tables of a known size."""

from __future__ import annotations

from pathlib import Path

from core.table import PlanTable
from planner.solver.tables import build_table
from tests.planner.oracle import chain_profile
from workers.cgroup import read_cgroup

MiB = 2**20
LIMIT = 1024 * MiB
IDLE = 512 * MiB


class Recorded:
    """A v2 group with a limit, its use set by the test."""

    def __init__(self, tmp: Path) -> None:
        proc = tmp / "proc"
        (proc / "self").mkdir(parents=True)
        (proc / "self" / "cgroup").write_text("0::/pod/ctr\n")
        (proc / "self" / "mountinfo").write_text(
            "25 20 0:23 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
        (proc / "meminfo").write_text("MemAvailable: 20000000 kB\n")
        self.group = tmp / "sys/fs/cgroup/pod/ctr"
        self.group.mkdir(parents=True)
        (self.group / "memory.max").write_text(f"{LIMIT}\n")
        self.proc, self.root = proc, tmp
        self.use(IDLE)

    def use(self, working_set: int) -> None:
        (self.group / "memory.current").write_text(f"{working_set + MiB}\n")
        (self.group / "memory.stat").write_text(f"anon {working_set}\ninactive_file {MiB}\n")

    def read(self):  # noqa: ANN201 - workers.cgroup.CgroupMemory | None
        return read_cgroup(self.proc, self.root)


def table_of(need: int, want: int | None = None) -> PlanTable:
    """A table whose one-sample plan needs ``need`` bytes and whose batches run at working
    speed with ``want`` (a multiple of ``need``: the whole batch in one piece, far faster per
    sample than one at a time)."""
    batches = (want or need) // need
    times = [1.0 + 0.05 * (b - 1) for b in range(1, batches + 1)]
    profile = chain_profile([(0, need, times, [0] * batches)], batch_max=batches)
    return build_table(profile, slot_bytes=MiB)
