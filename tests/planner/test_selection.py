"""Measured selection (``planner.solver.selection``): a per-unit plan that measured slower than
the uniform batch at its budget gives way to it, one that measured faster beyond the margin
in every round stays, and so does a larger uniform batch fbs-best passed over; at every budget
the row's plan measured at least as fast as fbs-best's there; the table keeps every plan's
measured time beside its prediction, through its bytes.
The times are given (the rule alone); tests/workers/test_plan_selection.py runs the plans."""

from __future__ import annotations

import json
import statistics

import pytest

from core.errors import InfeasibleError, TableFormatError, UsageError
from core.table import PlanTable
from planner.solver.selection import MARGIN, RULE, select, to_measure, wins
from planner.solver.synthetic import googlenet_like
from planner.solver.tables import build_tables

PROFILE = googlenet_like(6, seed=7)


@pytest.fixture(scope="module")
def tables() -> dict[str, PlanTable]:
    return build_tables(PROFILE, ("vbs", "fbs", "fbs-best"), slot_count=96)


def measured(tables: dict[str, PlanTable], per_unit: float) -> dict[str, list[float]]:
    """Three rounds of every plan to measure: the prediction, times ``per_unit`` for a plan
    that is not uniform, 1% apart."""
    vbs, uniform = tables["vbs"], tables["fbs-best"]
    ids = {p.plan_id for p in uniform.plans} | {p.plan_id for p in tables["fbs"].plans}
    out = {}
    for r in range(1, vbs.batch_max + 1):
        for t, i in to_measure(vbs, uniform, r, tables["fbs"]):
            tp = t.plans[i]
            base = tp.time_total * (1.0 if tp.plan_id in ids else per_unit)
            out[tp.plan_id] = [base * 0.99, base, base * 1.01]
    return out


def budgets(table: PlanTable, r: int) -> list[int]:
    points = {int(b) for b in table.row(r).peaks}
    return sorted({p + d for p in points for d in (-1, 0, 1)})


def median_at(table: PlanTable, r: int, budget: int, seconds: dict[str, list[float]]) -> float:
    return statistics.median(seconds[table.lookup(r, budget).plan_id])


def test_per_unit_plans_that_measure_slower_give_way_to_the_uniform_batch(tables):
    vbs, uniform = tables["vbs"], tables["fbs-best"]
    assert {p.plan_id for p in vbs.plans} - {p.plan_id for p in uniform.plans}  # some per-unit
    seconds = measured(tables, per_unit=10.0)  # (predicted gains are large here)
    done = select(vbs, uniform, seconds)
    assert done.replaced > 0 and done.kept == 0
    assert {p.plan_id for p in done.table.plans} <= {p.plan_id for p in uniform.plans}
    for r in range(1, vbs.batch_max + 1):
        assert done.table.min_peaks[r - 1] <= vbs.min_peaks[r - 1]  # no budget lost
        for b in budgets(uniform, r):
            try:
                want = median_at(uniform, r, b, seconds)
            except InfeasibleError:
                continue
            assert median_at(done.table, r, b, seconds) <= want


def test_per_unit_plans_that_measure_faster_are_kept_and_never_slower_than_uniform(tables):
    vbs, uniform = tables["vbs"], tables["fbs-best"]
    seconds = measured(tables, per_unit=0.8)
    done = select(vbs, uniform, seconds)
    assert done.kept > 0
    assert {p.plan_id for p in done.table.plans} - {p.plan_id for p in uniform.plans}
    for r in range(1, vbs.batch_max + 1):
        for b in budgets(vbs, r):
            try:
                got = median_at(done.table, r, b, seconds)
            except InfeasibleError:
                with pytest.raises(InfeasibleError):
                    vbs.lookup(r, b)
                continue
            try:
                assert got <= median_at(uniform, r, b, seconds)
            except InfeasibleError:
                pass


def test_where_nothing_wins_by_the_margin_the_row_is_fbs_bests_at_every_budget(tables):
    """Every plan of a request size measured alike (1% apart): no challenger, per-unit or
    another uniform batch, displaces the uniform batch fbs-best picks at its budget."""
    vbs, uniform = tables["vbs"], tables["fbs-best"]
    seconds = {pid: [0.99 * r, 1.0 * r, 1.01 * r] for r in range(1, vbs.batch_max + 1)
               for t, i in to_measure(vbs, uniform, r) for pid in [t.plans[i].plan_id]}
    done = select(vbs, uniform, seconds)
    assert done.kept == 0 and done.replaced > 0
    for r in range(1, vbs.batch_max + 1):
        for b in budgets(vbs, r) + budgets(uniform, r):
            try:
                want = uniform.lookup(r, b).plan_id
            except InfeasibleError:
                continue
            assert done.table.lookup(r, b).plan_id == want


