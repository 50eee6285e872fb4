"""Run a Program on real tensors: every unit at the batch size the plan gives it.

The executor is the walk of ``core.walk`` on the ``TorchBackend``: sub-batches are views of
the chunks a boundary holds, samples spread over several chunks are gathered into one buffer
slice by slice (never a torch.cat), joins are built in place (cat into channel slices, add by
accumulation, taking over the first branch output that brings every sample, mul with the
fork), and every buffer is dropped as soon as the walk frees it. A unit whose output is a view
of its input gets its output copied into a buffer of its own: the walk counts one, and a view
would pin its input's whole chunk (in-place ops on a unit's input compute new tensors since
capture, so they need no copy). Units run through ``Unit.call``, as the model runs its modules.
A uniform program (every unit at the whole request: every plan of one sample, and fbs's)
on torch runs through the reference runner, which allocates what the walk would, without
its bookkeeping. Steps on a runtime that runs units in calls (ONNX Runtime, CUDA graphs)
run as the plan's runs, one call each through the runtime interface
(``core.runtimes.base.UnitRuntime``), reading the walk's take and giving a buffer the walk
then owns, so the walk's accounting of activations holds for them too. Gathers and splits
between those calls copy on the CPU without torch's intra-op threads (``_copy``): torch's
OpenMP threads spin for a while after a parallel copy and take the cores from the next call.
Runs under ``torch.inference_mode``; CPU and CUDA; float32, float16, bfloat16.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.errors import ExecutionError, OutOfMemoryError
from core.units import Capture
from core.runner import run_node
from core.runtimes import KINDS, TORCH, load as rt_load
from core.runtimes.base import RuntimeOptions, UnitRuntime
from core.walk import walk
from core.program import Step
from core.runs import TreeIndex, run_runtime
from core.tree import Layer, Node, Parallel

Runtimes = Mapping[str, UnitRuntime]  # the worker's loaded runtimes, by name
_NUMPY = (torch.float32, torch.float16, torch.float64)  # dtypes numpy copies as they are


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; on the CPU a plain memory copy on this thread (numpy's), so that
    torch's OpenMP pool, woken by a parallel copy, is not left spinning on the cores while the
    next ONNX Runtime call runs."""
    if dst.device.type == "cpu" and dst.dtype in _NUMPY and src.dtype == dst.dtype:
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


