"""How many bytes are free for activations right now, on the device a worker runs on.

CUDA: what the driver reports free (``torch.cuda.mem_get_info``), in the pages the caching
allocator maps, plus what the allocator caches that a block of any size can use
(``workers.device_cache.Cache.reusable``). Not reserved − allocated: that also counts free bytes
wedged between live tensors, which only smaller blocks fit, and on a device a neighbour has
filled they would hold the reading above what a plan can get. Never the free bytes inside a
CUDA graph's private pool, its graphs alive or not: a pool's blocks serve only captures into
it, and a pool whose graphs are gone is the device's again only once ``empty_cache`` gives it
back (the device cache's trims), so no plan is given memory a pool holds.
CPU: the least headroom under the cgroup memory limits on this process's path (limit minus
working set, ``workers.cgroup``), never more than the kernel's ``MemAvailable``. Either way
the result is capped by the configured limit. What is kept back from plans (the margin) is the
device's memory owner's to decide (``workers.device_memory``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workers.cgroup import mem_available, parse_limit, parse_meminfo, read_headroom
from workers.device_cache import LARGE_PAGE, allocator_cache

__all__ = ["MemoryProbe", "cgroup_free", "cpu_free", "cuda_free", "parse_limit", "parse_meminfo",
           "release_cached"]


def cgroup_free(proc: Path = Path("/proc"), fs_root: Path = Path("/")) -> int | None:
    """Bytes left under the tightest cgroup memory limit on this process's path (its limit
    minus its working set, ``workers.cgroup``), or None when no limit applies."""
    return read_headroom(proc, fs_root)


def cpu_free(proc: Path = Path("/proc"), fs_root: Path = Path("/")) -> int:
    """Free memory for a CPU worker: the cgroup's headroom, never more than MemAvailable."""
    free = cgroup_free(proc, fs_root)
    available = mem_available(proc)
    if free is None:
        return available or 0
    return min(free, available) if available is not None else free


def cuda_free(device: int | str = 0) -> int:
    """Free memory on a CUDA device for this process's plans: the driver's free memory (in
    whole large pages where the allocator maps pages: less cannot hold a large block) and what
    the allocator caches that any block can use; nothing of CUDA graphs' private pools."""
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    cache = allocator_cache(device)
    if cache.expandable:
        free -= free % LARGE_PAGE
    return int(free + cache.reusable)


def cuda_driver_free(device: int | str = 0) -> int:
    """What the driver reports free on a CUDA device, the allocator's cache not read."""
    import torch

    return int(torch.cuda.mem_get_info(device)[0])


def release_cached(device: str) -> None:
    """Give the blocks PyTorch's caching allocator holds unused back to the device (CUDA only;
    call it once the tensors of a failed attempt are gone, or they stay cached)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


@dataclass
class MemoryProbe:
    """Bytes free for activations now: the device's free memory, capped.

    ``limit`` is the most a plan may use whatever the device has free (0 = no cap); it can
    be changed while serving (a smaller limit makes later batches step down to plans that
    fit). What the unit runtimes keep of the device allocator's cache for themselves (a CUDA
    graph's private pool) is never in the reading (``cuda_free``), so nothing is taken off.
    """

    device: str = "cpu"
    limit: int = 0
    source: Callable[[], int] | None = None  # overrides the device reading (e.g. a cgroup root)

    def device_free(self) -> int:
        if self.source is not None:
            free = self.source()
        elif self.device.startswith("cuda"):
            free = cuda_free(self.device)
        else:
            free = cpu_free()
        return max(0, free)

    def free(self) -> int:
        if self.limit and self.source is None and self.device.startswith("cuda"):
            # the driver alone covers the limit: the allocator's blocks need not be walked
            if cuda_driver_free(self.device) - LARGE_PAGE >= self.limit:
                return self.limit
        free = self.device_free()
        return min(free, self.limit) if self.limit else free
