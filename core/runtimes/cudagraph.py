"""CUDA graphs under the plan: a run of units at one batch size captured once, then replayed.

Eager torch on a GPU pays the host for every kernel launch: a small batch of a deep network
is mostly the device waiting for Python. A run (consecutive children of one series at one
batch size, as the DP forms them: ``core.runs``) is captured once as a CUDA graph and
replayed with one launch. The walk gives a run its input and takes its output in buffers of
its own (their addresses change from call to call), so a call copies the input into the
graph's static input, replays, and copies the static output into a buffer allocated for the
walk: the walk's accounting of activations holds for graph runs as for any other runtime.

Memory. Every graph of a model captures into one private pool and reads and writes one static
input and one static output buffer (views of two flat buffers, large enough for the largest
run captured). Nothing allocated in the pool outlives its capture (the output is copied into
the static buffer inside the graph; a capture that leaves a tensor alive there is refused),
so the pool holds only intermediates, which any later capture may reuse: replays on one
stream, one at a time (``_lock``), never meet.

PyTorch's allocator lets a capture name a pool only while a graph captured into it lives
(``use_count > 0``); a pool whose graphs are gone leaves its table only once ``empty_cache``
has given all its memory back, with expandable segments maybe never. So the graphs are given
back together with their pool (larger static buffers, no room, a refused capture), the next
capture starts a new pool, and the old one goes back at once (``gc.collect``,
``empty_cache``) unless a caller still holds one of its graphs. What the runtime keeps
(``held_bytes``) is the live pool's segments and the static buffers, measured after every
capture from the allocator's segments; no reading of free memory counts a pool's bytes as
free (``workers.memory``), so ``cached_bytes``, the pool's free part, is a report only.
A graph is captured when the worker prepares a table (the runs its plans use), else on its
first call, when memory allows (``RuntimeOptions.room``): all graphs are given back together
(one pool) when it does not, and the call is an out-of-memory error the worker answers with
a smaller plan.
"""

from __future__ import annotations

import gc
import threading
import traceback
from collections.abc import Callable

import torch

from core.errors import ExecutionError, OutOfMemoryError
from core.runner import run_nodes
from core.runs import TreeIndex
from core.runtimes import CUDAGRAPH
from core.runtimes.base import RuntimeOptions
from core.sizes import CUDA_GRANULE, allocation
from core.tree import Node, Parallel, Series
from core.units import Capture

NAME = CUDAGRAPH
WARMUP = 2  # eager runs on the capture stream before a capture (cuDNN and cuBLAS set up)
GROWTH = 2  # a capture's pool is estimated at this many times the run's largest in + out


def unavailable(capture: Capture) -> str:
    """Why CUDA graphs cannot run this model here ('' when they can)."""
    device = capture.model.device
    if device.type != "cuda":
        return f"CUDA graphs run on a CUDA device, not on {device.type}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return ""


Layout = tuple[tuple[int, ...], bool]  # per-sample shape, channels-last


def _layout_after(capture: Capture, node: Node) -> Layout:
    """The per-sample shape and layout of ``node``'s output in the model."""
    if isinstance(node, Parallel):
        join = capture.joins[node.name]
        return join.out_shape, join.channels_last
    if isinstance(node, Series):
        return _layout_after(capture, node.children[-1])
    unit = capture.units[node.name]
    return unit.out_shape, unit.channels_last


def _layout_before(capture: Capture, index: TreeIndex, node: Node) -> Layout:
    """The per-sample shape and layout of what ``node`` reads: the output of the node before
    it in its series, else its series' own input (a branch reads its block's fork)."""
    series, position = index.where[node.name]
    if position > 0:
        return _layout_after(capture, series.children[position - 1])
    if series is capture.tree:
        shape = tuple(capture.input_shape)
        return shape, False
    block = next(n for n in index.nodes.values()
                 if isinstance(n, Parallel) and any(b is series for b in n.branches))
    return _layout_before(capture, index, block)


def _view(flat: torch.Tensor, dtype: torch.dtype, samples: int, layout: Layout) -> torch.Tensor:
    """The first bytes of ``flat`` as a batch of ``samples`` samples in ``layout``."""
    shape, channels_last = layout
    count = samples
    for d in shape:
        count *= d
    data = flat[:count * dtype.itemsize].view(dtype)
    if channels_last and len(shape) in (3, 4):  # stored N, spatial..., C; read as N, C, spatial...
        stored = data.view(samples, *shape[1:], shape[0])
        return stored.permute(0, len(shape), *range(1, len(shape)))
    return data.view(samples, *shape)


