"""Plan tables: for every request size r = 1..B, the best plan at every memory budget, keyed by
the bytes the executor really allocates.

Building (``build_tables``, offline, in `vbs plan`): the solver proposes candidate programs
for every r (vbs and paper: the DP's optimal program at every budget of 0..M slots where it
changes; fbs and fbs-best: every uniform batch c = 1..r; greedy: its rule's choice at every
budget where it changes). Each candidate is laid out as the executor will run it
(``planner.solver.layout``: a walk on byte counts that needs only the profile), which gives
its exact peak, the outputs to split and each unit's need. The row of r is the frontier of
the candidates by (executor peak, rank): ascending peaks, each plan preferred to every plan
with a smaller peak. The rank is the solver's own preference: least cost for vbs, paper and
fbs-best, the largest batch for fbs, the largest rule budget for greedy. vbs weighs one thing
more (``CALL_MARGIN``): a plan that makes more runtime calls (or runs more steps on torch, each
a cut) than the one it would replace must be predicted faster by more than the margin. The
profile's times carry a few percent of noise, and a DP over them finds plans whose whole
predicted advantage is that noise (more sub-batches at the batch sizes that happened to
measure fast), each cut a chance to cost more than priced; within the margin the plan of
fewer calls is kept, so a row may hold a plan up to the margin slower than one with a
smaller peak. `vbs solve` prints the DP's own optimum, which the table may so pass over.

Reading (``find``, ``lookup``): the plan of r samples for F free bytes is the last breakpoint
at or below F, one binary search. A plan picked for F bytes never allocates more than F, and
the table says exactly what it allocates. When no plan of r fits, ``largest_fitting`` gives
the most samples that do, so a worker splits a batch by the table too.

Unit runtimes (``planner.runtimes``): every candidate names each step's runtime and its runs
(the DP's read-out says where it cuts runs; a baseline runs every span ONNX Runtime takes as
one call, or everything on torch), and is priced with them (``planner.solver.pricing``): the
time a table claims for a plan is what `vbs solve` says of the same plan and what the
executor pays.

Serialisation (``to_bytes``/``from_bytes``): zlib-compressed JSON, schema ``vbs.table/3``;
never pickle. Programs are flat integer lists ``[u0, c0, u1, c1, ...]`` indexing ``units``,
with each step's runtime (an index into ``runtimes``) and the runs beside them. Tables of an
older schema (``vbs.table/1``: keyed by the DP's model of memory, not by what runs;
``vbs.table/2``: no runtimes) are refused with a message that says to re-plan; so is
anything malformed.
"""

from __future__ import annotations

import json
import math
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from planner.errors import InfeasibleError, TableFormatError, UsageError
from planner.solver import baselines
from planner.solver.dp import ChainTables
from planner.solver.layout import Layout, layout
from planner.solver.memory import check_slot_bytes
from planner.solver.model import Instance, build_instance
from planner.solver.program import Plan, Program, Step, dispatches, program_id
from planner.solver.solve import DEFAULT_SLOT_COUNT, SOLVERS, default_slot_bytes, instance_of, \
    raw_steps, table_slots
from planner.tree import Profile

SCHEMA = "vbs.table/3"
OLD_SCHEMAS = ("vbs.table/1", "vbs.table/2")
MAX_TABLE_BYTES = 1 << 30  # a decompressed table larger than this is refused, not read
_NO_PLAN = np.iinfo(np.int64).max
_PROGRAM_CACHE = 64  # programs kept built per table (the executor takes Steps)
CALL_MARGIN = 0.08  # vbs: how much faster a plan of more runtime calls must be predicted


