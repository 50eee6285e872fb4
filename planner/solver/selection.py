"""Measured selection: at every budget a row gives fbs-best's uniform plan unless another plan
measured faster than it there, and every plan keeps its time as measured.

Why: the DP is exact for the prices it is given, but a unit's time measured alone is not its
time inside a plan (cache state, the thread pool's spin, the call before it), and a plan
predicted a few percent faster can measure 20% slower (docs/benchmarks.md section 2). The
planner compiles and the worker only looks up, so the planner can afford to run what it
proposes, as cuDNN's benchmark mode and TensorRT's tactic timing do. This module is the rule
alone, on times given to it; ``workers.plan_selection`` runs the plans in the executor (it
needs the runtimes, above the planner) and calls it.

The rule, row by row: the row is fbs-best's (the uniform batch a tuned user would pick at
each budget, chosen by the profile), and every other plan the solver's table holds for that
request size (a per-unit plan, or another uniform batch) is a challenger, and so is every
uniform batch larger than the largest fbs-best picks (fbs's plans above its top peak: the
profile prices small calls low, section 3, so fbs-best can pass over a larger batch that runs
faster, such as one call of all r samples), each taken from its peak up only where it wins
against fbs-best's plan there, round by round: each round runs every plan once, back to back
in a shuffled order, so the machine's drift between rounds hits the two alike within a round
(docs/benchmarks.md section 2: a plan faster in nearly every round whose rounds' spread
overlapped its rival's); the challenger must run faster than that plan in every round of 3 or
4 (in ``FASTER_SHARE`` of them from 5 on, so that more rounds make the choice surer, not one
slow round more likely to veto it), and the median of its times over that plan's, round by
round, be at least ``MARGIN`` below one. So at every
budget the row gives fbs-best's plan or one that measured faster than it in the same rounds,
and a row where nothing won is fbs-best's: two measurements of one uniform batch against
another differ by the machine's noise, and choosing between them by it would only move the
choice around (0.90x in the bench of a model the selection had given another uniform batch).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from core.errors import UsageError
from core.table import Measurements, PlanTable, TablePlan, TableRow
from planner.solver.compare import BASELINE

LARGER = "fbs"  # the table whose uniform batches above fbs-best's largest challenge it too
# The rule's version, kept with a table's measurements: 1, across rounds (its slowest round
# faster than the rival's fastest), fbs's larger batches not measured; 2, this module's.
RULE = 2

# how much faster (the median of its times over fbs-best's plan's, round by round) a
# challenger must measure: beyond the noise between two plans of one round on a shared VM
# (docs/benchmarks.md section 2: at 3%, a uniform batch of 4 won in the selection and measured
# 0.91x in the bench after it; at 10%, compared across rounds, a plan of regnet_y_800mf 0.93x)
MARGIN = 0.10
FASTER_SHARE = 0.8  # of the rounds a challenger must run faster in (all of 3 or 4; 4 of 5)


@dataclass(frozen=True)
class Selected:
    """A table after measured selection, with what the selection did."""

    table: PlanTable
    kept: int      # challengers (per-unit plans, other uniform batches) that took a budget
    replaced: int  # challengers that won none: fbs-best's plan stayed


def larger(tables: Mapping[str, PlanTable]) -> PlanTable | None:
    """The table whose uniform batches larger than fbs-best's challenge it (fbs's: the
    largest that fits at each budget), where ``tables`` holds it."""
    return tables.get(LARGER)


def to_measure(table: PlanTable, uniform: PlanTable, r: int, bigger: PlanTable | None = None
               ) -> list[tuple[PlanTable, int]]:
    """The plans of r samples to run, as (table, plan index), each once however many budgets
    share it: every plan of ``table``'s row and of ``uniform``'s, and ``bigger``'s (fbs's)
    above ``uniform``'s top peak."""
    _same_units(table, uniform)
    out: dict[str, tuple[PlanTable, int]] = {}
    for t in (table, uniform):
        for p in t.row(r).plans.tolist():
            out.setdefault(t.plans[p].plan_id, (t, p))
    for _, p in _above(uniform, bigger, r):
        assert bigger is not None
        out.setdefault(bigger.plans[p].plan_id, (bigger, p))
    return list(out.values())


def _above(uniform: PlanTable, bigger: PlanTable | None, r: int) -> list[tuple[int, int]]:
    """(peak, plan index) of ``bigger``'s row of r above ``uniform``'s top peak: the larger
    uniform batches fbs-best passed over."""
    if bigger is None or not len(uniform.row(r).peaks):
        return []
    _same_units(bigger, uniform)
    top = int(uniform.row(r).peaks[-1])
    row = bigger.row(r)
    return [(peak, p) for peak, p in zip(row.peaks.tolist(), row.plans.tolist()) if peak > top]


def wins(plan: Sequence[float], rival: Sequence[float], margin: float = MARGIN) -> bool:
    """Whether times ``plan`` beat ``rival``'s, measured in the same rounds (the i-th of each
    in round i): faster in ``FASTER_SHARE`` of the rounds (rounded up: every round of 3 or 4),
    and the median of its times over the rival's, round by round, at most ``1 - margin``."""
    if len(plan) != len(rival) or not plan:
        raise UsageError(f"plans measured in different rounds ({len(plan)} and {len(rival)} "
                         "times): measure the plans of one request size together")
    ratios = [p / q for p, q in zip(plan, rival)]
    faster = sum(x < 1.0 for x in ratios)
    return (statistics.median(ratios) <= 1.0 - margin
            and faster >= math.ceil(FASTER_SHARE * len(ratios) - 1e-9))


