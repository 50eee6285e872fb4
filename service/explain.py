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
from planner.solver.compare import Outcome, compare
from planner.solver.model import build_instance
from service.registry import ModelEntry

BASELINES = ("fbs", "greedy")


def _instance(entry: ModelEntry, objective: str) -> Any:
    return entry.cached(("instance", id(entry.prepared.profile), objective),
                        lambda: build_instance(entry.prepared.profile, objective))


def _describe(o: Outcome, r: int, budget: int) -> dict[str, Any]:
    if o.plan is None or o.simulation is None:
        return {"feasible": False, "solver": o.solver, "reason": o.reason}
    plan = o.plan
    return {
        "feasible": True, "solver": plan.solver, "plan_id": plan.plan_id,
        "time_total_s": plan.time_total, "time_per_sample_s": plan.time_per_sample,
        "throughput_per_s": r / plan.time_total if plan.time_total > 0 else None,
        "peak_bytes": plan.peak_bytes, "breakpoint_bytes": plan.budget_bytes,
        "unused_bytes": budget - plan.peak_bytes,
        "units": [{"unit": u.name, "batches": list(u.batches), "unused_bytes": list(u.unused_bytes)}
                  for u in o.simulation.units],
        "program": plan.program.to_json(),
    }


def explain(entry: ModelEntry, r: int, budget: int) -> dict[str, Any]:
    """The /plan answer for ``r`` samples within ``budget`` bytes (cached per table)."""
    table = entry.table
    key = ("plan", id(table), r, budget)
    return entry.cached(key, lambda: _explain(entry, table, r, budget))


def _explain(entry: ModelEntry, table: Any, r: int, budget: int) -> dict[str, Any]:
    inst = _instance(entry, table.objective)
    plans = {}
    try:
        plans[table.solver] = table.lookup(r, budget)
    except InfeasibleError:
        pass  # compare() solves it again and says why nothing fits
    solvers = (table.solver, *[s for s in BASELINES if s != table.solver])
    cmp = compare(inst, r, budget, slot_bytes=table.slot_bytes, solvers=solvers,
                  objective=table.objective, plans=plans)
    ours = _describe(cmp.outcome(table.solver), r, budget)
    return {"model": entry.name, "fingerprint": entry.fingerprint,
            "table_version": entry.table_version, "table_solver": table.solver,
            "slot_bytes": table.slot_bytes, "batch": r, "memory_budget": budget,
            "plan": ours,
            **{s: _describe(cmp.outcome(s), r, budget) if s != table.solver else ours
               for s in BASELINES},
            "gain": {s: cmp.gain(table.solver, s) for s in BASELINES}}
