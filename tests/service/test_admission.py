"""Admission's HTTP edge (``service.admission``) over the device's memory owner, on a recorded
cgroup: a request that never fits gets 413 naming the limit at once; one that does not fit
now waits in line (first come, first served, its body unread) and gets 503 with Retry-After
when its wait runs out; the wait counts toward its timeout."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from service.admission import AdmissionLine, estimate_hold
from service.errors import PayloadTooLargeError, UnavailableError
from tests.workers.cgroups import IDLE, LIMIT, MiB, Recorded, table_of
from workers.device_memory import DeviceMemory
from workers.ledger import GROWTH

NEED = 16 * MiB  # a one-sample plan
MARGIN = 32 * MiB


@pytest.fixture
def recorded(tmp_path: Path) -> Recorded:
    return Recorded(tmp_path)


def _line(recorded: Recorded, wait_s: float = 0.2) -> AdmissionLine:
    memory = DeviceMemory("cpu", margin=MARGIN, read=recorded.read, trim=lambda: None)
    table = table_of(NEED)
    memory.register("m", lambda: table, lambda: 0)
    return AdmissionLine(memory, wait_s)


def test_inactive_without_a_limit(recorded: Recorded) -> None:
    (recorded.group / "memory.max").write_text("max\n")
    line = _line(recorded)
    assert not line.active
    assert asyncio.run(line.admit("m", 10 * LIMIT)) is None  # nothing refused here


def test_too_large_for_an_idle_server_is_413_naming_the_limit(recorded: Recorded) -> None:
    line = _line(recorded)
    most = LIMIT - IDLE - MARGIN - int(GROWTH * NEED)
    with pytest.raises(PayloadTooLargeError, match=f"{LIMIT} bytes on cgroup /pod/ctr"):
        asyncio.run(line.admit("m", most + 1))
    assert asyncio.run(line.admit("m", most)) is not None  # exactly fits


def test_full_now_waits_then_503_and_fifo_when_memory_frees(recorded: Recorded) -> None:
    line = _line(recorded)
    memory = line.memory
    big = (LIMIT - IDLE - MARGIN - int(GROWTH * NEED)) // 2

    async def scenario() -> list[str]:
        first = await line.admit("m", big)
        second = await line.admit("m", big)
        with pytest.raises(UnavailableError, match="bytes held by 2 requests") as refused:
            await line.admit("m", big)  # no room: waits 0.2 s, then 503
        assert refused.value.retry_after >= 1
        order: list[str] = []
        assert first is not None and first.waited_s == 0.0  # admitted at once
        waited: list[float] = []

        async def late(name: str) -> None:
            ticket = await line.admit("m", big)
            assert ticket is not None
            order.append(name)
            waited.append(ticket.waited_s)  # it counts toward the request's timeout
            memory.done(ticket)

        waiting = [asyncio.create_task(late(n)) for n in ("a", "b")]
        await asyncio.sleep(0.05)
        assert order == []  # both wait in line, bodies unread
        memory.done(first)
        await asyncio.gather(*waiting)
        memory.done(second)
        assert all(w >= 0.04 for w in waited), waited  # they waited the 0.05 s above at least
        return order

    assert asyncio.run(scenario()) == ["a", "b"]
    report = memory.report()
    assert report.held_bytes == 0 and report.requests == 0
    assert report.admitted == 4 and report.refused_busy == 1


def test_a_body_holds_by_its_kind() -> None:
    assert estimate_hold(MiB, "binary") == 3 * MiB < estimate_hold(MiB, "json") \
        < estimate_hold(MiB, "image")
    assert estimate_hold(MiB, "text/plain") == estimate_hold(MiB, "json")


def test_the_line_waits_up_to_the_request_timeout_by_default() -> None:
    """A request waits in line for memory as long as it may wait for its answer (its body
    unread, it holds nothing meanwhile), never past that: the wait counts toward it."""
    from service.settings import Settings

    assert Settings(request_timeout_s=45).line_wait_s == 45
    assert Settings(request_timeout_s=45, admit_wait_s=2).line_wait_s == 2
    assert Settings(request_timeout_s=45, admit_wait_s=600).line_wait_s == 45


_RETAINED = """
import os, sys
import numpy as np
from core.malloc import LARGE_BLOCK, map_large_blocks
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
if sys.argv[1] == 'map':
    map_large_blocks(LARGE_BLOCK)
before = rss()
for _ in range(3):  # a request's body and samples, read and freed
    block = np.ones(8 << 20, np.uint8)
    del block
print(rss() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or
                    "glibc" not in " ".join(__import__("platform").libc_ver()),
                    reason="glibc's malloc on Linux")
def test_under_a_limit_freed_request_blocks_go_back_to_the_kernel() -> None:
    """glibc's malloc keeps a freed 8 MiB block in its heap by default (its threshold for
    mapping a block alone rises to the largest freed): use the limit's ledger would count as
    what stays. Under a limit, blocks of 1 MiB and more are mapped alone and given back."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]

    def retained(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _RETAINED, mode], cwd=root, check=True,
                             capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip())

    assert retained("default") >= 4 << 20  # the control: glibc keeps it
    assert retained("map") < 1 << 20
