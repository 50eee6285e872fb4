"""The unit runtime interface (``core.runtimes.base``): every runtime loads by name, runs a run
into a buffer of the walk's, says what it keeps, and gives it back; the executor and the
worker reach runtimes only through it; which runtimes a device runs."""

from __future__ import annotations

import pytest
import torch

from core import runtimes as rt
from core.errors import ExecutionError, UsageError
from core.loaded import ModelSpec
from core.runner import run_node
from core.runs import CallCost
from core.runtimes.base import RuntimeOptions
from planner.graph.capture import capture
from planner.models import load_model
from planner.profiling.profiler import ProfileOptions, measure
from planner.solver.tables import build_table
from workers.executor import execute
from workers.memory import MemoryProbe
from workers.worker import Worker


@pytest.fixture(scope="module")
def cap():
    torch.manual_seed(0)
    return capture(load_model(ModelSpec("resnet18", input_shape=(3, 32, 32))))


def test_auto_means_the_runtimes_that_run_on_the_device():
    assert rt.resolve("auto", "cpu") == ("torch", "onnxruntime")
    assert rt.resolve("auto", "cuda:0") == ("torch", "cudagraph")
    assert rt.resolve("cudagraph", "cuda") == ("cudagraph", "torch")
    assert rt.resolve("torch", "cuda") == ("torch",)
    with pytest.raises(UsageError, match="CUDA graphs run on a CUDA device"):
        rt.resolve("cudagraph", "cpu")
    with pytest.raises(UsageError, match="use one of auto, torch, onnxruntime, cudagraph"):
        rt.resolve("tensorrt")
    assert rt.grouping(("torch", "onnxruntime")) == "onnxruntime"
    assert rt.grouping(("torch", "cudagraph")) == "cudagraph"
    assert rt.grouping(("torch",)) == ""
    with pytest.raises(UsageError, match="both run units in calls"):
        rt.grouping(("torch", "onnxruntime", "cudagraph"))


def test_a_profile_asked_for_graphs_on_the_cpu_is_refused_before_it_measures(cap):
    with pytest.raises(UsageError, match="--device cuda"):
        measure(cap, ProfileOptions(batch_max=2, repeats=1, warmup=0, runtime="cudagraph"),
                progress=False)


@pytest.mark.parametrize("name", ["torch", "onnxruntime"])
def test_every_runtime_runs_a_run_into_a_new_buffer_as_the_model_computes_it(cap, name):
    units = rt.load(name, cap, RuntimeOptions())
    assert units.name == name
    x = cap.model.example(3, seed=1)
    children = tuple(cap.tree.children)
    with torch.inference_mode():
        want = run_node(cap, cap.tree, x)
        units.prepare(children, 3)
        got = units.call(children, x, 3)
        one = units.call(children[:1], x, 3)
        first = run_node(cap, children[0], x)
    assert got.data_ptr() != x.data_ptr() and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(one, first, rtol=1e-4, atol=1e-4)
    assert units.cached_bytes == 0  # nothing of a device allocator's cache on the CPU
    assert (units.held_bytes > 0) == (name == "onnxruntime")  # a session keeps its weights
    units.release()
    assert units.held_bytes == 0


def test_graphs_refuse_a_model_on_the_cpu_and_say_why(cap):
    with pytest.raises(ExecutionError, match="CUDA graphs cannot run it: CUDA graphs run on a "
                                             "CUDA device, not on cpu"):
        rt.load("cudagraph", cap, RuntimeOptions())
    with pytest.raises(UsageError, match="no unit runtime 'tensorrt'"):
        rt.load("tensorrt", cap, RuntimeOptions())


def test_the_executor_reaches_a_runtime_only_through_what_the_worker_loaded(cap):
    profile = measure(cap, ProfileOptions(batch_max=2, repeats=1, warmup=0,
                                          runtime="onnxruntime"), progress=False)
    table = build_table(profile, slot_count=32)
    plan = table.lookup(2, table.top_bytes)
    assert plan.runs, "the top plan runs on ONNX Runtime"
    x = cap.model.example(2, seed=2)
    with pytest.raises(ExecutionError, match="has not loaded onnxruntime"):
        execute(cap, plan.program.steps, x, plan.split_map, plan.run_map, {})
    worker = Worker(cap, table, MemoryProbe("cpu"))
    assert set(worker.runtimes) == {"onnxruntime"} and worker.held_bytes > 0
    with torch.inference_mode():
        want = cap.model.module(x)
    y, _ = worker.infer(x)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    worker.release()
    assert worker.runtimes == {} and worker.held_bytes == 0


def test_a_call_whose_host_issue_is_longer_than_its_device_work_costs_the_issue():
    cost = CallCost(call_s=(1.0, 1.0), byte_s=(0.0, 0.5), host_s=(5.0, 2.0))
    assert cost.total(1, 0, 0, [1.0, 2.0]) == 5.0       # the host's issue: 5 > 1 + 3
    assert cost.total(2, 1, 1, [1.0, 2.0]) == 6.0       # the device: 1 + 0.5 * 2 * 2 + 3 > 2
    assert CallCost((1.0,), (0.0,)).total(1, 0, 0, [2.0]) == 3.0  # no host figure: device
