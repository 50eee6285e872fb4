"""The admission ledger (``service.admission``) on a recorded cgroup: a temporary directory
laid out as /proc and /sys/fs/cgroup (v2), whose files the test rewrites as the group's use
changes. What must hold: 413 naming the limit for a request that never fits, a place or a
wait then 503 with Retry-After for one that does not fit now, first come first served, holds
given back when both the request and its samples are done, and plans given what is left."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import numpy as np
import pytest

from service.admission import GROWTH, RESERVE_SHARE, Admission, estimate_hold
from service.errors import PayloadTooLargeError, UnavailableError
from workers.cgroup import read_cgroup

MiB = 2**20
LIMIT = 1024 * MiB
IDLE = 512 * MiB
NEED = 16 * MiB  # a one-sample plan
MARGIN = 32 * MiB


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


@pytest.fixture
def recorded(tmp_path: Path) -> Recorded:
    return Recorded(tmp_path)


def _admission(recorded: Recorded, leased: list[int] | None = None,
               wait_s: float = 0.2) -> Admission:
    live = leased if leased is not None else [0]
    return Admission(lambda: live[0], lambda model: NEED, margin=MARGIN, wait_s=wait_s,
                     read=recorded.read, trim=lambda: None)


def test_inactive_without_a_limit(recorded: Recorded) -> None:
    (recorded.group / "memory.max").write_text("max\n")
    admission = _admission(recorded)
    assert not admission.active
    assert asyncio.run(admission.admit("m", 10 * LIMIT)) is None  # nothing refused here
    ledger = admission.ledger()
    assert ledger.limit_bytes is None and ledger.plans_may_use_bytes is None


def test_too_large_for_an_idle_server_is_413_naming_the_limit(recorded: Recorded) -> None:
    admission = _admission(recorded)
    capacity = LIMIT - IDLE - MARGIN
    most = capacity - int(GROWTH * NEED)  # a one-sample plan grows the group by GROWTH x
    with pytest.raises(PayloadTooLargeError, match=f"{LIMIT} bytes on cgroup /pod/ctr"):
        asyncio.run(admission.admit("m", most + 1))
    assert admission.ledger().refused_too_large == 1
    ticket = asyncio.run(admission.admit("m", most))  # exactly fits
    assert ticket is not None and admission.ledger().held_bytes == most


def test_full_now_waits_then_503_and_fifo_when_memory_frees(recorded: Recorded) -> None:
    admission = _admission(recorded)
    capacity = LIMIT - IDLE - MARGIN
    big = (capacity - int(GROWTH * NEED)) // 2

    async def scenario() -> list[str]:
        first = await admission.admit("m", big)
        second = await admission.admit("m", big)
        with pytest.raises(UnavailableError) as refused:  # no room: waits 0.2 s, then 503
            await admission.admit("m", big)
        assert refused.value.retry_after >= 1
        order: list[str] = []

        assert first.waited_s == 0.0  # admitted at once
        waited: list[float] = []

        async def late(name: str) -> None:
            ticket = await admission.admit("m", big)
            assert ticket is not None
            order.append(name)
            waited.append(ticket.waited_s)  # it counts toward the request's timeout
            admission.release(ticket)

        waiting = [asyncio.create_task(late(n)) for n in ("a", "b")]
        await asyncio.sleep(0.05)
        assert order == []  # both wait in line, bodies unread
        admission.release(first)
        await asyncio.gather(*waiting)
        admission.release(second)
        assert all(w >= 0.04 for w in waited), waited  # they waited the 0.05 s above at least
        return order

    assert asyncio.run(scenario()) == ["a", "b"]
    ledger = admission.ledger()
    assert ledger.held_bytes == 0 and ledger.requests == 0
    assert ledger.admitted == 4 and ledger.refused_busy == 1


def test_requests_leave_the_plans_their_working_bytes(recorded: Recorded) -> None:
    """Where a batch runs at working speed only with WANT bytes (more than a one-sample
    plan's), requests are admitted only while the plans keep them: a request decoded early
    gains nothing and would leave the batch one-sample plans."""
    want = 64 * MiB
    admission = Admission(lambda: 0, lambda model: NEED, want=lambda model: want,
                          margin=MARGIN, wait_s=0.1, read=recorded.read, trim=lambda: None)
    capacity = LIMIT - IDLE - MARGIN
    hold = (capacity - int(GROWTH * want)) // 2  # two fit beside the working plans, exactly

    async def scenario() -> None:
        first = await admission.admit("m", hold)
        second = await admission.admit("m", hold)
        with pytest.raises(UnavailableError):  # a third, however small, would eat into them
            await admission.admit("m", MiB)
        assert admission.plan_free() >= want
        admission.release(first)
        admission.release(second)

    asyncio.run(scenario())
    # a request too large to leave the working bytes still runs, on what is left
    alone = capacity - int(GROWTH * NEED)
    ticket = asyncio.run(admission.admit("m", alone))
    assert ticket is not None and admission.plan_free() >= NEED


def test_the_live_group_counts_too(recorded: Recorded) -> None:
    """The ledger has room, but the group's working set (something the ledger does not know
    of) leaves none: the request waits, then 503."""
    admission = _admission(recorded)
    recorded.use(LIMIT - MARGIN - NEED)
    with pytest.raises(UnavailableError):
        asyncio.run(admission.admit("m", MiB))


def test_a_hold_lasts_while_its_samples_live(recorded: Recorded) -> None:
    admission = _admission(recorded)
    ticket = asyncio.run(admission.admit("m", estimate_hold(MiB, "binary")))
    x = np.zeros(MiB // 4, np.float32)
    admission.resize(ticket, 2 * MiB)  # decoded: what it holds, at least what it was admitted for
    assert admission.ledger().held_bytes == estimate_hold(MiB, "binary")
    admission.keep(ticket, x)
    admission.release(ticket)  # answered, but a batch still holds the samples
    assert admission.ledger().requests == 1
    del x
    gc.collect()
    assert admission.ledger().requests == 0 and admission.ledger().held_bytes == 0


def test_plans_get_what_is_left_less_the_reserve(recorded: Recorded) -> None:
    leased = [0]
    admission = _admission(recorded, leased)
    capacity = LIMIT - IDLE - MARGIN
    assert admission.ceiling() == int(capacity / GROWTH)

    def expected(held: int, in_group: int) -> int:
        """The ledger's room less the reserve, or the group's headroom less what is coming
        and a quarter of the margin, whichever is less, over what a plan grows the group by."""
        room = capacity - held
        reserve = max(0, min(capacity // RESERVE_SHARE, room - int(GROWTH * NEED)))
        headroom = LIMIT - in_group - (held if in_group == IDLE else 0) - MARGIN // 4
        return int(min(room - reserve, headroom) / GROWTH)

    assert admission.plan_free() == expected(0, IDLE)
    ticket = asyncio.run(admission.admit("m", 100 * MiB))
    # the request's bytes are not the plans': held in the ledger, unread in the group
    assert admission.plan_free() == expected(100 * MiB, IDLE)
    admission.resize(ticket, 100 * MiB)  # read: in the group now
    recorded.use(IDLE + 100 * MiB)
    assert admission.plan_free() == expected(100 * MiB, IDLE + 100 * MiB)
    # the group grew beyond the ledger (an allocator's pool): plans get less, by the reading
    recorded.use(LIMIT - 2 * MARGIN)
    assert admission.plan_free() == int((2 * MARGIN - MARGIN // 4) / GROWTH)
    admission.release(ticket)


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
from service.admission import _map_large_blocks
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
if sys.argv[1] == 'map':
    _map_large_blocks()
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
