"""A cgroup recorded in a temporary directory (laid out as /proc and /sys/fs/cgroup, v2), whose
files a test rewrites as the group's use changes; and plan tables of a known size."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

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


def serve_in_group(group: Path, argv: list[str], env: dict[str, str], log: Path
                   ) -> subprocess.Popen[bytes]:
    """``argv`` started inside the memory cgroup ``group`` (joined before it execs, so all it
    allocates counts), its stderr to ``log``."""
    return subprocess.Popen(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"',
                             str(group), *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"))


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Until ``url``'s /v2/health/ready answers 200; AssertionError with the log's tail when
    the process exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vbs serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # a server starting: polled, not gated (another process)
    raise AssertionError(f"vbs serve not ready in {timeout_s} s: {log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server drains), SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
