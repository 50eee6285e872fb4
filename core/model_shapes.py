"""What a model's runs and buffers need to know of it, as plain data: no torch, no weights.

Composing a run's ONNX graph and laying out the buffers between runs read only the tree, each
unit's and join's per-sample output shape, how each join folds, and the dtype. ``Capture``
gives them from a torch model (``core.runtimes.onnx_graphs.shapes_of``), a compiled model
(``core.compiled``) from the store, so a worker that runs ONNX Runtime alone needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.tree import Parallel, Series, node_from_json, node_to_json


@dataclass(frozen=True)
class JoinSpec:
    """How a parallel block folds its branches (``core.units.Join`` without its torch parts)."""

    kind: str                                  # cat | add | mul | another op (exported)
    out_shape: tuple[int, ...]
    dim: int = 1                               # cat: the dimension of the slices
    slices: tuple[tuple[int, int], ...] = ()   # cat: (start, length) of each branch
    fork_first: tuple[bool, ...] = ()          # mul: whether the fork is the first operand


@dataclass(frozen=True)
class ModelShapes:
    """A model's name, dtype, tree, and every unit's and join's per-sample output shape."""

    name: str
    dtype: str                                 # float32 | float16 | bfloat16
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    tree: Series
    unit_out: dict[str, tuple[int, ...]]
    joins: dict[str, JoinSpec]

    def out_shape(self, node_name: str, block: bool) -> tuple[int, ...]:
        """Per-sample output shape of a unit, or of a block's join."""
        return self.joins[node_name].out_shape if block else self.unit_out[node_name]

    def output_of(self, node: Any) -> tuple[int, ...]:
        """Per-sample output shape of a tree node (a unit or a block)."""
        return self.out_shape(node.name, isinstance(node, Parallel))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "input_shape": list(self.input_shape),
                "output_shape": list(self.output_shape),
                "tree": node_to_json(self.tree, measured=False),
                "unit_out": {k: list(v) for k, v in self.unit_out.items()},
                "joins": {k: {"kind": j.kind, "out_shape": list(j.out_shape), "dim": j.dim,
                              "slices": [list(s) for s in j.slices],
                              "fork_first": list(j.fork_first)} for k, j in self.joins.items()}}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "ModelShapes":
        tree = node_from_json(raw["tree"])
        if not isinstance(tree, Series):
            raise ValueError("a model's tree is a series at its root")
        return cls(str(raw["name"]), str(raw["dtype"]), tuple(raw["input_shape"]),
                   tuple(raw["output_shape"]), tree,
                   {k: tuple(v) for k, v in raw["unit_out"].items()},
                   {k: JoinSpec(j["kind"], tuple(j["out_shape"]), int(j["dim"]),
                                tuple((int(a), int(b)) for a, b in j["slices"]),
                                tuple(bool(f) for f in j["fork_first"]))
                    for k, j in raw["joins"].items()})
