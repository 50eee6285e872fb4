"""Which batch sizes to measure, and how to fill in the others (pure functions).

By default every b = 1..B is measured: on CPU the time per sample is not monotone in b
(cache effects), so the DP should see what was measured. With a grid, b = 1, 2, 3, 4 and
then steps of about a third up to B are measured; time in between is interpolated linearly
in b, and workspace takes the larger of its two measured neighbours so that a plan never
needs more than the profile claims. ``vbs profile --grid`` reports the interpolation error
against a full measurement in docs/benchmarks.md.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from typing import Any


def batch_grid(batch_max: int, grid: bool) -> list[int]:
    """The batch sizes to measure for a profile up to ``batch_max``."""
    if not grid or batch_max <= 4:
        return list(range(1, batch_max + 1))
    points = {1, 2, 3, 4, batch_max}
    b = 4
    while b < batch_max:
        b = max(b + 1, math.ceil(b * 4 / 3))
        points.add(min(b, batch_max))
    return sorted(points)


def _fill(measured: Mapping[int, Any], batch_max: int,
          between: Callable[[int, int, int], Any]) -> list[Any]:
    """A value for every b = 1..B: the measured one, else ``between(lo, b, hi)`` of the
    measured batch sizes on either side."""
    xs = sorted(measured)
    out = []
    for b in range(1, batch_max + 1):
        if b in measured:
            out.append(measured[b])
            continue
        i = bisect.bisect_left(xs, b)
        out.append(between(xs[i - 1], b, xs[i]))
    return out


def fill_time(measured: Mapping[int, float], batch_max: int) -> list[float]:
    """Total time for every b = 1..B, linear between measured points."""
    def linear(lo: int, b: int, hi: int) -> float:
        w = (b - lo) / (hi - lo)
        return measured[lo] * (1 - w) + measured[hi] * w

    return [float(v) for v in _fill(measured, batch_max, linear)]


def fill_workspace(measured: Mapping[int, int], batch_max: int) -> list[int]:
    """Workspace for every b = 1..B: measured, or the larger measured neighbour."""
    return [int(v) for v in _fill(measured, batch_max,
                                  lambda lo, b, hi: max(measured[lo], measured[hi]))]
