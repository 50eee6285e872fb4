"""The one owner of a device's memory (``workers.device_memory``) on a recorded cgroup: what it
answers to "may this request in" (a ticket, not now, never: ``RequestTooLargeError`` naming
the limit) and to "what may this plan use" (what the ledger leaves, less the reserve, never
more than the group's headroom), with one margin, holds given back when both the request and
its samples are done, and the sizes it plans with taken from the tables registered with it."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from core.errors import RequestTooLargeError
from tests.workers.cgroups import IDLE, LIMIT, MiB, Recorded, table_of
from workers.device_memory import MARGIN_SHARE, MIN_MARGIN, DeviceMemory
from workers.ledger import GROWTH, RESERVE_SHARE, RETURNED_GROWTH

NEED = 16 * MiB  # a one-sample plan
MARGIN = 32 * MiB


@pytest.fixture
def recorded(tmp_path: Path) -> Recorded:
    return Recorded(tmp_path)


def _memory(recorded: Recorded, want: int | None = None, margin: int = MARGIN) -> DeviceMemory:
    memory = DeviceMemory("cpu", margin=margin, read=recorded.read, trim=lambda: None)
    table = table_of(NEED, want)
    memory.register("m", lambda: table, lambda: 0)
    return memory


def test_without_a_limit_nothing_is_counted(recorded: Recorded) -> None:
    (recorded.group / "memory.max").write_text("max\n")
    memory = _memory(recorded)
    assert not memory.counts_requests
    assert memory.admit("m", 10 * LIMIT).token == 0  # type: ignore[union-attr]  # nothing held
    report = memory.report()
    assert report.limit_bytes is None and report.plans_may_use_bytes is None


def test_the_sizes_come_from_the_registered_tables(recorded: Recorded) -> None:
    memory = _memory(recorded, want=64 * MiB)
    assert memory.one_sample_bytes("m") == NEED and memory.working_bytes("m") == 64 * MiB
    big = table_of(2 * NEED)
    memory.register("big", lambda: big, lambda: 0)
    assert memory.one_sample_bytes(None) == 2 * NEED  # the largest of the models
    assert memory.one_sample_bytes("unknown") == 2 * NEED


def test_one_margin_in_one_place(recorded: Recorded) -> None:
    assert _memory(recorded).margin(LIMIT) == MARGIN  # configured: everywhere
    unset = _memory(recorded, margin=0)
    assert unset.margin(LIMIT) == max(MIN_MARGIN, LIMIT // MARGIN_SHARE)  # under a limit
    assert unset.margin() == 0  # no limit, none configured


def test_too_large_for_an_idle_server_is_refused_naming_the_limit(recorded: Recorded) -> None:
    memory = _memory(recorded)
    capacity = LIMIT - IDLE - MARGIN
    most = capacity - int(GROWTH * NEED)  # a one-sample plan grows the group by GROWTH x
    with pytest.raises(RequestTooLargeError, match=f"{LIMIT} bytes on cgroup /pod/ctr"):
        memory.admit("m", most + 1)
    assert memory.report().refused_too_large == 1
    ticket = memory.admit("m", most)  # exactly fits
    assert ticket is not None and memory.report().held_bytes == most


def test_requests_leave_the_plans_their_working_bytes(recorded: Recorded) -> None:
    """Where a batch runs at working speed only with WANT bytes (more than a one-sample
    plan's), requests are admitted only while the plans keep them: a request decoded early
    gains nothing and would leave the batch one-sample plans."""
    want = 64 * MiB
    memory = _memory(recorded, want=want)
    capacity = LIMIT - IDLE - MARGIN
    hold = (capacity - int(GROWTH * want)) // 2  # two fit beside the working plans, exactly
    first, second = memory.admit("m", hold), memory.admit("m", hold)
    assert first is not None and second is not None
    assert memory.admit("m", MiB) is None  # a third, however small, would eat into them
    assert memory.plan_free() >= want
    memory.done(first)
    memory.done(second)
    # a request too large to leave the working bytes still runs, on what is left
    alone = capacity - int(GROWTH * NEED)
    assert memory.admit("m", alone) is not None and memory.plan_free() >= NEED


def test_the_live_group_counts_too(recorded: Recorded) -> None:
    """The ledger has room, but the group's working set (something the ledger does not know
    of) leaves none: not now."""
    memory = _memory(recorded)
    recorded.use(LIMIT - MARGIN - NEED)
    assert memory.admit("m", MiB) is None


def test_a_hold_lasts_while_its_samples_live(recorded: Recorded) -> None:
    memory = _memory(recorded)
    ticket = memory.admit("m", 3 * MiB)
    x = np.zeros(MiB // 4, np.float32)
    memory.resize(ticket, 2 * MiB)  # decoded: what it holds, at least what it was admitted for
    assert memory.report().held_bytes == 3 * MiB
    memory.keep(ticket, x)
    memory.done(ticket)  # answered, but a batch still holds the samples
    assert memory.report().requests == 1
    del x
    gc.collect()
    assert memory.report().requests == 0 and memory.report().held_bytes == 0


def test_plans_get_what_is_left_less_the_reserve(recorded: Recorded) -> None:
    memory = _memory(recorded)
    capacity = LIMIT - IDLE - MARGIN
    assert memory.ceiling() == int(capacity / GROWTH)

    def expected(held: int, in_group: int) -> int:
        """The ledger's room less the reserve, or the group's headroom less what is coming
        and a quarter of the margin, whichever is less, over what a plan grows the group by."""
        room = capacity - held
        reserve = max(0, min(capacity // RESERVE_SHARE, room - int(GROWTH * NEED)))
        headroom = LIMIT - in_group - (held if in_group == IDLE else 0) - MARGIN // 4
        return int(min(room - reserve, headroom) / GROWTH)

    assert memory.plan_free() == expected(0, IDLE)
    ticket = memory.admit("m", 100 * MiB)
    # the request's bytes are not the plans': held in the ledger, unread in the group
    assert memory.plan_free() == expected(100 * MiB, IDLE)
    memory.resize(ticket, 100 * MiB)  # read: in the group now
    recorded.use(IDLE + 100 * MiB)
    assert memory.plan_free() == expected(100 * MiB, IDLE + 100 * MiB)
    # the group grew beyond the ledger (an allocator's pool): plans get less, by the reading
    recorded.use(LIMIT - 2 * MARGIN)
    assert memory.plan_free() == int((2 * MARGIN - MARGIN // 4) / GROWTH)
    memory.done(ticket)
    # a configured cap applies on top, and the budget the worker leases from is this
    memory.probe.limit = 10 * MiB
    recorded.use(IDLE)
    assert memory.plan_free() == 10 * MiB == memory.budget()


def test_the_arena_given_back_under_a_limit_and_plans_counted_by_their_own_bytes(
        recorded: Recorded) -> None:
    """auto: where a cgroup limit applies, ONNX Runtime's arena is given back (at rest and
    when short: a host cache), and a plan then counts ``RETURNED_GROWTH`` times its bytes, not
    ``GROWTH``: the same limit leaves plans more; kept (shared) wherever asked, and wherever
    no limit applies; none gives it back after every call."""
    kept = DeviceMemory("cpu", margin=MARGIN, read=recorded.read, trim=lambda: None,
                        ort_arena="shared")
    given = DeviceMemory("cpu", margin=MARGIN, read=recorded.read, trim=lambda: None,
                         ort_arena="auto")
    assert kept.arena and not kept.gives_back and kept.host_cache is None
    assert kept.growth == GROWTH
    # a call keeps what it used; the memory owner gives it back
    assert given.arena and given.gives_back and given.host_cache is not None
    assert given.growth == RETURNED_GROWTH < GROWTH
    for memory in (kept, given):
        table = table_of(NEED)
        memory.register("m", lambda t=table: t, lambda: 0)
    assert given.ceiling() == int((LIMIT - IDLE - MARGIN) / RETURNED_GROWTH) > kept.ceiling()
    none = DeviceMemory("cpu", margin=MARGIN, read=recorded.read, trim=lambda: None,
                        ort_arena="none")
    assert not none.arena and none.gives_back and none.host_cache is None
    assert none.growth == RETURNED_GROWTH
    (recorded.group / "memory.max").write_text("max\n")
    unlimited = DeviceMemory("cpu", margin=MARGIN, read=recorded.read, trim=lambda: None,
                             ort_arena="auto")
    assert unlimited.arena and not unlimited.gives_back and unlimited.host_cache is None
    assert unlimited.growth == 1.0


def test_an_idle_reading_too_high_comes_down_when_the_group_does(recorded: Recorded) -> None:
    """The idle working set read while more was resident (what was freed later, the reading at
    the next release skipped as too soon) does not shrink the plans for good: with nothing
    held or leased, a lower reading is what stays; with a request held, it is not taken."""
    recorded.use(IDLE + 64 * MiB)
    memory = _memory(recorded)  # its first reading: 64 MiB more than stays
    assert memory.report().idle_working_set_bytes == IDLE + 64 * MiB
    ticket = memory.admit("m", MiB)
    assert ticket is not None
    recorded.use(IDLE)
    memory.plan_free()  # a request held: the group's reading is not the idle working set
    assert memory.report().idle_working_set_bytes == IDLE + 64 * MiB
    memory.done(ticket)
    memory.plan_free()
    assert memory.report().idle_working_set_bytes == IDLE
    recorded.use(IDLE + 32 * MiB)  # more resident again: taken when it is read at idle, not here
    memory.plan_free()
    assert memory.report().idle_working_set_bytes == IDLE


class _Kept:
    """What a runtime keeps of its calls in a recorded group: ``give_back`` (its hook) takes
    it out of the group's use."""

    def __init__(self, recorded: Recorded, memory: DeviceMemory) -> None:
        self.recorded, self.calls = recorded, 0
        self.given = threading.Event()
        assert memory.host_cache is not None
        memory.host_cache.register(self.give_back)

    def give_back(self) -> None:
        self.calls += 1
        self.recorded.use(IDLE)
        self.given.set()


