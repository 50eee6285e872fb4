"""`vbs bench`: the JSON contract of docs/architecture.md, plots and files, budgets respected."""

from __future__ import annotations

import json

import pytest

from service.commands import main
from core.errors import UsageError
from core.sizes import parse_budgets

KEYS = {"model", "strategy", "memory_budget", "batch", "time_per_sample_measured",
        "time_per_sample_predicted", "peak_bytes_measured", "peak_bytes_predicted",
        "peak_bytes_claimed", "max_abs_error", "feasible"}


def test_bench_json_rows_and_outputs(tmp_path, capsys) -> None:
    argv = ["bench", "--model", "squeezenet1_0", "--input-shape", "3,32,32", "--batch", "3",
            "--memory", "auto:3", "--repeat", "2", "--json", "--out", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache"),
            "--runtime", "onnxruntime"]  # steps on it whichever runtime measures faster here
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["strategy"] for r in rows} == {"vbs", "paper", "greedy", "fbs", "fbs-best"}
    # auto:3 spans fbs-best's least to fbs's whole, both measured (ONNX Runtime's share varies
    # run to run): up to 3 distinct budgets, a row per strategy at each
    budgets = sorted({r["memory_budget"] for r in rows})
    assert 1 <= len(budgets) <= 3 and len(rows) == 5 * len(budgets)
    for row in rows:
        assert KEYS <= set(row)
        if row["feasible"]:
            assert row["peak_bytes_claimed"] <= row["memory_budget"]
            # CPU: a fresh walk predicts what torch allocates, to the byte; the table's claim
            # is that, plus what ONNX Runtime holds inside its calls where steps ran there
            assert row["peak_bytes_measured"] == row["peak_bytes_predicted"]
            if row["runtimes"] == ["torch"]:
                assert row["peak_bytes_claimed"] == row["peak_bytes_measured"]
            else:
                assert row["peak_bytes_claimed"] >= row["peak_bytes_measured"]
            assert row["max_abs_error"] < 1e-3
            assert row["time_per_sample_measured"] > 0
            # vbs's table chosen by measurement first, as `vbs plan` chooses it (and fbs-best's
            # uniform plans measured beside it, and fbs's larger than fbs-best's largest); the
            # other strategies' tables as solved
            if row["strategy"] in ("vbs", "fbs-best"):
                assert row["time_per_sample_table"] > 0
            elif row["strategy"] == "fbs":
                assert row["time_per_sample_table"] is None or row["time_per_sample_table"] > 0
            else:
                assert row["time_per_sample_table"] is None
    assert any(r["runtimes"] and "onnxruntime" in r["runtimes"] for r in rows)
    # One accounting: the sweep starts where fbs-best runs one sample at a time, so the first
    # budget is feasible for fbs-best and vbs; at the top every uniform batch runs and vbs.
    # (The paper's and greedy's layer-by-layer plans may need more there: each of their units
    # is a call of its own, which holds its input and output beside what ONNX Runtime holds.)
    low = [r for r in rows if r["memory_budget"] == min(x["memory_budget"] for x in rows)]
    assert {r["strategy"] for r in low if r["feasible"]} >= {"vbs", "fbs-best", "fbs"}
    top = [r for r in rows if r["memory_budget"] == max(x["memory_budget"] for x in rows)]
    assert all(r["feasible"] for r in top if r["strategy"] in ("vbs", "fbs", "fbs-best"))
    for row in top:
        if row["strategy"] == "vbs":
            assert row["gain_over_fbs_best"] is not None and row["gain_over_fbs"] is not None
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"squeezenet1_0.json", "squeezenet1_0.csv", "squeezenet1_0-time-vs-memory.png",
            "squeezenet1_0-batch-per-unit.png"} <= files


def test_budget_specs() -> None:
    assert parse_budgets("1MB:3MB:1MB", 0, 0) == [1_000_000, 2_000_000, 3_000_000]
    assert parse_budgets("10KiB,20KiB", 0, 0) == [10240, 20480]
    assert parse_budgets("auto:3", 100, 400) == [100, 200, 400]  # even on a log scale
    assert len(parse_budgets("auto", 100, 400)) == 10
    # a range too narrow for N distinct budgets gives each once: no bench row twice
    assert parse_budgets("auto:3", 300, 300) == [300]
    assert parse_budgets("auto:3", 300, 200) == [300]
    assert parse_budgets("auto:10", 100, 103) == [100, 101, 102, 103]
    assert parse_budgets("auto:3", 0, 10) == [0, 5, 10]
    for bad in ("1MB:2MB", "3MB:1MB:1MB", "auto:1", "auto:x"):
        with pytest.raises(UsageError):
            parse_budgets(bad, 0, 10)


def test_the_served_time_error_splits_into_one_scale_and_what_is_left() -> None:
    """A run where the machine ran every plan 20% slower than profiled has a served MAPE of
    about 17%, a scale of 1.2 and nothing left once scaled; a price wrong between plans stays."""
    import torch

    from workers.plans_measured import Row, _summary

    def row(strategy: str, predicted: float, measured: float) -> Row:
        return Row("m", strategy, 1, 4, feasible=True, time_per_sample_predicted=predicted,
                   time_per_sample_measured=measured)

    done = [row("vbs", 1.0, 1.2), row("fbs-best", 2.0, 2.4), row("paper", 1.0, 3.0)]
    s = _summary("m", 4, torch.device("cpu"), 3, done, [1.0], [1.0])
    assert s["served_time_mape"] == pytest.approx(100 * 0.2 / 1.2)
    assert s["served_time_scale"] == pytest.approx(1.2)
    assert s["served_time_scaled_mape"] == pytest.approx(0.0, abs=1e-9)
    done[1] = row("fbs-best", 2.0, 3.6)  # this plan's price 1.5x off beside the other's
    s = _summary("m", 4, torch.device("cpu"), 3, done, [1.0], [1.0])
    assert s["served_time_scale"] == pytest.approx(1.5)  # the median of 1.2 and 1.8
    assert s["served_time_scaled_mape"] > 10
