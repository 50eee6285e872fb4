"""Runs: consecutive steps of a program that one runtime call executes, and what plans cost.

ONNX Runtime runs a run of units as one session: the children of one series from a first to
a last, all at the same batch size c, each taking exactly what the one before it made (no
samples waiting between them), a block inside whole (its phase of c samples, every branch's
units once at c, its join in the graph). Which steps form runs depends on what waits at each
boundary, so the executor's walk finds them (``planner.solver.layout``) and the table stores
them; this module holds the rules the walk applies:

- ``whole_end``: where the steps of a node run whole at c end;
- ``run_internal``: the bytes a run holds inside the runtime (the activations between its
  units and the largest workspace): its input is the walk's take, its output the walk's own
  buffer, so neither is counted here. Built from the units' own workspaces, which already
  hold the runtime's copies of their input and output, it errs high; the runs the profiler
  measured whole (``measured_runs``) are counted as measured;
- ``program_time``: a program's seconds with its runtimes and runs. A unit on ONNX Runtime
  costs its time inside a run, a block run whole its join's time inside it, and every call
  its ``CallCost`` (fixed, and by the bytes it takes and gives), as the profiler measured
  and fitted them (``planner.profiling.ort``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner import runtimes as rt
from planner.solver.memory import allocation
from planner.solver.program import Step
from planner.tree import Layer, Node, Parallel, Profile, Series, fold_order


@dataclass(frozen=True)
class CallCost:
    """What one call of a runtime costs beyond its units' time inside it, per batch size b:
    ``call_s[b-1] + byte_s[b-1] * (bytes into the call + bytes out of it)``."""

    call_s: tuple[float, ...]
    byte_s: tuple[float, ...]

    def of(self, samples: int, in_bytes: int, out_bytes: int) -> float:
        return self.call_s[samples - 1] + self.byte_s[samples - 1] * (in_bytes + out_bytes) * samples


RunMemory = dict[tuple[str, str], tuple[int, ...]]  # (first, last) -> bytes held inside, per b


def measured_runs(profile: Profile, runtime: str) -> RunMemory:
    """What the profiler measured runs of ``runtime`` to hold inside (its longest runs), by
    their first and last node: where a plan runs one of those, that is what it holds."""
    info = (profile.meta.get("runtimes") or {}).get(runtime) or {}
    return {(str(run["first"]), str(run["last"])): tuple(int(v) for v in run["ws"])
            for run in info.get("runs", ()) if run.get("ws")}


def call_cost(profile: Profile, runtime: str) -> CallCost | None:
    """A runtime's cost of a call, from a profile's meta (None when it has none)."""
    info = (profile.meta.get("runtimes") or {}).get(runtime) or {}
    call, per_byte = info.get("call_s"), info.get("byte_s")
    if not call or not per_byte:
        return None
    return CallCost(tuple(float(v) for v in call), tuple(float(v) for v in per_byte))


def step_runtime(node: Node, step: Step) -> str:
    """The runtime a step runs on: the one it names, else the unit's default at its batch
    size, else torch. A block's step names the runtime of its join (torch: folds)."""
    if step.runtime:
        return step.runtime
    if isinstance(node, Layer):
        return node.runtime_at(step.samples) or rt.TORCH
    return rt.TORCH


def supports(node: Node, runtime: str) -> bool:
    """Whether ``runtime`` can run ``node`` (a unit, or a block whole)."""
    if runtime == rt.TORCH:
        return True
    if any(name == runtime for name, _ in node.unsupported):  # type: ignore[union-attr]
        return False
    if isinstance(node, Layer):
        return node.measured(runtime) is not None
    return all(supports(c, runtime) for b in node.branches  # type: ignore[union-attr]
               for c in b.children)


def whole_end(nodes: dict[str, Node], steps: Sequence[Step], k: int, runtime: str) -> int:
    """The index after the steps that run step k's node whole at its batch size on
    ``runtime`` (a unit: k + 1; a block: its phase, then every branch unit once at that size,
    in fold order), or -1 when they do not."""
    step = steps[k]
    node = nodes[step.unit]
    if isinstance(node, Layer):
        return k + 1 if step_runtime(node, step) == runtime else -1
    if not isinstance(node, Parallel) or not supports(node, runtime):
        return -1
    pos = k + 1
    for i in fold_order(node):
        for child in node.branches[i].children:
            if pos >= len(steps) or steps[pos].unit != child.name or \
                    steps[pos].samples != step.samples:
                return -1
            pos = whole_end(nodes, steps, pos, runtime)
            if pos < 0:
                return -1
    return pos