def _ran(memory: DeviceMemory, recorded: Recorded, kept: int) -> None:
    """A plan ran, and what its runtime keeps stays in the group."""
    lease = memory.acquire("m", lambda free: _Plan(min(free, NEED)), need=NEED, timeout_s=5)
    recorded.use(IDLE + kept)
    memory.release(lease)


class _Plan:
    def __init__(self, peak: int) -> None:
        self.peak_bytes = peak


def _auto(recorded: Recorded, idle_s: float = 0.0) -> DeviceMemory:
    memory = DeviceMemory("cpu", margin=MARGIN, read=recorded.read, trim=lambda: None,
                          ort_arena="auto", cache_idle_s=idle_s)
    table = table_of(NEED, 4 * NEED)
    memory.register("m", lambda: table, lambda: 0)
    return memory


def test_what_the_arena_keeps_is_given_back_when_a_request_finds_the_group_short(
        recorded: Recorded) -> None:
    """The ledger has room but the group is short by what the arena kept of a plan: the
    request is admitted once it is given back (the group read again), not told to wait; where
    no plan ran since, or the ledger itself is full, nothing is given back."""
    memory = _auto(recorded)
    kept = _Kept(recorded, memory)
    recorded.use(LIMIT - MARGIN - NEED)  # something else, not a plan's: nothing to give back
    assert memory.admit("m", 8 * MiB) is None and kept.calls == 0
    recorded.use(IDLE)
    _ran(memory, recorded, LIMIT - MARGIN - NEED - IDLE)  # the arena keeps all but a plan's
    ticket = memory.admit("m", 8 * MiB)
    assert ticket is not None and kept.calls == 1
    assert memory.report().working_set_bytes == IDLE
    memory.done(ticket)
    # the ledger full of held requests: giving the arena back would not let one more in
    capacity = LIMIT - IDLE - MARGIN
    held = memory.admit("m", capacity - int(RETURNED_GROWTH * 4 * NEED))
    assert held is not None
    _ran(memory, recorded, 64 * MiB)
    assert memory.admit("m", 8 * MiB) is None and kept.calls == 1
    memory.done(held)