@dataclass(frozen=True, eq=False)
class TablePlan:
    """One distinct plan of a table: its program as unit indices and samples, and its figures."""

    plan_id: str
    units: np.ndarray       # int32 index into PlanTable.units per step
    samples: np.ndarray     # int32 samples per step
    cost: float
    time_total: float
    peak_bytes: int         # what the executor allocates running it: the table's claim
    model_peak_bytes: int   # the DP's model of memory for the same program
    splits: tuple[tuple[int, tuple[int, ...]], ...]  # (step, sizes): outputs split at once
    unit_peaks: np.ndarray  # int64 per table unit: the most held while a step of it ran
    runtimes: np.ndarray | None = None  # int8 per step: index into PlanTable.runtimes
    runs: tuple[tuple[int, int], ...] = ()  # (first step, last step): one runtime call each

    def runtime_names(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """Each step's runtime ('' everywhere when the table names none)."""
        if self.runtimes is None:
            return ("",) * len(self.units)
        return tuple(names[i] for i in self.runtimes.tolist())


@dataclass(frozen=True)
class TableRow:
    """The plans of one request size: ``plans[k]`` from ``peaks[k]`` bytes up."""

    peaks: np.ndarray  # int64 executor peaks, strictly ascending
    plans: np.ndarray  # int64 index into PlanTable.plans


@dataclass(frozen=True, eq=False)
class PlanTable:
    """Every request size's plans at every budget, for one profile, solver and objective."""

    fingerprint: str
    solver: str
    objective: str
    slot_bytes: int             # the DP's memory resolution (its candidates), not the lookup's
    granule: int                # the allocator rounding the executor peaks were counted with
    batch_max: int
    units: tuple[str, ...]
    plans: tuple[TablePlan, ...]
    rows: tuple[TableRow, ...]  # rows[r - 1]
    runtimes: tuple[str, ...] = ()  # the runtimes steps name (planner.runtimes); () = none
    # (batch_max,) int64: the least memory any plan of r samples needs, at index r - 1
    min_peaks: np.ndarray = field(init=False, repr=False, compare=False)
    _programs: OrderedDict[int, Program] = field(default_factory=OrderedDict, init=False,
                                                 repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                  compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_peaks", np.array(
            [int(row.peaks[0]) if len(row.peaks) else _NO_PLAN for row in self.rows], dtype=np.int64))

    # ------------------------------------------------------------------ queries

    @property
    def top_bytes(self) -> int:
        """The most any plan of the table allocates: above it nothing changes."""
        return max((int(row.peaks[-1]) for row in self.rows if len(row.peaks)), default=0)

    @property
    def meta(self) -> dict[str, Any]:
        """A JSON summary for a store's meta record."""
        return {"schema": SCHEMA, "fingerprint": self.fingerprint, "solver": self.solver,
                "objective": self.objective, "slot_bytes": self.slot_bytes,
                "granule": self.granule, "batch_max": self.batch_max, "plans": len(self.plans),
                "runtimes": list(self.runtimes),
                "min_bytes": [int(m) if m != _NO_PLAN else None for m in self.min_peaks]}

    def row(self, r: int) -> TableRow:
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= self.batch_max:
            raise UsageError(f"request size {r!r} is outside 1..{self.batch_max} of this table")
        return self.rows[r - 1]

    def find(self, r: int, free_bytes: int) -> int:
        """The index of the best plan of r samples that fits in ``free_bytes`` (one binary
        search), or InfeasibleError saying how many bytes the smallest needs."""
        row = self.row(r)
        if isinstance(free_bytes, bool) or not isinstance(free_bytes, (int, np.integer)) \
                or free_bytes < 0:
            raise UsageError(f"free memory must be a whole number of bytes >= 0, got {free_bytes!r}")
        k = int(np.searchsorted(row.peaks, free_bytes, side="right")) - 1
        if k < 0:
            if len(row.peaks) == 0:
                raise InfeasibleError(f"{self.solver} has no plan of {r} samples: plan with a "
                                      "larger table (more slots) or send fewer samples")
            need = int(row.peaks[0])
            raise InfeasibleError(
                f"no {self.solver} plan of {r} samples fits in {free_bytes} bytes: it needs at "
                f"least {need} bytes, {need - free_bytes} more; free memory or send fewer samples")
        return int(row.plans[k])

    def largest_fitting(self, r: int, free_bytes: int) -> int:
        """The most samples, at most r, that some plan runs within ``free_bytes`` (0: none)."""
        self.row(r)
        fits = np.flatnonzero(self.min_peaks[:r] <= free_bytes)
        return int(fits[-1]) + 1 if fits.size else 0

    def program(self, index: int) -> Program:
        """Plan ``index``'s program as Steps (built once, kept for the most recent plans)."""
        with self._lock:
            found = self._programs.get(index)
            if found is not None:
                self._programs.move_to_end(index)
                return found
        tp = self.plans[index]
        names = self.units
        program = Program(tuple(Step(names[u], c, rt) for u, c, rt in
                                zip(tp.units.tolist(), tp.samples.tolist(),
                                    tp.runtime_names(self.runtimes))))
        with self._lock:
            self._programs[index] = program
            while len(self._programs) > _PROGRAM_CACHE:
                self._programs.popitem(last=False)
        return program

    def plan(self, index: int, r: int, budget: int) -> Plan:
        """Plan ``index`` (of r samples) as a Plan, for a budget of ``budget`` bytes."""
        tp = self.plans[index]
        return Plan(solver=self.solver, objective=self.objective, batch=r, budget_bytes=budget,
                    slot_bytes=self.slot_bytes, program=self.program(index), cost=tp.cost,
                    time_total=tp.time_total, peak_bytes=tp.model_peak_bytes,
                    executor_peak_bytes=tp.peak_bytes, splits=tp.splits, runs=tp.runs)

    def lookup(self, r: int, free_bytes: int) -> Plan:
        """The best plan of r samples that fits in ``free_bytes``, or InfeasibleError."""
        return self.plan(self.find(r, free_bytes), r, free_bytes)

    def plans_for(self, r: int) -> list[tuple[int, Plan]]:
        """(breakpoint in bytes, plan) for every plan of r samples, ascending."""
        row = self.row(r)
        return [(int(peak), self.plan(int(p), r, int(peak))) for peak, p in zip(row.peaks, row.plans)]

    def times_within(self, free_bytes: int) -> tuple[float, ...]:
        """Predicted seconds of the best plan of each request size that fits in ``free_bytes``:
        element r for r samples (element 0 is 0.0; infinity where no plan of r fits). One
        lookup per request size."""
        times = [0.0]
        for r in range(1, self.batch_max + 1):
            try:
                times.append(float(self.plans[self.find(r, free_bytes)].time_total))
            except InfeasibleError:
                times.append(math.inf)
        return tuple(times)

    def largest_batch_within(self, free_bytes: int, latency_s: float) -> int:
        """The paper's latency bound: the largest r whose plan for ``free_bytes`` finishes all
        r samples within ``latency_s`` seconds; InfeasibleError if none does."""
        if not (isinstance(latency_s, (int, float)) and latency_s >= 0 and not math.isnan(latency_s)):
            raise UsageError(f"latency bound must be a number of seconds >= 0, got {latency_s!r}")
        fastest = math.inf
        for r in range(self.batch_max, 0, -1):
            try:
                index = self.find(r, free_bytes)
            except InfeasibleError:
                continue
            time = self.plans[index].time_total
            if time <= latency_s:
                return r
            fastest = min(fastest, time)
        if fastest == math.inf:
            raise InfeasibleError(f"no plan of any request size fits in {free_bytes} bytes")
        raise InfeasibleError(f"no request size finishes within {latency_s} s in {free_bytes} "
                              f"bytes; the fastest plan that fits takes {fastest:.6g} s")

    # ------------------------------------------------------------------ bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "fingerprint": self.fingerprint, "solver": self.solver,
            "objective": self.objective, "slot_bytes": self.slot_bytes, "granule": self.granule,
            "batch_max": self.batch_max, "units": list(self.units),
            "runtimes": list(self.runtimes),
            "plans": [{"id": p.plan_id, "cost": p.cost, "time": p.time_total, "peak": p.peak_bytes,
                       "model_peak": p.model_peak_bytes,
                       "steps": np.stack([p.units, p.samples], axis=1).reshape(-1).tolist(),
                       "splits": [[k, *sizes] for k, sizes in p.splits],
                       "unit_peaks": p.unit_peaks.tolist(),
                       **({"step_runtimes": p.runtimes.tolist()} if p.runtimes is not None
                          else {}),
                       **({"runs": [list(r) for r in p.runs]} if p.runs else {})}
                      for p in self.plans],
            "rows": [{"r": r + 1, "peaks": row.peaks.tolist(), "plans": row.plans.tolist()}
                     for r, row in enumerate(self.rows)],
        }

    def to_bytes(self) -> bytes:
        """zlib-compressed JSON (schema vbs.table/3)."""
        text = json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False)
        return zlib.compress(text.encode(), 6)

    @classmethod
    def from_bytes(cls, data: bytes, where: str | None = None, *,
                   max_bytes: int | None = None) -> PlanTable:
        """A table from its bytes; TableFormatError (saying what is wrong, and ``where``: the
        key or file the bytes came from) for anything else, a table that decompresses to more
        than ``max_bytes`` (default ``MAX_TABLE_BYTES``) included: it is not inflated past that."""
        max_bytes = MAX_TABLE_BYTES if max_bytes is None else max_bytes
        if where is None:
            return cls._from_bytes(data, max_bytes)
        try:
            return cls._from_bytes(data, max_bytes)
        except TableFormatError as exc:
            raise TableFormatError(f"{where}: {exc}") from exc

    @classmethod
    def _from_bytes(cls, data: bytes, max_bytes: int) -> PlanTable:
        try:
            inflate = zlib.decompressobj()
            text = inflate.decompress(data, max_bytes)
            if inflate.unconsumed_tail or (len(text) >= max_bytes and not inflate.eof):
                raise TableFormatError(f"plan table decompresses to more than {max_bytes} bytes: "
                                       "refused; rebuild it with `vbs plan`")
            raw = json.loads(text)
        except (zlib.error, UnicodeDecodeError, json.JSONDecodeError, TypeError,
                RecursionError) as exc:
            raise TableFormatError(f"plan table bytes cannot be read ({exc}): rebuild it with "
                             "`vbs plan`") from exc
        return cls.from_json(raw)

    @classmethod
    def from_json(cls, raw: Any) -> PlanTable:
        got = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
        if got in OLD_SCHEMAS:
            raise TableFormatError(f"plan table of old schema {got!r}: its budgets are the DP's model "
                             f"of memory, not what the executor allocates; re-plan it with "
                             f"`vbs plan --replan` (schema {SCHEMA!r})")
        if got != SCHEMA:
            raise TableFormatError(f"not a plan table of schema {SCHEMA!r} (got {got!r}): rebuild it "
                             "with `vbs plan`")
        try:
            units = tuple(str(u) for u in raw["units"])
            runtimes = tuple(str(r) for r in raw.get("runtimes", ()))
            plans = [_plan_from_json(p, len(units), len(runtimes)) for p in raw["plans"]]
            rows = [TableRow(np.asarray(row["peaks"], dtype=np.int64),
                             np.asarray(row["plans"], dtype=np.int64)) for row in raw["rows"]]
            table = cls(fingerprint=str(raw["fingerprint"]), solver=str(raw["solver"]),
                        objective=str(raw["objective"]), slot_bytes=int(raw["slot_bytes"]),
                        granule=int(raw["granule"]), batch_max=int(raw["batch_max"]),
                        units=units, plans=tuple(plans), rows=tuple(rows), runtimes=runtimes)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise TableFormatError(f"plan table is malformed ({exc!r}): rebuild it with `vbs plan`") from exc
        problem = _check(table)
        if problem:
            raise TableFormatError(f"plan table is malformed ({problem}): rebuild it with `vbs plan`")
        return table


