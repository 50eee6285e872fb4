"""A stored model run on numpy arrays: the walk of ``core.walk`` with no torch in the process.

A worker whose plans are all ONNX Runtime runs (the CPU's usual case) needs of torch only
buffers: the walk's views, gathers and splits are numpy slices and copies, and every run is a
call of the model's sessions (``core.runtimes.ort_arrays``). ``ArrayModel`` is what such a
worker serves: the compiled model from the store (``core.compiled``) with the profile's tree,
and the same small interface as a captured torch model (``workers.executor.TorchModel``):
its runtimes, a plan made ready to run, the batch buffer, the concatenation of pieces.

Folds of a block's branches outside a run (cat, add, mul) are done here too; a plan that
needs a torch step or another join outside a run is refused at load (``unrunnable``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from core import runtimes as rt
from core.compiled import CompiledModel
from core.errors import ExecutionError
from core.program import Step
from core.runs import TreeIndex, run_runtime
from core.runtimes.base import RuntimeOptions, UnitRuntime
from core.table import PlanTable
from core.tree import Layer, Node, Parallel, Series
from core.walk import walk

Runtimes = Mapping[str, UnitRuntime]


class ArrayBackend:
    """The walk's actions on numpy arrays; every run on the model's ONNX Runtime sessions."""

    def __init__(self, model: "ArrayModel", runtimes: Runtimes) -> None:
        self.model = model
        self.dtype = model.dtype
        found = runtimes.get(rt.ONNXRUNTIME)
        if found is None:
            raise ExecutionError(f"{model.name}: its worker has not loaded onnxruntime")
        self.sessions = found

    def _refuse(self, what: str) -> ExecutionError:
        return ExecutionError(f"{self.model.name}: {what} needs torch, and this worker serves "
                              "the compiled model without it: plan with --runtime onnxruntime "
                              "or serve with torch installed (VBS_LEAN=off)")

    def run(self, unit: Layer, x: np.ndarray, samples: int, runtime: str = rt.TORCH) -> np.ndarray:
        if runtime != rt.ONNXRUNTIME:
            raise self._refuse(f"unit {unit.name} on {runtime}")
        return self.sessions.call((unit,), x, samples)

    def run_many(self, nodes: tuple[Node, ...], x: np.ndarray, samples: int, runtime: str
                 ) -> np.ndarray:
        if runtime != rt.ONNXRUNTIME:
            raise self._refuse(f"a run of {nodes[0].name}..{nodes[-1].name} on {runtime}")
        return self.sessions.call(nodes, x, samples)

    def run_in_place(self, unit: Layer, chunk: np.ndarray, samples: int) -> np.ndarray:
        raise self._refuse(f"the in-place unit {unit.name} outside a run")

    def view(self, chunk: np.ndarray, start: int, samples: int) -> np.ndarray:
        if start == 0 and samples == chunk.shape[0]:
            return chunk
        return chunk[start:start + samples]

    def gather(self, producer: Node, samples: int) -> np.ndarray:
        return np.empty((samples, *self.model.shapes.output_of(producer)), dtype=self.dtype)

    def copy(self, dst: np.ndarray, dst_start: int, src: np.ndarray, src_start: int,
             samples: int) -> None:
        np.copyto(dst[dst_start:dst_start + samples], src[src_start:src_start + samples])

    def open_join(self, block: Parallel, fork: np.ndarray, samples: int) -> np.ndarray:
        return np.empty((samples, *self.model.shapes.joins[block.name].out_shape),
                        dtype=self.dtype)

    def fold(self, block: Parallel, join: np.ndarray, start: int, fork: np.ndarray,
             y: np.ndarray | None, branch: int, samples: int, first: bool) -> np.ndarray:
        spec = self.model.shapes.joins[block.name]
        out = self.view(join, start, samples)
        mine = self.view(fork, start, samples)
        if (spec.kind == "add" and first and y is not None and start == 0
                and y.shape == join.shape and y.base is None and not np.shares_memory(y, fork)):
            return y  # taken over whole, as the torch back end does (the walk drops join)
        operand = mine if y is None else y
        if spec.kind == "cat":
            at, length = spec.slices[branch]
            index = [slice(None)] * out.ndim
            index[spec.dim] = slice(at, at + length)
            np.copyto(out[tuple(index)], operand)
        elif spec.kind == "add":
            if first:
                np.copyto(out, operand)
            else:
                np.add(out, operand, out=out)
        elif y is None:  # the identity operand of a mul is read from the fork
            return join
        elif spec.kind == "mul":
            a, b = (mine, y) if spec.fork_first[0] else (y, mine)
            np.multiply(a, b, out=out)
        else:
            raise self._refuse(f"the {spec.kind} join of {block.name} outside a run")
        return join

    def free(self, buffer: np.ndarray) -> None:
        return None  # the walk drops its last reference

    def borrow(self, fork: np.ndarray) -> np.ndarray:
        return fork

    def split(self, producer: Node, chunk: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
        pieces, start = [], 0
        for n in sizes:
            piece = self.gather(producer, n)
            np.copyto(piece, chunk[start:start + n])
            pieces.append(piece)
            start += n
        return pieces


@dataclass(frozen=True)
class ArrayRun:
    """One plan made ready to run on ``samples`` samples (``workers.executor.Prepared``'s
    counterpart): one call of the root series' children when the plan is that, else the walk."""

    model: "ArrayModel"
    steps: tuple[Step, ...]
    splits: dict[int, list[int]] | None
    runs: dict[int, int] | None
    samples: int
    whole: tuple[Node, ...]
    calls_modules = False  # no torch module is ever called

    def __call__(self, x: np.ndarray, runtimes: Runtimes | None = None) -> np.ndarray:
        if x.shape[0] != self.samples:
            return self.model.prepare(self.steps, self.splits, self.runs, x.shape[0])(x, runtimes)
        backend = ArrayBackend(self.model, runtimes or {})
        if self.whole:
            return backend.run_many(self.whole, x, self.samples, rt.ONNXRUNTIME)
        return walk(backend, self.model.tree, self.steps, x, self.samples, self.splits,
                    runs=self.runs)