def _small_calls_cheap(profile, best: int = 2):  # type: ignore[no-untyped-def]
    """``profile`` with every batch above ``best`` 15% dearer per sample than ``best``: the
    profile's bias the selection corrects (small calls priced low), so that fbs-best's largest
    batch is ``best`` and larger uniform batches lie above it."""
    from core.tree import profile_from_json, profile_to_json

    def walk(node):  # type: ignore[no-untyped-def]
        if isinstance(node, dict):
            times = node.get("time")
            if isinstance(times, list) and len(times) > best:
                node["time"] = [t if b <= best else times[best - 1] * b / best * 1.15
                                for b, t in enumerate(times, start=1)]
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    raw = profile_to_json(profile)
    walk(raw["root"])
    return profile_from_json(raw)


@pytest.fixture(scope="module")
def small_cheap() -> dict[str, PlanTable]:
    return build_tables(_small_calls_cheap(PROFILE), ("vbs", "fbs", "fbs-best"), slot_count=96)


def _passed_over(tables: dict[str, PlanTable]) -> dict[int, set[str]]:
    """By request size, the ids of fbs's uniform batches larger than fbs-best's largest that
    neither fbs-best's row nor vbs's holds."""
    vbs, uniform, fbs = tables["vbs"], tables["fbs-best"], tables["fbs"]
    out = {}
    for r in range(1, vbs.batch_max + 1):
        held = {t.plans[p].plan_id for t in (vbs, uniform) for p in t.row(r).plans.tolist()}
        top = int(uniform.row(r).peaks[-1])
        out[r] = {fbs.plans[p].plan_id for peak, p in zip(fbs.row(r).peaks.tolist(),
                                                            fbs.row(r).plans.tolist())
                  if peak > top} - held
    return out


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_a_larger_uniform_batch_fbs_best_passed_over_is_measured_and_wins_only_by_the_margin(
        small_cheap, factor):
    """The profile prices small calls low, so fbs-best can pass over a larger uniform batch
    that runs faster (one call of all r samples): such a batch is measured too, and takes the
    budgets from its peak up where it beats fbs-best's plan (factor 0.5), and no budget where
    it measures alike or slower (the row is what it is without it)."""
    tables = small_cheap
    vbs, uniform, fbs = tables["vbs"], tables["fbs-best"], tables["fbs"]
    passed = _passed_over(tables)
    assert any(passed.values())  # the profile has such batches (else the test says nothing)
    seconds = measured(tables, per_unit=2.0)  # per-unit plans lose: fbs-best's row or these
    for ids in passed.values():
        assert ids <= seconds.keys()  # measured
        for key in ids:
            seconds[key] = [t * factor for t in seconds[key]]
    done = select(vbs, uniform, seconds, bigger=fbs)
    without = select(vbs, uniform, seconds)
    assert (done.kept > without.kept) == (factor < 1.0 - MARGIN)
    for r, ids in passed.items():
        top = max(vbs.top_bytes, fbs.top_bytes, uniform.top_bytes)
        got = done.table.lookup(r, top).plan_id
        if factor < 1.0 - MARGIN and ids:
            assert got in ids
            assert median_at(done.table, r, top, seconds) < median_at(uniform, r, top, seconds)
        else:
            assert got == without.table.lookup(r, top).plan_id
        for b in budgets(uniform, r) + budgets(fbs, r):
            try:
                want = median_at(uniform, r, b, seconds)
            except InfeasibleError:
                continue
            assert median_at(done.table, r, b, seconds) <= want  # never slower than fbs-best


def test_the_table_keeps_each_plans_measured_time_beside_its_prediction(tables):
    vbs, uniform = tables["vbs"], tables["fbs-best"]
    seconds = measured(tables, per_unit=0.8)
    table = select(vbs, uniform, seconds).table
    again = PlanTable.from_bytes(table.to_bytes())
    for t in (table, again):
        for tp in t.plans:
            assert tp.time_measured == statistics.median(seconds[tp.plan_id])
        for r in range(1, t.batch_max + 1):
            for peak, plan in t.plans_for(r):
                assert plan.time_measured == statistics.median(seconds[plan.plan_id])
                assert plan.to_json()["time_measured"] == plan.time_measured
                assert plan.time_total > 0 and plan.peak_bytes == peak
    assert all(tp.time_measured is None for tp in vbs.plans)  # solved, not measured
    assert "time_measured" not in vbs.lookup(1, vbs.top_bytes).to_json()


