"""`vbs plan` runs what it proposes: every plan of the served table and every uniform plan of
fbs-best run in the executor (``workers.plan_selection``), and the tables the worker without
torch serves keep each plan's measured time; at every budget the served plan measured at
least as fast as fbs-best's there, in the same rounds. Timings decide nothing here: what is
checked holds whatever the machine measured."""

from __future__ import annotations

from pathlib import Path

from core.errors import InfeasibleError
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
