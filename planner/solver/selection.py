"""Measured selection: a row keeps a per-unit plan only where it measured faster than the best
uniform batch at the same budget; everywhere else the uniform plan, and every plan's time as
measured.

Why: the DP is exact for the prices it is given, but a unit's time measured alone is not its
time inside a plan (cache state, the thread pool's spin, the call before it), and a plan
predicted a few percent faster can measure 20% slower (docs/benchmarks.md section 2). The
planner compiles and the worker only looks up, so the planner can afford to run what it
proposes, as cuDNN's benchmark mode and TensorRT's tactic timing do. This module is the rule
alone, on times given to it; ``workers.plan_selection`` runs the plans in the executor (it
needs the runtimes, above the planner) and calls it.

The rule, row by row: each breakpoint's plan ``p`` is kept only where it won against ``u``,
the uniform plan ``fbs-best`` gives for the same budget: its median at least ``MARGIN``
faster than u's, and its slowest round faster than u's median (beyond the rounds' spread).
The row is then the frontier of the kept plans and every uniform plan of the row, by executor
peak and measured median: ascending peaks, each faster than all before it. So at every budget
the row's plan measured at least as fast as the uniform plan fbs-best runs there (in the same
rounds), and a row where nothing won holds only uniform plans.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from core.errors import InfeasibleError, UsageError
from core.table import PlanTable, TablePlan, TableRow

MARGIN = 0.03  # how much faster (median) a per-unit plan must measure than the uniform one


@dataclass(frozen=True)
class Selected:
    """A table after measured selection, with what the selection did."""

    table: PlanTable
    kept: int      # breakpoints whose per-unit plan won against the uniform plan
    replaced: int  # breakpoints whose per-unit plan lost (or tied) and gave way


def to_measure(table: PlanTable, uniform: PlanTable, r: int) -> list[tuple[PlanTable, int]]:
    """The plans of r samples to run, as (table, plan index), each once however many budgets
    share it: every plan of ``table``'s row and of ``uniform``'s."""
    _same_units(table, uniform)
    out: dict[str, tuple[PlanTable, int]] = {}
    for t in (table, uniform):
        for p in t.row(r).plans.tolist():
            out.setdefault(t.plans[p].plan_id, (t, p))
    return list(out.values())


def wins(plan: Sequence[float], rival: Sequence[float], margin: float = MARGIN) -> bool:
    """Whether times ``plan`` beat ``rival``'s: median ``margin`` faster, slowest round faster
    than the rival's median."""
    rival_median = statistics.median(rival)
    return (statistics.median(plan) <= (1.0 - margin) * rival_median
            and max(plan) < rival_median)


def select(table: PlanTable, uniform: PlanTable, seconds: Mapping[str, Sequence[float]],
           margin: float = MARGIN, sizes: Collection[int] | None = None) -> Selected:
    """``table`` with each row chosen by measurement (see the module doc); ``seconds``: every
    plan of ``to_measure``'s rounds by plan id (seconds for its r samples); ``sizes``: the
    request sizes chosen so (default all; the other rows stay as solved, unmeasured)."""
    _same_units(table, uniform)
    plans: list[TablePlan] = []
    by_id: dict[str, int] = {}
    kept = replaced = 0

    def add(tp: TablePlan) -> int:
        if tp.plan_id not in by_id:
            by_id[tp.plan_id] = len(plans)
            plans.append(replace(tp, time_measured=statistics.median(_times(seconds, tp)))
                         if seconds.get(tp.plan_id) else tp)
        return by_id[tp.plan_id]

    rows = []
    for r in range(1, table.batch_max + 1):
        if sizes is not None and r not in sizes:
            row = table.row(r)
            rows.append(TableRow(row.peaks.copy(), np.array([add(table.plans[p]) for p in
                                                             row.plans.tolist()], dtype=np.int64)))
            continue
        pool: dict[str, TablePlan] = {uniform.plans[p].plan_id: uniform.plans[p]
                                      for p in uniform.row(r).plans.tolist()}
        for peak, p in zip(table.row(r).peaks.tolist(), table.row(r).plans.tolist()):
            tp = table.plans[p]
            rival = _uniform_at(uniform, r, peak)
            if rival is None or rival.plan_id == tp.plan_id or \
                    wins(_times(seconds, tp), _times(seconds, rival), margin):
                pool[tp.plan_id] = tp
                kept += rival is not None and rival.plan_id != tp.plan_id
            else:
                replaced += 1
        rows.append(_frontier(list(pool.values()), seconds, add))
    out = PlanTable(fingerprint=table.fingerprint, solver=table.solver,
                    objective=table.objective, slot_bytes=table.slot_bytes,
                    granule=table.granule, batch_max=table.batch_max, units=table.units,
                    plans=tuple(plans), rows=tuple(rows), runtimes=table.runtimes)
    return Selected(out, kept, replaced)


def with_measured(table: PlanTable, seconds: Mapping[str, Sequence[float]]) -> PlanTable:
    """``table`` with the median of every plan ``seconds`` holds (fbs-best's, measured as the
    selection's rival, so /plan and `vbs show` set the two side by side as they ran)."""
    plans = tuple(replace(tp, time_measured=statistics.median(seconds[tp.plan_id]))
                  if seconds.get(tp.plan_id) else tp for tp in table.plans)
    return replace(table, plans=plans)


def _frontier(pool: list[TablePlan], seconds: Mapping[str, Sequence[float]], add: object
              ) -> TableRow:
    """By ascending peak, every plan measured faster than all before it."""
    timed = sorted(((tp.peak_bytes, statistics.median(_times(seconds, tp)), tp) for tp in pool),
                   key=lambda t: (t[0], t[1]))
    peaks: list[int] = []
    chosen: list[int] = []
    best = float("inf")
    for peak, median, tp in timed:
        if median >= best:
            continue
        if peaks and peaks[-1] == peak:  # (sorted: the faster of one peak came first)
            continue
        peaks.append(peak)
        chosen.append(add(tp))  # type: ignore[operator]
        best = median
    return TableRow(np.array(peaks, dtype=np.int64), np.array(chosen, dtype=np.int64))


def _uniform_at(uniform: PlanTable, r: int, budget: int) -> TablePlan | None:
    """The uniform plan fbs-best runs for r samples in ``budget`` bytes (None: none fits)."""
    try:
        return uniform.plans[uniform.find(r, budget)]
    except InfeasibleError:
        return None


def _times(seconds: Mapping[str, Sequence[float]], tp: TablePlan) -> Sequence[float]:
    found = seconds.get(tp.plan_id)
    if not found:
        raise UsageError(f"plan {tp.plan_id} was not measured: measure every plan "
                         "``to_measure`` names before selecting")
    return found


def _same_units(table: PlanTable, uniform: PlanTable) -> None:
    if (table.units, table.runtimes, table.granule, table.batch_max) != \
            (uniform.units, uniform.runtimes, uniform.granule, uniform.batch_max):
        raise UsageError(f"tables {table.solver} and {uniform.solver} are not of one profile "
                         "(units, runtimes, granule or batch_max differ): build them together")


__all__ = ["MARGIN", "Selected", "select", "to_measure", "wins", "with_measured"]