def figures(layer: Layer, runtime: str, c: int) -> tuple[float, int]:
    """(seconds, workspace bytes) of a unit on ``runtime`` at c samples: the unit's own
    ``time``/``ws`` when they are that runtime's (its default at c, or a profile that names
    none), else that runtime's measurements."""
    measured = layer.measured(runtime)
    if measured is None or layer.runtime_at(c) in ("", runtime):
        return layer.time[c - 1], layer.ws[c - 1]
    return measured.time[c - 1], measured.ws[c - 1] if measured.ws else layer.ws[c - 1]


def _unit_ws(layer: Layer, runtime: str, c: int) -> int:
    return figures(layer, runtime, c)[1]


def run_internal(nodes: Sequence[Node], c: int, runtime: str, granule: int = 1,
                 *, count_output: bool = False) -> int:
    """The most a run of ``nodes`` at c samples holds inside ``runtime`` at once: at every
    unit, its input and output when they are the run's own (not its first input; not its
    last output unless ``count_output``) and its workspace; in a block, the fork and the
    outputs of the branches done so far, all of them at the join."""
    top = 0
    last = len(nodes) - 1
    for i, node in enumerate(nodes):
        held_in = allocation(node.in_bytes * c, granule) if i > 0 else 0  # type: ignore[union-attr]
        held_out = (allocation(node.out_bytes * c, granule)  # type: ignore[union-attr]
                    if i < last or count_output else 0)
        if isinstance(node, Layer):
            inner = _unit_ws(node, runtime, c)
        elif isinstance(node, Parallel):
            inner = done = 0
            for b in fold_order(node):
                branch = node.branches[b]
                if branch.children:
                    inner = max(inner, done + run_internal(branch.children, c, runtime, granule,
                                                           count_output=True))
                    done += allocation(branch.out_bytes * c, granule)
            inner = max(inner, done)  # every branch output, read by the join op
        else:
            inner = run_internal(node.children, c, runtime, granule, count_output=True)
            held_out = 0
        top = max(top, held_in + held_out + inner)
    return top


def program_time(tree: TreeIndex, steps: Sequence[Step], runs: Sequence[tuple[int, int]],
                 calls: dict[str, CallCost]) -> float:
    """Seconds of a program with its steps' runtimes and its runs (see the module's doc)."""
    in_run = {k for start, end in runs for k in range(start, end + 1)}
    parts = []
    for k, step in enumerate(steps):
        node = tree.nodes[step.unit]
        runtime = step_runtime(node, step)
        c = step.samples
        if isinstance(node, Layer):
            parts.append(figures(node, runtime, c)[0])
            cost = calls.get(runtime)
            if cost is not None and k not in in_run:  # a call of its own
                parts.append(cost.of(c, node.in_bytes, node.out_bytes))
        else:
            assert isinstance(node, Parallel)
            measured = node.measured(runtime) if k in in_run else None
            if measured is not None:
                parts.append(measured.time[c - 1])
            else:
                parts.append(node.time[c - 1] if node.time else 0.0)
    for start, end in runs:
        nodes = tree.run_nodes(steps, start, end)
        cost = calls.get(step_runtime(nodes[0], steps[start]))
        if cost is not None:
            parts.append(cost.of(steps[start].samples, nodes[0].in_bytes,  # type: ignore[union-attr]
                                 nodes[-1].out_bytes))  # type: ignore[union-attr]
    return math.fsum(parts)


class TreeIndex:
    """Where every named unit and block of a tree sits: its series and position there."""

    def __init__(self, root: Series) -> None:
        self.where: dict[str, tuple[Series, int]] = {}
        self.nodes: dict[str, Node] = {}
        self._add(root)

    def _add(self, series: Series) -> None:
        for i, child in enumerate(series.children):
            self.where[child.name] = (series, i)
            self.nodes[child.name] = child
            if isinstance(child, Parallel):
                for branch in child.branches:
                    self._add(branch)

    def run_nodes(self, steps: Sequence[Step], start: int, end: int) -> tuple[Node, ...]:
        """The children of one series that the run of steps ``start..end`` runs."""
        series, first = self.where[steps[start].unit]
        last = first
        for step in steps[start + 1:end + 1]:
            where = self.where.get(step.unit)
            if where is not None and where[0] is series:
                last = where[1]
        return series.children[first:last + 1]
