"""Plan tables: one solve for every (r, budget); lookup == direct solve; bytes round trip;
the paper's latency bound."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

from planner.errors import InfeasibleError, StoreError, UsageError
from planner.solver.model import build_instance
from planner.solver.program import Program
from planner.solver.simulate import simulate
from planner.solver.solve import solve
from planner.solver.synthetic import googlenet_like, resnet50_like
from planner.solver.table import PlanTable, build_table
from tests.planner.oracle import chain_profile

SOLVERS = ("vbs", "paper", "fbs", "greedy")


@pytest.fixture(scope="module")
def inst():
    return build_instance(googlenet_like(6, seed=7))


@pytest.fixture(scope="module")
def tables(inst):
    return {s: build_table(inst, solver=s, slot_count=96) for s in SOLVERS}


def test_table_carries_what_it_was_built_from(inst, tables):
    t = tables["vbs"]
    assert t.fingerprint == inst.fingerprint == "synthetic-googlenet-6-7"
    assert t.solver == "vbs" and t.objective == "time" and t.batch_max == 6
    assert len(t.rows) == 6 and t.slots >= 96 and t.slot_bytes > 1
    assert t.units == tuple(u.name for u in inst.global_units)


@pytest.mark.parametrize("solver", SOLVERS)
def test_breakpoints_ascend_and_plans_fit_where_they_start(inst, tables, solver):
    t = tables[solver]
    for r in range(1, t.batch_max + 1):
        row = t.row(r)
        assert np.all(np.diff(row.breakpoints) > 0)
        assert row.breakpoints.size == 0 or (row.breakpoints[0] >= 0 and row.breakpoints[-1] <= t.slots)
        costs = [t.plans[p].cost for p in row.plans]
        if solver in ("vbs", "paper"):  # a DP plan changes only when it gets strictly better
            assert all(a > b for a, b in zip(costs, costs[1:]))
        for bp, p in zip(row.breakpoints, row.plans):
            plan = t.plans[p]
            assert plan.peak_bytes <= bp * t.slot_bytes
            assert plan.plan_id == Program.of((t.units[u], c) for u, c in
                                              zip(plan.units.tolist(), plan.samples.tolist())).plan_id
    assert len({p.plan_id for p in t.plans}) == len(t.plans)  # only distinct plans are kept


@pytest.mark.parametrize("solver", SOLVERS)
def test_lookup_equals_a_direct_solve(inst, tables, solver):
    t = tables[solver]
    rng = random.Random(11)
    for _ in range(25):
        r = rng.randint(1, t.batch_max)
        free = rng.randint(0, t.top_bytes)
        try:
            direct = solve(inst, r, free, solver=solver, slot_bytes=t.slot_bytes)
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                t.lookup(r, free)
            continue
        got = t.lookup(r, free)
        assert got.cost == pytest.approx(direct.cost, rel=1e-12)
        if solver in ("fbs", "greedy"):
            assert got.program == direct.program
        sim = simulate(inst, got.program, r, free, slot_bytes=t.slot_bytes)
        assert sim.peak_bytes == got.peak_bytes <= free
        assert sim.cost == pytest.approx(got.cost, rel=1e-9)
        assert got.budget_bytes == free and got.batch == r


def test_vbs_table_is_never_worse_than_paper_or_baselines(tables):
    t = tables["vbs"]
    for r in range(1, t.batch_max + 1):
        for bp in sorted({int(b) for s in SOLVERS for b in tables[s].row(r).breakpoints}):
            free = bp * t.slot_bytes
            mine = t.lookup(r, free).cost
            for other in ("paper", "fbs", "greedy"):
                try:
                    assert mine <= tables[other].lookup(r, free).cost * (1 + 1e-12)
                except InfeasibleError:
                    pass


def test_lookup_below_the_first_breakpoint_says_how_much_is_missing(tables):
    t = tables["vbs"]
    first = int(t.row(4).breakpoints[0]) * t.slot_bytes
    assert first > 1000
    with pytest.raises(InfeasibleError, match=f"needs {first} bytes, {first - 1000} more"):
        t.lookup(4, 1000)
    with pytest.raises(InfeasibleError, match="1 more"):
        t.lookup(4, first - 1)
    assert t.lookup(4, first).cost == t.plans[int(t.row(4).plans[0])].cost
    with pytest.raises(UsageError):
        t.lookup(0, first)
    with pytest.raises(UsageError):
        t.lookup(7, first)
    # above the top, the top plan
    assert t.lookup(4, 10 * t.top_bytes).cost == t.plans[int(t.row(4).plans[-1])].cost


def test_top_plan_is_at_least_as_good_as_all_layers_at_batch_b(inst, tables):
    t = tables["vbs"]
    all_b = sum(u.time_at(6) for u in inst.global_units)
    assert t.lookup(6, t.top_bytes).time_total <= all_b * (1 + 1e-12)


@pytest.mark.parametrize("solver", SOLVERS)
def test_bytes_round_trip(tables, solver):
    t = tables[solver]
    blob = t.to_bytes()
    assert isinstance(blob, bytes) and blob[:1] == b"x"  # zlib, never pickle
    back = PlanTable.from_bytes(blob)
    assert back.to_json() == t.to_json()
    assert (back.fingerprint, back.solver, back.slot_bytes, back.slots, back.batch_max) == \
        (t.fingerprint, t.solver, t.slot_bytes, t.slots, t.batch_max)
    for r in range(1, t.batch_max + 1):
        for bp, plan in t.plans_for(r):
            assert back.lookup(r, bp) == t.lookup(r, bp) == plan


def test_bad_bytes_are_store_errors(tables):
    with pytest.raises(StoreError):
        PlanTable.from_bytes(b"not a table")
    with pytest.raises(StoreError, match="schema"):
        PlanTable.from_bytes(zlib.compress(b'{"schema": "something/9"}'))
    with pytest.raises(StoreError):
        PlanTable.from_bytes(zlib.compress(b'{"schema": "vbs.table/1", "plans": 3}'))


def test_latency_bound_picks_the_largest_request_that_finishes_in_time(tables):
    t = tables["vbs"]
    free = t.top_bytes // 3
    feasible = {}
    for r in range(1, t.batch_max + 1):
        try:
            feasible[r] = t.lookup(r, free).time_total
        except InfeasibleError:
            pass
    assert feasible
    for bound in sorted(feasible.values()):
        plan = t.largest_batch_within(free, bound)
        assert plan.time_total <= bound
        assert plan.batch == max(r for r, time in feasible.items() if time <= bound)
    with pytest.raises(InfeasibleError, match="fastest"):
        t.largest_batch_within(free, min(feasible.values()) / 2)
    with pytest.raises(UsageError):
        t.largest_batch_within(free, -1)


def test_one_table_serves_every_request_size_and_energy():
    p = chain_profile([(1, 2, [3, 4, 5], [1, 2, 3]), (2, 1, [3, 5, 6], [2, 2, 2])], batch_max=3,
                      energy=[[1, 1, 1], [2, 2, 2]])
    t = build_table(p, objective="energy", slot_bytes=1)
    assert t.objective == "energy" and t.slot_bytes == 1
    for r in (1, 2, 3):
        plans = t.plans_for(r)
        assert plans
        for bp, plan in plans:
            sim = simulate(p, plan.program, r, bp, objective="energy")
            assert sim.cost == plan.cost and sim.time_total == plan.time_total


def test_resnet_table_builds_with_add_joins_and_identity_branches():
    t = build_table(resnet50_like(4, seed=1), slot_count=48)
    assert all(t.row(r).breakpoints.size for r in range(1, 5))
