"""Every solver against the exhaustive oracle, on thousands of tiny chains and trees.

For each instance: oracle <= vbs <= paper; vbs is feasible wherever paper is; vbs is never
worse than the baselines; every returned program is valid in the simulator, within the
budget, and its claimed cost and peak equal the simulator's. Sizes are small integers and
slots are 1 byte, so every comparison is exact. The same on instances whose units ONNX
Runtime measured too, in the model that runs: every call and every cut priced, the oracle
searching every schedule of steps and calls.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import InfeasibleError
from planner.solver.simulate import simulate
from planner.solver.solve import solve
from tests.planner.oracle import chain_profile, oracle, oracle_program, strategies

small_chain, small_tree, with_onnxruntime = strategies()
SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
TOL = 1e-9


def checked(profile, r, budget, solver, slot=1):
    """The solver's cost (inf when infeasible), after checking its plan in the simulator."""
    try:
        plan = solve(profile, r, budget, solver=solver, slot_bytes=slot)
    except InfeasibleError:
        return math.inf
    sim = simulate(profile, plan.program, r, budget, slot_bytes=slot, runs=plan.runs)
    assert plan.cost == pytest.approx(sim.cost, rel=TOL, abs=TOL)
    assert plan.time_total == pytest.approx(sim.time_total, rel=TOL, abs=TOL)
    assert plan.modelled_bytes == sim.modelled_bytes <= budget // slot * slot
    return plan.cost


