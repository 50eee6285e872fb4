"""What the plan pictures are drawn from, as JSON: one plan's description, each strategy's
time-per-sample curve, the division tree, and the whole book a static page embeds.

Every figure here is read from the plan tables (``vbs plan`` built them): no solver runs.
The service's ``/plan`` (``service.explain``) and ``/models/{name}/curves`` answer with these
shapes, and ``book`` holds the same plans for a page without a service, whose script looks
plans up by the same rule as ``PlanTable.find`` (the last breakpoint at or below the budget).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from core.errors import UsageError
from core.precision import FLOAT, Precision
from core.runtimes import ONNXRUNTIME
from planner.solver.compare import BASELINE, STRATEGIES, unit_uses
from core.runs import plan_shape
from core.table import PlanTable
from core.tree import Profile, node_to_json

BOOK_SCHEMA = "vbs.view/1"


def plan_description(table: PlanTable, index: int, r: int,
                     precision: Precision = FLOAT) -> dict[str, Any]:
    """The budget-free part of plan ``index`` of ``r`` samples: id, predicted time (and what
    `vbs plan` measured it to take, where it ran it), peaks and,
    per unit in the order units first run, the batch size of each phase, the most held, its
    runtime and precision (int8 where ``precision`` has the unit and ONNX Runtime runs it)."""
    tp = table.plans[index]
    measured = tp.time_measured  # `vbs plan` ran it (None: not measured)
    return {"plan_id": tp.plan_id, "time_total_s": tp.time_total,
            "time_per_sample_s": tp.time_total / r,
            "measured_time_total_s": measured,
            "measured_time_per_sample_s": measured / r if measured is not None else None,
            "throughput_per_s": r / tp.time_total if tp.time_total > 0 else None,
            "peak_bytes": tp.peak_bytes, "model_peak_bytes": tp.modelled_bytes,
            "calls": len(tp.runs) or None,  # runtime calls its runs make (None: torch alone)
            "shape": plan_shape(table.program(index).steps, tp.runs),
            "units": [{"unit": u.name, "batches": list(u.batches), "need_bytes": u.need_bytes,
                       "runtime": "+".join(u.runtimes) or "torch",
                       "precision": precision.of(u.name, ONNXRUNTIME in u.runtimes)}
                      for u in unit_uses(table, index)]}


def curve(table: PlanTable, r: int) -> list[dict[str, Any]]:
    """Time per sample against memory for ``r`` samples (the paper's Fig. 7): one point per
    plan of the row, at the bytes from which the table uses it, ascending."""
    row = table.row(r)
    out = []
    for peak, index in zip(row.peaks.tolist(), row.plans.tolist()):
        tp = table.plans[index]
        out.append({"bytes": int(peak), "time_per_sample_s": tp.time_total / r,
                    "plan_id": tp.plan_id})
    return out


def ordered(tables: Mapping[str, PlanTable], served: str) -> list[str]:
    """The served strategy first, then the others in the usual order."""
    return [served] + [s for s in STRATEGIES if s in tables and s != served]


def curves(tables: Mapping[str, PlanTable], served: str, r: int) -> dict[str, Any]:
    """Every strategy's curve for ``r`` samples and the budgets worth a slider: from the least
    any plan needs to where the last plan of any strategy starts (nothing changes above)."""
    strategies = {s: curve(tables[s], r) for s in ordered(tables, served)}
    firsts = [points[0]["bytes"] for points in strategies.values() if points]
    lasts = [points[-1]["bytes"] for points in strategies.values() if points]
    if not firsts:
        raise UsageError(f"no strategy has a plan of {r} samples: plan with a larger table")
    return {"batch": r, "table_solver": served, "baseline": BASELINE,
            "low_bytes": min(firsts), "high_bytes": max(lasts), "strategies": strategies}


def tree(profile: Profile) -> dict[str, Any]:
    """The division tree without measurements: units in order, branches under their block."""
    return node_to_json(profile.root, measured=False)


def book(name: str, profile: Profile, tables: Mapping[str, PlanTable], served: str,
         sizes: Iterable[int] | None = None, meta: Mapping[str, Any] | None = None
         ) -> dict[str, Any]:
    """Everything a static page needs to draw ``name``'s plans for the request ``sizes``
    (default: all): per strategy, the plans those rows use (described once) and the rows."""
    table = tables[served]
    precision = Precision.from_json(profile.meta.get("precision"))
    wanted = sorted(set(sizes) if sizes is not None else range(1, table.batch_max + 1))
    for r in wanted:
        table.row(r)  # UsageError naming the size when out of range
    strategies: dict[str, Any] = {}
    for s in ordered(tables, served):
        t = tables[s]
        units = list(t.units)
        position = {u: i for i, u in enumerate(units)}
        plans: list[dict[str, Any]] = []
        seen: dict[tuple[int, int], int] = {}  # (table plan, r) -> index in plans
        rows: dict[str, Any] = {}
        for r in wanted:
            row = t.row(r)
            indices = []
            for index in row.plans.tolist():
                key = (index, r)
                if key not in seen:
                    d = plan_description(t, index, r, precision)
                    seen[key] = len(plans)
                    plans.append({**{k: v for k, v in d.items() if k != "units"},
                                  "units": [[position[u["unit"]], u["batches"], u["need_bytes"],
                                             u["runtime"], u["precision"]]
                                            for u in d["units"]]})
                indices.append(seen[key])
            rows[str(r)] = {"peaks": row.peaks.tolist(), "plans": indices}
        strategies[s] = {"units": units, "plans": plans, "rows": rows}
    return {"schema": BOOK_SCHEMA, "name": name, "batch_max": table.batch_max, "sizes": wanted,
            "table_solver": served, "objective": table.objective, "baseline": BASELINE,
            "fingerprint": table.fingerprint, "meta": dict(meta or {}), "tree": tree(profile),
            "strategies": strategies}
