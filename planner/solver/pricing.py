"""What a plan costs when it runs: the one model of time (and of any additive objective).

The DP, the simulator, the baselines, the table, `vbs solve`, `vbs show`, /plan and the page
all price a plan here, so one plan has one predicted time everywhere, and it is what the
executor pays (docs/architecture.md, "One model of time"):

- a step the executor runs itself (torch): its unit's time at that batch size; a block's
  phase outside any run costs its folds (torch's);
- a run (steps one runtime call executes, ``core.runs``): every unit's time
  inside the run and every whole block's join, plus one call of that runtime
  (``CallCost``: fixed, and by the bytes it takes and gives, which is what cutting a fused
  run costs: the runtime's layout is left and re-entered at the cut, or a CUDA graph's
  static buffers are copied in and out); where the host's issue of the call is measured
  apart (a CUDA graph's replay), the run costs the longer of that and the device's work:
  one stream waits for whichever is slower;
- a step on such a runtime outside any run is a run of one.

A profile that names no runtime costs (a hand-written chain, the paper's example) pays no
calls: its plans cost the sum of their steps, as in the paper. The energy objective sums the
units' energies (their counters measure calls too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from core import runtimes as rt
from core.program import Step
from core.runs import CallCost, TreeIndex, run_runtime, step_runtime, unit_figures
from core.tree import Layer, Node, Parallel, fold_order


@dataclass(frozen=True)
class Pricing:
    """Prices steps, runs and programs of one profile's tree for one objective."""

    tree: TreeIndex
    calls: Mapping[str, CallCost]
    objective: str = "time"
    _inside: dict[tuple[str, str, int], float] = field(default_factory=dict, compare=False,
                                                       repr=False)

    def call(self, runtime: str, c: int, in_bytes: int, out_bytes: int,
             inside: Sequence[float] = ()) -> float:
        """One call of ``runtime`` on c samples with its units' costs ``inside``: their sum,
        plus the call where that runtime's is measured (``CallCost.total``: the host's issue
        where that is longer)."""
        cost = self.calls.get(runtime) if self.objective == "time" else None
        if cost is None:
            return math.fsum(inside)
        return cost.total(c, in_bytes, out_bytes, inside)

    def inside(self, node: Node, runtime: str, c: int) -> float:
        """A unit's cost at c samples on ``runtime`` without a call; a block's: its join's
        (inside a run of that runtime, else torch's folds)."""
        key = (node.name, runtime, c)
        found = self._inside.get(key)
        if found is None:
            found = self._inside[key] = self._inside_of(node, runtime, c)
        return found

    def _inside_of(self, node: Node, runtime: str, c: int) -> float:
        if self.objective != "time":
            values = node.energy  # type: ignore[union-attr]
            return float(values[c - 1]) if values else 0.0
        if isinstance(node, Layer):
            return unit_figures(node, runtime, c)[0]
        assert isinstance(node, Parallel)
        measured = node.measured(runtime) if runtime != rt.TORCH else None
        if measured is not None:
            return measured.time[c - 1]
        return node.time[c - 1] if node.time else 0.0

    def step(self, node: Node, runtime: str, c: int) -> float:
        """A step outside any run: a unit on ``runtime`` (a call of its own where that runtime
        has one), or a block's phase (the executor's folds)."""
        if isinstance(node, Layer):
            return self.call(runtime, c, node.in_bytes, node.out_bytes,
                             (self.inside(node, runtime, c),))
        return self.inside(node, rt.TORCH, c)

    def run(self, nodes: Sequence[Node], runtime: str, c: int) -> float:
        """A run of consecutive children of one series at c samples, blocks whole: every unit
        inside it, every block's join, one call."""
        parts = []
        stack = list(reversed(nodes))
        while stack:
            node = stack.pop()
            parts.append(self.inside(node, runtime, c))
            if isinstance(node, Parallel):
                for b in reversed(fold_order(node)):
                    stack.extend(reversed(node.branches[b].children))
        return self.call(runtime, c, nodes[0].in_bytes, nodes[-1].out_bytes, parts)  # type: ignore[union-attr]

    def program(self, steps: Sequence[Step], runs: Sequence[tuple[int, int]]) -> float:
        """A program with its runs (first step, last step): see the module's doc."""
        parts = []
        in_run: set[int] = set()
        for start, end in runs:
            nodes = self.tree.run_nodes(steps, start, end)
            runtime = run_runtime(nodes[0], steps[start])
            c = steps[start].samples
            inside = [self.inside(self.tree.nodes[steps[k].unit], runtime, steps[k].samples)
                      for k in range(start, end + 1)]
            parts.append(self.call(runtime, c, nodes[0].in_bytes, nodes[-1].out_bytes,  # type: ignore[union-attr]
                                   inside))
            in_run.update(range(start, end + 1))
        for k, s in enumerate(steps):
            if k not in in_run:
                node = self.tree.nodes[s.unit]
                parts.append(self.step(node, step_runtime(node, s), s.samples))
        return math.fsum(parts)
