"""The CUDA-graph runtime's pools under the caching allocator's rules (``tests.core.cuda_double``):
the real ``GraphUnits`` on a small real model, captured in the orders the bench, the profiler,
a release, a failed capture and a want of room make, without a device. A capture may name a
pool only while a graph of it lives; a grown or released runtime's old pool goes back at
once; nothing a capture allocates outlives it, or the capture is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core.errors import ExecutionError
from core.loaded import ModelSpec
from core.runtimes import cudagraph
from core.runtimes.base import RuntimeOptions
from planner.graph.capture import capture
from planner.models import load_model
from tests.core.cuda_double import ASSERT, CudaDouble, install

TROUBLE = {"raise": False, "keep": False}  # what ``trouble`` does inside a capture
KEPT: list[torch.Tensor] = []


@torch.fx.wrap
def trouble(x: torch.Tensor) -> torch.Tensor:
    """Inside a capture: raise half way through the run, or keep a tensor it made."""
    if any(TROUBLE.values()) and torch.cuda.is_current_stream_capturing():
        if TROUBLE["raise"]:
            raise RuntimeError("a unit failed half way")
        if TROUBLE["keep"]:
            KEPT.append(x * 2)
    return x


class Chain(nn.Module):
    """Three convolutions, the second's output through ``trouble``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        return self.c(trouble(torch.relu(self.b(x))))


def chain() -> nn.Module:
    return Chain()


@pytest.fixture(scope="module")
def cap():
    torch.manual_seed(0)
    return capture(load_model(ModelSpec("tests.core.test_graph_pools:chain",
                                        input_shape=(3, 8, 8))))


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch):
    TROUBLE.update({"raise": False, "keep": False})
    yield install(monkeypatch)
    TROUBLE.update({"raise": False, "keep": False})
    KEPT.clear()


def _pools(cuda: CudaDouble) -> set[tuple[int, int]]:
    """The pools that map memory now."""
    return {tuple(s["segment_pool_id"]) for s in cuda.memory_snapshot()}


def _call(units: cudagraph.GraphUnits, nodes, b: int) -> torch.Tensor:
    shape = (3, 8, 8) if nodes[0].name == "a" else (8, 8, 8)  # the model's input, or a's out
    with torch.inference_mode():
        return units.call(nodes, torch.randn(b, *shape), b)


def test_the_double_refuses_a_pool_whose_graphs_are_gone(cuda: CudaDouble) -> None:
    """What failed on the H200: a pool that mapped in steps outlives empty_cache with no
    graph, and a capture naming it trips the allocator's assert; a live graph's pool is
    shared, and a fresh id always works."""
    pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        a = torch.ones(1000)
        b = a * 2  # a still alive: the pool maps more
        del a, b
    assert cuda.memory_allocated() == 0 and cuda.pools[pool].mappings == 2
    again = torch.cuda.CUDAGraph()
    with torch.cuda.graph(again, pool=pool):  # shared with a live graph
        torch.ones(10)
    assert cuda.pools[pool].uses == 2
    del graph, again
    torch.cuda.empty_cache()
    assert cuda.pools[pool].uses == 0 and _pools(cuda) == set()  # no memory, still there
    with pytest.raises(RuntimeError, match="use_count > 0 INTERNAL ASSERT FAILED") as raised:
        with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=pool):
            pass
    assert str(raised.value) == ASSERT
    with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=torch.cuda.graph_pool_handle()):
        pass


def test_the_benchs_order_grows_with_nothing_held_and_captures_in_a_new_pool(cap, cuda
                                                                          ) -> None:
    """`vbs bench`: a small run captured, then a larger one that needs larger static buffers
    (every graph given back), then more: each capture succeeds, the old pool goes back at
    once, and only the live pool maps memory."""
    units = cudagraph.GraphUnits(cap)
    nodes = tuple(cap.tree.children)
    _call(units, nodes, 1)
    (first,) = _pools(cuda)
    assert cuda.pools[first].mappings > 1  # as a real model's capture maps in steps
    _call(units, nodes, 4)  # larger buffers: the graph of 1 is given back
    assert units.graphs == 1 and len(_pools(cuda)) == 1 and first not in _pools(cuda)
    _call(units, nodes, 2)  # fits the buffers: shares the live pool
    _call(units, nodes[2:], 1)
    assert units.graphs == 3 and len(_pools(cuda)) == 1 and cuda.memory_allocated() == 0
    assert units.held_bytes >= cuda.memory_snapshot()[0]["total_size"] > 0


