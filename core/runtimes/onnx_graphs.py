"""Units as ONNX graphs with a dynamic batch axis, and runs of them joined into one graph.

ONNX Runtime pays for every call (binding, moving activations into its blocked layout and
back) and fuses only the ops it sees together, so units that run one after another at the
same batch size should run as one graph. Each unit is exported once (torch.onnx's
TorchScript exporter, batch axis dynamic); a run of a series' children is composed from
those graphs, every name prefixed by its unit, a block's join as Concat, Add or Mul (or the
join's own op, exported too). Composing any run takes milliseconds, not an export.

A unit or join that does not export is recorded with the reason: it runs on torch.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import onnx
import torch
from onnx import TensorProto, helper

from core.units import MODULE_GATE, Capture
from core.tree import Layer, Node, Parallel, Series, iter_layers

OPSET = 17
EXPORT_BATCH = 2  # traced at 2 samples: a batch of 1 lets the exporter fold size-1 dimensions
_ELEM = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
         torch.bfloat16: TensorProto.BFLOAT16}


class CannotCompose(Exception):
    """A run holds a unit or join that has no ONNX graph (the reason is the message)."""


@dataclass(frozen=True)
class UnitGraphs:
    """The ONNX graph of every unit (input ``x``, output ``y``) and of every join that is
    an op of its own (inputs ``fork`` and ``y``, output ``z``); what failed, and why."""

    capture: Capture
    units: dict[str, onnx.ModelProto]
    joins: dict[str, onnx.ModelProto]
    failed: dict[str, str] = field(default_factory=dict)  # unit or block name -> why

    def reason(self, node: Node) -> str:
        """Why ``node`` (a unit, or a block with everything in it) cannot run here; '' if it can."""
        if isinstance(node, Layer):
            return self.failed.get(node.name, "")
        if isinstance(node, Series):
            return next((r for r in map(self.reason, node.children) if r), "")
        if node.name in self.failed:
            return self.failed[node.name]
        return next((r for r in map(self.reason, node.branches) if r), "")

    def input_shape(self, unit: str) -> tuple[int, ...]:
        """Per-sample input shape of an exported unit."""
        dims = self.units[unit].graph.input[0].type.tensor_type.shape.dim
        return tuple(d.dim_value for d in dims[1:])

    def compose(self, nodes: Sequence[Node]) -> onnx.ModelProto:
        """One graph running ``nodes`` (consecutive children of one series) on input ``x``,
        output ``y``, batch axis ``N``; CannotCompose names what has no graph."""
        if not nodes:
            raise CannotCompose("an empty run")
        for node in nodes:
            why = self.reason(node)
            if why:
                raise CannotCompose(f"{node.name}: {why}")
        graph = _Composer(self)
        out = "x"
        for node in nodes:
            out = graph.node(node, out)
        return graph.model(nodes, out)


def _value(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, _ELEM[dtype], ["N", *shape])


class _Composer:
    """Builds one graph from unit graphs: every value and node renamed ``<unit>/<name>``."""

    def __init__(self, graphs: UnitGraphs) -> None:
        self.graphs = graphs
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def _splice(self, proto: onnx.ModelProto, prefix: str, inputs: dict[str, str],
                output: str) -> str:
        """Copy ``proto``'s nodes and initializers, its inputs bound to ``inputs`` (graph input
        name -> value here), its output ``output`` renamed; returns that output's new name."""
        names = dict(inputs)

        def rename(value: str) -> str:
            if not value:  # an omitted optional input
                return value
            found = names.get(value)
            if found is None:
                found = names[value] = f"{prefix}/{value}"
            return found

        for init in proto.graph.initializer:
            copy = onnx.TensorProto()
            copy.CopyFrom(init)
            copy.name = rename(init.name)
            self.initializers.append(copy)
        for n in proto.graph.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(n)
            copy.name = f"{prefix}/{n.name or n.op_type}"
            del copy.input[:]
            copy.input.extend(rename(v) for v in n.input)
            del copy.output[:]
            copy.output.extend(rename(v) for v in n.output)
            self.nodes.append(copy)
        return rename(output)

    def node(self, node: Node, x: str) -> str:
        """Add ``node`` reading value ``x``; returns the value it computes."""
        if isinstance(node, Layer):
            return self._splice(self.graphs.units[node.name], node.name, {"x": x}, "y")
        if isinstance(node, Series):
            for child in node.children:
                x = self.node(child, x)
            return x
        join = self.graphs.capture.joins[node.name]
        outs = [self.node(b, x) if b.children else x for b in node.branches]
        z = f"{node.name}/join"
        if join.kind == "cat":
            order = sorted(range(len(outs)), key=lambda i: join.slices[i][0])
            self.nodes.append(helper.make_node("Concat", [outs[i] for i in order], [z],
                                               name=f"{node.name}/Concat", axis=join.dim))
        elif join.kind == "add":
            self.nodes.append(helper.make_node("Add", outs, [z], name=f"{node.name}/Add"))
        else:
            y = next(o for o, b in zip(outs, node.branches) if b.children)
            if join.kind == "mul":
                pair = [x, y] if join.fork_first[0] else [y, x]
                self.nodes.append(helper.make_node("Mul", pair, [z], name=f"{node.name}/Mul"))
            else:
                z = self._splice(self.graphs.joins[node.name], node.name, {"fork": x, "y": y}, "z")
        return z

    def model(self, nodes: Sequence[Node], out: str) -> onnx.ModelProto:
        cap = self.graphs.capture
        dtype = cap.model.torch_dtype
        first, last = next(iter_layers(nodes[0])), nodes[-1]
        x_shape = self.graphs.input_shape(first.name)
        y_shape = (cap.joins[last.name].out_shape if isinstance(last, Parallel)
                   else cap.units[last.name].out_shape)
        for n in self.nodes:  # the run's result is the graph's output "y"
            n.output[:] = ["y" if v == out else v for v in n.output]
            n.input[:] = ["y" if v == out else v for v in n.input]
        graph = helper.make_graph(self.nodes, "run", [_value("x", dtype, x_shape)],
                                  [_value("y", dtype, tuple(y_shape))],
                                  initializer=self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="vbs-serve")
        model.ir_version = self.graphs.units[first.name].ir_version
        return model


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
    units: dict[str, onnx.ModelProto] = {}
    joins: dict[str, onnx.ModelProto] = {}
    failed: dict[str, str] = {}
    if dtype not in _ELEM:
        reason = f"{dtype} has no ONNX element type here"
        return UnitGraphs(capture, {}, {}, {n.name: reason for n in iter_layers(capture.tree)})

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
    return UnitGraphs(capture, units, joins, failed)