def select(table: PlanTable, uniform: PlanTable, seconds: Mapping[str, Sequence[float]],
           margin: float = MARGIN, sizes: Collection[int] | None = None,
           bigger: PlanTable | None = None) -> Selected:
    """``table`` with each row chosen by measurement (see the module doc); ``seconds``: every
    plan of ``to_measure``'s rounds by plan id (seconds for its r samples); ``sizes``: the
    request sizes chosen so (default all; the other rows stay as solved, unmeasured);
    ``bigger``: fbs's table, whose uniform batches above fbs-best's challenge too."""
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
        row, won, lost = _row(table, uniform, r, seconds, margin, bigger)
        kept, replaced = kept + won, replaced + lost
        rows.append(TableRow(np.array([peak for peak, _ in row], dtype=np.int64),
                             np.array([add(tp) for _, tp in row], dtype=np.int64)))
    out = PlanTable(fingerprint=table.fingerprint, solver=table.solver,
                    objective=table.objective, slot_bytes=table.slot_bytes,
                    granule=table.granule, batch_max=table.batch_max, units=table.units,
                    plans=tuple(plans), rows=tuple(rows), runtimes=table.runtimes,
                    measurements=Measurements.of(margin, seconds, RULE))
    return Selected(out, kept, replaced)


def chosen(tables: Mapping[str, PlanTable], solver: str, measurements: Measurements,
           sizes: Collection[int] | None = None) -> tuple[dict[str, PlanTable], Selected | None]:
    """``tables`` (built from one profile, fbs-best's among them) as `vbs plan` publishes them
    given ``measurements``: the ``solver``'s rows chosen by them (``select``; unchanged where
    the objective is not time or it is fbs-best itself), fbs-best's plans with their medians;
    with what the selection did (None where it did not run). `vbs plan` measures, then calls
    this; `vbs solve` given the same profile and measurements calls it too, so both say one
    plan and one time."""
    table = tables[solver]
    if solver == BASELINE or table.objective != "time":
        return dict(tables), None
    if measurements.rule != RULE:
        raise UsageError(f"the table's rows were chosen by selection rule {measurements.rule}, "
                         f"this release chooses by rule {RULE} (round by round, the larger "
                         "uniform batches measured too): plan the model again (`vbs plan "
                         "--replan`) and export its table again")
    seconds = measurements.seconds
    done = select(table, tables[BASELINE], seconds, measurements.margin, sizes, larger(tables))
    out = {**tables, solver: done.table, BASELINE: with_measured(tables[BASELINE], seconds)}
    if LARGER in tables and LARGER != solver:
        out[LARGER] = with_measured(tables[LARGER], seconds)
    return out, done


def with_measured(table: PlanTable, seconds: Mapping[str, Sequence[float]]) -> PlanTable:
    """``table`` with the median of every plan ``seconds`` holds (fbs-best's, measured as the
    selection's rival, so /plan and `vbs show` set the two side by side as they ran)."""
    plans = tuple(replace(tp, time_measured=statistics.median(seconds[tp.plan_id]))
                  if seconds.get(tp.plan_id) else tp for tp in table.plans)
    return replace(table, plans=plans)


def _row(table: PlanTable, uniform: PlanTable, r: int, seconds: Mapping[str, Sequence[float]],
         margin: float, bigger: PlanTable | None = None
         ) -> tuple[list[tuple[int, TablePlan]], int, int]:
    """The row of r: fbs-best's plans, each budget's own, overlaid by every other plan of
    ``table``'s row and ``bigger``'s above fbs-best's top (a challenger) from its peak up for
    as long as it wins against the uniform plan there; with how many challengers won and
    lost."""
    ids = {uniform.plans[p].plan_id for p in uniform.row(r).plans.tolist()}
    found: dict[str, tuple[int, TablePlan]] = {}
    for peak, tp in ([(peak, table.plans[p]) for peak, p in
                      zip(table.row(r).peaks.tolist(), table.row(r).plans.tolist())] +
                     [(peak, bigger.plans[p]) for peak, p in _above(uniform, bigger, r)
                      if bigger is not None]):
        if tp.plan_id not in ids:
            found.setdefault(tp.plan_id, (peak, tp))
    events = sorted([(peak, 0, uniform.plans[p]) for peak, p in
                     zip(uniform.row(r).peaks.tolist(), uniform.row(r).plans.tolist())] +
                    [(peak, 1, tp) for peak, tp in found.values()],
                    key=lambda e: (e[0], e[1]))
    row: list[tuple[int, TablePlan]] = []
    rival: TablePlan | None = None  # fbs-best's plan at this budget
    current: TablePlan | None = None  # what the row gives here
    won: set[str] = set()
    challengers = {tp.plan_id for _, kind, tp in events if kind}

    def beats(tp: TablePlan, other: TablePlan | None) -> bool:
        return other is None or wins(_times(seconds, tp), _times(seconds, other), margin)

    for peak, kind, tp in events:
        if kind == 0:  # the uniform batch changes here: a challenger stays while it wins
            rival = tp
            if current is not None and current.plan_id in challengers and beats(current, rival):
                continue
            current = tp
        elif beats(tp, rival) and (current is None or current is rival or
                                   statistics.median(_times(seconds, tp)) <
                                   statistics.median(_times(seconds, current))):
            current = tp
            won.add(tp.plan_id)
        else:
            continue
        if row and row[-1][0] == peak:
            row[-1] = (peak, current)
        else:
            row.append((peak, current))
    return row, len(won), len(challengers - won)


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


__all__ = ["FASTER_SHARE", "LARGER", "MARGIN", "RULE", "Selected", "chosen", "larger", "select",
           "to_measure", "wins", "with_measured"]