def _plan_from_json(p: Any, n_units: int, n_runtimes: int) -> TablePlan:
    steps = np.asarray(p["steps"], dtype=np.int64)
    if steps.ndim != 1 or steps.size == 0 or steps.size % 2:
        raise ValueError(f"plan {p.get('id')!r}: steps must be a flat list of (unit, samples) pairs")
    steps = steps.reshape(-1, 2)
    if steps[:, 0].min() < 0 or steps[:, 0].max() >= n_units or steps[:, 1].min() < 1:
        raise ValueError(f"plan {p.get('id')!r}: a step names a unit outside 0..{n_units - 1} "
                         "or runs fewer than 1 sample")
    unit_peaks = np.asarray(p["unit_peaks"], dtype=np.int64)
    if unit_peaks.shape != (n_units,):
        raise ValueError(f"plan {p.get('id')!r}: unit_peaks must have one value per unit")
    splits = tuple((int(s[0]), tuple(int(n) for n in s[1:])) for s in p["splits"])
    if any(not 0 <= k < len(steps) or len(sizes) < 2 or min(sizes) < 1 for k, sizes in splits):
        raise ValueError(f"plan {p.get('id')!r}: a split names no step or has a piece < 1")
    runtimes = None
    if n_runtimes:
        runtimes = np.asarray(p["step_runtimes"], dtype=np.int64)
        if runtimes.shape != (len(steps),) or runtimes.min() < 0 or runtimes.max() >= n_runtimes:
            raise ValueError(f"plan {p.get('id')!r}: step_runtimes must name a runtime per step")
        runtimes = runtimes.astype(np.int8)
    runs = tuple((int(r[0]), int(r[1])) for r in p.get("runs", ()))
    if any(len(r) != 2 for r in p.get("runs", ())) or \
            any(not 0 <= a <= b < len(steps) for a, b in runs) or \
            any(b1 >= a2 for (_, b1), (a2, _) in zip(runs, runs[1:])):
        raise ValueError(f"plan {p.get('id')!r}: runs must be ordered, disjoint [first, last] steps")
    return TablePlan(str(p["id"]), steps[:, 0].astype(np.int32), steps[:, 1].astype(np.int32),
                     float(p["cost"]), float(p["time"]), int(p["peak"]), int(p["model_peak"]),
                     splits, unit_peaks, runtimes, runs)


