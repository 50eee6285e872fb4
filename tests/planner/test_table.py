"""Plan tables keyed by the executor's exact peaks: every breakpoint is what its plan allocates,
a lookup is the best plan that fits, vbs is never worse than the paper or a baseline, fbs-best
is the fastest uniform batch that fits; bytes round trip, old and damaged tables are refused;
the paper's latency bound."""

from __future__ import annotations

import json
import math
import random
import zlib

import numpy as np
import pytest

from core.errors import InfeasibleError, StoreError, TableFormatError, UsageError
from planner.solver import baselines
from core.walk import account, layout
from planner.solver.model import build_instance
from core.program import Program
from planner.solver.simulate import simulate
from planner.solver.synthetic import googlenet_like, resnet50_like
from core.table import PlanTable
from planner.solver.tables import build_table, build_tables
from tests.planner.oracle import chain_profile

SOLVERS = ("vbs", "paper", "greedy", "fbs", "fbs-best")
PROFILE = googlenet_like(6, seed=7)


@pytest.fixture(scope="module")
def tables():
    return build_tables(PROFILE, SOLVERS, slot_count=96)


def _budgets(tables, r):
    """Every breakpoint of every table at r, and a byte on either side of each."""
    points = {int(b) for t in tables.values() for b in t.row(r).peaks}
    return sorted({p + d for p in points for d in (-1, 0, 1) if p + d >= 0})


def test_table_carries_what_it_was_built_from(tables):
    t = tables["vbs"]
    inst = build_instance(PROFILE)
    assert t.fingerprint == "synthetic-googlenet-6-7"
    assert t.solver == "vbs" and t.objective == "time" and t.batch_max == 6 and t.granule == 1
    assert len(t.rows) == 6 and t.slot_bytes > 1
    assert t.units == tuple(u.name for u in inst.global_units)
    assert {s: tables[s].solver for s in SOLVERS} == {s: s for s in SOLVERS}


@pytest.mark.parametrize("solver", SOLVERS)
def test_every_breakpoint_is_what_its_plan_allocates(tables, solver):
    """The table's claim is the executor's walk of the plan as it runs, splits included."""
    t = tables[solver]
    for r in range(1, t.batch_max + 1):
        row = t.row(r)
        assert row.peaks.size and np.all(np.diff(row.peaks) > 0)
        for peak, (bp, plan) in zip(row.peaks, t.plans_for(r)):
            assert bp == peak == plan.peak_bytes
            walked = account(PROFILE.root, plan.program.steps, r, splits=plan.split_map)
            assert walked.peak == peak
            assert layout(PROFILE.root, plan.program.steps, r).peak == peak
            entry = t.plans[t.find(r, int(peak))]
            for u, need in enumerate(entry.unit_peaks.tolist()):  # per unit: its steps' most
                steps = [k for k, g in enumerate(entry.units.tolist()) if g == u]
                assert need == max(walked.needs[k] for k in steps)
            # every plan is a valid program that moves all r samples
            sim = simulate(build_instance(PROFILE, count_request=False), plan.program, r, 1 << 62)
            assert sim.time_total == pytest.approx(plan.time_total) and sim.modelled_bytes == plan.modelled_bytes
    assert len({p.plan_id for p in t.plans}) == len(t.plans)  # only distinct plans are kept


@pytest.mark.parametrize("solver", SOLVERS)
def test_lookup_is_the_best_plan_that_fits(tables, solver):
    """Binary search equals a scan of the row; a plan found for F bytes never needs more."""
    t = tables[solver]
    rng = random.Random(11)
    for _ in range(60):
        r = rng.randint(1, t.batch_max)
        free = rng.randint(0, t.top_bytes + 1000)
        fits = [(peak, p) for peak, p in t.plans_for(r) if peak <= free]
        if not fits:
            with pytest.raises(InfeasibleError, match="needs at least"):
                t.lookup(r, free)
            continue
        got = t.lookup(r, free)
        assert got.peak_bytes <= free
        assert got.plan_id == fits[-1][1].plan_id
        assert got.budget_bytes == free and got.batch == r
    if solver in ("vbs", "paper", "fbs-best"):  # ranked by cost: more memory, never slower
        for r in range(1, t.batch_max + 1):
            costs = [p.cost for _, p in t.plans_for(r)]
            assert all(a > b for a, b in zip(costs, costs[1:]))


