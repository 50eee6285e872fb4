"""Strategies side by side for one request size and budget, from their plan tables: the paper's
Table II and Table III.

``compare`` looks every strategy's plan up in its table (lookups, no solving) and gives, per
strategy, its plan, predicted time per sample and the bytes the executor allocates; per unit
(in execution order) the batch size of each of its phases and the memory left unused while it
ran: the budget minus the most held while a step of that unit ran, which the table stores;
and the unit runtime its steps ran on. ``render`` prints it. Pure (no torch): `vbs show`, the service's /plan and `vbs bench` share it.
Headline gains are stated against ``BASELINE``, fbs-best: the uniform batch a careful user
would tune, not the largest one that fits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from core.errors import InfeasibleError
from core.sizes import format_bytes
from core.program import Plan
from core.runs import plan_shape
from core.table import PlanTable

STRATEGIES = ("vbs", "paper", "greedy", "fbs", "fbs-best")
BASELINE = "fbs-best"


def speedup(ours: tuple[float, float | None], other: tuple[float, float | None]
            ) -> float | None:
    """How many times faster ours is than other, each (predicted, measured) seconds: as `vbs
    plan` measured both where it ran both (in the same rounds), else as predicted."""
    i = 1 if ours[1] is not None and other[1] is not None else 0
    a, b = ours[i], other[i]
    return b / a if a is not None and b is not None and a > 0 else None


@dataclass(frozen=True)
class UnitUse:
    """One unit of a plan: the batch size of each of its steps, the most held meanwhile, and
    the runtimes its steps ran on (() when the table names none)."""

    name: str
    batches: tuple[int, ...]
    need_bytes: int
    runtimes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """One strategy's answer: its plan and per-unit use, or why nothing fits."""

    solver: str
    plan: Plan | None
    units: tuple[UnitUse, ...] = ()
    reason: str = ""
    need_bytes: int | None = None  # when infeasible: the least memory any plan needs

    @property
    def feasible(self) -> bool:
        return self.plan is not None

    @property
    def time_per_sample(self) -> float | None:
        return self.plan.time_per_sample if self.plan else None

    def usage(self, name: str) -> UnitUse:
        return next(u for u in self.units if u.name == name)


@dataclass(frozen=True)
class Comparison:
    """Every strategy's outcome for ``batch`` samples within ``budget`` bytes."""

    batch: int
    budget: int
    outcomes: tuple[Outcome, ...]

    def outcome(self, solver: str) -> Outcome:
        return next(o for o in self.outcomes if o.solver == solver)

    def gain(self, solver: str, over: str = BASELINE) -> float | None:
        """How many times faster ``solver`` is than ``over`` (None when either is infeasible)."""
        solvers = {o.solver for o in self.outcomes}
        if solver not in solvers or over not in solvers:
            return None
        a, b = self.outcome(solver).plan, self.outcome(over).plan
        if not (a and b):
            return None
        return speedup((a.time_total, a.time_measured), (b.time_total, b.time_measured))


def unit_uses(table: PlanTable, index: int) -> tuple[UnitUse, ...]:
    """Per unit of plan ``index``, in the order units first run: batches and the most held."""
    entry = table.plans[index]
    units = entry.units
    order = np.argsort(units, kind="stable")  # steps grouped by unit, in program order
    grouped = units[order]
    starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
    samples = entry.samples[order].tolist()
    bounds = starts.tolist() + [len(samples)]
    ids = grouped[starts].tolist()
    peaks = entry.unit_peaks.tolist()
    names = entry.runtime_names(table.runtimes) if table.runtimes else None
    runtimes = [names[i] for i in order.tolist()] if names else []

    def used(k: int) -> tuple[str, ...]:
        return tuple(dict.fromkeys(runtimes[bounds[k]:bounds[k + 1]])) if runtimes else ()

    return tuple(UnitUse(table.units[ids[k]], tuple(samples[bounds[k]:bounds[k + 1]]),
                         peaks[ids[k]], used(k))
                 for k in np.argsort(order[starts], kind="stable").tolist())  # by first run


def outcome(table: PlanTable, batch: int, budget: int) -> Outcome:
    """The plan ``table`` holds for ``batch`` samples within ``budget`` bytes (a lookup)."""
    try:
        index = table.find(batch, budget)
    except InfeasibleError as exc:
        need = int(table.min_peaks[batch - 1]) if len(table.row(batch).peaks) else None
        return Outcome(table.solver, None, reason=" ".join(str(exc).split()), need_bytes=need)
    return Outcome(table.solver, table.plan(index, batch, budget), unit_uses(table, index))


def compare(tables: Mapping[str, PlanTable], batch: int, budget: int,
            solvers: Sequence[str] | None = None) -> Comparison:
    """Every strategy of ``tables`` (or of ``solvers``, in that order) at one budget."""
    order = [s for s in (solvers or STRATEGIES) if s in tables]
    return Comparison(batch, budget, tuple(outcome(tables[s], batch, budget) for s in order))


