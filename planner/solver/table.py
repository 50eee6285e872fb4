"""Plan tables: one solve gives the plan of every request size r = 1..B at every budget.

The DP fills OPT[root, r, m] for all r and all m = 0..M slots at once. For each r the table
keeps only the budgets where the plan changes (breakpoints, ascending) and the plan from
there up (the paper keeps "only the entries used"); ``lookup(r, free_bytes)`` returns the
plan of the largest breakpoint at or below the free memory, which equals a direct
``solve`` at that budget. Plans are stored once, as arrays of (unit index, samples), with a
version-independent id (a hash of the program).

Serialisation (``to_bytes``/``from_bytes``): zlib-compressed JSON, schema ``vbs.table/1``;
never pickle. Programs are flat integer lists ``[u0, c0, u1, c1, ...]`` indexing ``units``.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.errors import InfeasibleError, StoreError, UsageError
from planner.solver import baselines
from planner.solver.dp import ChainTables
from planner.solver.memory import check_slot_bytes, slots_down
from planner.solver.model import Instance
from planner.solver.program import Plan, Program, program_id
from planner.solver.solve import (DEFAULT_SLOT_COUNT, SOLVERS, default_slot_bytes, instance_of,
                                  table_slots)
from planner.tree import Profile

SCHEMA = "vbs.table/1"


@dataclass(frozen=True)
class TablePlan:
    """One distinct plan of a table: its program as unit indices and samples, and its claims."""

    plan_id: str
    units: np.ndarray    # int32 index into PlanTable.units per step
    samples: np.ndarray  # int32 samples per step
    cost: float
    time_total: float
    peak_bytes: int


@dataclass(frozen=True)
class TableRow:
    """The plans of one request size: ``plans[k]`` from ``breakpoints[k]`` slots up."""

    breakpoints: np.ndarray  # int64 slots, strictly ascending
    plans: np.ndarray        # int64 index into PlanTable.plans


@dataclass(frozen=True, eq=False)
class PlanTable:
    """Every request size's plans at every budget, for one profile, solver and slot size."""

    fingerprint: str
    solver: str
    objective: str
    slot_bytes: int
    slots: int                  # the top of the table, M
    batch_max: int
    units: tuple[str, ...]
    plans: tuple[TablePlan, ...]
    rows: tuple[TableRow, ...]  # rows[r - 1]

    # ------------------------------------------------------------------ queries

    @property
    def top_bytes(self) -> int:
        """The budget at the top of the table; above it the top plans are returned."""
        return self.slots * self.slot_bytes

    @property
    def meta(self) -> dict[str, Any]:
        """A JSON summary for a store's meta record."""
        return {"schema": SCHEMA, "fingerprint": self.fingerprint, "solver": self.solver,
                "objective": self.objective, "slot_bytes": self.slot_bytes, "slots": self.slots,
                "batch_max": self.batch_max, "plans": len(self.plans),
                "min_bytes": [int(r.breakpoints[0]) * self.slot_bytes if len(r.breakpoints) else None
                              for r in self.rows]}

    def row(self, r: int) -> TableRow:
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= self.batch_max:
            raise UsageError(f"request size {r!r} is outside 1..{self.batch_max} of this table")
        return self.rows[r - 1]

    def _plan(self, index: int, r: int, budget: int) -> Plan:
        tp = self.plans[index]
        program = Program.of((self.units[u], c) for u, c in zip(tp.units.tolist(), tp.samples.tolist()))
        return Plan(solver=self.solver, objective=self.objective, batch=r, budget_bytes=budget,
                    slot_bytes=self.slot_bytes, program=program, cost=tp.cost,
                    time_total=tp.time_total, peak_bytes=tp.peak_bytes)

    def lookup(self, r: int, free_bytes: int) -> Plan:
        """The best plan of r samples that fits in ``free_bytes``, or InfeasibleError saying
        how many bytes are missing. Above the table's top the top plan is returned."""
        row = self.row(r)
        if isinstance(free_bytes, bool) or not isinstance(free_bytes, int) or free_bytes < 0:
            raise UsageError(f"free memory must be a whole number of bytes >= 0, got {free_bytes!r}")
        m = slots_down(free_bytes, self.slot_bytes)
        k = int(np.searchsorted(row.breakpoints, m, side="right")) - 1
        if k < 0:
            if len(row.breakpoints) == 0:
                raise InfeasibleError(
                    f"{self.solver} has no plan of {r} samples below the table's top of "
                    f"{self.top_bytes} bytes: build the table with more slots or a smaller request")
            need = int(row.breakpoints[0]) * self.slot_bytes
            raise InfeasibleError(
                f"no {self.solver} plan of {r} samples fits in {free_bytes} bytes: the smallest "
                f"needs {need} bytes, {need - free_bytes} more; free memory or ask for fewer samples")
        return self._plan(int(row.plans[k]), r, free_bytes)

    def plans_for(self, r: int) -> list[tuple[int, Plan]]:
        """(breakpoint in bytes, plan) for every distinct plan of r samples, ascending."""
        row = self.row(r)
        return [(int(bp) * self.slot_bytes, self._plan(int(p), r, int(bp) * self.slot_bytes))
                for bp, p in zip(row.breakpoints, row.plans)]

    def largest_batch_within(self, free_bytes: int, latency_s: float) -> Plan:
        """The paper's latency bound: the plan of the largest r that fits in ``free_bytes`` and
        finishes all r samples within ``latency_s`` seconds; InfeasibleError if none does."""
        if not (isinstance(latency_s, (int, float)) and latency_s >= 0 and not math.isnan(latency_s)):
            raise UsageError(f"latency bound must be a number of seconds >= 0, got {latency_s!r}")
        fastest = math.inf
        for r in range(self.batch_max, 0, -1):
            try:
                plan = self.lookup(r, free_bytes)
            except InfeasibleError:
                continue
            if plan.time_total <= latency_s:
                return plan
            fastest = min(fastest, plan.time_total)
        if fastest == math.inf:
            raise InfeasibleError(f"no plan of any request size fits in {free_bytes} bytes")
        raise InfeasibleError(f"no request size finishes within {latency_s} s in {free_bytes} "
                              f"bytes; the fastest plan that fits takes {fastest:.6g} s")

    # ------------------------------------------------------------------ bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "fingerprint": self.fingerprint, "solver": self.solver,
            "objective": self.objective, "slot_bytes": self.slot_bytes, "slots": self.slots,
            "batch_max": self.batch_max, "units": list(self.units),
            "plans": [{"id": p.plan_id, "cost": p.cost, "time": p.time_total, "peak": p.peak_bytes,
                       "steps": np.stack([p.units, p.samples], axis=1).reshape(-1).tolist()}
                      for p in self.plans],
            "rows": [{"r": r + 1, "breakpoints": row.breakpoints.tolist(), "plans": row.plans.tolist()}
                     for r, row in enumerate(self.rows)],
        }

    def to_bytes(self) -> bytes:
        """zlib-compressed JSON (schema vbs.table/1)."""
        text = json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False)
        return zlib.compress(text.encode(), 6)

    @classmethod
    def from_bytes(cls, data: bytes) -> "PlanTable":
        try:
            raw = json.loads(zlib.decompress(data))
        except (zlib.error, UnicodeDecodeError, json.JSONDecodeError, TypeError) as exc:
            raise StoreError(f"plan table bytes cannot be read ({exc}): rebuild it with `vbs plan`") from exc
        return cls.from_json(raw)

    @classmethod
    def from_json(cls, raw: Any) -> "PlanTable":
        if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
            got = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
            raise StoreError(f"not a plan table of schema {SCHEMA!r} (got {got!r}): rebuild it with `vbs plan`")
        try:
            plans = []
            for p in raw["plans"]:
                steps = np.asarray(p["steps"], dtype=np.int32).reshape(-1, 2)
                plans.append(TablePlan(str(p["id"]), steps[:, 0].copy(), steps[:, 1].copy(),
                                       float(p["cost"]), float(p["time"]), int(p["peak"])))
            rows = [TableRow(np.asarray(row["breakpoints"], dtype=np.int64),
                             np.asarray(row["plans"], dtype=np.int64)) for row in raw["rows"]]
            table = cls(fingerprint=str(raw["fingerprint"]), solver=str(raw["solver"]),
                        objective=str(raw["objective"]), slot_bytes=int(raw["slot_bytes"]),
                        slots=int(raw["slots"]), batch_max=int(raw["batch_max"]),
                        units=tuple(str(u) for u in raw["units"]), plans=tuple(plans),
                        rows=tuple(rows))
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"plan table is malformed ({exc!r}): rebuild it with `vbs plan`") from exc
        if len(table.rows) != table.batch_max or any(
                len(r.breakpoints) != len(r.plans) or (len(r.plans) and r.plans.max() >= len(plans))
                for r in table.rows):
            raise StoreError("plan table rows do not match its plans: rebuild it with `vbs plan`")
        return table


