"""Building plan tables (offline, in `vbs plan`): ``build_tables`` gives one ``core.table.PlanTable``
per solver. The solver proposes candidate programs
for every r (vbs and paper: the DP's optimal program at every budget of 0..M slots where it
changes; fbs and fbs-best: every uniform batch c = 1..r; greedy: its rule's choice at every
budget where it changes). Each candidate is laid out as the executor will run it
(``core.walk``: a walk on byte counts that needs only the profile), which gives
its exact peak, the outputs to split and each unit's need. The row of r is the frontier of
the candidates by (executor peak, rank): ascending peaks, each plan preferred to every plan
with a smaller peak. The rank is the solver's own preference: least cost for vbs, paper and
fbs-best, the largest batch for fbs, the largest rule budget for greedy. vbs weighs one thing
more (``call_margin``): a plan that makes more runtime calls (or runs more steps on torch,
each a cut) than the one it would replace must be predicted faster by more than a margin of
``CUT_MARGIN`` per extra call, at most ``CALL_MARGIN``. The profile's times carry a few
percent of noise, and a DP over them finds plans whose whole predicted advantage is that noise
(more sub-batches at the batch sizes that happened to measure fast), each cut a chance to cost
more than priced; one more call is one such chance (the classifier of a small network on the
whole request after its other units ran a sample at a time: one call more, 6% faster
predicted and 8-23% measured, docs/benchmarks.md section 2), ten more are many. Within the
margin the plan of fewer calls is kept, so a row may hold a plan up to ``CALL_MARGIN`` slower
than one with a smaller peak. `vbs solve` prints the DP's own optimum, which the table may so
pass over (`vbs solve --table` gives the table's plan).

Unit runtimes (``core.runtimes``): every candidate names each step's runtime and its runs
(the DP's read-out says where it cuts runs; a baseline runs every span ONNX Runtime takes as
one call, or everything on torch), and is priced with them (``planner.solver.pricing``): the
time a table claims for a plan is what `vbs solve` says of the same plan and what the
executor pays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from core import runtimes as rt
from core.errors import UsageError
from core.program import Step, dispatches, program_id
from core.runs import supports
from core.sizes import check_slot_bytes
from core.table import PlanTable, TablePlan, TableRow
from core.tree import Profile
from core.walk import Layout, layout
from planner.solver import baselines
from planner.solver.dp import ChainTables
from planner.solver.model import Instance, build_instance
from planner.solver.solve import DEFAULT_SLOT_COUNT, SOLVERS, default_slot_bytes, instance_of, \
    raw_steps, table_slots

CUT_MARGIN = 0.03   # vbs: how much faster a plan must be predicted for each call more it makes
CALL_MARGIN = 0.08  # ... and at most, whatever the number of calls more


def call_margin(more: int) -> float:
    """How much faster a plan of ``more`` dispatches more than another must be predicted to be
    taken instead of it (or, with fewer, how much slower it may be and still be kept)."""
    return min(CALL_MARGIN, CUT_MARGIN * abs(more))


@dataclass(frozen=True)
class _Candidate:
    """A program a solver proposes for r samples, with its runs, its figures and the solver's
    rank (lower is preferred at the same memory)."""

    steps: tuple[Step, ...]
    runs: tuple[tuple[int, int], ...]
    cost: float
    time: float
    model_peak: int
    rank: tuple[float, float]
    plan_id: str


class _Layouts:
    """Executor layouts of candidate programs, walked once per program and runs (shared by
    solvers)."""

    def __init__(self, inst: Instance) -> None:
        if inst.tree is None:
            raise UsageError("a plan table needs the profile's tree to lay out the executor's "
                             "memory: build it from a Profile")
        self.inst = inst
        self.done: dict[tuple[int, str], Layout] = {}
        self.walks = 0

    def of(self, r: int, cand: _Candidate) -> Layout:
        key = (r, cand.plan_id)
        found = self.done.get(key)
        if found is None:
            found = self.done[key] = layout(self.inst.tree, cand.steps, r,  # type: ignore[arg-type]
                                            granule=self.inst.granule, runs=cand.runs,
                                            measured=self.inst.spans_held_inside)
            self.walks += 1
        return found


def _candidate(inst: Instance, program: baselines.Program, peak: int, rank: float | None = None
               ) -> _Candidate:
    """A program with its runs priced (``planner.solver.pricing``); ranked by its cost, after
    ``rank`` when given."""
    steps, runs = program
    cost = inst.pricing.program(steps, runs)
    time = cost if inst.objective == "time" else inst.time_pricing.program(steps, runs)
    return _Candidate(tuple(steps), tuple(runs), cost, time, peak,
                      (cost if rank is None else rank, cost),
                      program_id(((s.unit, s.samples, s.runtime) for s in steps), runs))


def _keeps_choice(inst: Instance, c: _Candidate) -> bool:
    """Whether a program another strategy proposes runs where the table's worker can: in the
    tables of the worker without torch (``Instance.whole_blocks``), every unit or block the
    named runtime takes runs inside one of its runs, as the DP's own plans do there (their
    executor's steps cost ``inf``); the paper's DP and the baselines know no runs, and a
    block they leave to the executor to fold cannot run without torch."""
    choice = inst.runtime_choice
    if not inst.whole_blocks or choice not in inst.runtimes or not rt.KINDS[choice].calls:
        return True
    covered = [False] * len(c.steps)
    for start, end in c.runs:
        covered[start:end + 1] = [True] * (end - start + 1)
    def taken(unit: str) -> bool:
        cid, pos = inst.locate[unit]
        return supports(inst.chains[cid].nodes[pos], choice)

    return all(done or not taken(c.steps[k].unit) for k, done in enumerate(covered))


def _candidates(inst: Instance, solver: str, slot: int, M: int, dp: Callable[[str], ChainTables],
                proposed: Callable[[str, int], list[_Candidate]], r: int) -> list[_Candidate]:
    """The programs ``solver`` proposes for r samples, each with the solver's rank.

    vbs proposes the paper's and the baselines' programs too (ranked by cost like its own):
    the DPs choose by their model of memory, in which pieces are rounded up to whole slots (a
    uniform batch of 1 over r samples holds r small outputs, each rounded up) and chunks are
    released sample by sample, while the executor's exact peaks show what really fits; a
    program another strategy found can be the better one at some budgets. So at every budget
    vbs is at least as good as paper, fbs, fbs-best and greedy by the table's own accounting.
    """
    if solver in ("vbs", "paper"):
        tables = dp(solver)
        row = tables.top()[r]
        prev = np.concatenate(([np.inf], row[:-1]))
        out = []
        for m in np.nonzero(row < prev)[0].tolist():
            raw = tables.plan(r, m)
            assert raw is not None
            out.append(_candidate(inst, (raw_steps(inst, raw), raw.runs), raw.peak))
        if solver == "vbs":
            out += [replace(c, rank=(c.cost, c.cost)) for other in ("paper", "fbs", "greedy")
                    for c in proposed(other, r) if _keeps_choice(inst, c)]
        return out
    if solver in ("fbs", "fbs-best"):
        return [_candidate(inst, baselines.fbs_program(inst, c, r, a),
                           baselines.fbs_peak(inst, c, r, a), -c if solver == "fbs" else None)
                for c in range(1, r + 1) for a in baselines.assignments(inst)]
    out = []
    for a in baselines.assignments(inst):
        greedy = baselines.greedy_units(inst, r, slot, a)
        last = None
        for m in sorted({n for gu in greedy for n in gu.need_by_batch if n <= M}):
            choice = baselines.greedy_choice(greedy, m)
            if choice is None or choice == last:
                continue
            last = choice
            out.append(_candidate(inst, baselines.greedy_program(greedy, choice, r),
                                  baselines.greedy_peak(inst, greedy, choice, r), -m))
    return out


def _preferred(cand: _Candidate, best: _Candidate | None, floor: float, margins: bool) -> bool:
    """Whether ``cand`` displaces ``best``, the plan of the last breakpoint: a better rank;
    with margins (``call_margin``), a plan of more dispatches (runtime calls and steps on
    torch: each cuts a run) must cost less than best by more than the margin of the calls it
    adds, and one of fewer may cost up to the margin of the calls it saves more than
    ``floor``, the least cost of the row so far (so no plan is more than ``CALL_MARGIN``
    slower than any before it)."""
    if best is None:
        return True
    if margins:
        calls = dispatches(len(cand.steps), cand.runs)
        best_calls = dispatches(len(best.steps), best.runs)
        if calls > best_calls:
            return cand.cost < best.cost * (1.0 - call_margin(calls - best_calls))
        if calls < best_calls and cand.cost <= floor * (1.0 + call_margin(best_calls - calls)):
            return True
    return cand.rank < best.rank


def _frontier(inst: Instance, layouts: _Layouts, r: int, candidates: Iterable[_Candidate],
              add: Callable[[TablePlan], int], margins: bool = False) -> TableRow:
    """The row of r: by ascending executor peak, every candidate preferred to the plan before
    it (``_preferred``)."""
    laid = sorted(((layouts.of(r, cand), cand) for cand in candidates),
                  key=lambda t: (t[0].peak, t[1].rank, dispatches(len(t[1].steps), t[1].runs)))
    chosen: list[tuple[Layout, _Candidate]] = []
    floor = math.inf  # the least cost in ``chosen``
    for lay, cand in laid:
        if chosen and chosen[-1][0].peak == lay.peak:  # one plan per peak: the preferred
            before = chosen[-2][1] if len(chosen) > 1 else None
            rest = min((c.cost for _, c in chosen[:-1]), default=math.inf)
            if _preferred(cand, chosen[-1][1], floor, margins) and \
                    _preferred(cand, before, rest, margins):
                chosen[-1] = (lay, cand)
                floor = min(rest, cand.cost)
        elif _preferred(cand, chosen[-1][1] if chosen else None, floor, margins):
            chosen.append((lay, cand))
            floor = min(floor, cand.cost)
    peaks: list[int] = []
    plans: list[int] = []
    n_units = len(inst.global_units)
    names = {name: i for i, name in enumerate(inst.runtimes)}
    index = inst.global_index
    for lay, cand in chosen:
        arr = np.array([(index[s.unit], s.samples) for s in cand.steps], dtype=np.int32)
        unit_peaks = np.zeros(n_units, dtype=np.int64)
        np.maximum.at(unit_peaks, arr[:, 0], np.asarray(lay.needs, dtype=np.int64))
        step_rt = (np.array([names[s.runtime] for s in cand.steps], dtype=np.int8)
                   if inst.runtimes else None)
        plan = TablePlan(cand.plan_id, arr[:, 0].copy(), arr[:, 1].copy(), cand.cost, cand.time, lay.peak,
                         cand.model_peak, tuple((k, tuple(v)) for k, v in lay.splits.items()),
                         unit_peaks, step_rt, cand.runs)
        peaks.append(lay.peak)
        plans.append(add(plan))
    return TableRow(np.array(peaks, dtype=np.int64), np.array(plans, dtype=np.int64))


def build_tables(model: Profile | Instance, solvers: Sequence[str] = ("vbs",), *,
                 objective: str = "time", slot_bytes: int | None = None,
                 slot_count: int = DEFAULT_SLOT_COUNT) -> dict[str, PlanTable]:
    """One table per solver, every r = 1..batch_max at every budget, executor layouts walked
    once per distinct program across the solvers."""
    for solver in solvers:
        if solver not in SOLVERS:
            raise UsageError(f"unknown solver {solver!r}; use one of {', '.join(SOLVERS)}")
    # The request is its caller's (allocated before the plan is chosen), as the executor counts.
    inst = (instance_of(model, objective) if isinstance(model, Instance)
            else build_instance(model, objective, count_request=False))
    slot = check_slot_bytes(slot_bytes) if slot_bytes is not None else default_slot_bytes(inst, slot_count)
    M = table_slots(inst, slot)
    names = tuple(u.name for u in inst.global_units)
    layouts = _Layouts(inst)
    dps: dict[str, ChainTables] = {}

    def dp(mode: str) -> ChainTables:
        if mode not in dps:
            dps[mode] = ChainTables(inst, mode, slot, M)
        return dps[mode]

    proposals: dict[tuple[str, int], list[_Candidate]] = {}

    def proposed(solver: str, r: int) -> list[_Candidate]:
        """What ``solver`` proposes for r samples, made once for every table that uses it."""
        if (solver, r) not in proposals:
            proposals[solver, r] = _candidates(inst, solver, slot, M, dp, proposed, r)
        return proposals[solver, r]

    out = {}
    for solver in solvers:
        plans: list[TablePlan] = []
        by_id: dict[str, int] = {}

        def add(plan: TablePlan) -> int:
            if plan.plan_id not in by_id:
                by_id[plan.plan_id] = len(plans)
                plans.append(plan)
            return by_id[plan.plan_id]

        margins = solver == "vbs" and inst.objective == "time" and bool(inst.calls)
        rows = tuple(_frontier(inst, layouts, r, proposed(solver, r), add, margins)
                     for r in range(1, inst.batch_max + 1))
        out[solver] = PlanTable(fingerprint=inst.fingerprint, solver=solver, objective=objective,
                                slot_bytes=slot, granule=inst.granule, batch_max=inst.batch_max,
                                units=names, plans=tuple(plans), rows=rows,
                                runtimes=inst.runtimes)
    return out


def build_table(model: Profile | Instance, *, solver: str = "vbs", objective: str = "time",
                slot_bytes: int | None = None, slot_count: int = DEFAULT_SLOT_COUNT) -> PlanTable:
    """The table of one solver (see ``build_tables``)."""
    return build_tables(model, (solver,), objective=objective, slot_bytes=slot_bytes,
                        slot_count=slot_count)[solver]
