"""Solvers side by side for one request size and budget: the paper's Table II and Table III.

``compare`` solves the same profile with several solvers at one budget and replays each plan
in the simulator, so every row carries its predicted time per sample, its peak, and per unit
the batch size of each phase and the memory left unused while it ran. ``render`` prints it.
Pure (no torch): `vbs show`, the service's /plan and `vbs bench` share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.errors import InfeasibleError
from planner.solver.memory import format_bytes
from planner.solver.model import Instance
from planner.solver.program import Plan
from planner.solver.simulate import Simulation, simulate
from planner.solver.solve import instance_of, solve
from planner.tree import Profile

SOLVERS = ("vbs", "paper", "greedy", "fbs")


@dataclass(frozen=True)
class Outcome:
    """One solver's answer: its plan and replay, or why nothing fits."""

    solver: str
    plan: Plan | None
    simulation: Simulation | None
    reason: str = ""

    @property
    def feasible(self) -> bool:
        return self.plan is not None

    @property
    def time_per_sample(self) -> float | None:
        return self.plan.time_per_sample if self.plan else None


@dataclass(frozen=True)
class Comparison:
    """Every solver's outcome for ``batch`` samples within ``budget`` bytes."""

    batch: int
    budget: int
    slot_bytes: int
    outcomes: tuple[Outcome, ...]

    def outcome(self, solver: str) -> Outcome:
        return next(o for o in self.outcomes if o.solver == solver)

    def gain(self, solver: str, over: str) -> float | None:
        """How many times faster ``solver`` is than ``over`` (None when either is infeasible)."""
        a, b = self.outcome(solver), self.outcome(over)
        if not (a.plan and b.plan) or a.plan.time_total <= 0:
            return None
        return b.plan.time_total / a.plan.time_total


def compare(model: Profile | Instance, batch: int, budget: int, *, slot_bytes: int | None = None,
            solvers: Sequence[str] = SOLVERS, objective: str = "time",
            plans: dict[str, Plan] | None = None) -> Comparison:
    """Solve (or take from ``plans``, e.g. a table's lookup) and replay every solver's plan."""
    inst = instance_of(model, objective)
    outcomes = []
    slot = slot_bytes
    for solver in solvers:
        try:
            plan = (plans or {}).get(solver) or solve(inst, batch, budget, solver=solver,
                                                      objective=objective, slot_bytes=slot)
        except InfeasibleError as exc:
            outcomes.append(Outcome(solver, None, None, " ".join(str(exc).split())))
            continue
        slot = plan.slot_bytes
        sim = simulate(inst, plan.program, batch, budget, slot_bytes=plan.slot_bytes,
                       objective=objective)
        outcomes.append(Outcome(solver, plan, sim))
    return Comparison(batch, budget, slot or 0, tuple(outcomes))


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


def render(cmp: Comparison, title: str = "", detail: tuple[str, str] = ("vbs", "fbs")) -> str:
    """The comparison as text: a summary per solver, then per unit (Table III)."""
    lines = [f"{title}  r={cmp.batch}  budget {format_bytes(cmp.budget)}  "
             f"(slots of {format_bytes(cmp.slot_bytes)})".strip()]
    lines.append(f"{'solver':8} {'time/sample':>12} {'samples/s':>10} {'peak':>11}  "
                 f"{'vbs gain':>8}  plan")
    for o in cmp.outcomes:
        if not o.plan:
            lines.append(f"{o.solver:8} {'infeasible':>12}  {o.reason}")
            continue
        gain = cmp.gain("vbs", o.solver) if any(x.solver == "vbs" for x in cmp.outcomes) else None
        lines.append(f"{o.solver:8} {o.plan.time_per_sample * 1e3:>9.3f} ms "
                     f"{1 / o.plan.time_per_sample:>10.1f} {format_bytes(o.plan.peak_bytes):>11}  "
                     f"{(f'{gain:.2f}x' if gain else '-'):>8}  {o.plan.plan_id}")
    shown = [cmp.outcome(s) for s in detail if any(o.solver == s for o in cmp.outcomes)]
    shown = [o for o in shown if o.simulation]
    if not shown:
        return "\n".join(lines)
    names = [u.name for u in shown[0].simulation.units]  # type: ignore[union-attr]
    width = max(12, max(len(n) for n in names))
    header = f"\n{'unit':{width}}" + "".join(f" {o.solver + ' batches':>16} {'unused':>10}" for o in shown)
    lines.append(header)
    for name in names:
        row = f"{name:{width}}"
        for o in shown:
            use = o.simulation.usage(name)  # type: ignore[union-attr]
            unused = min(use.unused_bytes) if use.unused_bytes else None
            row += f" {_batches(use.batches):>16} {format_bytes(unused) if unused is not None else '-':>10}"
        lines.append(row)
    return "\n".join(lines)


def sweep(model: Profile | Instance, batch: int, budgets: Sequence[int], *,
          slot_bytes: int | None = None, solvers: Sequence[str] = SOLVERS) -> list[Comparison]:
    """``compare`` at every budget: the predicted side of the paper's Figure 7 and Table II."""
    inst = instance_of(model, "time")
    return [compare(inst, batch, b, slot_bytes=slot_bytes, solvers=solvers) for b in budgets]


def render_sweep(rows: list[Comparison], title: str = "") -> str:
    """Predicted time per sample of every solver at every budget, and vbs's gain over fbs."""
    solvers = [o.solver for o in rows[0].outcomes] if rows else []
    lines = [f"{title}  r={rows[0].batch if rows else '?'}  predicted time per sample (ms)".strip(),
             f"{'budget':>11} " + " ".join(f"{s:>9}" for s in solvers) + f" {'vbs/fbs':>8}"]
    for cmp in rows:
        cells = [f"{o.time_per_sample * 1e3:>9.3f}" if o.plan else f"{'-':>9}" for o in cmp.outcomes]
        gain = cmp.gain("vbs", "fbs") if "vbs" in solvers and "fbs" in solvers else None
        lines.append(f"{format_bytes(cmp.budget):>11} " + " ".join(cells) +
                     f" {(f'{gain:.2f}x' if gain else '-'):>8}")
    return "\n".join(lines)
