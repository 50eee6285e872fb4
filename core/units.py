"""A captured model as the executor runs it: the division tree (``core.tree``) with, for every
unit, the GraphModule that computes it (``Unit``) and, for every parallel block, how a branch's
sub-batch is folded into the join buffer (``Join``).

``planner.graph.capture`` builds a ``Capture`` from a model (offline, and when a worker loads
a model); the runner, the runtimes and the executor only read it. ``MODULE_GATE`` keeps a
torch.fx trace apart from every module call in the process (see ``ModuleGate``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

import torch
from torch import fx

from core.gate import MODULE_GATE, ModuleGate  # noqa: F401 - its home is core.gate
from core.loaded import LoadedModel
from core.precision import FLOAT, Precision
from core.tree import Layer, Parallel, Series, iter_nodes


def batch_buffer(like: torch.Tensor, samples: int, shape: tuple[int, ...],
                 channels_last: bool) -> torch.Tensor:
    """An empty buffer of ``samples`` samples of per-sample ``shape``, with ``like``'s dtype and
    device, in the layout the model gives that tensor (so later ops pick the same kernels)."""
    fmt = torch.contiguous_format
    if channels_last:
        fmt = torch.channels_last if len(shape) == 3 else torch.channels_last_3d
    return torch.empty((samples, *shape), dtype=like.dtype, device=like.device, memory_format=fmt)


@dataclass(frozen=True)
class Unit:
    """A unit as it runs: a GraphModule from its input tensor to its output tensor.

    ``call`` runs it: for a unit that is a chain of modules (a convolution, its BatchNorm and
    its activation: almost every unit), the modules one after the other, as the model's own
    ``nn.Sequential`` calls them; else the GraphModule's ``forward``. Calling the GraphModule
    itself costs its wrapper and a ``getattr`` per level of every module path, on every step:
    about half of what the executor adds to ``model(x)`` on one sample (docs/benchmarks.md,
    section 5)."""

    name: str
    module: fx.GraphModule
    out_shape: tuple[int, ...]  # per sample
    ops: tuple[str, ...]
    channels_last: bool = False  # the layout of its output in the model
    # for a unit that only writes into its input (``Layer.inplace``): its ops as the model runs
    # them, in place; ``call`` then writes a new tensor (see ``write_new_tensors``)
    in_place: fx.GraphModule | None = field(default=None, repr=False, compare=False)
    call: Callable[[torch.Tensor], torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "call", _runner(self.module))

    def empty(self, like: torch.Tensor, samples: int) -> torch.Tensor:
        """An output buffer for ``samples`` samples, in the layout the model uses."""
        return batch_buffer(like, samples, self.out_shape, self.channels_last)


def op_chain(gm: fx.GraphModule) -> list[fx.Node]:
    """A unit's ops when they form a chain from its input to its output (each reads the one
    before it as its first argument, and nothing else reads that); else []."""
    nodes = list(gm.graph.nodes)
    previous = next(n for n in nodes if n.op == "placeholder")
    inner = [n for n in nodes if n.op not in ("placeholder", "output")]
    for node in inner:
        if not node.args or node.args[0] is not previous or len(previous.users) != 1:
            return []
        previous = node
    output = next(n for n in nodes if n.op == "output")
    return inner if output.args[0] is previous else []


def _runner(gm: fx.GraphModule) -> Callable[[torch.Tensor], torch.Tensor]:
    """What runs a unit's GraphModule on its input (see ``Unit``)."""
    nodes = op_chain(gm)
    if not nodes or any(n.op != "call_module" or len(n.args) != 1 or n.kwargs for n in nodes):
        return gm.forward
    modules = tuple(gm.get_submodule(str(n.target)) for n in nodes)

    def run(x: torch.Tensor) -> torch.Tensor:
        for m in modules:
            x = m(x)
        return x

    return run