def test_vbs_is_never_worse_than_paper_or_a_baseline(tables):
    t = tables["vbs"]
    for r in range(1, t.batch_max + 1):
        for free in _budgets(tables, r):
            try:
                mine = t.lookup(r, free).cost
            except InfeasibleError:
                mine = math.inf
            for other in ("paper", "fbs", "fbs-best", "greedy"):
                try:
                    theirs = tables[other].lookup(r, free).cost
                except InfeasibleError:
                    continue
                assert mine <= theirs * (1 + 1e-12), (r, free, other)


def test_fbs_best_is_the_fastest_uniform_batch_that_fits_and_fbs_the_largest(tables):
    inst = build_instance(PROFILE, count_request=False)
    for r in range(1, 7):
        uniform = {}
        for c in range(1, r + 1):
            steps, runs = baselines.fbs_program(inst, c, r)
            program = Program(steps)
            uniform[c] = (layout(PROFILE.root, steps, r, runs=runs).peak,
                          inst.pricing.program(steps, runs), program.plan_id)
        for free in _budgets(tables, r):
            fit = {c: v for c, v in uniform.items() if v[0] <= free}
            if not fit:
                for s in ("fbs", "fbs-best"):
                    with pytest.raises(InfeasibleError):
                        tables[s].lookup(r, free)
                continue
            fastest = min(fit.values(), key=lambda v: v[1])
            assert tables["fbs-best"].lookup(r, free).cost == pytest.approx(fastest[1])
            assert tables["fbs"].lookup(r, free).plan_id == uniform[max(fit)][2]


def test_lookup_below_the_first_breakpoint_says_how_much_is_missing(tables):
    t = tables["vbs"]
    first = int(t.row(4).peaks[0])
    assert first > 1000 and t.min_peaks[3] == first
    with pytest.raises(InfeasibleError, match=f"needs at least {first} bytes, {first - 1000} more"):
        t.lookup(4, 1000)
    with pytest.raises(InfeasibleError, match="1 more"):
        t.lookup(4, first - 1)
    assert t.lookup(4, first).cost == t.plans[int(t.row(4).plans[0])].cost
    for bad in (0, 7, True):
        with pytest.raises(UsageError):
            t.lookup(bad, first)
    for bad in (-1, 1.5, "1"):
        with pytest.raises(UsageError):
            t.find(4, bad)
    # above the top, the top plan
    assert t.lookup(4, 10 * t.top_bytes).cost == t.plans[int(t.row(4).plans[-1])].cost


def test_largest_fitting_request_is_a_lookup(tables):
    t = tables["vbs"]
    for free in _budgets(tables, 6):
        for r in range(1, 7):
            want = max((k for k in range(1, r + 1) if t.min_peaks[k - 1] <= free), default=0)
            assert t.largest_fitting(r, free) == want


def test_times_within_are_the_lookups_time_for_every_request_size(tables):
    """What the batcher reads after each batch: one lookup per request size, inf where no
    plan of that size fits."""
    t = tables["vbs"]
    for free in _budgets(tables, 6):
        times = t.times_within(free)
        assert len(times) == t.batch_max + 1 and times[0] == 0.0
        for r in range(1, t.batch_max + 1):
            if t.min_peaks[r - 1] <= free:
                assert times[r] == t.lookup(r, free).time_total
            else:
                assert times[r] == math.inf


def test_top_plan_is_at_least_as_good_as_all_layers_at_batch_b(tables):
    inst = build_instance(PROFILE)
    all_b = sum(u.time_at(6) for u in inst.global_units)
    assert tables["vbs"].lookup(6, tables["vbs"].top_bytes).time_total <= all_b * (1 + 1e-12)