def test_the_profilers_order_holds_a_graph_across_a_grow(cap, cuda) -> None:
    """The profiler keeps the last graph it measured in a local while the next capture grows
    the buffers: the held graph's pool stays (outside what the runtime keeps) and goes back
    once the graph is dropped and the cache trimmed."""
    units = cudagraph.GraphUnits(cap)
    nodes = tuple(cap.tree.children)
    with torch.inference_mode():
        held = units.captured(nodes[:1], 1)
        (old,) = _pools(cuda)
        units.captured(nodes[1:2], 1)  # a larger input: every graph given back but the held
        (new,) = _pools(cuda) - {old}
        assert cuda.pools[old].uses == 1 and units.graphs == 1
        static = units.held_bytes - cuda.memory_snapshot()[-1]["total_size"]
        assert [s["segment_pool_id"] for s in cuda.memory_snapshot()] == [old, new]
        del held
        torch.cuda.empty_cache()
        assert _pools(cuda) == {new} and units.held_bytes > static > 0
        for b in (1, 2, 4):  # as _measure_batch does: each unit alone, the last one held
            for node in nodes:
                graph = units.captured((node,), b)
                graph.graph.replay()
    del graph
    torch.cuda.empty_cache()
    assert len(_pools(cuda)) == 1 and cuda.replays == 3 * len(nodes)
    units.release()
    assert units.graphs == 0 and units.held_bytes == 0 and _pools(cuda) == set()


def test_a_released_runtime_captures_again(cap, cuda) -> None:
    units = cudagraph.GraphUnits(cap)
    nodes = tuple(cap.tree.children)
    _call(units, nodes, 2)
    _call(units, nodes[1:], 2)
    units.release()
    assert units.graphs == 0 and _pools(cuda) == set()
    _call(units, nodes, 2)
    _call(units, nodes[:2], 1)
    assert units.graphs == 2 and len(_pools(cuda)) == 1


def test_a_capture_that_raises_half_way_leaves_nothing_and_the_next_one_succeeds(cap, cuda
                                                                               ) -> None:
    """The model raising inside the capture: an ExecutionError, nothing of the capture left
    alive (its graph, its tensors) while the caller holds the error, and the pool shared by
    the graphs before it still serves the next capture."""
    units = cudagraph.GraphUnits(cap)
    nodes = tuple(cap.tree.children)
    _call(units, nodes[:1], 2)
    (pool,) = _pools(cuda)
    TROUBLE["raise"] = True
    with pytest.raises(ExecutionError, match=r"a\.\..* cannot be captured as a CUDA graph: "
                                             "a unit failed half way") as failed:
        _call(units, nodes, 2)
    assert failed.value.__cause__ is not None  # the error is held, and its frames
    assert cuda.memory_allocated() == 0 and cuda.pools[pool].uses == units.graphs == 1
    TROUBLE["raise"] = False
    _call(units, nodes, 2)
    assert units.graphs == 2 and _pools(cuda) == {pool}


def test_a_runtime_short_of_room_gives_its_graphs_back_and_captures(cap, cuda) -> None:
    nodes = tuple(cap.tree.children)
    units = cudagraph.load(cap, RuntimeOptions(room=lambda: 0 if units.graphs else 1 << 40))
    _call(units, nodes[:1], 2)
    (first,) = _pools(cuda)
    _call(units, nodes, 2)  # too little room while a graph is kept: all given back first
    assert units.graphs == 1 and len(_pools(cuda)) == 1 and first not in _pools(cuda)


def test_a_capture_that_leaves_a_tensor_alive_in_the_pool_is_refused(cap, cuda) -> None:
    """A unit that keeps a tensor it made inside the capture: the pool would hand its block
    to no later capture, and its graph's replays write it behind the holder's back. Refused,
    the graph not kept and the pool given up; later captures take a new pool, and the old
    one goes back once the tensor does."""
    units = cudagraph.GraphUnits(cap)
    nodes = tuple(cap.tree.children)
    _call(units, nodes[:1], 2)
    TROUBLE["keep"] = True
    with pytest.raises(ExecutionError, match=r"a\.\..* on 2 samples is not kept as a CUDA "
                                             r"graph: \d+ bytes allocated inside its capture"):
        _call(units, nodes, 2)
    (old,) = _pools(cuda)
    assert units.graphs == 0 and cuda.pools[old].uses == 0
    assert cuda.memory_allocated() == KEPT[0].untyped_storage().nbytes()
    TROUBLE["keep"] = False
    _call(units, nodes, 2)
    assert units.graphs == 1 and old in _pools(cuda) and len(_pools(cuda)) == 2
    KEPT.clear()
    torch.cuda.empty_cache()
    assert old not in _pools(cuda) and len(_pools(cuda)) == 1
