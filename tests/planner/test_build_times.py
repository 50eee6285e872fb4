"""The benchmark helpers run and check what they time (no timing is asserted: benchmarks are
commands, see ``python -m planner.solver.build_times``)."""

from __future__ import annotations

from planner.solver.build_times import plain_vs_fast, time_builds
from planner.solver.synthetic import chain_like, googlenet_like


def test_build_time_rows_on_tiny_cases():
    rows = time_builds([("tiny-tree", googlenet_like(3, seed=5)), ("tiny-chain", chain_like(5, 3))],
                       solvers=("vbs",))
    assert [r.case for r in rows] == ["tiny-tree", "tiny-chain"]
    assert all(r.plans > 0 and r.table_bytes > 0 and r.dp_s >= 0 for r in rows)
    assert rows[0].blocks == 9 and rows[1].units == 5


def test_plain_and_fast_agree_on_a_small_instance():
    plain_s, fast_s = plain_vs_fast(googlenet_like(3, seed=1), slots=24)
    assert plain_s > 0 and fast_s > 0
