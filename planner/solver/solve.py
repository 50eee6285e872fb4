"""One entry point for every solver: ``solve(profile, batch, budget)`` -> Plan.

Solvers: ``vbs`` (default; the paper's DP widened, see ``kernel``), ``paper`` (recurrences
(1)-(3) with the branch collapse, faithfully), ``fbs`` and ``greedy`` (the paper's
baselines) and ``fbs-best`` (the fastest uniform batch that fits: what a user who tunes
max_batch_size gets). All five use the one model of memory of ``planner.solver.model`` and
the one model of time of ``planner.solver.pricing``; every plan's claimed cost and peak equal
what ``planner.solver.simulate`` finds for its program and runs; every plan also carries the
executor's exact peak (``core.walk``), which can differ. Plan tables (``core.table``) are keyed by that executor peak; a direct
``solve`` answers under the DP's model, which is what the oracle and simulator check.

Slots. By default a slot is 1/``slot_count`` of the exact bytes the plan "every unit at
batch B" needs (B = batch_max): the top of a plan table. A direct solve uses the same slot
size as the table of the same profile, so ``solve`` and ``PlanTable.lookup`` agree.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.errors import InfeasibleError, UsageError
from planner.solver import baselines
from planner.solver.dp import ChainTables, RawPlan
from core.walk import layout
from core.sizes import check_slot_bytes, slots_down, slots_up
from planner.solver.model import SOLVERS, Chain, Instance, build_instance, check_batch
from core.program import Plan, Program, Step
from core.tree import Profile

DEFAULT_SLOT_COUNT = 512


def all_at_batch_bytes(inst: Instance, b: int) -> int:
    """Exact peak of the plan that runs every unit once at b samples (the unconstrained plan),
    the hungriest way its steps may run."""
    return max(baselines.uniform_peak(inst.root, b, a) for a in baselines.assignments(inst))


def all_at_batch_slots(inst: Instance, b: int, slot_bytes: int) -> int:
    """Slots the DP's accounting (every piece rounded up) gives the all-at-b plan."""
    return max(baselines.uniform_slots(inst.root, b, slot_bytes, a)
               for a in baselines.assignments(inst))


def default_slot_bytes(inst: Instance, slot_count: int = DEFAULT_SLOT_COUNT) -> int:
    """Bytes per slot so that ``slot_count`` slots span the unconstrained plan at batch_max."""
    if slot_count < 1:
        raise UsageError(f"slot count must be >= 1, got {slot_count}")
    return max(1, slots_up(all_at_batch_bytes(inst, inst.batch_max), slot_count))


def table_slots(inst: Instance, slot_bytes: int) -> int:
    """Top of a plan table in slots: where the all-at-batch_max plan fits in the DP's accounting."""
    return all_at_batch_slots(inst, inst.batch_max, slot_bytes)


def max_need_slots(inst: Instance, r: int, slot_bytes: int) -> int:
    """An upper bound on the slots any DP schedule of r samples can need; more memory is useless.

    In a chain each sample is held at one boundary, the running unit adds its outputs and
    workspace (or, for a block, its join and its branches' own need), and each of at most
    r+1 pieces is rounded up by less than one slot.
    """
    def bound(chain: Chain) -> int:
        smax = max(chain.sizes, default=0)
        inner = 0
        for u in chain.units:
            if u.is_block:
                inner = max([inner] + [bound(br) for br in u.branches])
            else:
                inner = max(inner, slots_up(max(u.ws[:r]), slot_bytes))
        if chain.runs is not None:  # a run's need holds its input and output too
            inner = max([inner] + [slots_up(max(need[:r]), slot_bytes)
                                   for _, need in chain.runs.spans.values()])
        return slots_up(2 * r * smax, slot_bytes) + r + 2 + inner
    return bound(inst.root)


def instance_of(model: Profile | Instance, objective: str) -> Instance:
    if isinstance(model, Instance):
        if model.objective != objective:
            raise UsageError(f"instance was built for objective {model.objective!r}, not {objective!r}")
        return model
    return build_instance(model, objective)


