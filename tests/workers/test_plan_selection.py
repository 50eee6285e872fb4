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