def _check(table: PlanTable) -> str:
    """What is inconsistent in a table read from bytes ('' when nothing)."""
    if table.batch_max < 1 or len(table.rows) != table.batch_max:
        return f"{len(table.rows)} rows for batch_max {table.batch_max}"
    if table.granule < 1 or table.slot_bytes < 1:
        return "granule and slot_bytes must be >= 1"
    for r, row in enumerate(table.rows, start=1):
        if row.peaks.shape != row.plans.shape or row.peaks.ndim != 1:
            return f"row {r}: peaks and plans differ in length"
        if len(row.plans) and (row.plans.min() < 0 or row.plans.max() >= len(table.plans)):
            return f"row {r}: a plan index is outside 0..{len(table.plans) - 1}"
        if len(row.peaks) and (row.peaks[0] < 0 or np.any(np.diff(row.peaks) <= 0)):
            return f"row {r}: peaks are not strictly ascending bytes"
        if any(table.plans[int(p)].peak_bytes != int(b) for b, p in zip(row.peaks, row.plans)):
            return f"row {r}: a breakpoint is not its plan's peak"
    return ""


# --------------------------------------------------------------------------- building


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
                                            measured=self.inst.run_inners)
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
                    for c in proposed(other, r)]
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


def _preferred(cand: _Candidate, best: _Candidate | None, floor: float, margin: float) -> bool:
    """Whether ``cand`` displaces ``best``, the plan of the last breakpoint: a better rank;
    with a margin, a plan of more dispatches (runtime calls and steps on torch: each cuts a
    run) must cost less than best by more than the margin, and one of fewer may cost up to the
    margin more than ``floor``, the least cost of the row so far (so no plan is more than the
    margin slower than any before it)."""
    if best is None:
        return True
    if margin:
        calls = dispatches(len(cand.steps), cand.runs)
        best_calls = dispatches(len(best.steps), best.runs)
        if calls > best_calls:
            return cand.cost < best.cost * (1.0 - margin)
        if calls < best_calls and cand.cost <= floor * (1.0 + margin):
            return True
    return cand.rank < best.rank


def _frontier(inst: Instance, layouts: _Layouts, r: int, candidates: Iterable[_Candidate],
              add: Callable[[TablePlan], int], margin: float = 0.0) -> TableRow:
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
            if _preferred(cand, chosen[-1][1], floor, margin) and \
                    _preferred(cand, before, rest, margin):
                chosen[-1] = (lay, cand)
                floor = min(rest, cand.cost)
        elif _preferred(cand, chosen[-1][1] if chosen else None, floor, margin):
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

        margin = CALL_MARGIN if solver == "vbs" and inst.objective == "time" and inst.calls else 0.0
        rows = tuple(_frontier(inst, layouts, r, proposed(solver, r), add, margin)
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
