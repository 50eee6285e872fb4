"""The interim table (``planner.interim``): a real model, its whole graph in ONNX Runtime, its
memory measured in a child process and its time here; every plan at every budget where the
table changes runs through a real worker and gives ``model(x)``; a model ONNX Runtime cannot
run whole gets no interim table, and says why."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.errors import ProfileError
from core.runs import TreeIndex
from core.runtimes.base import RuntimeOptions
from core.spec import ModelSpec
from core.table import INTERIM
from planner.graph.capture import capture
from planner.interim import Interim, batch_sizes, build, phases, table_of
from planner.models import load_model
from workers.memory import MemoryProbe
from workers.worker import Worker

B = 6  # not a power of two: its own batch size is measured too


def _capture(name: str, shape: tuple[int, ...]) -> object:
    return capture(load_model(ModelSpec(name=name, input_shape=shape)))


@pytest.fixture(scope="module")
def residual() -> tuple[object, Interim]:
    cap = _capture("tests.planner.factories:inplace_residual", (3, 8, 8))
    built = build(cap, "f" * 16, B, RuntimeOptions())
    assert isinstance(built, Interim), built
    return cap, built


def test_batch_sizes_and_the_calls_of_a_plan() -> None:
    assert batch_sizes(1) == (1,)
    assert batch_sizes(16) == (1, 2, 4, 8, 16)
    assert batch_sizes(12) == (1, 2, 4, 8, 12)
    assert phases(13, 4) == [4, 4, 4, 1]
    assert phases(11, 8) == [8, 2, 1]
    assert phases(12, 12) == [12]
    for r in range(1, 13):  # every call at a measured size, the samples all there
        for c in (c for c in batch_sizes(12) if c <= r):
            calls = phases(r, c)
            assert sum(calls) == r and set(calls) <= set(batch_sizes(12))


def test_the_interim_table_is_measured_and_every_plan_runs_the_model(
        residual: tuple[object, Interim]) -> None:
    cap, built = residual
    table = built.table
    assert table.solver == INTERIM and table.fingerprint == "f" * 16
    assert table.runtimes == ("onnxruntime",) and table.batch_max == B
    assert sorted(built.seconds) == sorted(built.held) == list(batch_sizes(B))
    assert all(s > 0 for s in built.seconds.values()) and all(h > 0 for h in built.held.values())
    root = TreeIndex.of(cap.tree)  # type: ignore[attr-defined]
    worker = Worker(cap, table, MemoryProbe("cpu"), runtimes={"onnxruntime": built.units})
    module = cap.model.module  # type: ignore[attr-defined]
    for r in range(1, B + 1):
        row = table.row(r)
        times = [table.plans[i].time_total for i in row.plans.tolist()]
        assert len(row.peaks) >= 1 and times == sorted(times, reverse=True)
        for peak, index in zip(row.peaks.tolist(), row.plans.tolist()):
            plan = table.plans[index]
            steps = table.program(index).steps
            for first, last in plan.runs:  # every call: the whole model at a measured size
                assert root.run_nodes(steps, first, last) == cap.tree.children  # type: ignore[attr-defined]
                assert steps[first].samples in built.seconds
            x = torch.randn(r, 3, 8, 8)
            y, info = worker.infer(x, free=lambda p=peak: p)
            assert [c.peak_bytes for c in info.choices] == [peak]  # it fits where it says
            with torch.inference_mode():
                np.testing.assert_allclose(y.numpy(), module(x).numpy(), rtol=1e-4, atol=1e-5)


def test_a_table_needs_every_size_measured(residual: tuple[object, Interim]) -> None:
    cap, built = residual
    seconds = {b: s for b, s in built.seconds.items() if b != B}
    with pytest.raises(ProfileError, match="batch sizes"):
        table_of(cap.tree, cap.uniform_order, "f" * 16, B, seconds, built.held)  # type: ignore[attr-defined]


def test_a_model_onnx_runtime_cannot_run_whole_gets_no_interim_table() -> None:
    cap = _capture("tests.planner.factories:unexportable", (3, 8, 8))
    why = build(cap, "f" * 16, 4, RuntimeOptions())
    assert isinstance(why, str) and "whole graph cannot run in ONNX Runtime" in why
