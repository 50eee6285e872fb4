"""The paper's baselines, FBS and Greedy-VBS, under the same model of memory as the DP."""

from __future__ import annotations

import pytest

from core.errors import InfeasibleError
from planner.solver import baselines
from planner.solver.model import build_instance
from planner.solver.simulate import simulate
from planner.solver.solve import default_slot_bytes, solve, table_slots
from planner.solver.synthetic import googlenet_like, resnet50_like
from tests.planner.oracle import chain_profile


@pytest.fixture(scope="module")
def tree():
    return build_instance(googlenet_like(6, seed=4))


def budgets(inst, count=7):
    slot = default_slot_bytes(inst, 64)
    top = table_slots(inst, slot) * slot
    return slot, [int(top * (k + 1) / count) for k in range(count)]


def test_fbs_is_the_largest_uniform_batch_that_fits(tree):
    slot, bs = budgets(tree)
    for budget in bs:
        for r in (1, 4, 6):
            m = budget // slot
            try:
                plan = solve(tree, r, budget, solver="fbs", slot_bytes=slot)
            except InfeasibleError:
                assert baselines.fbs_slots(tree, 1, r, slot) > m
                continue
            c = max(s.samples for s in plan.program)
            assert set(s.samples for s in plan.program) <= {c, r % c}
            assert baselines.fbs_slots(tree, c, r, slot) <= m
            assert all(baselines.fbs_slots(tree, d, r, slot) > m for d in range(c + 1, r + 1))
            # the slot accounting never claims less than the exact bytes
            assert baselines.fbs_peak(tree, c, r) <= baselines.fbs_slots(tree, c, r, slot) * slot
            sim = simulate(tree, plan.program, r, budget, slot_bytes=slot)
            assert sim.modelled_bytes == plan.modelled_bytes and sim.cost == pytest.approx(plan.cost)
            # every unit runs once per phase, every phase has the same size but the last
            first = plan.program.steps[0].unit
            phases = [s.samples for s in plan.program if s.unit == first]
            assert phases == baselines.fbs_phases(c, r)


def test_fbs_best_is_the_fastest_uniform_batch_that_fits(tree):
    """Under the DP's model: among the uniform batches that fit, the cheapest; never slower
    than fbs, which takes the largest; vbs is never slower than either."""
    slot, bs = budgets(tree)
    for budget in bs:
        for r in (1, 4, 6):
            m = budget // slot
            fits = [c for c in range(1, r + 1) if baselines.fbs_slots(tree, c, r, slot) <= m]
            try:
                plan = solve(tree, r, budget, solver="fbs-best", slot_bytes=slot)
            except InfeasibleError:
                assert not fits
                continue
            cheapest = min(fits, key=lambda c: (baselines.fbs_cost(tree, c, r), -c))
            assert plan.program.steps[0].samples == cheapest
            assert plan.cost == pytest.approx(baselines.fbs_cost(tree, cheapest, r))
            assert plan.cost <= solve(tree, r, budget, solver="fbs", slot_bytes=slot).cost + 1e-12
            assert solve(tree, r, budget, solver="vbs", slot_bytes=slot).cost <= plan.cost + 1e-12
            sim = simulate(tree, plan.program, r, budget, slot_bytes=slot)
            assert sim.modelled_bytes == plan.modelled_bytes and sim.cost == pytest.approx(plan.cost)
            assert plan.peak_bytes > 0


def test_greedy_runs_layer_by_layer_at_the_largest_batch_its_rule_allows():
    inst = build_instance(resnet50_like(6, seed=4))
    slot, bs = budgets(inst)
    for budget in bs:
        for r in (2, 6):
            m = budget // slot
            usable = m * slot
            units = baselines.greedy_units(inst, r, slot)
            try:
                plan = solve(inst, r, budget, solver="greedy", slot_bytes=slot)
            except InfeasibleError:
                assert baselines.greedy_choice(units, m) is None
                continue
            by_unit: dict[str, list[int]] = {}
            order: list[str] = []
            for s in plan.program:
                if s.unit not in by_unit:
                    order.append(s.unit)
                by_unit.setdefault(s.unit, []).append(s.samples)
            assert order == [gu.name for gu in units]  # each unit once, over all r samples
            for gu in units:
                got = by_unit[gu.name]
                assert sum(got) == r
                if gu.is_block:
                    assert got == [r]
                    continue
                c = got[0]
                assert gu.need_by_batch[c - 1] <= m
                assert all(gu.need_by_batch[d - 1] > m for d in range(c + 1, r + 1))
            sim = simulate(inst, plan.program, r, budget, slot_bytes=slot)
            assert sim.modelled_bytes == plan.modelled_bytes <= usable
            assert sim.cost == pytest.approx(plan.cost)


def test_greedy_holds_all_samples_so_large_requests_become_infeasible():
    # one sample at a time fits easily, but all r held around the big layer do not
    p = chain_profile([(1, 10, [1, 2, 3, 4], [0] * 4), (10, 1, [1, 2, 3, 4], [0] * 4)], batch_max=4)
    assert solve(p, 1, 25, solver="greedy", slot_bytes=1).cost == 2
    with pytest.raises(InfeasibleError):
        solve(p, 4, 25, solver="greedy", slot_bytes=1)
    assert solve(p, 4, 25, solver="vbs", slot_bytes=1).cost <= solve(p, 4, 25, solver="fbs",
                                                                       slot_bytes=1).cost
