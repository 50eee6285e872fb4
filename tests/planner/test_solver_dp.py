"""The DP solvers: fast kernels equal the plain-Python recurrences; claims equal the simulator
on network-sized trees with real slot sizes; objectives; the memory cap; errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import InfeasibleError, ProfileError, UsageError
from planner.solver.dp import ChainTables
from planner.solver.model import build_instance
from planner.solver.plain import plain_top
from planner.solver.simulate import simulate
from planner.solver.solve import (default_slot_bytes, max_need_slots, solve, table_slots)
from planner.solver.synthetic import chain_like, googlenet_like, resnet50_like
from core.tree import profile_from_json
from tests.planner.oracle import chain_profile, strategies
from tests.planner.test_solver_oracle import SETTINGS

small_chain, small_tree, with_onnxruntime = strategies()


@settings(max_examples=150, **SETTINGS)
@given(small_tree(max_layers=6, max_batch=4), st.integers(1, 3), st.integers(0, 30))
def test_fast_kernels_equal_plain_python(case, slot, slots):
    profile, _, _ = case
    inst = build_instance(profile)
    for mode in ("vbs", "paper"):
        fast = ChainTables(inst, mode, slot, slots).top()
        plain = np.array(plain_top(inst, mode, slot, slots))
        assert np.array_equal(fast[1:], plain[1:])


def test_plain_python_matches_on_a_chain_of_six():
    p = chain_like(6, 5, seed=3)
    inst = build_instance(p)
    slot = default_slot_bytes(inst, 40)
    for mode in ("vbs", "paper"):
        assert np.array_equal(ChainTables(inst, mode, slot, 40).top()[1:],
                              np.array(plain_top(inst, mode, slot, 40))[1:])


@pytest.mark.parametrize("make", [lambda: googlenet_like(8, seed=2), lambda: resnet50_like(8, seed=2),
                                  lambda: chain_like(24, 8, seed=2)])
def test_claims_equal_the_simulator_on_network_sized_trees(make):
    profile = make()
    inst = build_instance(profile)
    slot = default_slot_bytes(inst, 128)
    top = table_slots(inst, slot) * slot
    for frac in (0.12, 0.2, 0.35, 0.6, 1.0):
        budget = int(top * frac) + 12345  # not a multiple of the slot size
        for r in (1, 3, 8):
            costs = {}
            for solver in ("vbs", "paper", "fbs", "greedy"):
                try:
                    plan = solve(inst, r, budget, solver=solver, slot_bytes=slot)
                except InfeasibleError:
                    costs[solver] = math.inf
                    continue
                sim = simulate(inst, plan.program, r, budget, slot_bytes=slot)
                assert plan.cost == pytest.approx(sim.cost, rel=1e-9)
                assert plan.modelled_bytes == sim.modelled_bytes <= budget // slot * slot
                costs[solver] = plan.cost
            assert costs["vbs"] <= costs["paper"] * (1 + 1e-9)
            if costs["paper"] < math.inf:
                assert costs["vbs"] < math.inf


def test_more_memory_than_any_schedule_needs_changes_nothing():
    inst = build_instance(googlenet_like(4, seed=1))
    slot = default_slot_bytes(inst, 64)
    cap = max_need_slots(inst, 4, slot)
    at_cap = solve(inst, 4, cap * slot, slot_bytes=slot)
    huge = solve(inst, 4, 1 << 40, slot_bytes=slot)
    assert huge.cost == at_cap.cost
    # and the cap is a true bound: the DP's value does not move beyond it
    top = ChainTables(inst, "vbs", slot, 2 * cap, batch=4).top()[4]
    assert top[cap] == top[2 * cap]


def test_energy_objective_minimises_energy_and_still_reports_time():
    # L1 is fast but costly in energy at batch 2: the energy plan avoids batch 2 there
    layers = [(1, 1, [4, 6], [0, 0]), (1, 1, [4, 5], [0, 0])]
    energy = [[1, 2], [1, 9]]
    p = chain_profile(layers, batch_max=2, energy=energy)
    by_time = solve(p, 2, 100, slot_bytes=1)
    by_energy = solve(p, 2, 100, slot_bytes=1, objective="energy")
    assert by_time.cost == by_time.time_total == 11
    assert by_energy.cost == 2 + 1 + 1 and by_energy.time_total == 6 + 4 + 4
    sim = simulate(p, by_energy.program, 2, 100, objective="energy")
    assert sim.cost == by_energy.cost and sim.time_total == by_energy.time_total
    for solver in ("paper", "fbs", "greedy"):
        plan = solve(p, 2, 100, slot_bytes=1, objective="energy", solver=solver)
        assert simulate(p, plan.program, 2, 100, objective="energy").cost == plan.cost


def test_energy_without_measurements_is_a_usage_error():
    p = chain_profile([(1, 1, [4, 6], [0, 0])], batch_max=2)
    with pytest.raises(UsageError, match="energy"):
        solve(p, 2, 100, objective="energy")


def test_bad_requests():
    p = chain_profile([(1, 1, [4, 6], [0, 0])], batch_max=2)
    with pytest.raises(UsageError, match="outside 1..2"):
        solve(p, 3, 100)
    with pytest.raises(UsageError, match="unknown solver"):
        solve(p, 1, 100, solver="magic")
    with pytest.raises(UsageError, match="objective"):
        solve(p, 1, 100, objective="joy")
    with pytest.raises(UsageError, match="budget"):
        solve(p, 1, -5)
    with pytest.raises(UsageError, match="too fine"):
        ChainTables(build_instance(p), "vbs", 1, 1 << 20)


def test_block_names_share_the_unit_namespace():
    raw = {"batch_max": 1, "root": [
        {"kind": "layer", "name": "x", "in": 1, "out": 1, "time": [1], "ws": [0]},
        {"kind": "parallel", "name": "x", "in": 1, "out": 1, "branches": [
            {"kind": "series", "name": "x.0", "children": [
                {"kind": "layer", "name": "y", "in": 1, "out": 1, "time": [1], "ws": [0]}]}]}]}
    with pytest.raises(ProfileError, match="used twice"):
        build_instance(profile_from_json(raw))


def test_unmeasured_tree_is_a_profile_error():
    from core.tree import Layer, Profile, Series
    p = Profile(batch_max=2, root=Series("root", (Layer("a", 1, 1),)))
    with pytest.raises(ProfileError, match="not measured"):
        build_instance(p)
