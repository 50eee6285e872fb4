"""Every unit of a captured model exported to ONNX, batch axis dynamic (torch's side).

Each unit is exported once (torch.onnx's TorchScript exporter); runs of them are composed by
``core.runtimes.onnx_compose``, which needs no torch. A unit or join that does not export is
recorded with the reason: it runs on torch.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from collections.abc import Iterator

import onnx
import torch

from core.model_shapes import JoinSpec, ModelShapes
from core.runtimes.onnx_compose import ELEM, OPSET, CannotCompose, UnitGraphs
from core.units import MODULE_GATE, Capture
from core.tree import Layer, Node, Series, iter_layers

__all__ = ["CannotCompose", "UnitGraphs", "export_units", "shapes_of"]

EXPORT_BATCH = 2  # traced at 2 samples: a batch of 1 lets the exporter fold size-1 dimensions


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The TorchScript exporter warns that it is deprecated and about traced shapes, and prints
    the graph of an op it cannot export on file descriptor 1 (where `vbs bench --json` writes
    its JSON): both are silenced, the failure itself is kept (``UnitGraphs.failed``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _export(module: torch.nn.Module, args: tuple[torch.Tensor, ...], inputs: list[str],
            output: str) -> onnx.ModelProto:
    buffer = io.BytesIO()
    axes = {name: {0: "N"} for name in (*inputs, output)}
    with _quiet():
        torch.onnx.export(module, args, buffer, dynamo=False, input_names=inputs,
                          output_names=[output], dynamic_axes=axes, opset_version=OPSET,
                          do_constant_folding=True)
    return onnx.load_from_string(buffer.getvalue())


def _why(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"the ONNX export failed ({type(exc).__name__}: {text[0][:200] if text else ''})"


def export_units(capture: Capture) -> UnitGraphs:
    """Export every unit and every op-join of ``capture`` (traced at EXPORT_BATCH samples,
    batch axis dynamic). Units whose dtype ONNX Runtime's CPU kernels lack are not exported."""
    dtype = capture.model.torch_dtype
    shapes = shapes_of(capture)
    units: dict[str, onnx.ModelProto] = {}
    joins: dict[str, onnx.ModelProto] = {}
    failed: dict[str, str] = {}
    if capture.model.spec.dtype not in ELEM:
        reason = f"{dtype} has no ONNX element type here"
        return UnitGraphs(shapes, {}, {}, {n.name: reason for n in iter_layers(capture.tree)})

    def run(node: Node, x: torch.Tensor) -> torch.Tensor:
        if isinstance(node, Layer):
            unit = capture.units[node.name]
            try:
                units[node.name] = _export(unit.module, (x,), ["x"], "y")
            except Exception as exc:  # any exporter failure: the unit runs on torch
                failed[node.name] = _why(exc)
            return unit.call(x)
        if isinstance(node, Series):
            for child in node.children:
                x = run(child, x)
            return x
        join = capture.joins[node.name]
        outs = [run(b, x) if b.children else x for b in node.branches]
        if join.kind == "cat":
            order = sorted(range(len(outs)), key=lambda i: join.slices[i][0])
            return torch.cat([outs[i] for i in order], join.dim)
        if join.kind == "add":
            return outs[0] + outs[1]
        y = next(o for o, b in zip(outs, node.branches) if b.children)
        if join.kind == "mul":
            return x * y if join.fork_first[0] else y * x
        assert join.apply is not None
        try:
            joins[node.name] = _export(join.apply, (x, y), ["fork", "y"], "z")
        except Exception as exc:
            failed[node.name] = _why(exc)
        return join.apply(x, y)

    # alone in the process: the exporter traces modules and sets process-wide state that
    # other threads' module calls would see (another model's batch, another export)
    with torch.no_grad(), MODULE_GATE.tracing():
        run(capture.tree, capture.model.example(EXPORT_BATCH, seed=7))
    return UnitGraphs(shapes, units, joins, failed)


def shapes_of(capture: Capture) -> ModelShapes:
    """What composing runs and laying out buffers read of ``capture`` (``core.model_shapes``)."""
    return ModelShapes(
        capture.model.spec.name, capture.model.spec.dtype, tuple(capture.input_shape),
        tuple(capture.output_shape), capture.tree,
        {name: tuple(u.out_shape) for name, u in capture.units.items()},
        {name: JoinSpec(j.kind, tuple(j.out_shape), j.dim, tuple(j.slices), tuple(j.fork_first))
         for name, j in capture.joins.items()})
