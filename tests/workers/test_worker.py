"""The worker: memory probe, plan choice, splitting, out-of-memory step-down, errors."""

from __future__ import annotations

import pytest
import torch

from core.errors import InfeasibleError
from planner.graph.capture import capture
from core.loaded import ModelSpec
from planner.models import load_model
from planner.profiling.profiler import ProfileOptions, measure
from planner.solver.tables import build_table
from workers.memory import MemoryProbe
from workers.worker import Worker


def _worker(name: str, shape: tuple[int, ...], batch_max: int = 4, solver: str = "vbs") -> Worker:
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec(name, input_shape=shape)))
    profile = measure(cap, ProfileOptions(batch_max=batch_max, repeats=1, warmup=0), progress=False)
    table = build_table(profile, solver=solver, slot_count=64)
    return Worker(cap, table, MemoryProbe("cpu"))


def test_worker_steps_down_until_the_plan_fits() -> None:
    worker = _worker("tests.planner.factories:two_layer", (3, 8, 8))
    x = worker.capture.model.example(4)
    with torch.inference_mode():
        expected = worker.capture.model.module(x)
    peaks = worker.table.row(4).peaks.tolist()
    assert len(peaks) > 1
    times = []
    for free in peaks:
        y, info = worker.infer(x, free=lambda: free)
        torch.testing.assert_close(y, expected)
        [choice] = info.choices
        assert choice.peak_bytes == free  # each breakpoint is its own plan's peak
        assert choice.seconds < 0.1
        times.append(choice.time_total)
    # More memory never picks a slower plan.
    assert times == sorted(times, reverse=True)


def test_a_batch_that_does_not_fit_whole_runs_in_the_largest_pieces_the_table_allows() -> None:
    worker = _worker("tests.planner.factories:two_layer", (3, 8, 8))
    x = worker.capture.model.example(4)
    with torch.inference_mode():
        expected = worker.capture.model.module(x)
    mins = worker.table.min_peaks
    free = int(mins[1])  # two samples fit, four do not
    assert mins[3] > free
    y, info = worker.infer(x, free=lambda: free)
    torch.testing.assert_close(y, expected)
    want = worker.table.largest_fitting(4, free)
    assert 2 <= want < 4
    assert [c.batch for c in info.choices][0] == want and sum(c.batch for c in info.choices) == 4
    assert info.splits == len(info.choices) - 1 >= 1
    assert all(c.peak_bytes <= free for c in info.choices)


def test_a_single_sample_that_cannot_fit_says_what_is_missing() -> None:
    worker = _worker("tests.planner.factories:two_layer", (3, 8, 8))
    with pytest.raises(InfeasibleError, match=r"bytes more"):
        worker.infer(worker.capture.model.example(2), free=lambda: 16)


def test_out_of_memory_steps_down_and_the_batch_is_not_lost() -> None:
    from tests.planner.factories import DEVICE_CAPACITY

    # fbs tables: with ample memory the first plan runs every unit on all 4 samples, so the
    # device's capacity of 3 is always hit (a vbs plan may already use smaller batches).
    worker = _worker("tests.planner.factories:out_of_memory_above", (3, 8, 8), solver="fbs")
    x = worker.capture.model.example(4)
    with torch.inference_mode():
        expected = worker.capture.model.module(x)
    DEVICE_CAPACITY["samples"] = 3  # memory was taken after the table was planned
    try:
        y, info = worker.infer(x, free=lambda: 10**9)
    finally:
        DEVICE_CAPACITY["samples"] = 1 << 30
    torch.testing.assert_close(y, expected)
    assert info.oom_retries >= 1
    assert worker.stats.oom_retries == info.oom_retries
    assert all(s.samples <= 3 for c in info.choices for s in c.plan.program.steps if s.unit == "b")


@pytest.fixture
def tiny() -> Worker:
    return _worker("tests.planner.factories:two_layer", (3, 8, 8))


def test_choosing_and_running_plans_is_lookups_only(tiny: Worker, no_planning) -> None:
    worker = tiny  # built (profiled and planned) before the lookups-only guard goes up
    x = worker.capture.model.example(4)
    table = worker.table
    budgets = {int(table.min_peaks[0]), int(table.min_peaks[1]), table.top_bytes}
    with torch.inference_mode():
        expected = worker.capture.model.module(x)
    for free in budgets:
        y, info = worker.infer(x, free=lambda: free)
        torch.testing.assert_close(y, expected)
        assert all(c.peak_bytes <= free for c in info.choices)
    assert no_planning == []
