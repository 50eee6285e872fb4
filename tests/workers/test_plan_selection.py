"""`vbs plan` runs what it proposes: every plan of the served table and every uniform plan of
fbs-best run in the executor (``workers.plan_selection``), and the tables the worker without
torch serves keep each plan's measured time; at every budget the served plan measured at
least as fast as fbs-best's there, in the same rounds. Timings decide nothing here: what is
checked holds whatever the machine measured."""

from __future__ import annotations

import json
from pathlib import Path

from core.errors import InfeasibleError
from core.table import PlanTable
from core.spec import ModelSpec
from planner.store import open_store
from planner.stored import read_compiled
from service.commands import main

NAME, SHAPE = "tests.planner.factories:two_layer", (3, 8, 8)


def _plan(tmp_path: Path, store: str, rounds: int) -> None:
    assert main(["plan", "--model", f"m={NAME}@3x8x8", "--batch-max", "3", "--store", store,
                 "--cache-dir", str(tmp_path / "cache"), "--select-rounds", str(rounds),
                 "--quiet"]) == 0


def test_the_served_tables_are_measured_and_never_slower_than_the_uniform_batch(
        tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    _plan(tmp_path, store, 2)
    with open_store(store) as st:
        stored = read_compiled(st, "m", ModelSpec(NAME, input_shape=SHAPE), "vbs", "time")
    vbs, uniform = stored.tables["vbs"], stored.tables["fbs-best"]
    assert all(tp.time_measured is not None and tp.time_measured > 0 for tp in vbs.plans)
    for r in range(1, vbs.batch_max + 1):
        for peak, plan in vbs.plans_for(r):
            for budget in (peak, peak + 1, vbs.top_bytes):
                try:
                    rival = uniform.lookup(r, budget)
                except InfeasibleError:
                    continue
                assert rival.time_measured is not None
                assert vbs.lookup(r, budget).time_measured <= rival.time_measured
            assert plan.time_total > 0  # the prediction beside it


def test_select_rounds_zero_publishes_the_tables_as_solved(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    _plan(tmp_path, store, 0)
    with open_store(store) as st:
        stored = read_compiled(st, "m", ModelSpec(NAME, input_shape=SHAPE), "vbs", "time")
    assert all(tp.time_measured is None for t in stored.tables.values() for tp in t.plans)


def test_solve_given_the_exported_profile_and_table_answers_as_the_served_table(
        tmp_path: Path, capsys) -> None:
    """`vbs plan` keeps the selection's rounds in the table; `vbs show --export-*` gives the
    table and its profile; `vbs solve --table` then says the plan and the measured time the
    worker's lookup gives, at every breakpoint of every request size."""
    store = str(tmp_path / "store")
    _plan(tmp_path, store, 2)
    table_path, profile_path = tmp_path / "table.json", tmp_path / "profile.json"
    assert main(["show", "--model", f"m={NAME}@3x8x8", "--batch-max", "3", "--store", store,
                 "--cache-dir", str(tmp_path / "cache"), "--quiet", "--export-table",
                 str(table_path), "--export-profile", str(profile_path)]) == 0
    capsys.readouterr()
    table = PlanTable.from_json(json.loads(table_path.read_text()))
    assert table.measurements is not None
    for r in range(1, table.batch_max + 1):
        for peak, plan in table.plans_for(r):
            assert main(["solve", "--profile", str(profile_path), "--table", str(table_path),
                         "--memory", str(peak), "--batch", str(r), "--json"]) == 0
            got = json.loads(capsys.readouterr().out)
            assert (got["plan_id"], got["time_total"], got["time_measured"]) == \
                (plan.plan_id, plan.time_total, plan.time_measured)


def test_a_short_plan_runs_several_calls_a_round_and_its_round_is_their_mean(
        monkeypatch) -> None:
    """A plan of a few milliseconds is timed over ``ROUND_S`` of calls back to back in each
    round (their mean), not by one call's jitter; a long one once a round, as before. Counted
    by the executor's calls: what a round ran, whatever the machine measured."""
    import workers.plan_selection as selection
    from planner.graph.capture import capture
    from planner.models import load_model
    from planner.profiling.profiler import ProfileOptions, measure
    from planner.solver.tables import build_tables

    assert selection.calls_per_round(1.0) == 1 and selection.calls_per_round(0.005) == 4
    assert selection.calls_per_round(1e-9) == selection.MAX_CALLS
    cap = capture(load_model(ModelSpec(NAME, input_shape=SHAPE)))
    tables = build_tables(measure(cap, ProfileOptions(batch_max=2, repeats=1, warmup=1),
                                  progress=False), ("vbs", "fbs-best"), slot_count=16)
    calls: list[int] = []
    execute = selection.execute

    def counted(*args, **kwargs):
        calls.append(1)
        return execute(*args, **kwargs)

    monkeypatch.setattr(selection, "execute", counted)
    rounds = 2
    seconds = selection.measure(cap, tables["vbs"], tables["fbs-best"], rounds, sizes=[2])
    assert seconds and all(len(v) == rounds and min(v) > 0 for v in seconds.values())
    # each plan: its check, the call that sizes its round, then its rounds; a plan of this
    # tiny model takes far below ROUND_S a call, so its rounds ran several calls each
    assert len(calls) > len(seconds) * (2 + rounds)
    assert len(calls) <= len(seconds) * (2 + rounds * selection.MAX_CALLS)