# --------------------------------------------------------------------------- building


def _row_from_changes(changes: list[tuple[int, int]]) -> TableRow:
    return TableRow(np.array([m for m, _ in changes], dtype=np.int64),
                    np.array([p for _, p in changes], dtype=np.int64))


def build_table(model: Profile | Instance, *, solver: str = "vbs", objective: str = "time",
                slot_bytes: int | None = None, slot_count: int = DEFAULT_SLOT_COUNT) -> PlanTable:
    """Solve once for every r = 1..batch_max and every budget of 0..M slots."""
    if solver not in SOLVERS:
        raise UsageError(f"unknown solver {solver!r}; use one of {', '.join(SOLVERS)}")
    inst = instance_of(model, objective)
    slot = check_slot_bytes(slot_bytes) if slot_bytes is not None else default_slot_bytes(inst, slot_count)
    M = table_slots(inst, slot)
    names = tuple(u.name for u in inst.global_units)
    index = inst.global_index
    plans: list[TablePlan] = []
    rows: list[TableRow] = []

    def add(units: np.ndarray, samples: np.ndarray, cost: float, time: float, peak: int) -> int:
        pid = program_id((names[u], c) for u, c in zip(units.tolist(), samples.tolist()))
        plans.append(TablePlan(pid, units.astype(np.int32), samples.astype(np.int32),
                               cost, time, peak))
        return len(plans) - 1

    def add_pairs(pairs: list[tuple[str, int]], peak: int) -> int:
        cost, time = baselines.program_costs(inst, pairs)
        return add(np.array([index[u] for u, _ in pairs]), np.array([c for _, c in pairs]),
                   cost, time, peak)

    if solver in ("vbs", "paper"):
        tables = ChainTables(inst, solver, slot, M)
        top = tables.top()
        times = np.array([[0.0] + list(u.time) for u in inst.global_units])  # [unit, b]
        for r in range(1, inst.batch_max + 1):
            row = top[r]
            prev = np.concatenate(([np.inf], row[:-1]))
            changes = []
            for m in np.nonzero(row < prev)[0].tolist():
                raw = tables.plan(r, m)
                assert raw is not None
                time = (raw.cost if objective == "time"
                        else math.fsum(times[raw.units, raw.samples].tolist()))
                changes.append((m, add(raw.units, raw.samples, raw.cost, time, raw.peak)))
            rows.append(_row_from_changes(changes))
    elif solver == "fbs":
        for r in range(1, inst.batch_max + 1):
            changes: list[tuple[int, int]] = []
            best = 0
            for m, c in sorted((baselines.fbs_slots(inst, c, r, slot), c) for c in range(1, r + 1)):
                if c > best and m <= M:  # the largest batch that fits from m slots up
                    best = c
                    pid = add_pairs(baselines.fbs_program(inst, c, r), baselines.fbs_peak(inst, c, r))
                    if changes and changes[-1][0] == m:
                        changes[-1] = (m, pid)
                    else:
                        changes.append((m, pid))
            rows.append(_row_from_changes(changes))
    else:
        for r in range(1, inst.batch_max + 1):
            units = baselines.greedy_units(inst, r, slot)
            points = sorted({n for gu in units for n in gu.need_by_batch if n <= M})
            changes, last = [], None
            for m in points:
                choice = baselines.greedy_choice(units, m)
                if choice is None or choice == last:
                    continue
                last = choice
                changes.append((m, add_pairs(baselines.greedy_program(units, choice, r),
                                             baselines.greedy_peak(inst, choice, r))))
            rows.append(_row_from_changes(changes))
    plans_t, rows_t = _compact(plans, rows)
    return PlanTable(fingerprint=inst.fingerprint, solver=solver, objective=objective,
                     slot_bytes=slot, slots=M, batch_max=inst.batch_max, units=names,
                     plans=plans_t, rows=rows_t)


def _compact(plans: list[TablePlan], rows: list[TableRow]) -> tuple[tuple[TablePlan, ...], tuple[TableRow, ...]]:
    """Keep only plans some row uses, each program once (equal ids are equal programs)."""
    used = sorted({int(p) for row in rows for p in row.plans})
    by_id: dict[str, int] = {}
    keep: list[TablePlan] = []
    remap: dict[int, int] = {}
    for old in used:
        pid = plans[old].plan_id
        if pid not in by_id:
            by_id[pid] = len(keep)
            keep.append(plans[old])
        remap[old] = by_id[pid]
    new_rows = tuple(TableRow(row.breakpoints, np.array([remap[int(p)] for p in row.plans], dtype=np.int64))
                     for row in rows)
    return tuple(keep), new_rows
