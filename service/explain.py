"""``GET /plan``: the table's plan for a budget and request size, beside the paper's baselines.

For the model's current table: the plan ``table.lookup(r, budget)`` gives, replayed by the
simulator (``planner.solver.simulate``) to show, per unit, the batch size of each of its phases
and the memory left unused while each ran; its predicted time per sample and throughput; and
the same for FBS and Greedy-VBS solved on the same profile with the table's slot size, and the
gain over each. Answers are cached per model (they depend only on the table). Runs in a
thread: solving can take a while for a large model.
"""

from __future__ import annotations

from typing import Any

from planner.errors import InfeasibleError
from planner.solver.model import build_instance
from planner.solver.program import Plan
from planner.solver.simulate import simulate
from planner.solver.solve import solve
from service.registry import ModelEntry

BASELINES = ("fbs", "greedy")


def _instance(entry: ModelEntry, objective: str) -> Any:
    return entry.cached(("instance", id(entry.prepared.profile), objective),
                        lambda: build_instance(entry.prepared.profile, objective))


def _describe(inst: Any, plan: Plan, r: int, budget: int, slot_bytes: int) -> dict[str, Any]:
    sim = simulate(inst, plan.program, r, budget, slot_bytes=slot_bytes)
    return {
        "feasible": True, "solver": plan.solver, "plan_id": plan.plan_id,
        "time_total_s": plan.time_total, "time_per_sample_s": plan.time_per_sample,
        "throughput_per_s": r / plan.time_total if plan.time_total > 0 else None,
        "peak_bytes": plan.peak_bytes, "breakpoint_bytes": plan.budget_bytes,
        "unused_bytes": budget - plan.peak_bytes,
        "units": [{"unit": u.name, "batches": list(u.batches), "unused_bytes": list(u.unused_bytes)}
                  for u in sim.units],
        "program": plan.program.to_json(),
    }


def _infeasible(solver: str, exc: InfeasibleError) -> dict[str, Any]:
    return {"feasible": False, "solver": solver, "reason": " ".join(str(exc).split())}


def explain(entry: ModelEntry, r: int, budget: int) -> dict[str, Any]:
    """The /plan answer for ``r`` samples within ``budget`` bytes (cached per table)."""
    table = entry.table
    key = ("plan", id(table), r, budget)
    return entry.cached(key, lambda: _explain(entry, table, r, budget))


def _explain(entry: ModelEntry, table: Any, r: int, budget: int) -> dict[str, Any]:
    inst = _instance(entry, table.objective)
    slot = table.slot_bytes
    answers: dict[str, dict[str, Any]] = {}
    try:
        plan = table.lookup(r, budget)
        answers["plan"] = _describe(inst, plan, r, budget, slot)
    except InfeasibleError as exc:
        answers["plan"] = _infeasible(table.solver, exc)
    for solver in BASELINES:
        try:
            baseline = solve(inst, r, budget, solver=solver, objective=table.objective,
                             slot_bytes=slot)
            answers[solver] = _describe(inst, baseline, r, budget, slot)
        except InfeasibleError as exc:
            answers[solver] = _infeasible(solver, exc)
    gain: dict[str, float | None] = {}
    ours = answers["plan"]
    for solver in BASELINES:
        theirs = answers[solver]
        if ours["feasible"] and theirs["feasible"] and ours["time_total_s"] > 0:
            gain[solver] = theirs["time_total_s"] / ours["time_total_s"]
        else:
            gain[solver] = None
    return {"model": entry.name, "fingerprint": entry.fingerprint,
            "table_version": entry.table_version, "table_solver": table.solver,
            "slot_bytes": slot, "batch": r, "memory_budget": budget,
            "plan": ours, "fbs": answers["fbs"], "greedy": answers["greedy"],
            "gain": gain}
