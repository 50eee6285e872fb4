"""Plan tables: for every request size r = 1..B, the best plan at every memory budget, keyed by
the bytes the executor really allocates. This is the read side, all a worker needs: it imports
neither the DP nor numba (``planner.solver.tables`` builds tables offline, in `vbs plan`).

Reading (``find``, ``lookup``): the plan of r samples for F free bytes is the last breakpoint
at or below F, one binary search. A plan picked for F bytes never allocates more than F, and
the table says exactly what it allocates. When no plan of r fits, ``largest_fitting`` gives
the most samples that do, so a worker splits a batch by the table too.

Serialisation (``to_bytes``/``from_bytes``): zlib-compressed JSON, schema ``vbs.table/3``;
never pickle. Programs are flat integer lists ``[u0, c0, u1, c1, ...]`` indexing ``units``,
with each step's runtime (an index into ``runtimes``) and the runs beside them. Tables of an
older schema (``vbs.table/1``: keyed by the DP's model of memory, not by what runs;
``vbs.table/2``: no runtimes) are refused with a message that says to re-plan; so is
anything malformed.
"""

from __future__ import annotations

import bisect
import json
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.errors import InfeasibleError, TableFormatError, UsageError
from core.lru import LRU
from core.program import Plan, Program, Step

SCHEMA = "vbs.table/3"
# the solver an interim table names (``planner.interim``: the whole model in one runtime call
# at measured batch sizes, served until the model's planned table is published); no solver
# made it, and it is never stored
INTERIM = "interim"
OLD_SCHEMAS = ("vbs.table/1", "vbs.table/2")
MAX_TABLE_BYTES = 1 << 30  # a decompressed table larger than this is refused, not read
_NO_PLAN = np.iinfo(np.int64).max
_PROGRAM_CACHE = 64  # programs kept built per table (the executor takes Steps)


@dataclass(frozen=True, eq=False)
class TablePlan:
    """One distinct plan of a table: its program as unit indices and samples, and its figures."""

    plan_id: str
    units: np.ndarray       # int32 index into PlanTable.units per step
    samples: np.ndarray     # int32 samples per step
    cost: float
    time_total: float
    peak_bytes: int         # what the executor allocates running it: the table's claim
    modelled_bytes: int     # the DP's model of memory for the same program
    splits: tuple[tuple[int, tuple[int, ...]], ...]  # (step, sizes): outputs split at once
    unit_peaks: np.ndarray  # int64 per table unit: the most held while a step of it ran
    runtimes: np.ndarray | None = None  # int8 per step: index into PlanTable.runtimes
    runs: tuple[tuple[int, int], ...] = ()  # (first step, last step): one runtime call each
    # median seconds `vbs plan` measured it to take in the executor, beside the prediction
    # ``time_total`` (None: not measured; ``workers.plan_selection``)
    time_measured: float | None = None

    @property
    def seconds(self) -> float:
        """What running it takes as the table knows it: measured where `vbs plan` ran it,
        else predicted (what the worker's lookups weigh: the latency bound, the shares)."""
        return self.time_measured if self.time_measured is not None else self.time_total

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


