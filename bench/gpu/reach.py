"""Whether the serve step's run can show plans at k distinct peaks as its neighbour moves memory.

On an H200 the check "plans followed the hog" failed by design: its limit was under one large
page, and the service's own cache covered it, so the reading never moved. This models the rules
the service follows, so that a design which cannot pass fails on the CPU first:

- the reading (``workers.memory.MemoryProbe.free``, ``cuda_free``): the limit while the driver
  has a large page more than it free; else the driver's free memory floored to whole large pages
  plus the allocator's cache, capped by the limit; the margin comes off
  (``workers.device_memory.DeviceMemory.plan_free``);
- the plan: the largest breakpoint of the table's row within that (``core.table.PlanTable.find``);
- the allocator maps the pages a plan needs beyond its cache from the driver and keeps them
  (expandable segments: ``workers.device_cache.LARGE_PAGE``);
- the cache goes back to the driver (``empty_cache``: every whole free page) only after a plan
  smaller than the last one with more cached than the slack allows (``DeviceCache.done``,
  ``excess``) or once the device idled ``idle_s`` (``IdleTrim``): a closed loop never idles.

Full batches only (smaller ones can only add trims), one plan at a time. Standard library and
``workers.device_cache`` (no torch).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from workers.device_cache import LARGE_PAGE, excess

PLENTY = 100 * 2**30  # the driver's free memory where the hog holds nothing
BATCHES = 32          # batches run back to back before a phase's plan must have settled


@dataclass(frozen=True)
class Phase:
    """What the hog does as the phase starts, held ``seconds``: take the driver's free memory
    but ``leave``, give back ``give`` of what it holds, or give back all (``free``)."""

    seconds: float
    leave: int | None = None
    give: int = 0
    free: bool = False


@dataclass(frozen=True)
class Load:
    """The service's ``idle_s`` (VBS_DEVICE_CACHE_IDLE_S; 0: no idle trim) and the load's pause
    at the end of each phase, before the hog's next move (0: a closed loop, never idle)."""

    idle_s: float
    pause_s: float = 0.0

    @property
    def idles(self) -> bool:
        return 0 < self.idle_s <= self.pause_s


@dataclass
class Reach:
    """The verdict: ``ok`` when the phases' settled plans show ``k`` distinct peaks or more."""

    ok: bool
    k: int
    distinct: int
    why: str
    peaks: list[int | None] = field(default_factory=list)     # each phase's settled plan
    readings: list[int] = field(default_factory=list)         # each phase's budget
    starved: list[int] = field(default_factory=list)          # phases where no plan fits

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _State:
    driver: int   # what the driver has free for the service
    cache: int    # what the service's allocator caches, unused between plans
    hog: int = 0  # what the hog holds
    last: int = 0  # the last plan's peak (DeviceCache._last_wanted)


def _floor(n: int, page: int) -> int:
    return n - n % page


