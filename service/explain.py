"""``GET /plan``: the served table's plan for a budget and request size, beside every strategy
it is compared with, read from their tables.

Every answer is lookups: each strategy's table (``vbs plan`` stored them all) gives its plan
for the budget by binary search; the plan's description (program, per unit the batch size of
each phase and the most held while it ran) is built once per (table, plan) and cached, and
only what depends on the budget (memory left unused) is added per request. No solver and no
walk runs here. An infeasible budget says how much the smallest plan of that strategy needs.
"""

from __future__ import annotations

from typing import Any

from core.errors import InfeasibleError
from core.precision import FLOAT
from planner.solver.compare import BASELINE, STRATEGIES, speedup
from core.table import PlanTable
from planner.view.data import plan_description
from service.entry import ModelEntry


def _described(entry: ModelEntry, table: PlanTable, index: int, r: int) -> dict[str, Any]:
    """The budget-free part of plan ``index`` of ``table`` (cached per table and plan)."""
    return entry.cached(("plan", id(table), index),
                        lambda: plan_description(table, index, r, entry.precision or FLOAT))


def _answer(entry: ModelEntry, table: PlanTable, r: int, budget: int, program: bool
            ) -> dict[str, Any]:
    try:
        index = table.find(r, budget)
    except InfeasibleError as exc:
        least = int(table.min_peaks[r - 1])
        return {"feasible": False, "solver": table.solver, "reason": " ".join(str(exc).split()),
                "needs_bytes": least if len(table.row(r).peaks) else None}
    base = _described(entry, table, index, r)
    out = {"feasible": True, "solver": table.solver, **base,
           "breakpoint_bytes": base["peak_bytes"],
           "unused_bytes": budget - base["peak_bytes"],
           "units": [{**u, "unused_bytes": budget - u["need_bytes"]} for u in base["units"]]}
    if program:
        out["program"] = table.program(index).to_json()
    return out


def _gain(ours: dict[str, Any], other: dict[str, Any]) -> float | None:
    if not (ours["feasible"] and other["feasible"]):
        return None
    return speedup((ours["time_total_s"], ours["measured_time_total_s"]),
                   (other["time_total_s"], other["measured_time_total_s"]))


def explain(entry: ModelEntry, r: int, budget: int, *, program: bool = False) -> dict[str, Any]:
    """The /plan answer for ``r`` samples within ``budget`` bytes, from the tables alone
    (``program``: with every step of each plan)."""
    tables = entry.tables
    served = entry.table
    ours = _answer(entry, served, r, budget, program)
    others = {s: _answer(entry, tables[s], r, budget, program) for s in STRATEGIES
              if s in tables and s != served.solver}
    return {"model": entry.name, "fingerprint": entry.fingerprint, "table_id": entry.table_id,
            "table_version": entry.table_version, "table_solver": served.solver,
            "objective": served.objective, "batch": r, "memory_budget": budget,
            "plan": ours, **others,
            "gain": {s: _gain(ours, other) for s, other in others.items()},
            "baseline": BASELINE}
