"""Runs of units joined into one ONNX graph, from the units' own graphs (no torch).

ONNX Runtime pays for every call (binding, moving activations into its blocked layout and
back) and fuses only the ops it sees together, so units that run one after another at the
same batch size should run as one graph. A run of a series' children is composed from the
units' graphs (``core.runtimes.onnx_graphs`` exports them, batch axis dynamic), every name
prefixed by its unit, a block's join as Concat, Add or Mul (or the join's own op, exported
too). Composing any run takes milliseconds, not an export; it reads only the model's shapes
(``core.model_shapes``), so a worker that runs stored graphs needs no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from core.model_shapes import ModelShapes
from core.tree import Layer, Node, Parallel, Series, iter_layers
from core.weights_file import WeightsFile, is_moved, tensor_bytes

OPSET = 17
ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
        "bfloat16": TensorProto.BFLOAT16}


class CannotCompose(Exception):
    """A run holds a unit or join that has no ONNX graph (the reason is the message)."""


@dataclass(frozen=True)
class Composed:
    """A run's graph whose large weights are shells (name, type and shape, no bytes), and
    the unit graphs' tensors that hold their bytes: what a session's making reads one tensor
    at a time (``core.runtimes.ort_weights``) instead of a copy of every weight made first."""

    model: onnx.ModelProto
    sources: dict[str, Callable[[], bytes]]  # a shell's name -> its bytes, read when called

    @property
    def weight_bytes(self) -> int:
        """Bytes of the run's weights, the shells' included."""
        return sum(tensor_bytes(t) for t in self.model.graph.initializer)


@dataclass(frozen=True)
class UnitGraphs:
    """The ONNX graph of every unit (input ``x``, output ``y``) and of every join that is
    an op of its own (inputs ``fork`` and ``y``, output ``z``); what failed, and why."""

    shapes: ModelShapes
    units: dict[str, onnx.ModelProto]
    joins: dict[str, onnx.ModelProto]
    failed: dict[str, str] = field(default_factory=dict)  # unit or block name -> why
    # where the graphs' large weights are, where they are not in the graphs (``moved``)
    weights: WeightsFile | None = field(default=None, compare=False)

    def raw(self, tensor: onnx.TensorProto) -> bytes:
        """A weight's bytes, wherever they are."""
        if is_moved(tensor):
            if self.weights is None:
                raise CannotCompose(f"{tensor.name}: its bytes are in a weights file this "
                                    "model does not have")
            return self.weights.tensor_raw(tensor)
        return tensor.raw_data

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
        return self._composer(nodes, refer_from=None).model(nodes)

    def compose_referring(self, nodes: Sequence[Node], min_bytes: int) -> Composed:
        """``compose``, each weight of ``min_bytes`` or more left where it is (in its unit's
        graph, or the weights file): the run's graph names it as a shell, ``sources`` reads
        its bytes when called (nothing is copied here)."""
        composer = self._composer(nodes, refer_from=min_bytes)
        return Composed(composer.model(nodes), composer.sources)

    def _composer(self, nodes: Sequence[Node], refer_from: int | None) -> _Composer:
        if not nodes:
            raise CannotCompose("an empty run")
        for node in nodes:
            why = self.reason(node)
            if why:
                raise CannotCompose(f"{node.name}: {why}")
        graph = _Composer(self, refer_from)
        for node in nodes:
            graph.out = graph.node(node, graph.out)
        return graph


def _value(name: str, dtype: str, shape: tuple[int, ...]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, ELEM[dtype], ["N", *shape])


class _Composer:
    """Builds one graph from unit graphs: every value and node renamed ``<unit>/<name>``."""

    def __init__(self, graphs: UnitGraphs, refer_from: int | None) -> None:
        self.graphs = graphs
        self.refer_from = refer_from  # weights of this many bytes or more as shells (None: none)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.sources: dict[str, Callable[[], bytes]] = {}
        self.out = "x"  # the value the nodes added so far compute

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
            moved = is_moved(init)
            if self.refer_from is not None and (moved or init.HasField("raw_data")) \
                    and tensor_bytes(init) >= self.refer_from:
                copy.name, copy.data_type = rename(init.name), init.data_type
                copy.dims.extend(init.dims)
                self.sources[copy.name] = functools.partial(self.graphs.raw, init)
            elif moved:  # its bytes read back into the graph
                copy.name, copy.data_type = rename(init.name), init.data_type
                copy.dims.extend(init.dims)
                copy.raw_data = self.graphs.raw(init)
            else:
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
        join = self.graphs.shapes.joins[node.name]
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

    def model(self, nodes: Sequence[Node]) -> onnx.ModelProto:
        out = self.out
        shapes = self.graphs.shapes
        dtype = shapes.dtype
        first, last = next(iter_layers(nodes[0])), nodes[-1]
        x_shape = self.graphs.input_shape(first.name)
        y_shape = shapes.output_of(last)
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
