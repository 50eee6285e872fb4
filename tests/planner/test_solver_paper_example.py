"""The paper's three-layer example (section III), as a hand-written profile JSON.

in(i,b) = out(i,b) = b, ws(1,b) = ws(3,b) = b, ws(2,b) = 4b, memory 7, time(i,1) = 4 and
time(i,2) = 3 per sample (6 in total for 2 samples): VBS and the paper's DP process 2, 1+1, 2
samples at L1, L2, L3 for 10 per image; the fixed batch size baseline manages 1 for 12.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.errors import InfeasibleError
from planner.solver import kernel
from planner.solver.dp import ChainTables
from planner.solver.model import build_instance
from planner.solver.simulate import simulate
from planner.solver.solve import solve
from core.tree import profile_from_json

PAPER_EXAMPLE_JSON = """
{"schema": "vbs.profile/1", "batch_max": 2,
 "meta": {"model": "the three-layer example of the VBS paper, section III"},
 "root": [
  {"kind": "layer", "name": "L1", "in": 1, "out": 1, "time": [4, 6], "ws": [1, 2]},
  {"kind": "layer", "name": "L2", "in": 1, "out": 1, "time": [4, 6], "ws": [4, 8]},
  {"kind": "layer", "name": "L3", "in": 1, "out": 1, "time": [4, 6], "ws": [1, 2]}]}
"""


@pytest.fixture(scope="module")
def profile():
    return profile_from_json(json.loads(PAPER_EXAMPLE_JSON))


@pytest.mark.parametrize("solver, per_image", [("vbs", 10.0), ("paper", 10.0), ("fbs", 12.0)])
def test_time_per_image(profile, solver, per_image):
    plan = solve(profile, 2, 7, solver=solver, slot_bytes=1)
    assert plan.time_per_sample == per_image
    sim = simulate(profile, plan.program, 2, 7)
    assert sim.time_per_sample == per_image and sim.modelled_bytes == plan.modelled_bytes <= 7


@pytest.mark.parametrize("solver", ["vbs", "paper"])
def test_batch_sizes_are_two_one_one_two(profile, solver):
    plan = solve(profile, 2, 7, solver=solver, slot_bytes=1)
    assert [(s.unit, s.samples) for s in plan.program] == [("L1", 2), ("L2", 1), ("L2", 1), ("L3", 2)]


def test_fbs_runs_one_image_at_a_time(profile):
    plan = solve(profile, 2, 7, solver="fbs", slot_bytes=1)
    assert [s.samples for s in plan.program] == [1] * 6


def test_greedy_needs_both_samples_held_around_l2(profile):
    # Greedy-VBS holds all 2 samples at L2's input and output: 2 + 4 + 2 = 8 > 7
    with pytest.raises(InfeasibleError, match="1 more"):
        solve(profile, 2, 7, solver="greedy", slot_bytes=1)
    assert solve(profile, 2, 8, solver="greedy", slot_bytes=1).time_total == 6 + 8 + 6


def test_dp_entries_of_the_illustration(profile):
    """OPTExact / OPT entries the paper lists (totals here, not per sample)."""
    t = ChainTables(build_instance(profile), "paper", 1, 7)
    E = t.exact(0)
    n = 3
    inf = np.inf
    assert list(E[0, 1]) == [inf] * 3 + [4] * 5      # OPTExact[1,1,1,m] = 4 for m >= 3
    assert list(E[1, 1]) == [inf] * 6 + [4] * 2      # L2 at 1 needs 1 + 4 + 1 = 6
    assert list(E[2, 2]) == [inf] * 6 + [6] * 2      # OPTExact[3,3,2,m] = 3 per sample, m >= 6
    assert all(v == inf for v in E[1, 2])            # L2 at 2 needs 12
    T = t.table(0)
    assert T[kernel.tri(n, 1, 1), 2, 7] == 8         # OPT[2,2,2,7] = 4 per sample
    assert T[kernel.tri(n, 1, 2), 2, 7] == 8 + 6     # OPT[2,3,2,7] = OPT[2,2,2,7] + 3 per sample
    assert T[kernel.tri(n, 0, 2), 2, 7] == 20        # OPT[1,3,2,7] = 10 per sample
    assert T[kernel.tri(n, 0, 2), 2, 6] == inf       # nothing fits in 6


def test_six_bytes_is_infeasible_and_says_how_much_is_missing(profile):
    with pytest.raises(InfeasibleError, match=r"needs at least 7 bytes \(1 more\)"):
        solve(profile, 2, 6, slot_bytes=1)
