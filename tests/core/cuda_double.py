"""A test double of the few ``torch.cuda`` calls the CUDA-graph runtime makes, keeping the
caching allocator's rules for graph pools, so the real ``GraphUnits`` runs on CPU tensors.

Why: `vbs bench --runtime cudagraph` failed on an H200 at every capture after its graphs
were given back (``use_count > 0 INTERNAL ASSERT FAILED``), and no device was left to prove
a fix. The rules that broke it are the allocator's bookkeeping, not the GPU's arithmetic, so
they can be kept here (read from c10/cuda/CUDACachingAllocator.cpp, aten/src/ATen/cuda/
CUDAGraph.cpp and torch/cuda/graphs.py):

- ``graph_pool_handle()`` is a fresh id; nothing exists for it until a capture names it.
- ``torch.cuda.graph`` synchronizes and empties the cache, then begins the capture: an id not
  in the allocator's table makes its pool (one use); an id there must have a use left (else
  the allocator's assert, its text) and gets one more.
- Leaving the block, even on an error from inside it, ends the capture; from then on the
  graph's death (its last reference dropped) gives its use back, and a pool with none left
  is freeable.
- Every tensor an op makes during a capture is a block of the pool (a ``TorchDispatchMode``
  sees the ops), live as long as its storage (a ``weakref.finalize`` sees it go). The pool
  maps memory in ``page``s; each block that does not fit in what it mapped maps more, which
  the allocator counts (``cudaMalloc_count``, with expandable segments: this project's
  setting, ``core.cuda_allocator``).
- ``empty_cache()``: a freeable pool with no live block unmaps its memory, one free range,
  counted off once; it leaves the table only when its count is back to none. So a pool that
  mapped in two steps or more stays there without memory, and its id can never be named
  again: what the H200 met.

Not kept: kernels (a replay is counted, it computes nothing: values are the GPU tests'),
streams (one, always ready), the default pool (only pools' blocks are counted by
``memory_allocated`` and shown by ``memory_snapshot``), the free pages beside a live block of
a freeable pool (kept mapped here). ``install`` puts the double in ``torch.cuda``'s place for
one test and lets the runtime load on the CPU.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# the allocator's assert as PyTorch 2.11 worded it on the H200 (docs/bench/gpu-h200-issue44-46)
ASSERT = ('it->second->use_count > 0 INTERNAL ASSERT FAILED at '
          '"/pytorch/c10/cuda/CUDACachingAllocator.cpp":2799, please report a bug to PyTorch. ')
BLOCK = 512  # the allocator rounds every block up to this (kMinBlockSize)


@dataclass(eq=False)
class Pool:
    """One private pool as the allocator keeps it."""

    id: tuple[int, int]
    uses: int = 1         # graphs captured into it, alive (and captures underway)
    reserved: int = 0     # bytes mapped
    mappings: int = 0     # cudaMalloc_count: blocks that mapped more, less ranges unmapped
    blocks: dict[int, int] = field(default_factory=dict)  # live: data_ptr -> bytes

    @property
    def allocated(self) -> int:
        return sum(self.blocks.values())


class CudaDouble:
    """The allocator's graph pools and the calls that reach them (see the module doc)."""

    def __init__(self, page: int = BLOCK, total: int = 1 << 30) -> None:
        self.page = page      # what a pool maps at a time
        self.total = total    # the device's memory, for ``mem_get_info``
        self.pools: dict[tuple[int, int], Pool] = {}  # the allocator's graph_pools
        self.capturing: Pool | None = None
        self.peak = 0
        self.replays = 0
        self._ids = 0
        self.CUDAGraph = lambda *a, **k: Graph(self)

    # ------------------------------------------------------------------ the allocator

    def begin(self, pool_id: tuple[int, int] | None) -> Pool:
        """beginAllocateToPool."""
        if pool_id is None:  # no pool named: one of the graph's own
            self._ids += 1
            pool_id = (self._ids, 0)
        pool = self.pools.get(pool_id)
        if pool is None:
            pool = self.pools[pool_id] = Pool(pool_id)
        elif pool.uses <= 0:
            raise RuntimeError(ASSERT)
        else:
            pool.uses += 1
        self.capturing = pool
        return pool

    def release_pool(self, pool: Pool) -> None:
        """releasePool: a graph whose capture ended is gone."""
        pool.uses -= 1
        assert pool.uses >= 0

    def allocate(self, storage: torch.UntypedStorage) -> None:
        """A block for ``storage`` in the pool being captured into, mapping more if needed."""
        pool, key = self.capturing, storage.data_ptr()
        assert pool is not None
        if key in pool.blocks or storage.nbytes() == 0:
            return
        size = -(-storage.nbytes() // BLOCK) * BLOCK
        short = pool.allocated + size - pool.reserved
        if short > 0:
            pool.reserved += -(-short // self.page) * self.page
            pool.mappings += 1
        pool.blocks[key] = size
        self.peak = max(self.peak, self.memory_allocated())
        weakref.finalize(storage, pool.blocks.pop, key, None)

    # ------------------------------------------------------------------ torch.cuda's calls

    def graph_pool_handle(self) -> tuple[int, int]:
        self._ids += 1
        return (0, self._ids)

    def graph(self, cuda_graph: Graph, pool: tuple[int, int] | None = None,
              stream: Any = None, capture_error_mode: str = "global") -> Any:
        return _capturing(self, cuda_graph, pool)

    def empty_cache(self) -> None:
        for pool in list(self.pools.values()):
            if pool.uses or pool.blocks:
                continue
            if pool.reserved:  # one free range unmapped, counted off once
                pool.reserved = 0
                pool.mappings -= 1
            if pool.mappings == 0:
                del self.pools[pool.id]

    def memory_allocated(self, device: Any = None) -> int:
        return sum(p.allocated for p in self.pools.values())

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.peak = self.memory_allocated()

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return self.total - sum(p.reserved for p in self.pools.values()), self.total

    def memory_snapshot(self) -> list[dict[str, Any]]:
        """One expandable segment per pool that maps memory, shaped as PyTorch's."""
        segments = []
        for i, pool in enumerate(p for p in self.pools.values() if p.reserved):
            blocks = [{"size": s, "state": "active_allocated"} for s in pool.blocks.values()]
            if pool.reserved > pool.allocated:
                blocks.append({"size": pool.reserved - pool.allocated, "state": "inactive"})
            segments.append({"device": 0, "address": (i + 1) << 40, "stream": 0,
                             "segment_type": "large", "segment_pool_id": pool.id,
                             "is_expandable": True, "total_size": pool.reserved,
                             "allocated_size": pool.allocated, "blocks": blocks})
        return segments

    def is_current_stream_capturing(self) -> bool:
        return self.capturing is not None

    def synchronize(self, device: Any = None) -> None:
        return None


class Graph:
    """torch.cuda.CUDAGraph: gives its pool's use back when it dies, once its capture ended."""

    def __init__(self, cuda: CudaDouble) -> None:
        self._cuda = cuda
        self.pool: Pool | None = None

    def capture_begin(self, pool: tuple[int, int] | None = None) -> None:
        self.pool = self._cuda.begin(pool)

    def capture_end(self) -> None:
        assert self.pool is not None
        self._cuda.capturing = None
        weakref.finalize(self, self._cuda.release_pool, self.pool)

    def replay(self) -> None:
        assert self.pool is not None and self._cuda.capturing is None
        self._cuda.replays += 1


class _Allocations(TorchDispatchMode):
    """Every new storage an op makes while a capture is underway: a block of its pool."""

    def __init__(self, cuda: CudaDouble) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.cuda.allocate(t.untyped_storage())
        return out


@contextlib.contextmanager
def _capturing(cuda: CudaDouble, graph: Graph, pool: tuple[int, int] | None) -> Iterator[None]:
    """torch.cuda.graph: empty the cache, begin; end the capture however the block ends."""
    cuda.synchronize()
    cuda.empty_cache()
    graph.capture_begin(pool)
    try:
        with _Allocations(cuda):
            yield
    finally:
        graph.capture_end()


class _Stream:
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = device

    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


def install(monkeypatch: pytest.MonkeyPatch, cuda: CudaDouble | None = None) -> CudaDouble:
    """Put ``cuda`` (a new double by default) in ``torch.cuda``'s place for this test, and let
    the CUDA-graph runtime load on the CPU."""
    from core.runtimes import cudagraph

    cuda = cuda or CudaDouble()
    default = _Stream()
    for name in ("graph_pool_handle", "graph", "CUDAGraph", "empty_cache", "memory_allocated",
                 "max_memory_allocated", "reset_peak_memory_stats", "mem_get_info",
                 "memory_snapshot", "is_current_stream_capturing", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cudagraph, "unavailable", lambda capture: "")
    return cuda
