"""Runs: consecutive steps of a program that one runtime call executes, and what they hold.

ONNX Runtime runs a run of units as one session: the children of one series from a first to
a last, all at the same batch size c, each taking exactly what the one before it made (no
samples waiting between them), a block inside whole (its phase of c samples, every branch's
units once at c, its join in the graph). Where a plan cuts its runs is the DP's choice (a
cut costs a call: ``planner.solver.pricing``), so every plan carries its runs and the walk
(``core.walk``) follows them; this module holds what a run is and holds:

- ``unit_figures``: a unit's (seconds, workspace bytes) on a runtime at c samples;
- ``held_inside_bound``: the bytes a run holds inside the runtime (the activations between
  its units and the largest workspace): its input is the walk's take, its output the walk's
  own buffer, so neither is counted here. Built from the units' own workspaces, which already
  hold the runtime's copies of their input and output, it errs high;
- ``held_inside``: what a run holds inside the runtime: as measured for the runs the
  profiler measured whole (``measured_runs``), else ``held_inside_bound``;
- ``run_peak``: the most a run needs while it runs, the one figure the DP, the simulator and
  the walk use for it.

What runs cost is ``planner.solver.pricing``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from core import runtimes as rt
from core.lru import OwnedLRU
from core.sizes import allocation
from core.program import Step
from core.tree import Layer, Node, Parallel, Profile, Series, fold_order


@dataclass(frozen=True)
class CallCost:
    """What one call of a runtime costs beyond its units' time inside it, per batch size b:
    ``call_s[b-1] + byte_s[b-1] * (bytes into the call + bytes out of it)``. Where the call
    runs on a device the host only feeds (a CUDA graph's replay), ``host_s[b-1]`` is what the
    host spends issuing it: one stream then takes the longer of the two, the host's issue
    and the device's work (``total``)."""

    call_s: tuple[float, ...]
    byte_s: tuple[float, ...]
    host_s: tuple[float, ...] = ()

    def of(self, samples: int, in_bytes: int, out_bytes: int) -> float:
        return self.call_s[samples - 1] + self.byte_s[samples - 1] * (in_bytes + out_bytes) * samples

    def total(self, samples: int, in_bytes: int, out_bytes: int, inside: Sequence[float]
              ) -> float:
        """A call with its units' work ``inside``: the call and the work, or the host's
        issue where that is longer."""
        device = math.fsum([self.of(samples, in_bytes, out_bytes), *inside])
        return max(device, self.host_s[samples - 1]) if self.host_s else device


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
    return CallCost(tuple(float(v) for v in call), tuple(float(v) for v in per_byte),
                    tuple(float(v) for v in info.get("host_s") or ()))


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


def run_runtime(first: Node, step: Step) -> str:
    """The runtime a run calls: its first step's (a run that starts with a block: the one its
    step names, else ONNX Runtime, which ran such runs before steps named theirs)."""
    if isinstance(first, Layer):
        return step_runtime(first, step)
    return step.runtime or rt.ONNXRUNTIME


def unit_figures(layer: Layer, runtime: str, c: int) -> tuple[float, int]:
    """(seconds, workspace bytes) of a unit on ``runtime`` at c samples: the unit's own
    ``time``/``ws`` when they are that runtime's (its default at c, or a profile that names
    none), else that runtime's measurements."""
    measured = layer.measured(runtime)
    if measured is None or layer.runtime_at(c) in ("", runtime):
        return layer.time[c - 1], layer.ws[c - 1]
    return measured.time[c - 1], measured.ws[c - 1] if measured.ws else layer.ws[c - 1]


def _unit_ws(layer: Layer, runtime: str, c: int) -> int:
    return unit_figures(layer, runtime, c)[1]


def held_inside_bound(nodes: Sequence[Node], c: int, runtime: str, granule: int = 1,
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
                    inner = max(inner, done + held_inside_bound(
                        branch.children, c, runtime, granule, count_output=True))
                    done += allocation(branch.out_bytes * c, granule)
            inner = max(inner, done)  # every branch output, read by the join op
        else:
            inner = held_inside_bound(node.children, c, runtime, granule, count_output=True)
            held_out = 0
        top = max(top, held_in + held_out + inner)
    return top


def held_inside(nodes: Sequence[Node], c: int, runtime: str, granule: int = 1,
                measured: RunMemory | None = None) -> int:
    """What a run of ``nodes`` at c samples holds inside ``runtime``: as the profiler measured
    it where it measured that run whole, else ``held_inside_bound``."""
    whole = (measured or {}).get((nodes[0].name, nodes[-1].name))
    return whole[c - 1] if whole else held_inside_bound(nodes, c, runtime, granule)


def run_peak(nodes: Sequence[Node], c: int, runtime: str, in_bytes: int, granule: int = 1,
             measured: RunMemory | None = None) -> int:
    """The most a run of ``nodes`` at c samples needs while it runs: ``in_bytes`` (its input as
    its chain counts it), what it holds inside, and its output (the walk allocates it before
    the call)."""
    return (in_bytes + held_inside(nodes, c, runtime, granule, measured)
            + allocation(nodes[-1].out_bytes * c, granule))  # type: ignore[union-attr]


class TreeIndex:
    """Where every named unit and block of a tree sits: its series and position there."""

    _made: OwnedLRU["TreeIndex"] = OwnedLRU(64)  # by the root's identity (trees are frozen)

    @classmethod
    def of(cls, root: Series) -> "TreeIndex":
        """The index of ``root``, made once (the walk asks for it on every plan it lays out)."""
        return cls._made.get_or_make(root, None, lambda: cls(root))

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
            elif isinstance(child, Series):
                self._add(child)

    def span(self, first: str, last: str) -> tuple[Node, ...] | None:
        """The children of one series from ``first`` to ``last``, or None when they are not
        siblings in that order."""
        series, start = self.where[first]
        other, stop = self.where[last]
        return series.children[start:stop + 1] if other is series and stop >= start else None

    def run_nodes(self, steps: Sequence[Step], start: int, end: int) -> tuple[Node, ...]:
        """The children of one series that the run of steps ``start..end`` runs."""
        series, first = self.where[steps[start].unit]
        last = first
        for step in steps[start + 1:end + 1]:
            where = self.where.get(step.unit)
            if where is not None and where[0] is series:
                last = where[1]
        return series.children[first:last + 1]


def plan_shape(steps: Sequence[Step], runs: Sequence[tuple[int, int]], limit: int = 8) -> str:
    """A plan in a line, by what each call and step runs: ``first..last: batches`` for each
    stretch of calls over the same units (its first and last step's; ``1x2 2x7``: two calls on
    one sample, seven on two), a step of the executor's own as ``unit: batches``; at most
    ``limit`` stretches."""
    parts: list[tuple[str, list[int]]] = []
    starts = dict(runs)
    k = 0
    while k < len(steps):
        end = starts.get(k, k)
        first, last = steps[k].unit, steps[end].unit
        label = first if first == last else f"{first}..{last}"
        if parts and parts[-1][0] == label:
            parts[-1][1].append(steps[k].samples)
        else:
            parts.append((label, [steps[k].samples]))
        k = end + 1
    text = []
    for label, sizes in parts[:limit]:
        counts: list[tuple[int, int]] = []
        for c in sizes:
            if counts and counts[-1][0] == c:
                counts[-1] = (c, counts[-1][1] + 1)
            else:
                counts.append((c, 1))
        text.append(f"{label}: " + " ".join(f"{c}x{n}" if n > 1 else str(c) for c, n in counts))
    more = f" | ... ({len(parts) - limit} more)" if len(parts) > limit else ""
    return " | ".join(text) + more