def test_the_lookups_weigh_the_measured_time(tables):
    """A measured table's lookups (the latency bound, the batcher's and the shares' times)
    read what `vbs plan` measured, not the prediction beside it."""
    vbs, uniform = tables["vbs"], tables["fbs-best"]
    seconds = {pid: [1.5 * t for t in ts] for pid, ts in measured(tables, 0.8).items()}
    table = select(vbs, uniform, seconds).table
    top = table.top_bytes
    times = table.times_within(top)
    for r in range(1, table.batch_max + 1):
        plan = table.lookup(r, top)
        assert times[r] == plan.time_measured == statistics.median(seconds[plan.plan_id])
        assert plan.time_measured != plan.time_total
    slowest = max(times[1:])
    assert table.largest_batch_within(top, slowest) == max(
        r for r in range(1, table.batch_max + 1) if times[r] <= slowest)


def test_winning_needs_the_margin_and_every_round():
    fast = 1 - MARGIN - 0.01
    assert wins([fast - 0.01, fast, fast + 0.005], [1.0, 1.0, 1.0])
    assert not wins([1 - MARGIN / 2] * 3, [1.0, 1.0, 1.0])  # within the margin
    assert not wins([fast, fast, 1.05], [1.0, 1.0, 1.0])  # its slowest round loses
    assert not wins([fast, fast, 0.96], [0.95, 1.0, 1.0])  # round by round, within the margin
    assert wins([1 - MARGIN] * 3, [1.0] * 3)
    assert wins([0.98] * 3, [1.0] * 3, margin=0.01)  # a quieter machine's margin


def test_winning_is_judged_round_by_round_so_drift_between_rounds_hits_both_alike():
    """Each round runs every plan once: a plan faster in every round by the margin wins though
    the machine ran twice as slow in one round (the rounds' spreads overlap); one slower in a
    single round, or by less than the margin, does not; times of other rounds are refused."""
    rival = [1.0, 2.0, 1.02, 1.5]
    assert wins([0.85, 1.7, 0.87, 1.3], rival)  # 0.85-0.87 of the rival's in every round
    assert not wins([0.85, 2.1, 0.87, 1.3], rival)  # slower in round 2
    assert not wins([0.95, 1.9, 0.97, 1.4], rival)  # faster everywhere, within the margin
    with pytest.raises(UsageError, match="different rounds"):
        wins([0.5, 0.5], rival)


def test_from_five_rounds_one_slow_round_does_not_veto_a_plan_faster_in_the_others():
    """More rounds make the choice surer: of 5, a plan faster by the margin in 4 wins (one
    round slower: a context switch), of 3 it must be faster in all, of 10 in 8."""
    assert wins([0.85, 0.86, 1.05, 0.84, 0.85], [1.0] * 5)
    assert not wins([0.85, 1.05, 0.84], [1.0] * 3)
    assert not wins([0.85, 1.05, 1.02, 0.84, 0.85], [1.0] * 5)  # two of five slower
    assert wins([0.85] * 8 + [1.1, 1.2], [1.0] * 10)
    assert not wins([0.85] * 7 + [1.1, 1.2, 1.3], [1.0] * 10)


def test_a_plan_not_measured_or_tables_of_two_profiles_are_refused(tables):
    vbs, uniform = tables["vbs"], tables["fbs-best"]
    with pytest.raises(UsageError, match="was not measured"):
        select(vbs, uniform, {})
    other = build_tables(googlenet_like(5, seed=7), ("fbs-best",), slot_count=96)["fbs-best"]
    with pytest.raises(UsageError, match="not of one profile"):
        select(vbs, other, measured(tables, 1.0))


def _mixed(tables: dict[str, PlanTable]) -> dict[str, list[float]]:
    """Rounds where some per-unit plans win and others lose: each plan's prediction, times 0.7
    or 1.3 by the parity of its id's first hex digit where it is not uniform."""
    ids = {p.plan_id for p in tables["fbs-best"].plans}
    out = {}
    for key, times in measured(tables, per_unit=1.0).items():
        factor = 1.0 if key in ids else (0.7 if int(key[0], 16) % 2 else 1.3)
        out[key] = [t * factor for t in times]
    return out


