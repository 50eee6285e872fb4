"""The service gives back device memory its plans no longer use (``workers.device_cache``
through ``workers.device_memory``): after a smaller plan than the last, and after the device
idles; a neighbour then takes it, the reading follows, and the worker's plans step down with
nothing lost.

On CUDA the input is 448 px, so that plans are large beside the 20 MiB pages the allocator
maps (``workers.device_cache.LARGE_PAGE``): a neighbour's take and a trim move whole pages.
On the CPU the model, profile and table are built and the test skips at its first CUDA call.
"""

from __future__ import annotations

import time

import pytest
import torch

from core.loaded import ModelSpec
from planner.graph.capture import capture
from planner.models import load_model
from planner.profiling.profiler import ProfileOptions, measure
from planner.solver.tables import build_table
from tests.gpu.conftest import cuda_only
from workers.device_memory import DeviceMemory
from workers.memory import release_cached
from workers.worker import Worker

pytestmark = pytest.mark.gpu
MiB = 2**20


def _worker(device: str, memory: DeviceMemory) -> tuple[Worker, torch.Tensor]:
    torch.manual_seed(0)
    shape = (3, 448, 448) if device == "cuda" else (3, 64, 64)
    cap = capture(load_model(ModelSpec("resnet18", input_shape=shape, device=device)))
    profile = measure(cap, ProfileOptions(batch_max=8, repeats=1, warmup=1), progress=False)
    table = build_table(profile, solver="fbs", slot_count=64)
    memory.register("resnet18", lambda: table, lambda: 0)
    worker = Worker(cap, table, memory.probe, name="resnet18", memory=memory)
    return worker, cap.model.example(8, seed=3)


def test_a_smaller_plan_gives_the_cache_back_and_a_neighbour_moves_the_plans(device: str
                                                                              ) -> None:
    memory = DeviceMemory(device, cache_idle_s=0)  # only the smaller-plan trim here
    try:
        worker, x = _worker(device, memory)
        cuda_only(device, "the CUDA caching allocator's cache")
        release_cached(device)
        y8, big = worker.infer(x)                       # the top plan: its blocks cached
        cached_big = memory.cache.unused()              # what a trim would give back
        assert cached_big >= big.choices[0].peak_bytes // 2
        y1, small = worker.infer(x[:1])                 # a smaller plan: the rest given back
        assert memory.cache.trims == 1
        assert memory.cache.unused() < cached_big
        torch.testing.assert_close(y1, y8[:1], rtol=1e-3, atol=1e-3)
        # a neighbour takes what the service gave back, and leaves room for a smaller plan only
        top = big.choices[0].peak_bytes
        least = int(worker.table.min_peaks[0])
        leave = (top + least) // 2 + memory.margin()
        release_cached(device)
        neighbour = torch.empty(torch.cuda.mem_get_info()[0] - leave, dtype=torch.uint8,
                                device="cuda")
        try:
            reading = memory.probe.free()                # the neighbour's bytes are not free
            assert least <= reading < top, (least, reading, top)
            y, info = worker.infer(x)
        finally:
            del neighbour
            release_cached(device)
        assert info.oom_retries == 0                     # the reading stepped down first
        assert all(c.peak_bytes < top for c in info.choices)
        assert sum(c.batch for c in info.choices) == 8
        torch.testing.assert_close(y, y8, rtol=1e-3, atol=1e-3)
    finally:
        memory.close()


def test_an_idle_device_gives_its_cache_back(device: str) -> None:
    memory = DeviceMemory(device, cache_idle_s=0.05)
    try:
        worker, x = _worker(device, memory)
        cuda_only(device, "the CUDA caching allocator's cache")
        release_cached(device)
        torch.cuda.reset_peak_memory_stats()
        _, info = worker.infer(x)
        for _ in range(200):  # the idle thread trims once the device has idled 50 ms
            if memory.cache.idle_trims:
                break
            time.sleep(0.05)
        assert memory.cache.idle_trims >= 1, "no trim after 10 s idle"
        # nothing is left that a trim gives back, and the plan's blocks went to the driver
        assert memory.cache.unused() < 2 * MiB, f"{memory.cache.unused()} bytes still cached"
        given = torch.cuda.max_memory_reserved() - torch.cuda.memory_reserved()
        assert given >= info.choices[0].peak_bytes // 2, (given, info.choices[0].peak_bytes)
    finally:
        memory.close()
