"""The serve step's check "plans followed the hog" can pass only by design (bench/gpu/reach.py):
the H200's run of 2026-11-28 (docs/bench/gpu-h200-issue44-46/serve.json) could not, and this
fails whenever a design cannot either, before a GPU is lent.

The breakpoints stand for resnet50's vbs row at a full batch on that H200: 60 peaks spaced on a
log scale from fbs-best's one-sample plan to vbs's top plan, both from the record, with the peak
the run's plans settled at among them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu import config, reach
from bench.gpu.step_serve import levels, predict
from workers.device_cache import LARGE_PAGE

ROOT = Path(__file__).resolve().parents[2]
H200 = json.loads((ROOT / "docs/bench/gpu-h200-issue44-46/serve.json").read_text())
MiB = 2**20


def _breakpoints() -> list[int]:
    low, top = H200["limit"]["fbs_best_min_bytes"], H200["limit"]["vbs_top_bytes"]
    seen = H200["items"][0]["over_time"]["plan_peaks_seen"]
    return sorted({int(low * (top / low) ** (i / 59)) for i in range(60)} | set(seen))


def _covering(limit: int, breakpoints: list[int]) -> int:
    """What the allocator caches after plans at the limit ran: their pages."""
    top = max(b for b in breakpoints if b <= limit)
    return -(-top // LARGE_PAGE) * LARGE_PAGE


def test_the_h200_run_could_not_show_three_plans_and_the_model_says_so() -> None:
    bp = _breakpoints()
    limit = H200["limit"]["limit"]
    hog = H200["items"][0]["hog"]
    assert limit < LARGE_PAGE  # 19.4 MiB, under one page
    got = reach.reachable(limit=limit, breakpoints=bp, load=reach.Load(idle_s=1.0),
                          phases=reach.cycles(hog["sizes"], 1.0, 1.0, H200["duration_s"]),
                          cache=_covering(limit, bp))
    assert not got.ok and got.distinct == 1
    assert "large pages" in got.why
    # and it settles where the run's plans did, in every phase
    assert set(got.peaks) == set(H200["items"][0]["over_time"]["plan_peaks_seen"])


@pytest.mark.parametrize("limit", [H200["limit"]["limit"], LARGE_PAGE, 2 * LARGE_PAGE,
                                   int(2.5 * LARGE_PAGE)])
def test_a_limit_under_k_pages_cannot_show_k_plans(limit: int) -> None:
    """Even with the hog's steps on a service whose cache was given back."""
    bp = _breakpoints()
    phases = reach.staircase([int(f * limit) for f in (0.3, 0.55, 0.8)], 3.0, 3.0)
    got = reach.reachable(limit=limit, breakpoints=bp, phases=phases, load=reach.Load(1.0),
                          cache=0, k=3)
    assert not got.ok
    assert "large pages" in got.why


def test_a_cache_that_covers_the_limit_never_lets_the_hog_move_the_plans() -> None:
    """Seven pages, but the hog's cycles start after the load ran and the load never idles:
    the reading counts the service's own cache, which nothing gives back."""
    bp = _breakpoints()
    limit = 7 * LARGE_PAGE
    phases = reach.cycles([2 * limit, limit, limit // 2, limit // 4], 1.0, 1.0, 40)
    got = reach.reachable(limit=limit, breakpoints=bp, phases=phases, load=reach.Load(1.0),
                          cache=_covering(limit, bp))
    assert not got.ok and got.distinct == 1
    assert "cache covers the limit" in got.why
    assert not reach.spans(limit, 0, bp, 3)  # the limit alone would have allowed it


def test_pauses_longer_than_the_idle_time_let_the_cycles_move_the_plans() -> None:
    bp = _breakpoints()
    limit = 7 * LARGE_PAGE
    phases = reach.cycles([2 * limit, limit, limit // 2, limit // 4], 1.0, 1.0, 40)
    cache = _covering(limit, bp)
    longer = reach.reachable(limit=limit, breakpoints=bp, phases=phases, cache=cache,
                             load=reach.Load(idle_s=1.0, pause_s=1.5))
    shorter = reach.reachable(limit=limit, breakpoints=bp, phases=phases, cache=cache,
                              load=reach.Load(idle_s=1.0, pause_s=0.5))
    assert longer.ok and longer.distinct >= 3
    assert not shorter.ok


def test_the_serve_steps_design_can_show_three_plans() -> None:
    """The full run's serve config, its budget chosen from the H200's candidates as the step
    chooses it, its hog's steps as the step runs them."""
    cfg = config.full("cuda")
    s = cfg.serve
    picked = reach.pick_limit(H200["limit"]["candidates"], floor=s.pages * LARGE_PAGE,
                              within=s.within)
    budget = picked["chosen"]["budget"]
    assert budget >= 5 * LARGE_PAGE and picked["chosen"]["gain"] >= 2.0
    margin = LARGE_PAGE  # the config's 20MiB
    got = predict(cfg, {"vbs": _breakpoints()}, budget + margin, margin)["vbs"]
    assert got["ok"], got["why"]
    assert got["distinct"] >= s.k and not got["starved"]
    steps = levels(cfg, budget + margin, margin)
    assert steps == sorted(steps) and steps[0] > margin + min(_breakpoints())
    # the same steps on a service that was not let idle first: nothing moves
    phases = reach.staircase(steps, s.hold_s, s.tail_s)
    warm = reach.reachable(limit=budget + margin, margin=margin, breakpoints=_breakpoints(),
                           phases=phases, load=reach.Load(s.idle_s),
                           cache=_covering(budget, _breakpoints()))
    assert not warm.ok


def test_the_limit_is_the_smallest_of_five_pages_or_more_within_a_few_percent_of_the_best() -> None:
    candidates = H200["limit"]["candidates"]
    picked = reach.pick_limit(candidates, floor=5 * LARGE_PAGE, within=0.03)
    eligible = [c for c in candidates if c["budget"] >= 5 * LARGE_PAGE]
    assert picked["chosen"] in eligible
    assert picked["chosen"]["gain"] >= 0.97 * max(c["gain"] for c in eligible)
    assert "at or above" in picked["rule"]
    # the old rule, the largest predicted gain anywhere: the H200's 19.4 MiB
    assert picked["best"]["budget"] == H200["limit"]["limit"]
    none = reach.pick_limit(candidates, floor=10**12, within=0.03)
    assert none["chosen"] == none["best"] and "no candidate" in none["rule"]


def test_each_step_is_read_at_the_plan_the_sampler_saw_most() -> None:
    points = [(10.2, 0, 5), (10.7, 0, 7), (11.2, 0, 7), (11.7, 0, 7), (12.2, 0, 9), (12.7, 0, 9),
              (13.2, 0, 0)]
    assert reach.settled_peaks(points, [10.0, 12.0], 13.5) == [7, 9]
    assert reach.settled_peaks(points, [10.0, 12.0, 13.0], 13.5) == [7, 9, None]