def check_against_oracle(profile, r, budget, slot=1):
    """With slot > 1 the solvers round every piece up, so the oracle (exact bytes within the
    budget rounded down to slots) may only be better; the solvers still compare exactly."""
    best, moves = oracle(profile, r, budget // slot * slot)
    if moves is not None:  # the oracle's own schedule is valid and costs what it says
        steps, runs = oracle_program(profile, moves)
        assert simulate(profile, steps, r, budget, runs=runs).cost == pytest.approx(best)
    vbs = checked(profile, r, budget, "vbs", slot)
    paper = checked(profile, r, budget, "paper", slot)
    fbs = checked(profile, r, budget, "fbs", slot)
    fbs_best = checked(profile, r, budget, "fbs-best", slot)
    greedy = checked(profile, r, budget, "greedy", slot)
    assert best <= vbs + TOL
    assert vbs <= paper + TOL, "vbs must never be worse than the paper's DP"
    assert vbs <= fbs_best + TOL <= fbs + 2 * TOL and vbs <= greedy + TOL, \
        "vbs must never be worse than a baseline, nor fbs-best than fbs"
    if paper < math.inf:
        assert vbs < math.inf
    if best == math.inf:
        assert vbs == paper == fbs == fbs_best == greedy == math.inf
    return best, vbs, paper


@settings(max_examples=2500, **SETTINGS)
@given(small_chain())
def test_chains_against_the_oracle(case):
    check_against_oracle(*case)


@settings(max_examples=300, **SETTINGS)
@given(small_chain(max_units=3, max_batch=8, max_size=4, max_ws=8))
def test_longer_requests_against_the_oracle(case):
    check_against_oracle(*case)


@settings(max_examples=600, **SETTINGS)
@given(small_tree())
def test_trees_with_blocks_against_the_oracle(case):
    check_against_oracle(*case)


@settings(max_examples=1500, **SETTINGS)
@given(with_onnxruntime(small_chain(max_units=4, max_batch=4)))
def test_priced_chains_against_the_oracle(case):
    check_against_oracle(*case)


@settings(max_examples=500, **SETTINGS)
@given(with_onnxruntime(small_tree(max_layers=4, max_batch=3)))
def test_priced_trees_with_blocks_against_the_oracle(case):
    check_against_oracle(*case)


@settings(max_examples=600, **SETTINGS)
@given(with_onnxruntime(small_chain(max_units=4, max_batch=4), runtime="cudagraph", host=True))
def test_graph_runs_priced_by_the_slower_of_host_and_device_against_the_oracle(case):
    """CUDA graphs' runs: a call costs the longer of the host's issue and the device's work,
    and the DP still finds the true optimum in that cost model."""
    check_against_oracle(*case)


@settings(max_examples=250, **SETTINGS)
@given(with_onnxruntime(small_tree(max_layers=4, max_batch=3), runtime="cudagraph", host=True))
def test_graph_runs_in_trees_with_blocks_against_the_oracle(case):
    check_against_oracle(*case)


@settings(max_examples=400, **SETTINGS)
@given(st.one_of(small_chain(), small_tree(), with_onnxruntime(small_chain(max_units=4))),
       st.integers(2, 3))
def test_coarse_slots_stay_within_budget_and_ordered(case, slot):
    profile, r, budget = case
    check_against_oracle(profile, r, budget, slot)


def test_paper_misses_a_faster_schedule_that_vbs_finds():
    # the paper's phases need one layer at the full phase batch; splitting between any two
    # layers finds L0 1, L1 1, L0 1, L1 1, L2 2 (or as good)
    p = chain_profile([(1, 3, [5, 1], [3, 1]), (3, 0, [5, 7], [0, 2]), (0, 2, [1, 6], [4, 1])],
                      batch_max=2)
    best, vbs, paper = check_against_oracle(p, 2, 8)
    assert best == vbs == 22 and paper == 26


def test_paper_finds_nothing_where_vbs_finds_the_optimum():
    p = chain_profile([(2, 1, [9, 1, 7], [3, 1, 3]), (1, 2, [5, 1, 6], [4, 4, 4]),
                       (2, 1, [2, 8, 3], [2, 2, 0])], batch_max=3)
    best, vbs, paper = check_against_oracle(p, 3, 9)
    assert best == vbs == 31 and paper == math.inf


def test_carry_phases_reach_the_optimum_splits_miss():
    # found by the oracle: L2 3, L3 2, L2 1, L3 2 leaves one sample between L2 and L3
    p = chain_profile([(2, 2, [2, 1, 10, 7, 5], [1, 3, 2, 1, 3]), (2, 1, [10, 9, 8, 2, 9], [0, 4, 0, 2, 2]),
                       (1, 3, [4, 9, 4, 3, 5], [2, 3, 1, 2, 0]), (3, 2, [1, 1, 9, 3, 3], [0, 0, 3, 1, 4])],
                      batch_max=5)
    best, vbs, paper = check_against_oracle(p, 4, 15)
    assert best == vbs == 14 and paper > 14


@settings(max_examples=300, **SETTINGS)
@given(with_onnxruntime(small_tree(max_layers=4, max_batch=3)))
def test_tables_of_the_worker_without_torch_run_every_block_it_takes_inside_a_run(case):
    """The worker without torch folds no join: in its tables (a ``lean`` profile, every step
    on ONNX Runtime) no plan of any request size leaves a unit or block ONNX Runtime takes
    outside one of its runs, whether the DP found it or vbs took it from another strategy
    (paper's DP and the baselines know no runs). Fails when a block's fold is priced for the
    executor there, or another strategy's program is taken unchecked."""
    from dataclasses import replace

    from core.runs import supports
    from core.tree import iter_nodes
    from planner.solver.tables import build_tables

    from hypothesis import assume

    from core.tree import iter_layers

    profile, _, _ = case
    # a model ONNX Runtime takes no unit of is served with torch, never by that worker
    assume(any(dict(u.runtimes).get("onnxruntime") for u in iter_layers(profile.root)))
    lean = replace(profile, meta={**profile.meta, "runtime": "onnxruntime", "lean": True})
    nodes = {n.name: n for n in iter_nodes(lean.root)}
    table = build_tables(lean, ("vbs",), slot_bytes=1)["vbs"]
    for index, plan in enumerate(table.plans):
        steps = table.program(index).steps
        covered = {k for start, end in plan.runs for k in range(start, end + 1)}
        for k, step in enumerate(steps):
            if k not in covered and step.unit in nodes:
                assert not supports(nodes[step.unit], "onnxruntime"), (plan.plan_id, step)
