"""Unit runtimes in the plan, on hand-made trees (no torch): which steps one runtime call runs
(runs), what they hold and cost, and how tables name every step's runtime."""

from __future__ import annotations

import math

import pytest

from core.errors import InvalidProgramError, TableFormatError
from core.walk import account, layout
from planner.solver.pricing import Pricing
from core.program import Step
from core.runs import CallCost, TreeIndex, held_inside_bound
from planner.solver.simulate import simulate
from core.table import PlanTable
from planner.solver.tables import build_table
from core.tree import Layer, Measured, Parallel, Profile, Series

ORT, TORCH = "onnxruntime", "torch"
B = 4


def unit(name: str, size: int = 1, t_ort: float = 1.0, t_torch: float = 3.0, ws_ort: int = 2,
         ws_torch: int = 1) -> Layer:
    """A unit ONNX Runtime runs faster, with more workspace (per sample) than torch."""
    ort = Measured((t_ort,) * B, tuple(ws_ort * b for b in range(1, B + 1)))
    torch = Measured((t_torch,) * B, tuple(ws_torch * b for b in range(1, B + 1)))
    return Layer(name, size, size, time=ort.time, ws=ort.ws, runtimes=((TORCH, torch), (ORT, ort)),
                 runtime=(ORT,) * B)


CHAIN = Series("net", (unit("A"), unit("B"), unit("C")))
BLOCK = Series("net", (
    unit("stem", size=2),
    Parallel("blk", 2, 2, branches=(Series("a", (unit("a1", size=2),)), Series("id", ())),
             join="add", time=(0.5,) * B, runtimes=((ORT, Measured((0.0,) * B)),)),
    unit("head", size=2),
))
COST = {ORT: CallCost((10.0,) * B, (0.25,) * B)}


def steps(*pairs: tuple[str, int] | tuple[str, int, str]) -> list[Step]:
    return [Step(*p) for p in pairs]  # type: ignore[arg-type]


def test_the_walk_runs_the_runs_a_plan_gives_it() -> None:
    program = steps(("A", 2, ORT), ("B", 2, ORT), ("C", 2, ORT))
    assert layout(CHAIN, program, 2, runs=((0, 2),)).runs == ((0, 2),)
    # cut after A: two calls; the walk does not fuse them again
    cut = layout(CHAIN, program, 2, runs=((0, 0), (1, 2)))
    assert cut.runs == ((0, 0), (1, 2))
    whole = layout(CHAIN, program, 2, runs=((0, 2),))
    # one call holds what it holds inside and C's output from its start; cut, A needs less
    assert cut.needs[0] < whole.needs[0] and cut.peak <= whole.peak


def test_the_walk_refuses_a_run_that_would_overtake_samples_waiting_inside_it() -> None:
    # B has run one sample; a call of B..C on the other would pass it on the way to C
    program = steps(("A", 2, ORT), ("B", 1, ORT), ("B", 1, ORT), ("C", 1, ORT), ("C", 1, ORT))
    with pytest.raises(InvalidProgramError, match="wait between its units"):
        account(CHAIN, program, 2, runs={0: 0, 1: 1, 2: 3, 4: 4})
    assert account(CHAIN, program, 2, runs={0: 0, 1: 1, 2: 2, 3: 3, 4: 4}).peak > 0


def test_the_simulator_refuses_a_run_that_is_not_one() -> None:
    profile = Profile(batch_max=B, root=BLOCK, meta={"runtimes": {ORT: {
        "call_s": [1.0] * B, "byte_s": [0.0] * B}}})
    ok = steps(("stem", 2, ORT), ("blk", 2, ORT), ("a1", 2, ORT), ("head", 2, ORT))
    assert simulate(profile, ok, 2, 10**6, runs=((0, 3),)).time_total == 3.0 + 0.0 + 1.0
    with pytest.raises(InvalidProgramError, match="once each at one batch size"):
        simulate(profile, ok, 2, 10**6, runs=((0, 1),))  # a block not whole
    mixed = steps(("stem", 1, ORT), ("stem", 1, ORT), ("blk", 2, ORT), ("a1", 2, ORT),
                  ("head", 2, ORT))
    with pytest.raises(InvalidProgramError, match="once each at one batch size"):
        simulate(profile, mixed, 2, 10**6, runs=((1, 4),))
    waits = steps(("stem", 1, ORT), ("stem", 1, ORT), ("blk", 1, ORT), ("a1", 1, ORT),
                  ("blk", 1, ORT), ("a1", 1, ORT), ("head", 2, ORT))
    with pytest.raises(InvalidProgramError, match="wait between its units"):
        simulate(profile, waits, 2, 10**6, runs=((1, 3),))  # a sample of stem's waits at blk


