"""The reading bench/gpu/reach.py models is the probe's (``workers.memory.MemoryProbe.free``) on a
real device: the driver's free memory in whole pages plus the allocator's cache, capped by the
limit, whether the cache covers what a neighbour left or was given back. On the CPU it skips at
once (nothing before its CUDA calls is worth the rehearsal's time).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.gpu import reach
from core.cuda_allocator import split_exactly
from tests.gpu.conftest import cuda_only
from workers.device_cache import LARGE_PAGE, allocator_cache
from workers.memory import MemoryProbe, release_cached

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _modelled(limit: int) -> int:
    free = int(torch.cuda.mem_get_info()[0])
    return reach.reading(free, allocator_cache("cuda").reusable, limit)


def test_the_probes_reading_is_the_one_reach_models(device: str, tmp_path: Path) -> None:
    cuda_only(device, "the driver's free memory and the caching allocator's cache")
    split_exactly()
    limit = 5 * LARGE_PAGE
    probe = MemoryProbe("cuda", limit=limit)
    release_cached("cuda")
    block = torch.empty(3 * LARGE_PAGE, dtype=torch.uint8, device="cuda")
    del block  # a plan's blocks, cached
    assert probe.free() == _modelled(limit) == limit  # the driver alone covers the limit
    ready = tmp_path / "held"
    hog = subprocess.Popen([sys.executable, str(ROOT / "bench/memory_hog.py"), "--device", "cuda",
                            "--leave-steps", str(3 * LARGE_PAGE // 2), "--hold-s", "60",
                            "--ready", str(ready)], cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while not ready.exists() and time.monotonic() - t0 < 60:
            assert hog.poll() is None, "the hog stopped before it took memory"
            time.sleep(0.1)
        covered = probe.free()
        assert covered == _modelled(limit)
        assert covered >= 3 * LARGE_PAGE  # the cache still counts: the neighbour could not move it
        release_cached("cuda")
        assert probe.free() == _modelled(limit) < limit  # what is left, in whole pages
    finally:
        hog.terminate()
        hog.wait(10)
