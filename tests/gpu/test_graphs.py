"""CUDA graphs under the plan (``core.runtimes.cudagraph``, ``planner.profiling.cudagraph``):
a run replays what eager torch computes, a plan of graph runs allocates exactly what its walk
says torch allocates and its table's claim bounds it, the pool is kept and not counted as
free, a worker captures its table's graphs ahead, and the profile prices the device, with the
host's issue apart.

On the CPU every test builds its model (and where it can, its profile and table) and skips at
its first CUDA call.
"""

from __future__ import annotations

import pytest
import torch

from core import runtimes as rt
from core.errors import ExecutionError, UsageError
from core.loaded import ModelSpec
from core.runtimes.base import RuntimeOptions
from core.sizes import CUDA_GRANULE, allocation
from core.tree import iter_layers
from core.walk import executor_peak
from planner.graph.capture import capture
from planner.graph.inspect import arithmetic_tolerance
from planner.models import load_model
from planner.profiling.profiler import ProfileOptions, measure
from planner.solver.tables import build_table
from tests.gpu.conftest import cuda_only
from workers.executor import execute
from workers.device_cache import LARGE_PAGE, allocator_cache
from workers.memory import MemoryProbe, release_cached
from workers.worker import Worker

pytestmark = pytest.mark.gpu


def _captured(name: str, shape: tuple[int, ...], device: str, dtype: str = "float32"):
    torch.manual_seed(0)
    return capture(load_model(ModelSpec(name, input_shape=shape, dtype=dtype, device=device)))


def _close(got: torch.Tensor, want: torch.Tensor, device: str) -> None:
    rtol, atol = arithmetic_tolerance(want.dtype, device)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol,
                               atol=atol * max(1.0, float(want.abs().max())))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_graph_replays_the_model_and_its_pool_is_kept_not_free(device: str, dtype: str) -> None:
    cap = _captured("resnet18", (3, 64, 64), device, dtype)
    x = cap.model.example(4, seed=1)
    nodes = tuple(cap.tree.children)
    if device != "cuda":
        with pytest.raises(ExecutionError, match="CUDA graphs cannot run it"):
            rt.load(rt.CUDAGRAPH, cap, RuntimeOptions())
    cuda_only(device, "capturing and replaying a CUDA graph")
    probe = MemoryProbe(device)
    graphs = rt.load(rt.CUDAGRAPH, cap, RuntimeOptions(room=probe.device_free))
    with torch.inference_mode():
        want = cap.model.module(x)
        graphs.prepare(nodes, 4)
        assert graphs.held_bytes > 0 and 0 <= graphs.cached_bytes <= graphs.held_bytes
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        got = graphs.call(nodes, x, 4)
        torch.cuda.synchronize()
        # a replay allocates nothing but the output it gives the walk
        assert torch.cuda.max_memory_allocated() - base == allocation(
            got.untyped_storage().nbytes(), CUDA_GRANULE)
        _close(got, want, device)
        again = graphs.call(nodes, cap.model.example(4, seed=2), 4)  # new input, same graph
        _close(again, cap.model.module(cap.model.example(4, seed=2)), device)
    assert graphs.graphs == 1
    # the pool's free blocks are the graphs': the reading leaves them out until the pool
    # goes back with them (the reading counts the driver in whole large pages)
    release_cached(device)
    pool = graphs.cached_bytes
    assert pool > 0 and allocator_cache(device).pools >= pool  # kept, and free to no plan
    without = probe.device_free()
    graphs.release()
    assert graphs.graphs == 0 and graphs.held_bytes == 0
    assert probe.device_free() - without >= pool - LARGE_PAGE


