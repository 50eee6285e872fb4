"""The simulator: the one executable statement of what a program means (docs/architecture.md's model).

Every need below is computed by hand from the model of memory in the module docstring of
planner.solver.simulate, so these tests pin the semantics the executor must follow.
"""

from __future__ import annotations

import pytest

from core.errors import InvalidProgramError, UsageError
from core.program import Program, Step
from planner.solver.simulate import simulate
from core.tree import profile_from_json
from tests.planner.oracle import chain_profile


def paper_example():
    # the paper's three-layer example: in = out = 1 per sample, ws = b, 4b, b, time 4 / 6
    return chain_profile([(1, 1, [4, 6], [1, 2]), (1, 1, [4, 6], [4, 8]), (1, 1, [4, 6], [1, 2])],
                         batch_max=2)


def block_profile(B: int = 2):
    """L0 (2->3), block P (fork 3, join 4) of [A (3->1), B (1->4)], [C (3->4)], [], then L4 (4->1)."""
    def layer(name, i, o, t, w):
        return {"kind": "layer", "name": name, "in": i, "out": o, "time": t, "ws": w}
    return profile_from_json({"schema": "vbs.profile/1", "batch_max": B, "root": [
        layer("L0", 2, 3, [1.0, 1.5], [5, 9]),
        {"kind": "parallel", "name": "P", "in": 3, "out": 4, "join": "cat", "time": [0.25, 0.5],
         "branches": [
             {"kind": "series", "name": "P.0", "children": [
                 layer("A", 3, 1, [2.0, 3.0], [7, 11]), layer("B", 1, 4, [4.0, 5.0], [13, 17])]},
             {"kind": "series", "name": "P.1", "children": [layer("C", 3, 4, [8.0, 9.0], [19, 23])]},
             {"kind": "series", "name": "P.2", "children": []}]},
        layer("L4", 4, 1, [16.0, 17.0], [29, 31])]})


def test_paper_example_program_cost_peak_and_table_iii():
    sim = simulate(paper_example(), Program.of([("L0", 2), ("L1", 1), ("L1", 1), ("L2", 2)]), 2, 7)
    assert sim.time_total == 20 and sim.time_per_sample == 10 and sim.cost == 20
    # L0: 2 inputs + ws 2 + 2 outputs; L1: 2 held at its input + ws 4 + 1 out; then 1+1 held ...
    assert sim.step_need_bytes == (6, 7, 7, 6)
    assert sim.modelled_bytes == 7 and sim.peak_slot_bytes == 7
    assert sim.usage("L1").batches == (1, 1) and sim.usage("L1").unused_bytes == (0, 0)
    assert sim.usage("L0").unused_bytes == (1,)


def test_waiting_inputs_and_finished_outputs_are_held():
    # FBS at batch 1 on the example: the second sample waits at the input during the first
    sim = simulate(paper_example(), Program.of([("L0", 1), ("L1", 1), ("L2", 1)] * 2), 2, 7)
    assert sim.step_need_bytes == (1 + 1 + 1 + 1, 1 + 1 + 4 + 1, 1 + 1 + 1 + 1,
                                   1 + 1 + 1 + 1, 1 + 1 + 4 + 1, 1 + 1 + 1 + 1)
    assert sim.time_total == 24


def test_block_phase_fork_join_and_branch_order():
    prog = Program.of([("L0", 2), ("P", 2), ("A", 1), ("B", 1), ("A", 1), ("B", 1), ("C", 2),
                       ("L4", 2)])
    sim = simulate(block_profile(), prog, 2, 1000)
    fork, join = 3 * 2, 4 * 2
    assert sim.step_need_bytes == (
        2 * 2 + 9 + 3 * 2,        # L0 x2: inputs, ws(2), outputs
        fork + join,              # P opens: fork held, join reserved
        fork + join + 7 + 1,      # A x1: branch input is the fork (0 more), ws, 1 out
        fork + join + 1 + 13 + 4,  # B x1: A's output held, ws, B's output (folded right after)
        fork + join + 7 + 1,      # A x1
        fork + join + 1 + 13 + 4,  # B x1
        fork + join + 23 + 4 * 2,  # C x2: ws and its output, folded into the join
        4 * 2 + 31 + 1 * 2)       # L4 x2: the join became its input; the fork is released
    assert sim.cost == pytest.approx(1.5 + 0.5 + 2 + 4 + 2 + 4 + 9 + 17)
    assert sim.usage("P").batches == (2,) and sim.usage("A").batches == (1, 1)


def test_empty_branch_costs_only_the_fold_and_phases_may_repeat():
    prog = Program.of([("L0", 1), ("P", 1), ("A", 1), ("B", 1), ("C", 1), ("L0", 1), ("P", 1),
                       ("A", 1), ("B", 1), ("C", 1), ("L4", 2)])
    sim = simulate(block_profile(), prog, 2, 1000)
    assert sim.cost == pytest.approx(1 + 0.25 + 2 + 4 + 8 + 1 + 0.25 + 2 + 4 + 8 + 17)
    assert sim.usage("P").batches == (1, 1)
    # second L0 runs with the first sample's join held at L4's input
    assert sim.step_need_bytes[5] == 2 * 1 + 4 * 1 + 5 + 3 * 1