class TorchBackend:
    """The walk's actions on tensors, with the units and joins of one capture; units and
    runs are called on the runtime each step names (``runtimes``; torch is always there)."""

    def __init__(self, capture: Capture, like: torch.Tensor, runtimes: Runtimes | None = None
                 ) -> None:
        self.capture = capture
        self.like = like  # dtype and device of every buffer
        self._eager: UnitRuntime | None = None  # torch's, made when a step first needs it
        self.runtimes = runtimes or {}

    def _runtime(self, runtime: str) -> UnitRuntime:
        if runtime == TORCH:
            found = self.runtimes.get(TORCH) or self._eager
            if found is None:  # a backend is made per batch: loaded only where a step asks
                found = self._eager = rt_load(TORCH, self.capture, RuntimeOptions())
            return found
        found = self.runtimes.get(runtime)
        if found is None:
            if runtime not in KINDS:
                raise ExecutionError(f"no unit runtime {runtime!r} here: plan with --runtime "
                                     "torch, onnxruntime or cudagraph")
            raise ExecutionError(f"a plan of {self.capture.model.spec.name!r} runs steps on "
                                 f"{runtime}, but its worker has not loaded {runtime}")
        return found

    def run(self, unit: Layer, x: torch.Tensor, samples: int, runtime: str = TORCH
            ) -> torch.Tensor:
        return self._runtime(runtime).call((unit,), x, samples)

    def run_many(self, nodes: tuple[Node, ...], x: torch.Tensor, samples: int, runtime: str
                 ) -> torch.Tensor:
        return self._runtime(runtime).call(nodes, x, samples)

    def run_in_place(self, unit: Layer, chunk: torch.Tensor, samples: int) -> torch.Tensor:
        return self._runtime(TORCH).call((unit,), chunk, samples, own=True)

    def view(self, chunk: torch.Tensor, start: int, samples: int) -> torch.Tensor:
        if start == 0 and samples == chunk.shape[0]:
            return chunk
        return chunk.narrow(0, start, samples)

    def gather(self, producer: Node, samples: int) -> torch.Tensor:
        if isinstance(producer, Parallel):
            return self.capture.joins[producer.name].empty(self.like, samples)
        return self.capture.units[producer.name].empty(self.like, samples)

    def copy(self, dst: torch.Tensor, dst_start: int, src: torch.Tensor, src_start: int,
             samples: int) -> None:
        _copy(dst.narrow(0, dst_start, samples), src.narrow(0, src_start, samples))

    def open_join(self, block: Parallel, fork: torch.Tensor, samples: int) -> torch.Tensor:
        return self.capture.joins[block.name].empty(fork, samples)

    def fold(self, block: Parallel, join: torch.Tensor, start: int, fork: torch.Tensor,
             y: torch.Tensor | None, branch: int, samples: int, first: bool) -> torch.Tensor:
        out = self.view(join, start, samples)
        held = self.capture.joins[block.name].fold(out, self.view(fork, start, samples), y,
                                                   branch, first)
        return join if held is out else held  # an add's first output taken over whole

    def free(self, buffer: torch.Tensor) -> None:
        # Nothing to do: the walk drops its last reference, and torch frees the storage.
        return None

    def borrow(self, fork: torch.Tensor) -> torch.Tensor:
        return fork

    def split(self, producer: Node, chunk: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        pieces, start = [], 0
        for n in sizes:
            piece = self.gather(producer, n)
            _copy(piece, chunk.narrow(0, start, n))
            pieces.append(piece)
            start += n
        return pieces


def _uniform(capture: Capture, steps: tuple[Step, ...], samples: int) -> bool:
    """Whether ``steps`` run every unit and block of the tree once, in order, on all samples,
    on torch: then the reference runner does exactly what the walk would, without its
    bookkeeping, a visible share of a one-sample pass (docs/benchmarks.md, section 5)."""
    order = capture.uniform_order
    return (len(steps) == len(order) and all(step.samples == samples for step in steps)
            and all(step.unit == name and step.runtime in ("", TORCH)
                    for step, name in zip(steps, order)))


def _one_call(capture: Capture, steps: tuple[Step, ...], runs: dict[int, int] | None,
              samples: int) -> tuple[Node, ...]:
    """The root series' children when ``steps`` are one run of the whole model on all samples
    (every plan of one sample that ONNX Runtime takes whole): then that call is all the walk
    would do, and it is made without the walk's bookkeeping (else ())."""
    if not steps or runs != {0: len(steps) - 1} or any(s.samples != samples for s in steps):
        return ()
    nodes = TreeIndex.of(capture.tree).run_nodes(steps, 0, len(steps) - 1)
    children = capture.tree.children  # the run must span the root series, first to last
    return nodes if len(nodes) == len(children) and nodes[0] is children[0] else ()


@dataclass(frozen=True)
class Prepared:
    """How one plan runs on ``samples`` samples: the reference runner, one runtime call, or
    the walk. Deciding scans every step; a worker decides once per plan and keeps these."""

    capture: Capture
    steps: tuple[Step, ...]
    splits: dict[int, list[int]] | None
    runs: dict[int, int] | None
    samples: int
    uniform: bool              # every unit at all samples on torch: the reference runner
    whole: tuple[Node, ...]    # one call of the root series on all samples, else ()
    runtime: str               # the runtime of that call

    @property
    def calls_modules(self) -> bool:
        """Whether it calls the model's torch modules (else it is one call of a runtime that
        does not, which a torch.fx trace elsewhere in the process cannot meet:
        ``MODULE_GATE``)."""
        return not self.whole or KINDS[self.runtime].modules

    def __call__(self, x: torch.Tensor, runtimes: Runtimes | None = None) -> torch.Tensor:
        """``model(x)`` for ``x`` of ``samples`` samples; see ``execute``."""
        if x.shape[0] != self.samples:
            return prepare(self.capture, self.steps, self.splits, self.runs,
                           x.shape[0])(x, runtimes)
        capture = self.capture
        try:
            if self.whole and not KINDS[self.runtime].modules and runtimes:
                # the call alone: no backend, no inference mode (nothing of torch runs);
                # they were a visible share of a one-sample request on a small model
                # (docs/benchmarks.md, section 1)
                found = runtimes.get(self.runtime)
                if found is not None:
                    return found.call(self.whole, x, self.samples)
            with torch.inference_mode():
                if self.uniform:
                    return run_node(capture, capture.tree, x)
                backend = TorchBackend(capture, x, runtimes)
                if self.whole:
                    return backend.run_many(self.whole, x, self.samples, self.runtime)
                return walk(backend, capture.tree, self.steps, x, self.samples, self.splits,
                            runs=self.runs)
        except torch.cuda.OutOfMemoryError as exc:  # = torch.OutOfMemoryError (torch >= 2.5)
            raise OutOfMemoryError(f"out of memory running a plan of {capture.model.spec.name!r} "
                                   f"on {x.shape[0]} samples: {str(exc).splitlines()[0]}") from exc
        except RuntimeError as exc:
            raise ExecutionError(f"running a plan of {capture.model.spec.name!r} failed: "
                                 f"{str(exc).splitlines()[0]}") from exc


def prepare(capture: Capture, steps: Iterable[Step], splits: dict[int, list[int]] | None,
            runs: dict[int, int] | None, samples: int) -> Prepared:
    """``steps`` (with their ``splits`` and ``runs``, as ``execute`` takes them) ready to run
    on a request of ``samples`` samples."""
    steps = tuple(steps)
    samples = int(samples)
    uniform = not splits and not runs and _uniform(capture, steps, samples)
    whole = () if uniform or splits else _one_call(capture, steps, runs, samples)
    runtime = run_runtime(whole[0], steps[0]) if whole else TORCH
    return Prepared(capture, steps, splits or None, runs or None, samples, uniform, whole, runtime)


def execute(capture: Capture, steps: Iterable[Step], x: torch.Tensor,
            splits: dict[int, list[int]] | None = None, runs: dict[int, int] | None = None,
            runtimes: Runtimes | None = None) -> torch.Tensor:
    """Run ``steps`` on the request ``x`` (``runs``: first step -> last step of each run one
    runtime call executes, on the runtime of ``runtimes`` its steps name; torch needs none);
    the result equals ``model(x)``.

    torch's out-of-memory error becomes OutOfMemoryError (the worker steps down and
    retries); any other failure of a unit becomes an ExecutionError naming the model.
    """
    return prepare(capture, steps, splits, runs, x.shape[0])(x, runtimes)


@dataclass(frozen=True)
class TorchModel:
    """A captured model as a worker runs it (``workers.worker.Served``): its runtimes loaded
    from the capture, its plans run by the executor on tensors."""

    capture: Capture

    @property
    def name(self) -> str:
        return self.capture.model.spec.name

    @property
    def tree(self) -> Any:
        return self.capture.tree

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.capture.input_shape)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return tuple(self.capture.output_shape)

    @property
    def weights_bytes(self) -> int:
        """Its parameters' and buffers' bytes."""
        module = self.capture.model.module
        return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))

    @property
    def resident_weights_bytes(self) -> int:
        """All its weights: the module holds them."""
        return self.weights_bytes

    @property
    def sample_bytes(self) -> int:
        """One input sample's bytes in its dtype."""
        return math.prod(self.input_shape) * self.capture.model.torch_dtype.itemsize

    def load_runtime(self, name: str, options: RuntimeOptions) -> UnitRuntime:
        return rt_load(name, self.capture, options)

    def prepare(self, steps: Iterable[Step], splits: dict[int, list[int]] | None,
                runs: dict[int, int] | None, samples: int) -> Prepared:
        return prepare(self.capture, steps, splits, runs, samples)

    def concat(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(outputs)

    def host_buffer(self, n: int) -> tuple[torch.Tensor, np.ndarray]:
        """A host buffer for n samples (pinned on CUDA) and a numpy view of it."""
        loaded = self.capture.model
        # numpy has no bfloat16: such a batch is written as float32 and cast on the device
        dtype = torch.float32 if loaded.torch_dtype == torch.bfloat16 else loaded.torch_dtype
        buffer = torch.empty((n, *self.input_shape), dtype=dtype,
                             pin_memory=loaded.device.type == "cuda")
        # its pages now, not when the first full batch writes them: in the group's working
        # set from the start, which the memory limit's ledger reads as what stays
        buffer.numpy().fill(0)
        return buffer, buffer.numpy()

    def to_input(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of the host buffer as the model takes them: on its device, in its dtype."""
        loaded = self.capture.model
        if x.device != loaded.device or x.dtype != loaded.torch_dtype:  # not on a CPU float32
            x = x.to(device=loaded.device, dtype=loaded.torch_dtype, non_blocking=True)
        return x

    def to_host(self, y: torch.Tensor, buffer: torch.Tensor) -> np.ndarray:
        """An output as float32 numpy on the host, never a view of the reused ``buffer``."""
        if y.device.type != "cpu" or y.dtype != torch.float32:
            y = y.to(device="cpu", dtype=torch.float32)
        if buffer.data_ptr() <= y.data_ptr() < buffer.data_ptr() + buffer.nbytes:
            y = y.clone()  # a model that returns its input: the buffer is reused next batch
        return y.numpy()
