"""The reference runner: the units of a capture in tree order, all at one batch size.

It is the plainest statement of what the units compute; it must reproduce ``model(x)``.
The executor (workers/) runs the same units and joins with a batch size per unit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from planner.graph.capture import Capture
from planner.tree import Layer, Node, Parallel, Series


class Recording(NamedTuple):
    """What a reference pass saw: every unit's input, every join's fork and branch outputs."""

    inputs: dict[str, torch.Tensor]
    folds: dict[str, tuple[torch.Tensor, list[torch.Tensor | None]]]


def run_node(capture: Capture, node: Node, x: torch.Tensor,
             record: Recording | None = None) -> torch.Tensor:
    """Run one node of the tree on all the samples of ``x`` at once."""
    if isinstance(node, Layer):
        if record is not None:
            # Units may work in place on their input: keep a copy of what they were given.
            record.inputs[node.name] = x.clone()
        return capture.units[node.name].module(x)
    if isinstance(node, Series):
        for child in node.children:
            x = run_node(capture, child, x, record)
        return x
    join = capture.joins[node.name]
    fork = x.clone() if record is not None else x
    out = join.empty(x, x.shape[0])
    outputs: list[torch.Tensor | None] = []
    for i, branch in enumerate(node.branches):
        y = run_node(capture, branch, x, record) if branch.children else None
        outputs.append(y)
        join.fold(out, x, y, i, first=(i == 0))
    if record is not None:
        record.folds[node.name] = (fork, outputs)
    return out


def record_pass(capture: Capture, x: torch.Tensor) -> Recording:
    """One reference pass that keeps the real input of every unit and join, for profiling."""
    record = Recording({}, {})
    with torch.inference_mode():
        run_node(capture, capture.tree, x, record)
    return record


def run_reference(capture: Capture, x: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """``model(x)`` through the units, ``batch`` samples at a time (default: all at once)."""
    batch = batch or x.shape[0]
    with torch.inference_mode():
        return torch.cat([run_node(capture, capture.tree, chunk) for chunk in x.split(batch)])