def test_graphs_given_back_for_larger_buffers_are_captured_again_in_a_new_pool(device: str
                                                                             ) -> None:
    """A larger run gives every graph back (its static buffers grow): the next capture must
    not name their pool, which the allocator may keep with no graph in it and then refuse
    (``use_count > 0``, as `vbs bench --runtime cudagraph` did at the first run it captured
    again); a smaller run shares the pool of the graphs alive."""
    cap = _captured("resnet18", (3, 224, 224), device)
    nodes = tuple(cap.tree.children)
    cuda_only(device, "capturing CUDA graphs again after their buffers grew")
    graphs = rt.load(rt.CUDAGRAPH, cap, RuntimeOptions())
    with torch.inference_mode():
        for b, kept in ((4, 1), (8, 1), (2, 2), (16, 1), (1, 2)):  # 8 and 16 grow them
            x = cap.model.example(b, seed=b)
            _close(graphs.call(nodes, x, b), cap.model.module(x), device)
            assert graphs.graphs == kept
    assert graphs.held_bytes > 0
    graphs.release()
    with torch.inference_mode():  # and after a release, a new pool, measured as the first
        x = cap.model.example(2, seed=9)
        y = graphs.call(nodes, x, 2)
        _close(y, cap.model.module(x), device)
    static = allocation(x.nbytes, CUDA_GRANULE) + allocation(y.nbytes, CUDA_GRANULE)
    assert graphs.graphs == 1 and graphs.held_bytes > static


def test_plans_of_graph_runs_allocate_what_their_walk_says_and_equal_the_model(device: str
                                                                              ) -> None:
    cap = _captured("resnet18", (3, 64, 64), device)
    options = ProfileOptions(batch_max=4, repeats=1, warmup=1, runtime=rt.CUDAGRAPH)
    if device != "cuda":
        with pytest.raises(UsageError, match="--device cuda"):
            measure(cap, options, progress=False)
    cuda_only(device, "profiling CUDA graphs")
    profile = measure(cap, options, progress=False)
    meta = profile.meta["runtimes"][rt.CUDAGRAPH]
    assert len(meta["call_s"]) == len(meta["host_s"]) == 4 and meta["runs"]
    table = build_table(profile, slot_count=48)
    assert rt.CUDAGRAPH in table.runtimes
    graphs = rt.load(rt.CUDAGRAPH, cap, RuntimeOptions())
    x = cap.model.example(4, seed=3)
    with torch.inference_mode():
        want = cap.model.module(x)
    ran = 0
    for _, plan in table.plans_for(4):
        def run() -> torch.Tensor:
            return execute(cap, plan.program.steps, x, plan.split_map, plan.run_map,
                           {rt.CUDAGRAPH: graphs})
        run()  # captured here, outside the measured run
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        walk = executor_peak(profile.root, plan.program.steps, 4, granule=table.granule,
                             splits=plan.split_map, runs=plan.run_map, inside=False)
        assert peak == walk <= plan.peak_bytes, (plan.plan_id, peak, walk, plan.peak_bytes)
        _close(y, want, device)
        ran += bool(plan.runs)
        del y
    assert ran, "no plan ran graphs"


def test_a_worker_captures_its_tables_graphs_ahead(device: str) -> None:
    cap = _captured("squeezenet1_0", (3, 64, 64), device)
    cuda_only(device, "profiling CUDA graphs")
    profile = measure(cap, ProfileOptions(batch_max=4, repeats=1, warmup=1,
                                          runtime=rt.CUDAGRAPH), progress=False)
    table = build_table(profile, slot_count=32)
    probe = MemoryProbe(device)
    worker = Worker(cap, table, probe)
    graphs = worker.runtimes[rt.CUDAGRAPH]
    assert graphs.graphs >= 1 and worker.held_bytes == graphs.held_bytes > 0  # type: ignore[attr-defined]
    x = cap.model.example(4, seed=4)
    with torch.inference_mode():
        want = cap.model.module(x)
    y, info = worker.infer(x)
    _close(y, want, device)
    worker.release()
    assert worker.runtimes == {}


def test_an_eager_step_on_cuda_costs_at_least_the_hosts_issue(device: str) -> None:
    """On CUDA an eager step costs the longer of the host's issue and the device's work (one
    stream waits for the slower), both measured apart: never less than the issue."""
    cap = _captured("resnet18", (3, 64, 64), device)
    cuda_only(device, "timing the device with graphs and the host apart")
    profile = measure(cap, ProfileOptions(batch_max=2, repeats=3, warmup=1,
                                          runtime=rt.CUDAGRAPH), progress=False)
    host = profile.meta["runtimes"][rt.CUDAGRAPH]["eager_host_s"]
    checked = 0
    for layer in iter_layers(profile.root):
        eager = layer.measured("torch")
        if eager is None or layer.name not in host:
            continue
        for b in (1, 2):
            assert eager.time[b - 1] >= host[layer.name][b - 1]
        checked += 1
    assert checked