def budget_range(tables: Mapping[str, PlanTable], batch: int) -> tuple[int, int]:
    """Budgets worth comparing for ``batch`` samples: from where fbs-best runs one sample at a
    time (the least a uniform batch needs) to where fbs runs all of them at once."""
    low = int(tables[BASELINE].min_peaks[batch - 1])
    high = int(tables["fbs"].row(batch).peaks[-1])
    return low, max(low, high)


def _batches(values: Sequence[int]) -> str:
    """``6,6,6,2`` as ``6x3+2``: the phases of one unit."""
    if not values:
        return "-"
    parts: list[str] = []
    run, count = values[0], 0
    for v in list(values) + [None]:  # type: ignore[list-item]
        if v == run:
            count += 1
            continue
        parts.append(f"{run}x{count}" if count > 1 else str(run))
        run, count = v, 1  # type: ignore[assignment]
    return "+".join(parts)


SHORT = {"onnxruntime": "ort", "cudagraph": "graph", "torch": "torch"}


def render(cmp: Comparison, title: str = "", detail: tuple[str, ...] = ("vbs", BASELINE)) -> str:
    """The comparison as text: a summary per strategy (predicted time per sample, and what `vbs
    plan` measured where it ran the plan; the calls its runs make), then per
    unit (Table III): its phases, the memory left unused, and its runtime."""
    lines = [f"{title}  r={cmp.batch}  budget {format_bytes(cmp.budget)}".strip()]
    lines.append(f"{'strategy':9} {'time/sample':>12} {'measured':>12} {'samples/s':>10} "
                 f"{'peak':>11}  {'vbs gain':>8}  plan")
    for o in cmp.outcomes:
        if not o.plan:
            lines.append(f"{o.solver:9} {'infeasible':>12}  {o.reason}")
            continue
        gain = cmp.gain("vbs", o.solver)
        runs = f" ({len(o.plan.runs)} runtime calls)" if o.plan.runs else ""
        measured = (f"{o.plan.time_measured / o.plan.batch * 1e3:>9.3f} ms"
                    if o.plan.time_measured is not None else f"{'-':>12}")
        lines.append(f"{o.solver:9} {o.plan.time_per_sample * 1e3:>9.3f} ms {measured} "
                     f"{1 / o.plan.time_per_sample:>10.1f} "
                     f"{format_bytes(o.plan.peak_bytes):>11}  "
                     f"{(f'{gain:.2f}x' if gain else '-'):>8}  {o.plan.plan_id}{runs}")
    shown = [cmp.outcome(s) for s in detail if any(o.solver == s for o in cmp.outcomes)]
    shown = [o for o in shown if o.plan]
    for o in shown:
        lines.append(f"{o.solver} runs: {plan_shape(o.plan.program.steps, o.plan.runs)}")
    if not shown:
        return "\n".join(lines)
    names = [u.name for u in shown[0].units]
    width = max(12, max(len(n) for n in names))
    lines.append(f"\n{'unit':{width}}" + "".join(f" {o.solver + ' batches':>18} {'unused':>10}"
                                                 for o in shown))
    for name in names:
        row = f"{name:{width}}"
        for o in shown:
            use = o.usage(name)
            on = "+".join(SHORT.get(r, r) for r in use.runtimes)
            batches = f"{_batches(use.batches)} {on}" if on else _batches(use.batches)
            row += f" {batches:>18} {format_bytes(cmp.budget - use.need_bytes):>10}"
        lines.append(row)
    return "\n".join(lines)


def sweep(tables: Mapping[str, PlanTable], batch: int, budgets: Sequence[int]) -> list[Comparison]:
    """``compare`` at every budget: the predicted side of the paper's Figure 7 and Table II."""
    return [compare(tables, batch, b) for b in budgets]


def render_sweep(rows: list[Comparison], title: str = "") -> str:
    """Predicted time per sample of every strategy at every budget, and vbs's gain over fbs-best."""
    solvers = [o.solver for o in rows[0].outcomes] if rows else []
    lines = [f"{title}  r={rows[0].batch if rows else '?'}  predicted time per sample (ms)".strip(),
             f"{'budget':>11} " + " ".join(f"{s:>9}" for s in solvers) + f" {'vbs/' + BASELINE:>13}"]
    for cmp in rows:
        cells = [f"{o.time_per_sample * 1e3:>9.3f}" if o.plan else f"{'-':>9}" for o in cmp.outcomes]
        gain = cmp.gain("vbs")
        lines.append(f"{format_bytes(cmp.budget):>11} " + " ".join(cells) +
                     f" {(f'{gain:.2f}x' if gain else '-'):>13}")
    return "\n".join(lines)