def test_what_a_run_holds_inside_its_runtime_and_what_the_executor_allocates() -> None:
    program = steps(("A", 2), ("B", 2), ("C", 2))
    runs = {0: 2}
    # inside: B's input and output (A's and C's are the walk's) and its workspace, the most
    inside = held_inside_bound(CHAIN.children, 2, ORT)
    assert inside == max(0 + 2 + 4, 2 + 2 + 4, 2 + 0 + 4)
    # the executor allocates the run's output (the request is its caller's)
    assert account(CHAIN, program, 2, runs=runs, inside=False).peak == 2
    assert account(CHAIN, program, 2, runs=runs).peak == inside + 2
    # a block inside: the fork and every branch output at the join (2 bytes a sample, a
    # workspace of 2 a sample)
    assert held_inside_bound(BLOCK.children, 2, ORT) == max(
        0 + 4 + 4,                     # stem: its output, its workspace
        4 + 4 + max(0 + 4 + 4, 4),     # blk: fork, join; a1: its output (the branch's), ws
        4 + 0 + 4)                     # head: its input, its workspace


def test_time_of_runs_and_single_calls() -> None:
    price = Pricing(TreeIndex(CHAIN), COST)
    one = steps(("A", 2, ORT), ("B", 2, ORT), ("C", 2, ORT))
    # one call: the units' times inside it, and the call's cost for 1 byte in and 1 out a sample
    assert price.program(one, ((0, 2),)) == 3 * 1.0 + 10.0 + 0.25 * 2 * (1 + 1)
    assert price.run(CHAIN.children, ORT, 2) == price.program(one, ((0, 2),))
    # three calls: each unit pays a call; a step on ONNX Runtime outside a run is a call too
    assert price.program(one, ((0, 0), (1, 1), (2, 2))) == 3 * (1.0 + 10.0 + 0.25 * 4)
    assert price.program(one, ()) == price.program(one, ((0, 0), (1, 1), (2, 2)))
    # on torch: its own times, no call cost
    assert price.program(steps(("A", 2, TORCH), ("B", 2, TORCH), ("C", 2, TORCH)), ()) == 9.0
    # a block run whole costs its join's time inside the run; else the walk's folds
    whole = steps(("stem", 2, ORT), ("blk", 2, ORT), ("a1", 2, ORT), ("head", 2, ORT))
    assert Pricing(TreeIndex(BLOCK), COST).program(whole, ((0, 3),)) == 3.0 + 0.0 + 10.0 + 0.25 * 8


def _profile() -> Profile:
    meta = {"runtime": "auto", "runtimes": {ORT: {"version": "x", "call_s": [1e-3] * B,
                                                  "byte_s": [0.0] * B}}}
    tree = Series("net", (unit("A", size=100, t_ort=1e-3, t_torch=3e-3, ws_ort=50, ws_torch=0),
                          unit("B", size=100, t_ort=1e-3, t_torch=3e-3, ws_ort=50, ws_torch=0)))
    return Profile(batch_max=B, root=tree, meta=meta)


def test_tables_name_every_step_s_runtime_and_keep_torch_where_it_needs_less() -> None:
    table = build_table(_profile(), slot_count=64)
    assert table.runtimes == (TORCH, ORT)
    top = table.plans_for(4)[-1][1]
    assert {s.runtime for s in top.program.steps} == {ORT} and top.runs == ((0, 1),)
    assert math.isclose(top.time_total, 2e-3 + 1e-3)  # one call
    # the least memory: B on torch, which needs no workspace (ONNX Runtime's does), A on
    # ONNX Runtime, as fast and within the same peak; each call priced
    least = table.plans_for(4)[0][1]
    assert [s.runtime for s in least.program.steps] == [ORT, TORCH] and least.runs == ((0, 0),)
    assert least.peak_bytes < top.peak_bytes
    assert math.isclose(least.time_total, (1e-3 + 1e-3) + 3e-3)
    again = PlanTable.from_bytes(table.to_bytes())
    assert again.runtimes == table.runtimes
    for k in range(len(table.plans)):
        assert again.program(k) == table.program(k) and again.plans[k].runs == table.plans[k].runs


def test_tables_of_an_older_schema_are_refused() -> None:
    import json
    import zlib

    raw = build_table(_profile(), slot_count=64).to_json()
    raw["schema"] = "vbs.table/2"
    with pytest.raises(TableFormatError, match="re-plan"):
        PlanTable.from_bytes(zlib.compress(json.dumps(raw).encode()))
    raw["schema"] = "vbs.table/3"
    raw["plans"][0]["runs"] = [[1, 0]]
    with pytest.raises(TableFormatError, match="runs"):
        PlanTable.from_bytes(zlib.compress(json.dumps(raw).encode()))
