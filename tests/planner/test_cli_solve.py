"""``vbs solve``: through run() with the real parser, and as a process (no torch imported)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli_solve import add_parser, run
from core.errors import ProfileError, UsageError
from core.program import Program
from planner.solver.simulate import simulate
from planner.solver.synthetic import googlenet_like
from core.tree import profile_from_json, profile_to_json, save_profile
from tests.planner.test_solver_paper_example import PAPER_EXAMPLE_JSON

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def example(tmp_path):
    path = tmp_path / "paper_example.json"
    path.write_text(PAPER_EXAMPLE_JSON)
    return path


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vbs")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["solve", *argv])


def solve_json(capsys, *argv: str) -> dict:
    assert run(parse(*argv, "--json")) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object on one line
    return json.loads(out)


@pytest.mark.parametrize("solver, per_image", [("vbs", 10.0), ("paper", 10.0), ("fbs", 12.0),
                                               ("fbs-best", 12.0)])
def test_paper_example_json(capsys, example, solver, per_image):
    out = solve_json(capsys, "--profile", str(example), "--memory", "7", "--batch", "2",
                     "--slot-bytes", "1", "--solver", solver)
    assert out["feasible"] is True and out["solver"] == solver
    assert out["time_per_sample"] == per_image and out["time_total"] == 2 * per_image
    assert out["memory_budget"] == 7 and out["slot_bytes"] == 1 and out["peak_bytes"] <= 7
    program = Program.from_json(out["program"])
    sim = simulate(profile_from_json(json.loads(PAPER_EXAMPLE_JSON)), program, 2, 7)
    assert sim.time_total == out["time_total"] and sim.modelled_bytes == out["peak_bytes"]
    assert set(out) >= {"feasible", "time_total", "time_per_sample", "peak_bytes", "program",
                        "solver", "memory_budget", "slot_bytes", "executor_peak_bytes"}
    # What the executor allocates for the same program: the request is its caller's, so at most
    # the DP's figure here (no chunk is read in several views beyond what it holds anyway).
    assert 0 < out["executor_peak_bytes"] <= 7


def test_infeasible_is_an_answer_with_nulls(capsys, example):
    out = solve_json(capsys, "--profile", str(example), "--memory", "6", "--batch", "2")
    assert out["feasible"] is False
    assert out["time_total"] is None and out["time_per_sample"] is None
    assert out["peak_bytes"] is None and out["program"] is None
    assert out["memory_budget"] == 6 and "more" in out["reason"]


def test_memory_with_units_and_default_slots(capsys, tmp_path):
    path = tmp_path / "g.json"
    save_profile(googlenet_like(4, seed=3), path)
    out = solve_json(capsys, "--profile", str(path), "--memory", "60MiB", "--batch", "4")
    assert out["memory_budget"] == 60 * 2**20 and out["slot_bytes"] > 1
    assert out["feasible"] is True and out["peak_bytes"] <= 60 * 2**20
    dec = solve_json(capsys, "--profile", str(path), "--memory", "0.06GB", "--batch", "4")
    assert dec["memory_budget"] == 60_000_000


def test_energy_objective(capsys, tmp_path):
    raw = json.loads(PAPER_EXAMPLE_JSON)
    for layer in raw["root"]:
        layer["energy"] = [1.0, 5.0]
    path = tmp_path / "e.json"
    path.write_text(json.dumps(raw))
    out = solve_json(capsys, "--profile", str(path), "--memory", "100", "--batch", "2",
                     "--slot-bytes", "1", "--objective", "energy")
    assert out["cost"] == 6.0 and out["time_total"] == 24.0  # batch 1 everywhere is cheapest


def test_readable_table(capsys, example):
    assert run(parse("--profile", str(example), "--memory", "7", "--batch", "2", "--slot-bytes", "1")) == 0
    text = capsys.readouterr().out
    assert "10 s per sample" in text
    lines = {line.split()[0]: line.split() for line in text.splitlines()[3:]}
    assert lines["L2"][-2:] == ["1", "1"] and lines["L1"][-1] == "2"
    assert lines["L2"][1:3] == ["0", "B"]  # no memory left while L2 runs (Table III)


@pytest.mark.parametrize("argv, error, match", [
    (["--memory", "7 parsecs", "--batch", "2"], UsageError, "unit"),
    (["--memory", "7", "--batch", "3"], UsageError, "batch_max"),
    (["--memory", "7", "--batch", "2", "--slot-bytes", "0"], UsageError, "slot"),
    (["--memory", "7", "--batch", "2", "--objective", "energy"], UsageError, "energy"),
])
def test_bad_input_raises_for_main_to_report(example, argv, error, match):
    with pytest.raises(error, match=match):
        run(parse("--profile", str(example), *argv))


def test_missing_or_bad_profile_is_a_profile_error(tmp_path):
    with pytest.raises(ProfileError, match="no profile"):
        run(parse("--profile", str(tmp_path / "none.json"), "--memory", "7", "--batch", "1"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        run(parse("--profile", str(bad), "--memory", "7", "--batch", "1"))


def test_as_a_process_without_torch(example):
    code = ("import sys, json; import planner.cli_solve as c; "
            "rc = c.main(['--profile', sys.argv[1], '--memory', '7', '--batch', '2', '--slot-bytes', '1', '--json']); "
            "print('torch' in sys.modules); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, str(example)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()
    assert json.loads(first)["time_per_sample"] == 10.0
    assert second == "False"
    bad = subprocess.run([sys.executable, "-m", "planner.cli_solve", "--profile", str(example),
                          "--memory", "lots", "--batch", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "size" in bad.stderr


def test_round_trip_profile_file_is_accepted(capsys, tmp_path, example):
    p = profile_from_json(json.loads(PAPER_EXAMPLE_JSON))
    path = tmp_path / "again.json"
    path.write_text(json.dumps(profile_to_json(p)))
    assert solve_json(capsys, "--profile", str(path), "--memory", "7", "--batch", "2",
                      "--slot-bytes", "1")["time_total"] == 20.0


def test_dispatched_by_the_vbs_command(capsys, example):
    from service.commands import main
    assert main(["solve", "--profile", str(example), "--memory", "7", "--batch", "2",
                 "--slot-bytes", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["time_per_sample"] == 10.0
    assert main(["solve", "--profile", str(example), "--memory", "7XB", "--batch", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vbs solve: error:") and err.count("\n") == 1