def test_solve_given_the_profile_and_the_tables_measurements_says_what_the_table_says(
        tables, tmp_path, capsys):
    """`vbs solve --table` rebuilds the table from the profile and chooses its rows by the
    measurements the table keeps: at every request size and budget it gives the table's plan
    and the table's (measured) time, through the table's JSON, where a plain solve gives the
    DP's own optimum."""
    from core.table import Measurements
    from core.tree import save_profile
    from planner.cli_solve import main
    from planner.solver.selection import chosen

    seconds = _mixed(tables)
    published, done = chosen(tables, "vbs", Measurements.of(MARGIN, seconds, RULE))
    assert done is not None and done.kept > 0 and done.replaced > 0  # both kinds of rows
    table = published["vbs"]
    assert table.measurements is not None and table.measurements.seconds.keys() == seconds.keys()
    again = PlanTable.from_bytes(table.to_bytes())  # what the store and --export-table keep
    assert again.measurements == table.measurements
    profile_path, table_path = tmp_path / "profile.json", tmp_path / "table.json"
    save_profile(PROFILE, profile_path)
    table_path.write_text(json.dumps(again.to_json()))
    differs = 0
    for r in (1, 3, table.batch_max):
        for b in budgets(table, r)[::2] + [table.top_bytes * 2]:
            code = main(["--profile", str(profile_path), "--table", str(table_path),
                         "--memory", str(b), "--batch", str(r), "--json"])
            got = json.loads(capsys.readouterr().out)
            assert code == 0
            try:
                want = table.lookup(r, b)
            except InfeasibleError:
                assert got["feasible"] is False
                continue
            assert (got["plan_id"], got["time_total"], got.get("time_measured")) == \
                (want.plan_id, want.time_total, want.time_measured)
            assert got["time_measured"] == statistics.median(seconds[want.plan_id])
            main(["--profile", str(profile_path), "--memory", str(b), "--batch", str(r),
                  "--slot-bytes", str(table.slot_bytes), "--json"])
            differs += json.loads(capsys.readouterr().out).get("plan_id") != want.plan_id
    assert differs  # the DP's optimum alone is not the table's answer here


def test_solve_refuses_a_table_of_another_profile_or_solver(tables, tmp_path, capsys):
    from core.tree import save_profile
    from planner.cli_solve import main

    table = tables["vbs"]
    table_path = tmp_path / "table.json"
    table_path.write_text(json.dumps(table.to_json()))
    other = tmp_path / "other.json"
    save_profile(googlenet_like(6, seed=8), other)
    assert main(["--profile", str(other), "--table", str(table_path), "--memory", "1GB",
                 "--batch", "2", "--json"]) == 2
    assert "planned from profile" in capsys.readouterr().err
    mine = tmp_path / "mine.json"
    save_profile(PROFILE, mine)
    assert main(["--profile", str(mine), "--table", str(table_path), "--memory", "1GB",
                 "--batch", "2", "--solver", "paper", "--json"]) == 2
    assert "pass --solver vbs" in capsys.readouterr().err


def test_solve_refuses_a_table_chosen_by_an_earlier_rule_naming_the_fix(tables, tmp_path,
                                                                        capsys):
    """A table published before the rule was kept with its measurements (rule 1: across
    rounds, fbs's larger batches unmeasured) cannot be chosen again alike: `vbs solve --table`
    says so and how to plan it again, rather than another answer or a missing plan."""
    from core.table import Measurements
    from core.tree import save_profile
    from planner.cli_solve import main
    from planner.solver.selection import chosen

    published, _ = chosen(tables, "vbs", Measurements.of(MARGIN, _mixed(tables), RULE))
    raw = published["vbs"].to_json()
    assert raw["measurements"]["rule"] == RULE
    del raw["measurements"]["rule"]  # as an earlier release wrote it
    assert PlanTable.from_json(raw).measurements.rule == 1
    profile_path, table_path = tmp_path / "profile.json", tmp_path / "table.json"
    save_profile(PROFILE, profile_path)
    table_path.write_text(json.dumps(raw))
    assert main(["--profile", str(profile_path), "--table", str(table_path), "--memory", "1GB",
                 "--batch", "2", "--json"]) == 2
    err = capsys.readouterr().err
    assert "selection rule 1" in err and "--replan" in err
    raw["measurements"]["rule"] = "two"
    with pytest.raises(TableFormatError, match="rule must be a whole number"):
        PlanTable.from_json(raw)