class Captured:
    """One captured run: its graph, the views of the static buffers it reads and writes, and
    the most its capture allocated in the pool (its intermediates: the run's inner memory)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, x: torch.Tensor, y: torch.Tensor,
                 inner: int) -> None:
        self.graph, self.x, self.y, self.inner = graph, x, y, inner


class GraphUnits:
    """CUDA graphs of the runs of one captured model (a ``core.runtimes.base.UnitRuntime``)."""

    name = NAME

    def __init__(self, capture: Capture, room: Callable[[], int] | None = None) -> None:
        why = unavailable(capture)
        if why:
            raise ExecutionError(f"{capture.model.spec.name}: CUDA graphs cannot run it: {why}")
        self.capture = capture
        self.device = capture.model.device
        self.dtype = capture.model.torch_dtype
        self._index = TreeIndex.of(capture.tree)
        self._room = room
        self._lock = threading.RLock()
        self._graphs: dict[tuple[str, str, int], Captured] = {}
        self._pool: tuple[int, int] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._in = self._out = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._pool_reserved = self._pool_allocated = 0

    # ------------------------------------------------------------------ the interface

    def prepare(self, nodes: tuple[Node, ...], samples: int) -> None:
        """Capture the run now, not at its first call."""
        self.captured(nodes, samples)

    def captured(self, nodes: tuple[Node, ...], samples: int) -> Captured:
        """The run's graph, captured now if it was not (the profiler replays it alone)."""
        key = (nodes[0].name, nodes[-1].name, samples)
        found = self._graphs.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._graphs.get(key)
            if found is None:
                found = self._graphs[key] = self._capture(nodes, samples)
        return found

    def call(self, nodes: tuple[Node, ...], x: torch.Tensor, samples: int,
             own: bool = False) -> torch.Tensor:
        """Copy ``x`` in, replay the run's graph, copy its output into a buffer of the walk's."""
        shape, channels_last = _layout_after(self.capture, nodes[-1])
        fmt = torch.contiguous_format
        if channels_last:
            fmt = torch.channels_last if len(shape) == 3 else torch.channels_last_3d
        out = torch.empty((samples, *shape), dtype=x.dtype, device=x.device, memory_format=fmt)
        with self._lock:
            graph = self.captured(nodes, samples)
            graph.x.copy_(x)
            graph.graph.replay()
            out.copy_(graph.y)
        return out

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    @property
    def held_bytes(self) -> int:
        """The pool's segments and the static buffers."""
        return self._pool_reserved + allocation(self._in.numel(), CUDA_GRANULE) + \
            allocation(self._out.numel(), CUDA_GRANULE)

    @property
    def making_bytes(self) -> int:
        """0: a capture's memory is its pool's, counted in ``held_bytes`` as it is made."""
        return 0

    @property
    def making_seen(self) -> float:
        return 0.0

    @property
    def cached_bytes(self) -> int:
        """The pool's segments no live tensor uses: cached, but only for these graphs (a
        report: no reading of free memory counts a pool's bytes as free)."""
        return max(0, self._pool_reserved - self._pool_allocated)

    def give_back(self) -> None:
        return None  # its pool is its graphs' while they live; the rest is the device cache's

    def release(self) -> None:
        """Give back every graph, the pool and the static buffers."""
        with self._lock:
            self._in = self._out = torch.empty(0, dtype=torch.uint8, device=self.device)
            self._drop_graphs()

    # ------------------------------------------------------------------ capture

    def _capture(self, nodes: tuple[Node, ...], samples: int) -> Captured:
        before = _layout_before(self.capture, self._index, nodes[0])
        after = _layout_after(self.capture, nodes[-1])
        size = self.dtype.itemsize
        in_bytes = samples * size * _count(before[0])
        out_bytes = samples * size * _count(after[0])
        grow = max(0, in_bytes - self._in.numel()) + max(0, out_bytes - self._out.numel())
        self._make_room(nodes, samples, grow + GROWTH * samples * max(
            n.in_bytes + n.out_bytes for n in nodes))  # type: ignore[union-attr]
        try:
            if in_bytes > self._in.numel() or out_bytes > self._out.numel():
                self._grow(in_bytes, out_bytes)
            x = _view(self._in, self.dtype, samples, before)
            y = _view(self._out, self.dtype, samples, after)
            graph, inner = self._record(nodes, x, y)
        except torch.cuda.OutOfMemoryError as exc:
            _forget(exc)
            raise OutOfMemoryError(f"{self.capture.model.spec.name}: capturing "
                                   f"{nodes[0].name}..{nodes[-1].name} on {samples} samples as a "
                                   f"CUDA graph ran out of memory: {str(exc).splitlines()[0]}"
                                   ) from exc
        except RuntimeError as exc:
            _forget(exc)
            raise ExecutionError(f"{self.capture.model.spec.name}: {nodes[0].name}.."
                                 f"{nodes[-1].name} cannot be captured as a CUDA graph: "
                                 f"{str(exc).splitlines()[0]}") from exc
        self._measure()
        left = self._pool_allocated
        if left:  # the pool holds a tensor its capture made: no later capture may share it
            del graph
            self._drop_graphs()
            raise ExecutionError(f"{self.capture.model.spec.name}: {nodes[0].name}.."
                                 f"{nodes[-1].name} on {samples} samples is not kept as a CUDA "
                                 f"graph: {left} bytes allocated inside its capture are still "
                                 "alive after it (a unit keeps a tensor it made)")
        return Captured(graph, x, y, inner)

    def _record(self, nodes: tuple[Node, ...], x: torch.Tensor, y: torch.Tensor
                ) -> tuple[torch.cuda.CUDAGraph, int]:
        """Warm the run up on the capture stream, then capture it into the shared pool; the
        graph, and the most its capture allocated (the allocator's peak is the process's:
        exact where nothing else allocates meanwhile, as when profiling)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if self._pool is None or not self._graphs:
            # A pool is shared only with graphs alive in it (a failed capture's graph is not
            # kept): a capture naming one whose graphs are gone fails use_count > 0.
            self._pool = torch.cuda.graph_pool_handle()
        x.zero_()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode():
            with torch.cuda.stream(stream):
                for _ in range(WARMUP):
                    run_nodes(self.capture, nodes, x)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other models' threads may use the device meanwhile
            with torch.cuda.graph(graph, pool=self._pool, stream=stream,
                                  capture_error_mode="thread_local"):
                out = run_nodes(self.capture, nodes, x)
                y.copy_(out)
                del out  # back to the pool: nothing captured outlives its capture
            inner = max(0, torch.cuda.max_memory_allocated(self.device) - base)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph, int(inner)

    def _grow(self, in_bytes: int, out_bytes: int) -> None:
        """Static buffers for a larger run: the graphs captured read the old ones, so they
        are given back first, their pool with them (and captured again when they next run)."""
        self._in = self._out = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._drop_graphs()
        self._in = torch.empty(max(in_bytes, 1), dtype=torch.uint8, device=self.device)
        self._out = torch.empty(max(out_bytes, 1), dtype=torch.uint8, device=self.device)

    def _drop_graphs(self) -> None:
        """Give back every graph and their pool: the next capture starts a new one, and the
        old one goes back to the device now, unless a caller still holds one of its graphs
        (then at a later ``empty_cache``: a capture's, the device cache's trims)."""
        self._graphs.clear()
        self._pool = None
        self._pool_reserved = self._pool_allocated = 0
        gc.collect()
        torch.cuda.empty_cache()

    def _measure(self) -> None:
        """The pool's size and what of it live tensors use, from the allocator's segments."""
        if self._pool is None:
            return
        pool = tuple(self._pool)
        reserved = allocated = 0
        for segment in torch.cuda.memory_snapshot():
            if tuple(segment.get("segment_pool_id", ())) == pool:
                reserved += int(segment.get("total_size", 0))
                allocated += int(segment.get("allocated_size", 0))
        self._pool_reserved, self._pool_allocated = reserved, allocated

    def _make_room(self, nodes: tuple[Node, ...], samples: int, need: int) -> None:
        """Before a capture: about ``need`` bytes free (``room``), the graphs given back
        (their pool is one) when they are not; else OutOfMemoryError."""
        if self._room is None:
            return
        if self._room() < need and self._graphs:
            self.release()
        free = self._room()
        if free < need:
            raise OutOfMemoryError(
                f"{self.capture.model.spec.name}: the CUDA graph of {nodes[0].name}.."
                f"{nodes[-1].name} on {samples} samples needs about {need} bytes and {free} "
                "are free: a smaller plan, or more memory")


def _forget(exc: BaseException) -> None:
    """Drop what a failed capture's frames hold (its graph, the tensors made before the
    error): the error keeps its message, and the pool nothing of the capture, even while the
    caller keeps the error."""
    traceback.clear_frames(exc.__traceback__)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def load(capture: Capture, options: RuntimeOptions) -> GraphUnits:
    return GraphUnits(capture, room=options.room)