@dataclass(frozen=True)
class ArrayModel:
    """A compiled model as a worker serves it without torch (see the module doc). ``tree`` is
    the profile's (its measurements name each step's runtime where a plan leaves it out)."""

    compiled: CompiledModel
    tree: Series
    fingerprint: str

    @property
    def name(self) -> str:
        return self.compiled.name

    @property
    def shapes(self) -> Any:
        return self.compiled.shapes

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def device(self) -> str:
        return "cpu"

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.compiled.shapes.input_shape

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.compiled.shapes.output_shape

    @property
    def weights_bytes(self) -> int:
        """The stored graphs' weights, once (every session shares them)."""
        return self.compiled.weight_bytes()

    @property
    def resident_weights_bytes(self) -> int:
        """Of the graphs' weights, those they hold in memory (none of those moved to the
        weights file, ``core.weights_file``: their copy in memory is the sessions')."""
        return self.compiled.resident_weight_bytes()

    @property
    def sample_bytes(self) -> int:
        """One input sample's bytes (float32)."""
        return int(np.prod(self.input_shape, dtype=np.int64)) * self.dtype.itemsize

    def load_runtime(self, name: str, options: RuntimeOptions) -> UnitRuntime:
        return rt.load_compiled(name, self.compiled.graphs, options)

    def prepare(self, steps: Sequence[Step], splits: dict[int, list[int]] | None,
                runs: dict[int, int] | None, samples: int) -> ArrayRun:
        steps = tuple(steps)
        whole: tuple[Node, ...] = ()
        if not splits and runs == {0: len(steps) - 1} and all(s.samples == samples for s in steps):
            nodes = TreeIndex.of(self.tree).run_nodes(steps, 0, len(steps) - 1)
            if len(nodes) == len(self.tree.children) and nodes[0] is self.tree.children[0]:
                whole = nodes
        return ArrayRun(self, steps, splits or None, runs or None, int(samples), whole)

    def concat(self, outputs: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(outputs)

    def host_buffer(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The batch buffer for ``n`` samples and its numpy view (the same array here)."""
        buffer = np.empty((n, *self.input_shape), dtype=self.dtype)
        # its pages now, not when the first full batch writes them (calloc's zeros are not
        # touched): in the group's working set from the start, as the torch worker's buffer
        buffer.fill(0)
        return buffer, buffer

    def to_input(self, x: np.ndarray) -> np.ndarray:
        return x

    def to_host(self, y: np.ndarray, buffer: np.ndarray) -> np.ndarray:
        """An output never a view of the reused ``buffer``."""
        return y.copy() if np.shares_memory(y, buffer) else y

    def unrunnable(self, table: PlanTable) -> str:
        """Why some plan of ``table`` cannot run without torch ('' when every one can): each
        step in a run of ONNX Runtime, on a unit or block that has a stored graph."""
        index = TreeIndex.of(self.tree)
        for i in range(len(table.plans)):
            steps = table.program(i).steps
            covered = [False] * len(steps)
            for start, end in table.plans[i].runs:
                nodes = index.run_nodes(steps, start, end)
                runtime = run_runtime(nodes[0], steps[start])
                if runtime != rt.ONNXRUNTIME:
                    return (f"plan {table.plans[i].plan_id} runs {nodes[0].name}.. on "
                            f"{runtime}")
                why = next((f"{n.name}: {r}" for n in nodes
                            if (r := self.compiled.graphs.reason(n))), "")
                if why:
                    return f"plan {table.plans[i].plan_id}: {why}"
                covered[start:end + 1] = [True] * (end - start + 1)
            if not all(covered):
                k = covered.index(False)
                return (f"plan {table.plans[i].plan_id} runs {steps[k].unit} on its own, "
                        "outside a run of ONNX Runtime")
        return ""
