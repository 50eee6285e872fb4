"""The CUDA allocator's cache given back (``workers.device_cache``): when it is worth a trim,
the idle thread that trims once per idle spell, and what of the cache a trim gives back and a
plan can use (from recorded snapshots). The allocator itself is in
tests/gpu/test_device_cache.py."""

from __future__ import annotations

import threading

import pytest

from workers.device_cache import (LARGE_PAGE, MIN_SLACK, Cache, DeviceCache, IdleTrim,
                                  cache_of, excess)

MiB = 2**20


def test_excess_keeps_what_plans_want_and_a_slack() -> None:
    assert excess(0, 0) == 0
    assert excess(100 * MiB, 100 * MiB) == 0             # a plan of the cache's size: kept
    assert excess(100 * MiB + MIN_SLACK, 100 * MiB) == 0  # a slack's worth over: kept
    assert excess(200 * MiB, 100 * MiB) == 100 * MiB      # a smaller plan ran: the rest back
    # the slack grows with the plans' need: a quarter of it
    assert excess(1000 * MiB + 200 * MiB, 1000 * MiB) == 0
    assert excess(1000 * MiB + 300 * MiB, 1000 * MiB) == 300 * MiB
    assert excess(10 * MiB, 100 * MiB) == 0               # less cached than wanted


def test_idle_trim_once_per_idle_spell() -> None:
    trimmed = threading.Semaphore(0)
    trim = IdleTrim(trimmed.release, idle_s=0.01)
    try:
        trim.idle()
        assert trimmed.acquire(timeout=10)
        assert trim.trims == 1
        trim.busy()
        trim.idle()          # a new spell: one more
        assert trimmed.acquire(timeout=10)
        assert trim.trims == 2
    finally:
        trim.close()
    assert not trimmed.acquire(blocking=False)  # never a second trim in one spell


def test_busy_before_the_idle_time_cancels_the_trim() -> None:
    now = [0.0]
    trimmed = threading.Event()
    trim = IdleTrim(trimmed.set, idle_s=5.0, clock=lambda: now[0])
    try:
        trim.idle()      # idle from t = 0
        trim.busy()      # busy again before t = 5
        now[0] = 100.0   # long after: but the spell ended, so nothing is due
        trim.idle()      # a new spell from t = 100: due at t = 105
        now[0] = 104.0
        assert not trimmed.wait(0.2)
        now[0] = 106.0   # the thread rechecks within its wait of at most idle_s: due now
        assert trimmed.wait(10)
        assert trim.trims == 1
    finally:
        trim.close()


def test_a_failing_trim_leaves_the_thread_running() -> None:
    calls = threading.Semaphore(0)

    def trim() -> None:
        calls.release()
        raise RuntimeError("driver said no")

    idle = IdleTrim(trim, idle_s=0.0)
    try:
        idle.idle()
        assert calls.acquire(timeout=10)
        idle.idle()
        assert calls.acquire(timeout=10)
        assert idle.trims == 0
    finally:
        idle.close()


# ---------------------------------------------------------------- what the cache is good for

def _segment(address: int, blocks: list[tuple[int, bool]], *, expandable: bool = True,
             small: bool = False, pool: tuple[int, int] = (0, 0), stream: int = 0) -> dict:
    """A segment as ``torch.cuda.memory_snapshot()`` gives it: (size, in use) per block."""
    return {"device": 0, "address": address, "stream": stream, "is_expandable": expandable,
            "segment_type": "small" if small else "large", "segment_pool_id": pool,
            "total_size": sum(size for size, _ in blocks),
            "allocated_size": sum(size for size, used in blocks if used),
            "blocks": [{"size": size, "state": "active_allocated" if used else "inactive"}
                       for size, used in blocks]}


def test_only_whole_pages_and_whole_segments_go_back() -> None:
    page = LARGE_PAGE
    base = 1 << 40
    # one mapped range of 5 pages: live, free across page 1, live, free to its end
    first = _segment(base, [(5 * MiB, True), (50 * MiB, False), (1 * MiB, True),
                            (44 * MiB, False)])
    # a higher range of the same stream: its first block borders the unmapped pages below
    second = _segment(base + 10 * page, [(30 * MiB, False), (10 * MiB, True)])
    cache = cache_of([first, second])
    assert cache.expandable
    # free, in whole pages: [20, 40) MiB of the first block, [60, 100) of the last, [0, 20)
    assert cache.releasable == 20 * MiB + 40 * MiB + 20 * MiB
    # a block that can grow into unmapped pages is free whole: the first range's last block
    # and the second range's first (the first range's first is the segment's start)
    assert cache.reusable == 20 * MiB + 44 * MiB + 30 * MiB
    assert cache.pools == 0


def test_the_small_pool_and_cudamalloc_segments_and_graph_pools() -> None:
    small = _segment(0, [(1 * MiB, True), (3 * MiB, False), (2 * MiB, False)], small=True)
    assert cache_of([small]) == Cache(releasable=4 * MiB, reusable=4 * MiB, pools=0,
                                      expandable=True)
    whole = _segment(1 << 30, [(20 * MiB, False)], expandable=False)
    split = _segment(1 << 31, [(1 * MiB, True), (19 * MiB, False)], expandable=False)
    assert cache_of([whole, split]) == Cache(20 * MiB, 20 * MiB, 0, False)
    graphs = _segment(1 << 32, [(4 * MiB, True), (36 * MiB, False)], pool=(0, 7))
    assert cache_of([graphs, whole]) == Cache(20 * MiB, 20 * MiB, 36 * MiB, False)


def test_the_reading_counts_the_driver_in_pages_and_the_cache_any_block_can_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from workers import memory

    driver = [5 * LARGE_PAGE + 7 * MiB]
    segments = [_segment(1 << 40, [(5 * MiB, True), (35 * MiB, False)]),  # 20 MiB: a page
                _segment(1 << 41, [(1 * MiB, True), (3 * MiB, False)], pool=(0, 3))]
    snapshots = []

    def snapshot() -> list[dict]:
        snapshots.append(1)
        return segments

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (driver[0], 1 << 40))
    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # a CUDA graph's pool is never free for plans (tests/workers/test_dead_pools.py)
    assert memory.cuda_free("cuda") == 5 * LARGE_PAGE + 35 * MiB
    assert memory.MemoryProbe("cuda").free() == 5 * LARGE_PAGE + 35 * MiB
    assert DeviceCache("cuda:0", idle_s=0).unused() == 20 * MiB
    # under a limit the driver alone covers, the allocator's blocks are not walked
    snapshots.clear()
    capped = memory.MemoryProbe("cuda", limit=2 * LARGE_PAGE)
    assert capped.free() == 2 * LARGE_PAGE and not snapshots
    driver[0] = 7 * MiB  # a neighbour took the rest, short of a page: the cache is read
    assert capped.free() == 35 * MiB and snapshots
