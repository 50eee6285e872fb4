"""One rule for CUDA graphs' private pools in the device's reading of free memory
(``workers.memory``, ``workers.device_cache``): no byte inside a pool is free for plans,
its graphs alive or not. A pool's blocks serve only captures into it, and a pool whose graphs
are gone (a runtime grown or released while a caller held one of its graphs) is the
device's again only when an ``empty_cache`` gives it back: counting its free bytes would give
a plan memory it holds.
"""

from __future__ import annotations

import pytest
import torch

from core.loaded import ModelSpec
from core.runtimes import cudagraph
from planner.graph.capture import capture
from planner.models import load_model
from tests.core.cuda_double import CudaDouble, install
from workers import memory
from workers.device_cache import LARGE_PAGE, DeviceCache, cache_of

MiB = 2**20
LIVE, DEAD = (0, 3), (0, 5)  # a pool with a graph, a pool whose graphs are gone


def _segment(address: int, blocks: list[tuple[int, bool]], pool: tuple[int, int] = (0, 0)
             ) -> dict:
    """A mapped range as ``torch.cuda.memory_snapshot()`` gives it: (size, in use) per block."""
    return {"device": 0, "address": address, "stream": 0, "is_expandable": True,
            "segment_type": "large", "segment_pool_id": pool,
            "total_size": sum(size for size, _ in blocks),
            "allocated_size": sum(size for size, used in blocks if used),
            "active_size": sum(size for size, used in blocks if used),
            "blocks": [{"size": size, "state": "active_allocated" if used else "inactive"}
                       for size, used in blocks]}


SEGMENTS = [_segment(1 << 40, [(5 * MiB, True), (35 * MiB, False)]),  # plans': 35 MiB reusable
            _segment(1 << 41, [(1 * MiB, True), (19 * MiB, False)], pool=LIVE),
            _segment(1 << 42, [(40 * MiB, False)], pool=DEAD)]  # not yet emptied
DRIVER = 5 * LARGE_PAGE + 7 * MiB


def test_no_pool_byte_is_reusable_or_releasable_and_both_are_reported() -> None:
    cache = cache_of(SEGMENTS)
    assert cache.reusable == 35 * MiB and cache.releasable == 20 * MiB  # the plans' range
    assert cache.pools == 19 * MiB + 40 * MiB


def test_the_reading_counts_no_pool_live_or_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule before counted every pool's free bytes and took a runtime's own off again
    (``MemoryProbe.keep``), so a dead pool, which no runtime keeps, read as free."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (DRIVER, 1 << 40))
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: SEGMENTS)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    plans = 5 * LARGE_PAGE + 35 * MiB  # the driver in whole pages, the plans' cache
    assert memory.cuda_free("cuda") == plans
    assert memory.MemoryProbe("cuda").free() == plans
    assert memory.MemoryProbe("cuda", limit=plans + 10 * MiB).free() == plans
    assert memory.MemoryProbe("cuda", limit=2 * LARGE_PAGE).free() == 2 * LARGE_PAGE


def test_a_grown_runtimes_dead_pool_is_free_only_once_a_trim_gives_it_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real runtime grown while a caller holds its graph (the profiler's order), then
    the graph dropped: its pool is dead and still mapped. The reading leaves it out, and
    counts it once the device cache's trim gives it back."""
    cuda = install(monkeypatch, CudaDouble(page=LARGE_PAGE, total=50 * LARGE_PAGE))
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("tests.planner.factories:two_layer",
                                       input_shape=(3, 8, 8))))
    units = cudagraph.GraphUnits(cap)
    a, b = cap.tree.children
    with torch.inference_mode():
        held = units.captured((a,), 1)
        units.captured((b,), 1)  # a larger input: grown, the held graph's pool kept
    del held
    pools = cache_of(cuda.memory_snapshot()).pools
    assert len(cuda.memory_snapshot()) == 2 and pools > LARGE_PAGE  # the dead one and the live
    assert memory.cuda_free("cuda") == 48 * LARGE_PAGE  # neither
    DeviceCache("cuda:0", idle_s=0).trim()
    assert len(cuda.memory_snapshot()) == 1 and memory.cuda_free("cuda") == 49 * LARGE_PAGE
    units.release()
    assert cuda.memory_snapshot() == [] and memory.cuda_free("cuda") == 50 * LARGE_PAGE