def test_what_the_arena_keeps_is_given_back_before_a_plan_gets_less_than_its_working_bytes(
        recorded: Recorded) -> None:
    memory = _auto(recorded)
    kept = _Kept(recorded, memory)
    full = memory.plan_free()
    _ran(memory, recorded, LIMIT - IDLE - MARGIN - 2 * NEED)  # the headroom: under 4 x NEED
    assert memory.plan_free() == full and kept.calls == 1
    _ran(memory, recorded, 96 * MiB)  # less for plans, but not short of working bytes: kept
    assert memory.plan_free() < full and kept.calls == 1


def test_the_idle_use_is_read_with_what_the_arena_kept_given_back(recorded: Recorded) -> None:
    """What the arena keeps is not what stays: read at rest as the idle working set, it would
    leave requests less room for good (they waited in line and got 503 under a burst)."""
    memory = _auto(recorded)
    kept = _Kept(recorded, memory)
    ticket = memory.admit("m", MiB)
    _ran(memory, recorded, 96 * MiB)
    memory.done(ticket)  # at rest: the arena given back, then what stays read
    assert kept.calls == 1 and memory.report().idle_working_set_bytes == IDLE


def test_what_the_arena_keeps_is_given_back_after_the_device_rested(
        recorded: Recorded) -> None:
    """A plan ran while a request was held (the release's reading skipped: too soon after the
    last), then nothing: after ``idle_s`` it is given back and the idle use read again."""
    memory = _auto(recorded, idle_s=0.01)
    kept = _Kept(recorded, memory)
    memory.rebase()  # read just now: the next release's reading is skipped
    ticket = memory.admit("m", MiB)
    _ran(memory, recorded, 96 * MiB)
    memory.done(ticket)
    assert kept.given.wait(5), "the arena was not given back at rest"
    deadline = time.monotonic() + 5
    while memory.report().idle_working_set_bytes != IDLE and time.monotonic() < deadline:
        kept.given.wait(0.01)  # the read after the give-back, on the cache's thread
    assert memory.report().idle_working_set_bytes == IDLE
    memory.close()