def plan_of(inst: Instance, steps: Sequence[Step], runs: Sequence[tuple[int, int]], *,
            solver: str, batch: int, budget: int, slot_bytes: int, peak: int) -> Plan:
    """A Plan of a program with its runs: priced (``planner.solver.pricing``) and laid out as
    the executor runs it (its exact peak and splits)."""
    if inst.tree is None:
        raise UsageError("this instance was not built from a profile: its tree is needed to lay "
                         "out the executor's memory")
    program = Program(tuple(steps))
    lay = layout(inst.tree, program.steps, batch, granule=inst.granule, runs=runs,
                 measured=inst.run_memory)
    return Plan(solver=solver, objective=inst.objective, batch=batch, budget_bytes=budget,
                slot_bytes=slot_bytes, program=program,
                cost=inst.pricing.program(program.steps, runs),
                time_total=inst.time_pricing.program(program.steps, runs),
                modelled_bytes=peak, peak_bytes=lay.peak,
                splits=tuple((k, tuple(v)) for k, v in lay.splits.items()), runs=tuple(runs))


def raw_steps(inst: Instance, raw: RawPlan) -> tuple[Step, ...]:
    """A DP read-out's steps, each naming its runtime."""
    units = inst.global_units
    runtimes = raw.runtimes or ("",) * len(raw.units)
    return tuple(Step(units[g].name, int(c), r) for g, c, r in
                 zip(raw.units.tolist(), raw.samples.tolist(), runtimes))


def solve(model: Profile | Instance, batch: int, budget_bytes: int, *, solver: str = "vbs",
          objective: str = "time", slot_bytes: int | None = None,
          slot_count: int = DEFAULT_SLOT_COUNT) -> Plan:
    """The best plan of ``solver`` for ``batch`` samples within ``budget_bytes``.

    Raises InfeasibleError (saying how many bytes are missing) when nothing fits.
    """
    if solver not in SOLVERS:
        raise UsageError(f"unknown solver {solver!r}; use one of {', '.join(SOLVERS)}")
    inst = instance_of(model, objective)
    r = check_batch(inst, batch)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise UsageError(f"memory budget must be a whole number of bytes >= 0, got {budget_bytes!r}")
    slot = check_slot_bytes(slot_bytes) if slot_bytes is not None else default_slot_bytes(inst, slot_count)
    m = slots_down(budget_bytes, slot)
    usable = m * slot
    if solver in ("fbs", "fbs-best"):
        chosen = baselines.fbs_choice(inst, r, m, slot, best=solver == "fbs-best")
        if chosen is None:
            raise baselines.infeasible(solver, r, budget_bytes, usable,
                                       baselines.least_fbs_bytes(inst, r, slot))
        c, a = chosen
        return plan_of(inst, *baselines.fbs_program(inst, c, r, a), solver=solver, batch=r,
                       budget=budget_bytes, slot_bytes=slot, peak=baselines.fbs_peak(inst, c, r, a))
    if solver == "greedy":
        found = baselines.greedy_best(inst, r, m, slot)
        if found is None:
            raise baselines.infeasible("greedy", r, budget_bytes, usable,
                                       baselines.least_greedy_bytes(inst, r, slot))
        units, choice = found
        return plan_of(inst, *baselines.greedy_program(units, choice, r), solver=solver,
                       batch=r, budget=budget_bytes, slot_bytes=slot,
                       peak=baselines.greedy_peak(inst, units, choice, r))
    cap = max_need_slots(inst, r, slot)
    tables = ChainTables(inst, solver, slot, min(m, cap), batch=r)
    raw = tables.plan(r, min(m, cap))
    if raw is None:
        raise _dp_infeasible(inst, solver, r, budget_bytes, slot, usable, cap)
    return plan_of(inst, raw_steps(inst, raw), raw.runs, solver=solver, batch=r,
                   budget=budget_bytes, slot_bytes=slot, peak=raw.peak)


def _dp_infeasible(inst: Instance, solver: str, r: int, budget: int, slot: int, usable: int,
                   cap: int) -> InfeasibleError:
    """Say how much memory the smallest plan of the DP needs (one more solve, up to the cap)."""
    least = None
    if cap < (1 << 16):
        top = ChainTables(inst, solver, slot, cap, batch=r).top()[r]
        finite = [m for m in range(cap + 1) if top[m] < float("inf")]
        if finite:
            least = finite[0] * slot
    return baselines.infeasible(solver, r, budget, usable, least)
