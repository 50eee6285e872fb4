"""The reference runner: the units of a capture in tree order, all at one batch size.

It is the plainest statement of what the units compute; it must reproduce ``model(x)``.
The executor (workers/) runs the same units and joins with a batch size per unit, and runs a
uniform program (every unit at the whole request) with this runner: it allocates and frees
what the executor's walk does for such a program, in the same order (a unit's output, then
its input dropped; a block's join while its fork is held), without the walk's bookkeeping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ContextManager

import torch

from core.units import Capture
from core.tree import Layer, Node, Series, fold_order


Around = Callable[[str], ContextManager[Any]]
# What runs one unit on all of x (``own``: nobody else reads x): ``run_unit`` by default, or a
# unit runtime's (core.runtimes), which the profiler times in the same passes.
UnitRunner = Callable[[Layer, torch.Tensor, bool], torch.Tensor]


def run_unit(capture: Capture, unit: Layer, x: torch.Tensor, *, in_place: bool = False
             ) -> torch.Tensor:
    """One unit on ``x``, its output in a buffer of its own; with ``in_place`` (an ``inplace``
    unit on a buffer nobody else reads: see ``core.walk``), in ``x`` itself.

    A unit whose output is a view of its input (ShuffleNet's channel split; an in-place op on
    the input computes a new tensor since capture, see ``write_new_tensors``) gets it copied:
    the executor's walk counts a new output buffer and frees the input's chunk once its
    samples are taken, but a view would pin that whole chunk for as long as the output lives,
    above the table's claim."""
    ran = capture.units[unit.name]
    if in_place and ran.in_place is not None:
        return ran.in_place(x)
    y = ran.call(x)
    if y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        y = y.clone(memory_format=torch.contiguous_format)
    return y


def run_node(capture: Capture, node: Node, x: torch.Tensor, around: Around | None = None,
             own: bool = False, runner: UnitRunner | None = None) -> torch.Tensor:
    """Run one node of the tree on all the samples of ``x`` at once (``own``: nobody else
    reads ``x``, so an ``inplace`` unit writes into it, as the executor's walk does).

    ``around(name)``, when given, wraps every unit run (named after the unit) and every fold
    into a join (named after the block): the profiler times and measures them in place, in
    a real pass through the network, so each unit sees what it sees when the model runs.
    ``runner`` runs the units (default: ``run_unit``).
    """
    if isinstance(node, Layer):
        if around is None:
            return run_unit(capture, node, x, in_place=own) if runner is None else runner(node, x, own)
        with around(node.name):
            return run_unit(capture, node, x, in_place=own) if runner is None else runner(node, x, own)
    if isinstance(node, Series):
        for i, child in enumerate(node.children):
            # a series' input is its caller's (the request, a fork its siblings read); what a
            # child gets from the one before it is this series' own, to write into in place
            x = run_node(capture, child, x, around, own=i > 0, runner=runner)
        return x
    join = capture.joins[node.name]
    out = join.empty(x, x.shape[0])
    for k, i in enumerate(fold_order(node)):
        branch = node.branches[i]
        y = run_node(capture, branch, x, around, runner=runner) if branch.children else None
        with (around(node.name) if around is not None else contextlib.nullcontext()):
            out = join.fold(out, x, y, i, first=(k == 0))
        del y
    return out


def run_nodes(capture: Capture, nodes: tuple[Node, ...], x: torch.Tensor, own: bool = False
              ) -> torch.Tensor:
    """Consecutive children of one series on all of ``x``, each one's output the next one's
    to write into (``own``: the first may write into ``x`` too): a run, as one runtime call
    computes it (eager torch's call, a CUDA graph's capture)."""
    for i, node in enumerate(nodes):
        x = run_node(capture, node, x, own=own or i > 0)
    return x


def run_reference(capture: Capture, x: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """``model(x)`` through the units, ``batch`` samples at a time (default: all at once)."""
    batch = batch or x.shape[0]
    with torch.inference_mode():
        return torch.cat([run_node(capture, capture.tree, chunk) for chunk in x.split(batch)])