def _ceil(n: int, page: int) -> int:
    return -(-n // page) * page


def reading(driver: int, cache: int, limit: int, page: int = LARGE_PAGE) -> int:
    """``MemoryProbe.free`` with a limit, eager torch (no graph pools kept)."""
    if limit and driver - page >= limit:
        return limit
    free = _floor(driver, page) + cache
    return min(free, limit) if limit else free


def _plan(breakpoints: Sequence[int], budget: int) -> int | None:
    fits = [b for b in breakpoints if b <= budget]
    return max(fits) if fits else None


def _batch(s: _State, breakpoints: Sequence[int], limit: int, margin: int, page: int
           ) -> tuple[int | None, int]:
    """One batch: the plan the reading gives, its pages mapped, the trim after it."""
    budget = max(0, reading(s.driver, s.cache, limit, page) - margin)
    peak = _plan(breakpoints, budget)
    if peak is None:
        return None, budget
    need = _ceil(max(0, peak - s.cache), page)
    s.driver -= need
    s.cache += need
    smaller, s.last = peak < s.last, peak
    if smaller and excess(s.cache, peak):
        s.driver, s.cache = s.driver + s.cache, 0
    return peak, budget


def _settle(s: _State, breakpoints: Sequence[int], limit: int, margin: int, page: int
            ) -> tuple[int | None, int]:
    """Batches back to back until the plan repeats."""
    last: tuple[int | None, int] = (None, 0)
    for _ in range(BATCHES):
        now = _batch(s, breakpoints, limit, margin, page)
        if now == last:
            break
        last = now
    return last


def _hog(s: _State, phase: Phase) -> None:
    if phase.leave is not None:
        take = max(0, s.driver - phase.leave)
        s.hog, s.driver = s.hog + take, s.driver - take
    if phase.give:
        give = min(phase.give, s.hog)
        s.hog, s.driver = s.hog - give, s.driver + give
    if phase.free:
        s.hog, s.driver = 0, s.driver + s.hog


def spans(limit: int, margin: int, breakpoints: Sequence[int], k: int,
          page: int = LARGE_PAGE) -> str:
    """'' when the plans' budget holds k readings a page apart, the lowest at the one-sample
    plan; else why not. Below the limit the reading moves in whole pages (the driver's free
    memory is floored to pages, the allocator maps and unmaps whole pages), so k distinct plans
    need budget >= least + (k - 1) pages."""
    least = min(breakpoints)
    need = least + (k - 1) * page
    if limit - margin >= need:
        return ""
    return (f"the plans' budget ({limit - margin} bytes) is under the one-sample plan "
            f"({least}) plus {k - 1} large pages of {page}: the reading moves in whole pages, "
            f"so it holds fewer than {k} distinct plans")


def reachable(*, limit: int, breakpoints: Sequence[int], phases: Sequence[Phase], load: Load,
              k: int = 3, margin: int = 0, page: int = LARGE_PAGE, cache: int = 0,
              driver: int = PLENTY, sample_s: float = 0.5) -> Reach:
    """Whether plans settle at ``k`` distinct peaks or more over ``phases`` (each seen only if
    it lasts ``sample_s``, the sampler's period). ``cache``: what the service's allocator
    caches as the hog starts (0 after an idle trim; the top plan's pages after a load ran)."""
    s = _State(driver=driver, cache=cache, last=0)
    peaks: list[int | None] = []
    budgets: list[int] = []
    for phase in phases:
        _hog(s, phase)
        peak, budget = _settle(s, breakpoints, limit, margin, page)
        if load.idles:  # the pause ends the phase: the idle thread gives the cache back
            s.driver, s.cache = s.driver + s.cache, 0
        peaks.append(peak if phase.seconds >= sample_s else None)
        budgets.append(budget)
    starved = [i for i, (p, ph) in enumerate(zip(peaks, phases))
               if p is None and ph.seconds >= sample_s]
    distinct = len({p for p in peaks if p is not None})
    short = spans(limit, margin, breakpoints, k, page)
    why = short or ("" if distinct >= k else
                    f"the plans settle at {distinct} distinct peak(s) over the hog's phases: "
                    + ("the service's cache covers the limit and is never given back"
                       if len(set(budgets)) == 1 else "too few readings cross breakpoints"))
    return Reach(not short and distinct >= k, k, distinct, why, peaks, budgets, starved)


def cycles(sizes: Sequence[int], hold_s: float, gap_s: float, duration_s: float) -> list[Phase]:
    """bench/memory_hog.py's cycles (``--leave``): take all but the next size, hold, give it all
    back, wait."""
    phases: list[Phase] = []
    t, i = 0.0, 0
    while t < duration_s:
        phases += [Phase(hold_s, leave=sizes[i % len(sizes)]), Phase(gap_s, free=True)]
        t += hold_s + gap_s
        i += 1
    return phases


def staircase(levels: Sequence[int], hold_s: float, tail_s: float) -> list[Phase]:
    """bench/memory_hog.py's steps (``--leave-steps``): take all but the first level, then give
    back up to each next level, then give back all."""
    phases = [Phase(hold_s, leave=levels[0])]
    phases += [Phase(hold_s, give=b - a) for a, b in zip(levels, levels[1:])]
    return phases + [Phase(tail_s, free=True)]


def pick_limit(candidates: Sequence[dict[str, Any]], *, floor: int, within: float
               ) -> dict[str, Any]:
    """The serve step's plans' budget: among the candidates at ``floor`` bytes or more, the
    smallest whose predicted gain is within ``within`` of the best of them; with none that
    large, the largest gain of all (the smallest such). Says which rule chose it."""
    best = max(candidates, key=lambda c: (round(c["gain"], 3), -c["budget"]))
    eligible = [c for c in candidates if c["budget"] >= floor]
    if not eligible:
        return {"chosen": best, "best": best, "floor": floor,
                "rule": f"no candidate at or above {floor} bytes: the largest predicted gain"}
    top = max(c["gain"] for c in eligible)
    chosen = min((c for c in eligible if c["gain"] >= top * (1 - within)),
                 key=lambda c: c["budget"])
    return {"chosen": chosen, "best": best, "floor": floor,
            "rule": f"the smallest budget at or above {floor} bytes whose predicted gain is "
                    f"within {within:.0%} of the best there ({top:.2f}x)"}


def settled_peaks(points: Sequence[Sequence[float]], starts: Sequence[float], end: float,
                  settle_s: float = 0.5) -> list[int | None]:
    """The plan peak most often read in each of the hog's phases (``starts``, absolute; the
    last phase ends at ``end``), leaving out the first ``settle_s`` of each; ``points`` are the
    sampler's (absolute time, free, peak)."""
    out: list[int | None] = []
    for i, start in enumerate(starts):
        stop = starts[i + 1] if i + 1 < len(starts) else end
        seen = Counter(int(p) for t, _, p in points if start + settle_s <= t < stop and p > 0)
        out.append(seen.most_common(1)[0][0] if seen else None)
    return out
