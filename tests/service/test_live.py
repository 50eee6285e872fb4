"""``service.live``: the window of answered requests behind the page's live figures, on a
clock the test moves (no sleeps), with real outcomes of a real table."""

from __future__ import annotations

import numpy as np
import pytest

from planner.solver.synthetic import chain_like
from planner.solver.tables import build_table
from service import live as live_module
from service.batch_stage import Outcome, Timing
from service.live import Live
from service.metrics import Metrics
from workers.worker import Choice, RunInfo


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def outcome(samples: int, batch: int, pieces: int = 1) -> Outcome:
    table = build_table(chain_like(n_units=4, batch_max=4), slot_count=16)
    choices = tuple(Choice(table, int(table.rows[batch - 1].plans[-1]), batch, 10**9 + k, 0.0)
                    for k in range(pieces))
    return Outcome(np.zeros((samples, 3), np.float32), None, RunInfo(choices, 1, pieces - 1),
                   batch * pieces, Timing(0.0, 0.0, 0.0, 0.0, 0.0), 7)


def test_figures_cover_the_window_and_name_the_last_plan() -> None:
    clock = Clock()
    live = Live(window_s=10.0, clock=clock, wall=lambda: 1234.5)
    assert live.figures("m") == live_module.Figures(10.0, 0, 0, 0.0, None, None, None)
    first = outcome(samples=2, batch=4)
    for latency in (0.01, 0.02, 0.03, 0.04):
        live.record("m", latency, first)
    clock.now += 5
    last = outcome(samples=1, batch=3, pieces=2)
    live.record("m", 0.5, last)
    got = live.figures("m")
    assert (got.requests, got.samples, got.samples_per_s) == (5, 9, 0.9)
    assert got.p50_s == pytest.approx(0.03) and got.p99_s == pytest.approx(0.5, rel=0.05)
    c = last.info.choices[-1]
    assert got.last == live_module.LastBatch(
        at=1234.5, plan_id=c.plan_id, solver="vbs", batch=3, samples=6, pieces=2,
        budget_bytes=10**9 + 1, peak_bytes=c.peak_bytes, predicted_time_s=c.time_total,
        oom_retries=1, table_version=7)
    clock.now += 6  # the first four left the window; the last plan stays known
    got = live.figures("m")
    assert (got.requests, got.samples) == (1, 1) and got.last is not None
    assert live.figures("other").requests == 0


def test_a_full_window_reports_the_span_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live_module, "MAX_KEPT", 100)
    clock = Clock()
    live = Live(window_s=10.0, clock=clock)
    one = outcome(samples=1, batch=1)
    for _ in range(300):  # 300 requests in 3 s: only the last 100 (1 s) are kept
        live.record("m", 0.001, one)
        clock.now += 0.01
    got = live.figures("m")
    assert got.requests == 100 and got.window_s == pytest.approx(1.0)
    assert got.samples_per_s == pytest.approx(100.0)


def test_table_stamps_change_with_the_table() -> None:
    wall = iter([1.0, 2.0, 3.0])
    live = Live(wall=lambda: next(wall))
    a, b = object(), object()
    assert live.table_stamp("m") is None
    assert live.note_table("m", a, 1) == live_module.TableStamp(1, 1.0)
    assert live.note_table("m", a, 1) == live_module.TableStamp(1, 1.0)  # the same table
    assert live.note_table("m", b, 2) == live_module.TableStamp(2, 2.0)  # swapped in
    assert live.note_table("m", b, 3) == live_module.TableStamp(3, 3.0)
    assert live.table_stamp("m") == live_module.TableStamp(3, 3.0)


def test_metrics_total_reads_one_counter() -> None:
    metrics = Metrics()
    metrics.for_model("a").samples.inc(5)
    metrics.for_model("b").samples.inc(2)
    metrics.for_model("a").oom_retries.inc()
    assert metrics.total(metrics.samples, "a") == 5 == metrics.value("vbs_samples_total", {"model": "a"})
    assert metrics.total(metrics.samples, "b") == 2
    assert metrics.total(metrics.oom_retries, "a") == 1
    assert metrics.total(metrics.splits, "a") == 0 and metrics.total(metrics.samples, "c") == 0
