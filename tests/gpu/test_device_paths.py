"""What only a GPU runs for real: CUDA timing and peaks, cuda_free, the out-of-memory step-down,
pinned staging and the device transfer in the service, float16, NVML energy.

Small models (resnet18 and squeezenet1_0 at 64x64 to 96x96, batches up to 8), so the CPU
rehearsal builds everything up to the CUDA call in seconds.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from planner.graph.capture import capture
from planner.graph.inspect import arithmetic_tolerance
from core.runner import run_node
from core.loaded import ModelSpec
from planner.models import load_model
from planner.profiling.measure import PassTimer
from planner.profiling.profiler import ProfileOptions, measure
from planner.solver.tables import build_table
from core.tree import iter_layers
from tests.gpu.conftest import cuda_only
from workers.executor import execute
from workers.memory import MemoryProbe, release_cached
from workers.worker import Worker

pytestmark = pytest.mark.gpu
MiB = 2**20


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _captured(name: str, shape: tuple[int, ...], device: str, dtype: str = "float32"):
    torch.manual_seed(0)
    return capture(load_model(ModelSpec(name, input_shape=shape, dtype=dtype, device=device)))


def test_the_pass_timer_splits_a_pass_among_its_units(device: str) -> None:
    cap = _captured("resnet18", (3, 64, 64), device)
    x = cap.model.example(4)
    timer = PassTimer(cap.model.device)
    with torch.inference_mode():
        run_node(cap, cap.tree, x)  # warm: kernels chosen, memory cached
        _sync(device)
        t0 = time.perf_counter()
        timer.start()
        run_node(cap, cap.tree, x, timer)
        times = timer.results()  # CUDA: synchronises, then reads the events
        wall = time.perf_counter() - t0
    assert {layer.name for layer in iter_layers(cap.tree)} <= set(times)
    assert all(t >= 0 for t in times.values())
    # the regions cover the pass from its start to its last unit: all of it, nothing beyond
    assert 0.3 * wall <= sum(times.values()) <= 1.05 * wall + 1e-3


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_no_plan_allocates_more_than_its_table_says(device: str, dtype: str) -> None:
    cap = _captured("resnet18", (3, 64, 64), device, dtype)
    profile = measure(cap, ProfileOptions(batch_max=4, repeats=1, warmup=1), progress=False)
    assert profile.granule == (512 if device == "cuda" else 1)
    table = build_table(profile, slot_count=48)
    x = cap.model.example(4, seed=3)
    with torch.inference_mode():
        expected = cap.model.module(x).float()
    plans = table.plans_for(4)
    assert len(plans) > 1
    cuda_only(device, "the caching allocator's peak of every plan's run")
    if dtype == "float32":  # TF32 convolutions on CUDA: as close as float16's mantissa allows
        rtol, atol = arithmetic_tolerance(torch.float32, device)
        atol *= max(1.0, float(expected.abs().max()))
    else:
        rtol = atol = 3e-2
    for _, plan in plans:
        _sync(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = execute(cap, plan.program.steps, x, plan.split_map, plan.run_map)
        _sync(device)
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= plan.peak_bytes, (plan.plan_id, peak, plan.peak_bytes)
        torch.testing.assert_close(y.float(), expected, rtol=rtol, atol=atol)
        del y


def test_cuda_free_counts_what_the_allocator_caches(device: str) -> None:
    probe = MemoryProbe(device)
    assert probe.free() > 0
    cuda_only(device, "torch.cuda.mem_get_info and the caching allocator's cache")
    release_cached(device)
    before = probe.free()
    held = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    taken = before - probe.free()
    assert 256 * MiB - 8 * MiB <= taken <= 256 * MiB + 8 * MiB
    del held  # back in the cache: still free for a plan
    assert abs(probe.free() - before) <= 8 * MiB
    release_cached(device)  # back to the driver: free either way
    assert abs(probe.free() - before) <= 8 * MiB


def test_running_out_of_device_memory_steps_down_and_loses_nothing(device: str) -> None:
    # on CUDA a large input: cuDNN's workspace at one sample (~9 MB on an H200) would make the
    # least plan half the top one at 96 px, and the reading counts the driver's free memory in
    # the allocator's 20 MiB pages: half the gap between the plans is well over a page at 448
    cap = _captured("resnet18", (3, 448, 448) if device == "cuda" else (3, 96, 96), device)
    profile = measure(cap, ProfileOptions(batch_max=8, repeats=1, warmup=1), progress=False)
    table = build_table(profile, solver="fbs", slot_count=64)  # the top plan runs all 8 at once
    worker = Worker(cap, table, MemoryProbe(device), max_oom_retries=8)
    x = cap.model.example(8, seed=5)
    with torch.inference_mode():
        expected = cap.model.module(x)
    top, least = int(table.row(8).peaks[-1]), int(table.min_peaks[0])
    assert top > 2 * least
    leave = (top + least) // 2  # some plans fit in what is left, the one picked first does not
    cuda_only(device, "filling the device after the plan is picked, as another process does")
    release_cached(device)
    filler = torch.empty(torch.cuda.mem_get_info()[0] - leave, dtype=torch.uint8, device="cuda")
    stale = iter([top])  # the reading the plan was picked by, taken before the memory went
    try:
        y, info = worker.infer(x, free=lambda: next(stale, None) or worker.probe.free())
    finally:
        del filler
        release_cached(device)
    assert info.oom_retries >= 1 and worker.stats.oom_retries == info.oom_retries
    assert sum(c.batch for c in info.choices) == 8
    assert all(c.peak_bytes < top for c in info.choices)
    rtol, atol = arithmetic_tolerance(torch.float32, device)
    torch.testing.assert_close(y, expected, rtol=rtol, atol=atol * max(1.0, float(expected.abs().max())))


def test_the_service_stages_batches_in_pinned_memory_and_moves_them_to_the_device(
        device: str, tmp_path) -> None:
    from service.main import create_app
    from tests.service.conftest import run, running, settings_for

    settings = settings_for(tmp_path / "cache", tmp_path / "store", device=device,
                            models=["small=squeezenet1_0@3x64x64"], batch_max=4)
    app = create_app(settings)
    xs = [np.random.default_rng(k).standard_normal((k, 3, 64, 64)).astype(np.float32)
          for k in (1, 3)]

    async def main() -> tuple[list[dict], object]:
        async with running(app) as client:
            answers = [await client.post("/infer?model=small", json={"inputs": x.tolist()})
                       for x in xs]
            for a in answers:
                assert a.status_code == 200, a.text
            entry = app.state.registry.entries["small"]
            return [a.json() for a in answers], entry

    answers, entry = run(main())
    module = entry.prepared.capture.model.module
    for x, answer in zip(xs, answers):
        with torch.inference_mode():
            want = module(torch.from_numpy(x).to(device)).float().cpu().numpy()
        got = np.asarray(answer["outputs"], dtype=np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * max(1.0, float(abs(want).max())))
    buffer = entry.batcher.stage.buffer
    assert buffer.device.type == "cpu"
    cuda_only(device, "pinned host memory for the batch's transfer")
    assert buffer.is_pinned()


def test_nvml_reads_the_energy_of_every_unit(device: str) -> None:
    from planner.profiling import energy

    assert energy.energy_grid(12) == [1, 2, 4, 8, 12]
    cap = _captured("squeezenet1_0", (3, 64, 64), device)
    profile = measure(cap, ProfileOptions(batch_max=4, repeats=1, warmup=1), progress=False)
    cuda_only(device, "NVML's energy counter of the board")
    counter = energy.NvmlCounter(cap.model.device)
    clock = energy.calibrate(counter)
    assert clock.tick_s > 0 and clock.idle_per_s > 0
    spent, meta = energy.measure_units(cap, counter, [1, 4], clock=clock, min_window_s=0.02)
    layers = [layer.name for layer in iter_layers(cap.tree)]
    assert all(spent[name][b] >= 0 for name in layers for b in (1, 4))
    assert sum(spent[name][4] for name in layers) > 0  # a pass of 4 samples costs energy
    table = build_table(energy.with_energy(profile, spent, meta), objective="energy", slot_count=32)
    assert table.lookup(4, table.top_bytes).cost > 0
