"""`vbs plan` into a real redis-server and a local directory; `vbs show` beside the baselines."""

from __future__ import annotations

import random

import pytest

from service.commands import main
from core.errors import InfeasibleError, TableFormatError
from core.loaded import ModelSpec
from planner.pipeline import model_key
from planner.solver.compare import STRATEGIES, compare, render
from core.table import PlanTable
from planner.solver.tables import build_tables
from planner.store import open_store
from planner.stored import compiled_key

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
    tid = store.get_model(model_key(spec, "vbs", "time"))
    assert tid and tid.endswith(".vbs.time")
    table = PlanTable.from_bytes(store.get_table(tid).blob)
    assert table.solver == "vbs" and table.objective == "time"
    fingerprint = tid.removesuffix(".vbs.time")
    assert table.fingerprint == fingerprint and store.get_profile(fingerprint)
    # Every compared strategy has its own table under its own id; and where the served table
    # runs a step on torch, so do those the compiled model names (ONNX Runtime's runs alone,
    # for the worker without torch), under their own fingerprint.
    stored = {info.fingerprint for info in store.list_tables()}
    lean = store.get_model(compiled_key("tiny", spec)).split(".")[0]
    assert stored == {f"{fp}.{s}.time" for fp in {fingerprint, lean}
                      for s in ("vbs", "paper", "greedy", "fbs", "fbs-best")}
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
    before = store.list_tables()
    assert len(before) in (5, 10)  # and the compiled model's, where they differ
    _plan(location, tmp_path, capsys, "--replan")
    for info in before:
        assert store.table_version(info.fingerprint) == info.version + 1


def test_services_with_different_solvers_share_a_store(tmp_path, capsys) -> None:
    """A store planned for vbs then for fbs (VBS_SOLVER differs) keeps both served tables."""
    location = str(tmp_path / "store")
    _plan(location, tmp_path, capsys)
    store = open_store(location)
    spec = ModelSpec("tests.planner.factories:two_layer", input_shape=(3, 8, 8))
    vbs_id = store.get_model(model_key(spec, "vbs", "time"))
    vbs_version = store.table_version(vbs_id)
    assert "already in the store" in _plan(location, tmp_path, capsys, "--solver", "fbs")
    fbs_id = store.get_model(model_key(spec, "fbs", "time"))
    assert fbs_id != vbs_id
    assert store.table_version(vbs_id) == vbs_version  # not overwritten
    assert PlanTable.from_bytes(store.get_table(vbs_id).blob).solver == "vbs"
    assert PlanTable.from_bytes(store.get_table(fbs_id).blob).solver == "fbs"


def test_an_old_format_table_is_planned_again(tmp_path, capsys) -> None:
    """A table of schema vbs.table/1 under the served key is never read as a new one."""
    import json
    import zlib

    location = str(tmp_path / "store")
    _plan(location, tmp_path, capsys)
    store = open_store(location)
    spec = ModelSpec("tests.planner.factories:two_layer", input_shape=(3, 8, 8))
    tid = store.get_model(model_key(spec, "vbs", "time"))
    version = store.table_version(tid)
    old = zlib.compress(json.dumps({"schema": "vbs.table/1", "rows": []}).encode())
    store.put_table(tid, old, {"model": "two_layer"})
    with pytest.raises(TableFormatError, match="old schema.*re-plan"):
        PlanTable.from_bytes(store.get_table(tid).blob)
    assert "solved and published" in _plan(location, tmp_path, capsys)
    assert store.table_version(tid) == version + 2
    assert PlanTable.from_bytes(store.get_table(tid).blob).solver == "vbs"


def test_show_prints_every_solver_and_the_units(tmp_path, capsys) -> None:
    argv = ["show", "--model", MODEL, "--batch-max", "4", "--memory", "1MB", "--batch", "4",
            "--store", str(tmp_path / "store"), "--quiet", "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for word in ("vbs", "paper", "greedy", "fbs", "fbs-best", "a", "b", "batches", "unused"):
        assert word in out


def test_compare_solvers_on_the_paper_example() -> None:
    from tests.planner.test_profile import PAPER_EXAMPLE
    from core.tree import profile_from_json

    tables = build_tables(profile_from_json(PAPER_EXAMPLE), STRATEGIES, slot_bytes=1)
    # 7 bytes: L2 runs one sample at a time while L1's two outputs are held (2 + 4 + 1).
    cmp = compare(tables, 2, 7)
    assert cmp.outcome("vbs").time_per_sample == 10 and cmp.outcome("paper").time_per_sample == 10
    assert cmp.outcome("fbs").time_per_sample == 12
    assert cmp.outcome("fbs-best").time_per_sample == 12
    assert cmp.gain("vbs", "fbs") == pytest.approx(1.2) == cmp.gain("vbs")
    assert cmp.outcome("vbs").usage("L2").batches == (1, 1)
    assert cmp.outcome("vbs").plan.peak_bytes == 7
    text = render(cmp, "paper example")
    assert "1.20x" in text and "1x2" in text


def test_show_sweeps_budgets(tmp_path, capsys) -> None:
    argv = ["show", "--model", MODEL, "--batch-max", "4", "--memory", "auto:4", "--batch", "4",
            "--store", str(tmp_path / "store"), "--quiet", "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "vbs/fbs-best" in lines[1] and len(lines) == 2 + 4
    assert lines[-1].split()[-1].endswith("x")  # at the top budget every solver is feasible


def test_plan_takes_the_weights_setting_as_serve_does(monkeypatch, tmp_path) -> None:
    """VBS_WEIGHTS reaches `vbs plan` as it reaches `vbs serve`: a worker without torch serves
    the weights the planner compiled, so a planner that ignored it would serve random ones."""
    from planner.cli_plan import model_specs as _specs
    from planner.cli import settings_from
    from service.commands import build_parser

    weights = tmp_path / "w.pt"
    monkeypatch.setenv("VBS_WEIGHTS", str(weights))
    args = build_parser().parse_args(["plan", "--model", MODEL, "--batch-max", "2"])
    [(served, spec)] = _specs(args, settings_from(args))
    assert served == "tiny" and spec.weights == weights
    args = build_parser().parse_args(["plan", "--model", MODEL, "--weights", "x.pt"])
    assert _specs(args, settings_from(args))[0][1].weights.name == "x.pt"