@pytest.mark.parametrize("solver", SOLVERS)
def test_bytes_round_trip(tables, solver):
    t = tables[solver]
    blob = t.to_bytes()
    assert isinstance(blob, bytes) and blob[:1] == b"x"  # zlib, never pickle
    back = PlanTable.from_bytes(blob)
    assert back.to_json() == t.to_json()
    assert (back.fingerprint, back.solver, back.slot_bytes, back.granule, back.batch_max) == \
        (t.fingerprint, t.solver, t.slot_bytes, t.granule, t.batch_max)
    for r in range(1, t.batch_max + 1):
        for bp, plan in t.plans_for(r):
            assert back.lookup(r, bp) == t.lookup(r, bp) == plan


def _blob(raw) -> bytes:
    return zlib.compress(json.dumps(raw).encode())


def test_old_and_damaged_tables_are_refused_never_misread(tables):
    with pytest.raises(TableFormatError, match="cannot be read"):
        PlanTable.from_bytes(b"not a table")
    with pytest.raises(TableFormatError, match="schema"):
        PlanTable.from_bytes(_blob({"schema": "something/9"}))
    with pytest.raises(TableFormatError, match="old schema 'vbs.table/1'.*re-plan"):
        PlanTable.from_bytes(_blob({"schema": "vbs.table/1", "plans": [], "rows": []}))
    good = tables["vbs"].to_json()

    def damaged(change):
        raw = json.loads(json.dumps(good))
        change(raw)
        return _blob(raw)

    cases = {
        "unit outside": lambda raw: raw["plans"][0]["steps"].__setitem__(0, 10_000),
        "plan index": lambda raw: raw["rows"][0]["plans"].__setitem__(0, 10_000),
        "ascending": lambda raw: raw["rows"][5].__setitem__("peaks", raw["rows"][5]["peaks"][::-1]),
        "its plan's peak": lambda raw: raw["rows"][0]["peaks"].__setitem__(0, 1),
        "rows for batch_max": lambda raw: raw["rows"].pop(),
        "unit_peaks": lambda raw: raw["plans"][0]["unit_peaks"].pop(),
        "KeyError": lambda raw: raw.pop("granule"),
    }
    for words, change in cases.items():
        with pytest.raises(TableFormatError, match=words):
            PlanTable.from_bytes(damaged(change))
    assert issubclass(TableFormatError, StoreError)


def test_a_table_that_inflates_beyond_the_bound_is_refused(monkeypatch):
    from core import table as module

    monkeypatch.setattr(module, "MAX_TABLE_BYTES", 1000)
    with pytest.raises(TableFormatError, match="more than 1000 bytes"):
        PlanTable.from_bytes(zlib.compress(b" " * 5000))


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
        assert t.largest_batch_within(free, bound) == max(r for r, time in feasible.items()
                                                          if time <= bound)
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
            sim = simulate(p, plan.program, r, 1 << 30, objective="energy")
            assert sim.cost == plan.cost and sim.time_total == plan.time_total


def test_resnet_table_builds_with_add_joins_and_identity_branches():
    t = build_table(resnet50_like(4, seed=1), slot_count=48)
    assert all(t.row(r).peaks.size for r in range(1, 5))


def test_cuda_tables_count_allocations_in_512_byte_blocks():
    """A CUDA profile's table: every peak is the walk with the caching allocator's rounding."""
    from core.tree import Profile

    cuda = Profile(PROFILE.batch_max, PROFILE.root, {**PROFILE.meta, "device": "cuda"})
    assert cuda.granule == 512
    t = build_table(cuda, slot_count=48)
    assert t.granule == 512
    cpu = build_table(PROFILE, slot_count=48)
    for r in (1, 6):
        for bp, plan in t.plans_for(r):
            assert bp == account(PROFILE.root, plan.program.steps, r, granule=512,
                                 splits=plan.split_map).peak
        assert t.min_peaks[r - 1] >= cpu.min_peaks[r - 1]