def test_nested_block_at_branch_end_holds_its_own_join():
    def layer(name, i, o, w):
        return {"kind": "layer", "name": name, "in": i, "out": o, "time": [1.0], "ws": [w]}
    p = profile_from_json({"batch_max": 1, "root": [
        {"kind": "parallel", "name": "P", "in": 3, "out": 4, "branches": [
            {"kind": "series", "name": "P.0", "children": [
                {"kind": "parallel", "name": "Q", "in": 3, "out": 4, "branches": [
                    {"kind": "series", "name": "Q.0", "children": [layer("X", 3, 4, 5)]}]}]}]}]})
    sim = simulate(p, Program.of([("P", 1), ("Q", 1), ("X", 1)]), 1, 100)
    # Q's fork is P's (a branch's input holds 0 bytes) but Q's join is a buffer of its own
    # (folded into P's when Q closes); X's output is allocated before it is folded.
    assert sim.step_need_bytes == (3 + 4, 3 + 4 + 4, 3 + 4 + 4 + 5 + 4)


@pytest.mark.parametrize("steps, budget, match", [
    ([("nope", 1)], 100, r"step 0 \('nope' x 1\): no unit of that name"),
    ([("L0", 0)], 100, r"samples must be a whole number >= 1"),
    ([("L0", 3)], 100, r"only 2 samples wait at the input of 'L0'"),
    ([("L0", 1), ("L1", 2)], 100, r"step 1 \('L1' x 2\): only 1 samples wait at the input"),
    ([("L0", 2), ("L1", 2)], 11, r"step 1 \('L1' x 2\): needs 12 bytes but the budget allows 11"),
    ([("L0", 2), ("L1", 1)], 100, r"ends with samples unprocessed: 1 wait before 'L1'"),
])
def test_invalid_chain_programs_say_which_step_and_why(steps, budget, match):
    with pytest.raises(InvalidProgramError, match=match):
        simulate(paper_example(), Program.of(steps), 2, budget)


@pytest.mark.parametrize("steps, match", [
    ([("L0", 2), ("A", 1)], r"inside branch 0 of block 'P', which has no phase open; open one"),
    ([("L0", 2), ("P", 2), ("C", 2)], r"branches of block 'P' run in order: branch 0 has 2 of 2"),
    ([("L0", 2), ("P", 2), ("A", 2), ("L4", 2)], r"block 'P' has a phase of 2 samples open"),
    ([("L0", 2), ("P", 2), ("A", 2), ("B", 2), ("A", 1)],
     r"branch 0 of block 'P' has already processed all 2 samples"),
    ([("L0", 2), ("P", 2), ("A", 2)], r"unprocessed: .*block 'P' has a phase of 2 open"),
    ([("L0", 1), ("P", 2)], r"only 1 samples wait at the input of 'P'"),
])
def test_invalid_block_programs_say_which_step_and_why(steps, match):
    with pytest.raises(InvalidProgramError, match=match):
        simulate(block_profile(), Program.of(steps), 2, 1000)


def test_budget_is_rounded_down_to_slots_and_the_peak_up():
    prog = Program.of([("L0", 2), ("L1", 1), ("L1", 1), ("L2", 2)])
    sim = simulate(paper_example(), prog, 2, 9, slot_bytes=4)  # usable 8
    assert sim.usable_bytes == 8 and sim.modelled_bytes == 7 and sim.peak_slot_bytes == 8
    with pytest.raises(InvalidProgramError, match=r"allows 4 \(7 rounded down to slots of 4\)"):
        simulate(paper_example(), prog, 2, 7, slot_bytes=4)


def test_bad_requests_are_usage_errors():
    prog = Program.of([("L0", 1), ("L1", 1), ("L2", 1)])
    for batch in (0, 3, True):
        with pytest.raises(UsageError):
            simulate(paper_example(), prog, batch, 10)
    with pytest.raises(UsageError):
        simulate(paper_example(), prog, 1, -1)


def test_program_json_round_trip_and_errors():
    prog = Program.of([("L0", 2), ("L1", 1)])
    assert Program.from_json(prog.to_json()) == prog
    assert prog.plan_id == Program((Step("L0", 2), Step("L1", 1))).plan_id
    assert prog.plan_id != Program.of([("L0", 1), ("L1", 2)]).plan_id
    assert len(prog.plan_id) == 16
    on_ort = Program((Step("L0", 2, "onnxruntime"), Step("L1", 1, "torch")))
    assert Program.from_json(on_ort.to_json()) == on_ort
    assert on_ort.plan_id != prog.plan_id  # where a step runs is part of the program
    for bad, match in [({"unit": "L0"}, "must be a JSON list"),
                       ([{"unit": "L0"}], "'unit' and 'samples'"),
                       ([{"unit": "L0", "samples": 1, "extra": 1}], "'unit' and 'samples'"),
                       ([{"unit": 3, "samples": 1}], "unit name"),
                       ([{"unit": "L0", "samples": "2"}], "whole number"),
                       ([{"unit": "L0", "samples": 2, "runtime": "tvm"}], "'runtime' must be")]:
        with pytest.raises(InvalidProgramError, match=match):
            Program.from_json(bad)
    # a JSON program (list of dicts) is accepted by the simulator directly
    assert simulate(paper_example(), [{"unit": "L0", "samples": 2}, {"unit": "L1", "samples": 1},
                                      {"unit": "L1", "samples": 1}, {"unit": "L2", "samples": 2}],
                    2, 7).time_total == 20