@dataclass(frozen=True)
class Measurements:
    """What `vbs plan`'s measured selection ran to choose a table's rows
    (``planner.solver.selection``): every plan's seconds per round by plan id (those that gave
    way and fbs-best's too), the margin and the rule it chose by. Kept with the table, so that
    `vbs solve`, given the profile and these, chooses as the table did and says the same time
    (a table chosen by an earlier rule is refused there, naming the fix)."""

    margin: float
    rounds: tuple[tuple[str, tuple[float, ...]], ...]  # (plan id, seconds per round), sorted
    rule: int = 1  # the selection rule's version (``planner.solver.selection.RULE``); 1: unsaid

    @classmethod
    def of(cls, margin: float, seconds: Mapping[str, Sequence[float]], rule: int
           ) -> Measurements:
        return cls(float(margin), tuple(sorted((str(k), tuple(float(t) for t in v))
                                               for k, v in seconds.items() if v)), int(rule))

    @property
    def seconds(self) -> dict[str, tuple[float, ...]]:
        return dict(self.rounds)

    def to_json(self) -> dict[str, Any]:
        return {"margin": self.margin, "rounds": {k: list(v) for k, v in self.rounds},
                "rule": self.rule}

    @classmethod
    def from_json(cls, raw: Any) -> Measurements:
        """From ``to_json``'s object; ValueError naming what is wrong."""
        if not isinstance(raw, dict) or not isinstance(raw.get("rounds"), dict):
            raise ValueError("measurements must be an object with 'margin' and 'rounds' "
                             "(plan id -> seconds per round)")
        margin = raw.get("margin")
        if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"measurements: margin must be a fraction in [0, 1), got {margin!r}")
        for key, times in raw["rounds"].items():
            if not isinstance(times, list) or not times or not all(
                    isinstance(t, (int, float)) and t > 0 for t in times):
                raise ValueError(f"measurements: plan {key!r} must have a list of seconds > 0")
        rule = raw.get("rule", 1)  # tables published before the rule was said: the first
        if isinstance(rule, bool) or not isinstance(rule, int) or rule < 1:
            raise ValueError(f"measurements: rule must be a whole number >= 1, got {rule!r}")
        return cls.of(margin, raw["rounds"], rule)


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
    runtimes: tuple[str, ...] = ()  # the runtimes steps name (core.runtimes); () = none
    # what `vbs plan` measured to choose the rows (None: the rows are as solved)
    measurements: Measurements | None = None
    # (batch_max,) int64: the least memory any plan of r samples needs, at index r - 1
    min_peaks: np.ndarray = field(init=False, repr=False, compare=False)
    _programs: LRU[Program] = field(default_factory=lambda: LRU(_PROGRAM_CACHE), init=False,
                                    repr=False, compare=False)
    # the rows and min_peaks as Python ints, for the lookups before every batch: a binary
    # search over a list costs a microsecond where numpy's calls on small arrays cost tens
    _search: tuple[tuple[list[int], list[int]], ...] = field(init=False, repr=False,
                                                             compare=False)
    _least: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_peaks", np.array(
            [int(row.peaks[0]) if len(row.peaks) else _NO_PLAN for row in self.rows], dtype=np.int64))
        object.__setattr__(self, "_search", tuple((row.peaks.tolist(), row.plans.tolist())
                                                  for row in self.rows))
        object.__setattr__(self, "_least", tuple(self.min_peaks.tolist()))

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
        self.row(r)
        if isinstance(free_bytes, bool) or not isinstance(free_bytes, (int, np.integer)) \
                or free_bytes < 0:
            raise UsageError(f"free memory must be a whole number of bytes >= 0, got {free_bytes!r}")
        peaks, plans = self._search[r - 1]
        k = bisect.bisect_right(peaks, free_bytes) - 1
        if k < 0:
            if not peaks:
                raise InfeasibleError(f"{self.solver} has no plan of {r} samples: plan with a "
                                      "larger table (more slots) or send fewer samples")
            need = peaks[0]
            raise InfeasibleError(
                f"no {self.solver} plan of {r} samples fits in {free_bytes} bytes: it needs at "
                f"least {need} bytes, {need - free_bytes} more; free memory or send fewer samples")
        return plans[k]

    def largest_fitting(self, r: int, free_bytes: int) -> int:
        """The most samples, at most r, that some plan runs within ``free_bytes`` (0: none)."""
        self.row(r)
        least = self._least
        for size in range(r, 0, -1):
            if least[size - 1] <= free_bytes:
                return size
        return 0

    def program(self, index: int) -> Program:
        """Plan ``index``'s program as Steps (built once, kept for the most recent plans)."""
        return self._programs.get_or_make(index, lambda: self._build_program(index))

    def _build_program(self, index: int) -> Program:
        tp = self.plans[index]
        return Program(tuple(Step(self.units[u], c, rt) for u, c, rt in
                             zip(tp.units.tolist(), tp.samples.tolist(),
                                 tp.runtime_names(self.runtimes))))

    def plan(self, index: int, r: int, budget: int) -> Plan:
        """Plan ``index`` (of r samples) as a Plan, for a budget of ``budget`` bytes."""
        tp = self.plans[index]
        return Plan(solver=self.solver, objective=self.objective, batch=r, budget_bytes=budget,
                    slot_bytes=self.slot_bytes, program=self.program(index), cost=tp.cost,
                    time_total=tp.time_total, modelled_bytes=tp.modelled_bytes,
                    peak_bytes=tp.peak_bytes, splits=tp.splits, runs=tp.runs,
                    time_measured=tp.time_measured)

    def lookup(self, r: int, free_bytes: int) -> Plan:
        """The best plan of r samples that fits in ``free_bytes``, or InfeasibleError."""
        return self.plan(self.find(r, free_bytes), r, free_bytes)

    def plans_for(self, r: int) -> list[tuple[int, Plan]]:
        """(breakpoint in bytes, plan) for every plan of r samples, ascending."""
        row = self.row(r)
        return [(int(peak), self.plan(int(p), r, int(peak))) for peak, p in zip(row.peaks, row.plans)]

    def times_within(self, free_bytes: int) -> tuple[float, ...]:
        """Seconds of the best plan of each request size that fits in ``free_bytes`` (measured
        where `vbs plan` ran it, else predicted: ``TablePlan.seconds``):
        element r for r samples (element 0 is 0.0; infinity where no plan of r fits). One
        lookup per request size."""
        times = [0.0]
        for r in range(1, self.batch_max + 1):
            try:
                times.append(float(self.plans[self.find(r, free_bytes)].seconds))
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
            time = self.plans[index].seconds
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
                       "model_peak": p.modelled_bytes,
                       "steps": np.stack([p.units, p.samples], axis=1).reshape(-1).tolist(),
                       "splits": [[k, *sizes] for k, sizes in p.splits],
                       "unit_peaks": p.unit_peaks.tolist(),
                       **({"step_runtimes": p.runtimes.tolist()} if p.runtimes is not None
                          else {}),
                       **({"runs": [list(r) for r in p.runs]} if p.runs else {}),
                       **({"measured": p.time_measured} if p.time_measured is not None
                          else {})}
                      for p in self.plans],
            "rows": [{"r": r + 1, "peaks": row.peaks.tolist(), "plans": row.plans.tolist()}
                     for r, row in enumerate(self.rows)],
            **({"measurements": self.measurements.to_json()} if self.measurements else {}),
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
            measured = raw.get("measurements")
            table = cls(fingerprint=str(raw["fingerprint"]), solver=str(raw["solver"]),
                        objective=str(raw["objective"]), slot_bytes=int(raw["slot_bytes"]),
                        granule=int(raw["granule"]), batch_max=int(raw["batch_max"]),
                        units=units, plans=tuple(plans), rows=tuple(rows), runtimes=runtimes,
                        measurements=Measurements.from_json(measured) if measured is not None
                        else None)
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
    measured = p.get("measured")
    if measured is not None and not (isinstance(measured, (int, float)) and measured > 0):
        raise ValueError(f"plan {p.get('id')!r}: measured must be seconds > 0")
    return TablePlan(str(p["id"]), steps[:, 0].astype(np.int32), steps[:, 1].astype(np.int32),
                     float(p["cost"]), float(p["time"]), int(p["peak"]), int(p["model_peak"]),
                     splits, unit_peaks, runtimes, runs,
                     float(measured) if measured is not None else None)


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
