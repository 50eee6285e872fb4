"""The CUDA allocator's cache given back (``workers.device_cache``): when it is worth a trim,
and the idle thread that trims once per idle spell. The allocator itself is in
tests/gpu/test_device_cache.py."""

from __future__ import annotations

import threading

from workers.device_cache import MIN_SLACK, IdleTrim, excess

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
