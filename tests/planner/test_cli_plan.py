"""`vbs plan` into a real redis-server and a local directory; `vbs show` beside the baselines."""

from __future__ import annotations

import random

import pytest

from planner.cli import main
from planner.errors import InfeasibleError
from planner.pipeline import model_key
from planner.models import ModelSpec
from planner.solver.compare import compare, render
from planner.solver.table import PlanTable
from planner.store import open_store

MODEL = "tiny=tests.planner.factories:two_layer@3x8x8"


def _plan(store: str, tmp_path, capsys, *extra: str) -> str:
    argv = ["plan", "--model", MODEL, "--batch-max", "4", "--store", store, "--quiet",
            "--cache-dir", str(tmp_path / "cache"), *extra]
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("backend", ["redis", "local"])
def test_plan_publishes_a_table_that_reads_back_with_the_same_lookups(backend, request, tmp_path,
                                                                      capsys) -> None:
    location = request.getfixturevalue("redis_url") if backend == "redis" else str(tmp_path / "store")
    out = _plan(location, tmp_path, capsys)
    assert "solved and published" in out
    store = open_store(location)
    spec = ModelSpec("tests.planner.factories:two_layer", input_shape=(3, 8, 8))
    fingerprint = store.get_model(model_key(spec))
    assert fingerprint
    table = PlanTable.from_bytes(store.get_table(fingerprint).blob)
    assert store.get_profile(fingerprint)
    # Planning again finds the table in the store.
    assert "already in the store" in _plan(location, tmp_path, capsys)
    # The table as read back answers every lookup as the planner's own table.
    again = PlanTable.from_bytes(table.to_bytes())
    rng = random.Random(0)
    for _ in range(200):
        r, free = rng.randint(1, 4), rng.randint(0, table.top_bytes + 4096)
        try:
            a = table.lookup(r, free).plan_id
        except InfeasibleError:
            a = None
        try:
            b = again.lookup(r, free).plan_id
        except InfeasibleError:
            b = None
        assert a == b
    store.close()


def test_replan_publishes_a_new_version(tmp_path, capsys) -> None:
    location = str(tmp_path / "store")
    _plan(location, tmp_path, capsys)
    store = open_store(location)
    [info] = store.list_tables()
    _plan(location, tmp_path, capsys, "--replan")
    assert store.table_version(info.fingerprint) == info.version + 1


def test_show_prints_every_solver_and_the_units(tmp_path, capsys) -> None:
    argv = ["show", "--model", MODEL, "--batch-max", "4", "--memory", "1MB", "--batch", "4",
            "--store", str(tmp_path / "store"), "--quiet", "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for word in ("vbs", "paper", "greedy", "fbs", "a", "b", "batches", "unused"):
        assert word in out


def test_compare_solvers_on_the_paper_example() -> None:
    from tests.planner.test_profile import PAPER_EXAMPLE
    from planner.tree import profile_from_json

    cmp = compare(profile_from_json(PAPER_EXAMPLE), 2, 7, slot_bytes=1)
    assert cmp.outcome("vbs").time_per_sample == 10 and cmp.outcome("paper").time_per_sample == 10
    assert cmp.outcome("fbs").time_per_sample == 12
    assert cmp.gain("vbs", "fbs") == pytest.approx(1.2)
    assert cmp.outcome("vbs").simulation.usage("L2").batches == (1, 1)
    text = render(cmp, "paper example")
    assert "1.20x" in text and "1x2" in text


def test_show_sweeps_budgets(tmp_path, capsys) -> None:
    argv = ["show", "--model", MODEL, "--batch-max", "4", "--memory", "auto:4", "--batch", "4",
            "--store", str(tmp_path / "store"), "--quiet", "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "vbs/fbs" in lines[1] and len(lines) == 2 + 4
    assert lines[-1].split()[-1].endswith("x")  # at the top budget every solver is feasible