@dataclass(frozen=True)
class Join:
    """How a parallel block folds each branch's sub-batch into its join buffer."""

    name: str
    kind: str  # "cat" | "add" | "mul" | another op, applied with the fork
    out_shape: tuple[int, ...]
    dim: int = 1  # cat: the dimension of the slices (batch dimension included)
    slices: tuple[tuple[int, int], ...] = ()  # cat: (start, length) of each branch
    apply: fx.GraphModule | None = None  # other ops: (fork, branch_output) -> joined
    fork_first: tuple[bool, ...] = ()  # mul: whether the fork is the op's first operand
    channels_last: bool = False  # the layout of the join tensor in the model

    def empty(self, like: torch.Tensor, samples: int) -> torch.Tensor:
        """A join buffer for ``samples`` samples, in the layout the model uses."""
        return batch_buffer(like, samples, self.out_shape, self.channels_last)

    def fold(self, out: torch.Tensor, fork: torch.Tensor, y: torch.Tensor | None, branch: int,
             first: bool) -> torch.Tensor:
        """Fold branch ``branch``'s output ``y`` (None: identity) for the samples of ``out``;
        ``first``: no branch has folded them yet. Returns what holds the join from now on:
        ``out``, or, for the first output of an ``add`` that is a buffer exactly like ``out``
        (all its samples, the same layout and size), ``y`` itself, not copied (the caller
        drops ``out``: see ``core.tree.fold_order``)."""
        if self.kind == "add" and first and y is not None and _can_stand_for(y, out, fork):
            return y
        y = fork if y is None else y
        if self.kind == "cat":
            start, length = self.slices[branch]
            out.narrow(self.dim, start, length).copy_(y)
        elif self.kind == "add":
            if first:
                out.copy_(y)
            else:
                out.add_(y)
        elif y is fork:  # the identity operand of a mul/apply join is read from the fork
            return out
        elif self.kind == "mul":
            a, b = (fork, y) if self.fork_first[0] else (y, fork)
            torch.mul(a, b, out=out)
        else:
            assert self.apply is not None
            out.copy_(self.apply(fork, y))
        return out


def _can_stand_for(y: torch.Tensor, out: torch.Tensor, fork: torch.Tensor) -> bool:
    """Whether ``y`` can stand for the join buffer ``out``: a tensor of its own (not the
    fork's memory, which the other branch still reads) with out's shape, strides, dtype and
    device, and a storage of exactly out's size (taking it over holds the bytes out held)."""
    mine = y.untyped_storage()
    return (y.shape == out.shape and y.stride() == out.stride() and y.dtype == out.dtype
            and y.device == out.device and y.storage_offset() == 0 == out.storage_offset()
            and mine.nbytes() == out.untyped_storage().nbytes()
            and mine.data_ptr() not in (out.untyped_storage().data_ptr(),
                                        fork.untyped_storage().data_ptr()))


@dataclass(frozen=True)
class Capture:
    """A model as a division tree, with what runs each unit and each join."""

    model: LoadedModel
    graph: fx.GraphModule
    tree: Series
    units: dict[str, Unit]
    joins: dict[str, Join]
    output_shape: tuple[int, ...]
    ops: dict[str, str] = field(default_factory=dict)  # fx node name -> owning unit or block
    # the units' ONNX graphs where the planner made them (int8 units quantized from
    # calibration data: ``planner.precision``); None: exported from the modules when needed
    graphs: Any = field(default=None, compare=False)  # core.runtimes.onnx_compose.UnitGraphs
    precision: Precision = FLOAT
    # held-out calibration samples (a float32 array, samples first) where the precision was
    # measured on them: what a check of a plan's answer against model(x) runs on
    held_out: Any = field(default=None, compare=False)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.model.input_shape

    @functools.cached_property
    def uniform_order(self) -> tuple[str, ...]:
        """Every unit and block of the tree once, in the order a program runs them: the steps
        of a uniform program (every unit on the whole request)."""
        return tuple(n.name for n in iter_nodes(self.tree) if isinstance(n, (Layer, Parallel)))
