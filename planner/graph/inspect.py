"""One pass over a traced model: what every node is, and whether any op mixes samples.

``BatchInspector`` runs the graph on a small batch and, alongside, on the same samples cut
into parts (1 and 2 of 3). For every node it records whether it is an *activation* (a
tensor computed from the input whose first dimension is the batch) or an *inline* value
(weights, shapes, tuples: recomputed where they are used), and the per-sample shape of
activations. An activation whose parts, put back together, differ from the whole was
computed by an op that mixes samples: the pass stops there and names the op, so a model
that cannot run layers on sub-batches is refused before anything is planned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from core.errors import BatchMixingError, ModelError

PARTS = (1, 2)  # a batch of 3 cut unevenly, so a batch size baked into an op shows


@dataclass(frozen=True)
class NodeInfo:
    """What one fx node produces."""

    activation: bool  # a batch-major tensor computed from the input
    shape: tuple[int, ...] = ()  # per sample, activations only
    itemsize: int = 0
    # The layout the model gives this tensor; buffers that hold it copy the layout, so the
    # next op picks the same kernel as in the model and results stay bit-exact.
    channels_last: bool = False

    @property
    def bytes_per_sample(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


def module_path(node: fx.Node) -> str:
    """The path of the module a node belongs to (``layer1.0.conv1``), "" at the top level: a
    module call's own target, else the innermost module the tracer recorded it in."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def describe(node: fx.Node) -> str:
    """A node as a person finds it in the model: module path and op."""
    path = module_path(node)
    op = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    where = f" in module {path!r}" if path else ""
    return f"op {node.name!r} ({node.op} {op}){where}"


def _channels_last(t: torch.Tensor) -> bool:
    if t.is_contiguous() or t.dim() not in (4, 5):
        return False
    fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return t.is_contiguous(memory_format=fmt)


def _tf32() -> bool:
    """Whether CUDA may compute float32 convolutions or matrix products in TF32 (cuDNN's
    convolutions do by default): 10 bits of mantissa, as float16 has."""
    return bool(torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32)


def arithmetic_tolerance(dtype: torch.dtype, device_type: str) -> tuple[float, float]:
    # Sub-batches may pick other kernels (blocking, reductions, another cuDNN algorithm), so
    # equal means close here, as close as the arithmetic's mantissa allows; an op that mixes
    # samples is off by the size of the values themselves.
    if dtype in (torch.float16, torch.bfloat16) or (
            dtype == torch.float32 and device_type == "cuda" and _tf32()):
        return (1e-2, 1e-2)
    return (1e-3, 1e-4)


class BatchInspector(fx.Interpreter):
    """Classify every node and check that no op mixes the samples of a batch."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # our errors name the node themselves, in one line
        self.infos: dict[fx.Node, NodeInfo] = {}
        self._parts: dict[fx.Node, list[Any]] = {}
        self._batch = 0

    def inspect(self, x: torch.Tensor) -> dict[fx.Node, NodeInfo]:
        self._batch = x.shape[0]
        assert self._batch == sum(PARTS)
        with torch.inference_mode():
            self.run(x)
        return self.infos

    def run_node(self, n: fx.Node) -> Any:
        try:
            whole = super().run_node(n)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise ModelError(f"{describe(n)} failed on a batch of {self._batch}: "
                             f"{type(exc).__name__}: {first}") from exc
        if n.op == "placeholder":
            self._parts[n] = [p.clone() for p in whole.split(list(PARTS))]
        elif n.op != "output" and any(a in self._parts for a in n.all_input_nodes):
            self._parts[n] = [self._run_part(n, k) for k in range(len(PARTS))]
        derived = n in self._parts
        if derived and isinstance(whole, torch.Tensor):
            self._check(n, whole)
            self.infos[n] = NodeInfo(True, tuple(whole.shape[1:]), whole.element_size(),
                                     channels_last=_channels_last(whole))
        else:
            self.infos[n] = NodeInfo(False)
        return whole

    def _run_part(self, n: fx.Node, k: int) -> Any:
        def pick(a: fx.Node) -> Any:
            return self._parts[a][k] if a in self._parts else self.env[a]

        args = fx.node.map_arg(n.args, pick)
        kwargs = fx.node.map_arg(n.kwargs, pick)
        try:
            return getattr(self, n.op)(n.target, args, kwargs)
        except Exception as exc:
            raise BatchMixingError(
                f"{describe(n)} fails on a sub-batch of {PARTS[k]} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); "
                "it fixes the batch size, so layers cannot run on sub-batches: compute the batch "
                "size from the input (x.shape[0]) instead") from exc

    def _check(self, n: fx.Node, whole: torch.Tensor) -> None:
        parts = self._parts[n]
        if whole.dim() == 0 or whole.shape[0] != self._batch or not all(
                isinstance(p, torch.Tensor) and p.dim() > 0 and p.shape[0] == s
                for p, s in zip(parts, PARTS)):
            raise BatchMixingError(
                f"{describe(n)} mixes the samples of a batch: it returns shape {tuple(whole.shape)}, whose "
                f"first dimension is not the batch of {self._batch}; vbs-serve needs the batch first in "
                "every activation, so it can run each layer on sub-batches")
        rtol, atol = arithmetic_tolerance(whole.dtype, whole.device.type)
        joined = torch.cat(parts).to(torch.float32)
        ref = whole.to(torch.float32)
        # of its finite values: a half precision's overflow (inf, and NaN after it) would make
        # the tolerance NaN, where those places need only match (``equal_nan``)
        finite = ref[torch.isfinite(ref)] if ref.is_floating_point() else ref
        scale = float(finite.abs().max()) if finite.numel() and ref.is_floating_point() else 1.0
        if not torch.allclose(joined, ref, rtol=rtol, atol=atol * max(scale, 1.0), equal_nan=True):
            diff = float((joined - ref).abs().max())
            raise BatchMixingError(
                f"{describe(n)} mixes the samples of a batch (its output on sub-batches differs from "
                f"the whole batch by {diff:.3g}); such a model cannot run layers at their own batch "
                "sizes: put the model in eval mode or remove the op")
