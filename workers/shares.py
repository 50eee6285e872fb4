"""Dividing one device's memory among its models: a small knapsack over their plan tables.

Why: every model's table says how fast it runs at every memory budget (``PlanTable``: per
request size, plans keyed by the executor's exact peak), and its queue says how many samples
wait. With several models on a device, the bytes are best given where they shorten the
queued work most. ``divide`` chooses the shares that minimise the time the queued samples
take, summed over the models (weighted), which maximises the service's goodput:

    minimise  sum_i  w_i * d_i * t_i(m_i)     subject to  sum_i m_i <= budget,  m_i >= min_i

where d_i is model i's demand (queued + running samples, rounded up to a power of 2), w_i its
weight (settings), and t_i(m) the time per sample of the plan its table picks for a batch of
r_i = min(d_i, batch_max) samples within m bytes; when no plan of r_i fits, the batch runs in
the largest pieces that fit (``largest_fitting``), as the worker does. A model that cannot run
one sample within m is charged a penalty (eight times its slowest time), so the knapsack
serves every busy model it can before it speeds one up.

The budget is cut into ``LEVELS`` equal levels; each model's cost is read from its table at
every level (two binary searches per level, cached per table, r and budget), and a
multiple-choice knapsack over the levels (a DP, ``n x LEVELS^2`` additions in numpy: well under
a millisecond for three models) picks the fewest bytes that reach the least total cost. What
is left (rounding, models whose plans stop improving) goes to the busy models in proportion to
their weighted demand: more bytes never pick a slower plan. Idle models get their minimum (0
unless configured): their memory goes to the busy ones.

The caller (``workers.arbiter``) recomputes shares only when a demand level, a table or the
budget changes, never per request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.lru import OwnedLRU
from core.table import PlanTable

LEVELS = 256          # the budget is divided into this many equal levels
PENALTY = 8.0         # a busy model left without a plan costs this many times its slowest time
_CACHED = 64          # cost vectors kept (per table, request size and budget)


@dataclass(frozen=True)
class Want:
    """One model's claim on the device's memory."""

    name: str
    table: PlanTable
    samples: int          # demand: queued + running samples (0 = idle)
    weight: float = 1.0
    minimum: int = 0      # bytes it keeps even when idle


def demand_level(samples: int) -> int:
    """Samples rounded up to a power of 2 (0 stays 0): shares change with the level, not with
    every request."""
    return 0 if samples <= 0 else 1 << (int(samples) - 1).bit_length()


_times: OwnedLRU[np.ndarray] = OwnedLRU(_CACHED)  # by table, request size and budgets


def time_per_sample(table: PlanTable, r: int, budgets: np.ndarray) -> np.ndarray:
    """Seconds per sample of the plans the table picks for r samples at each budget (a batch
    too large for a budget runs in the largest pieces that fit); inf where one sample does not
    fit. Lookups only."""
    r = max(1, min(int(r), table.batch_max))
    key = (r, len(budgets), int(budgets[-1]) if len(budgets) else 0)
    return _times.get_or_make(table, key, lambda: _time_per_sample(table, r, budgets))


def _time_per_sample(table: PlanTable, r: int, budgets: np.ndarray) -> np.ndarray:
    times = np.array([p.seconds for p in table.plans], dtype=np.float64)
    mins = table.min_peaks[:r]
    fits = mins[None, :] <= budgets[:, None]                 # (levels, r)
    any_fit = fits.any(axis=1)
    pieces = np.where(any_fit, r - np.argmax(fits[:, ::-1], axis=1), 0)  # largest fitting c
    out = np.full(len(budgets), math.inf)
    for c in np.unique(pieces[pieces > 0]).tolist():
        at = np.flatnonzero(pieces == c)
        row = table.row(int(c))
        k = np.searchsorted(row.peaks, budgets[at], side="right") - 1
        out[at] = times[row.plans[k]] / c
    return out


WORKING_WITHIN = 0.10  # a plan within this much of the fastest time per sample is working speed
_working: OwnedLRU[int] = OwnedLRU(_CACHED)  # by table and tolerance


def working_bytes(table: PlanTable, within: float = WORKING_WITHIN) -> int:
    """The fewest bytes at which a request of ``batch_max`` samples runs within ``within`` of
    its fastest time per sample (in the largest pieces that fit, as the worker runs it): what
    a batch needs to run near full speed, where one sample at a time may cost far more (0:
    the table has no plan). Lookups only; cached per table."""
    return _working.get_or_make(table, within, lambda: _working_bytes(table, within))


def _working_bytes(table: PlanTable, within: float) -> int:
    peaks = [row.peaks for row in table.rows if len(row.peaks)]
    if not peaks:
        return 0
    budgets = np.unique(np.concatenate(peaks))
    tps = time_per_sample(table, table.batch_max, budgets)
    fastest = float(tps.min())
    at = int(np.flatnonzero(tps <= fastest * (1.0 + within))[0])
    return int(budgets[at])


def divide(budget: int, wants: Sequence[Want], levels: int = LEVELS) -> dict[str, int]:
    """Bytes for each model, summing to ``budget`` (see the module doc)."""
    if not wants:
        return {}
    budget = max(0, int(budget))
    if budget == 0:
        return {w.name: 0 for w in wants}
    grid = (np.arange(levels + 1, dtype=np.float64) * (budget / levels)).astype(np.int64)
    unit = budget / levels
    floors = np.array([min(levels, math.ceil(w.minimum / unit)) for w in wants], dtype=np.int64)
    if floors.sum() > levels:  # minimums over the budget: scaled down to fit
        floors = np.floor(floors * (levels / floors.sum())).astype(np.int64)
    costs = []
    for w, floor in zip(wants, floors.tolist()):
        if w.samples > 0:
            tps = time_per_sample(w.table, w.samples, grid)
            finite = tps[np.isfinite(tps)]
            worst = float(finite.max()) if finite.size else 1.0
            cost = w.weight * w.samples * np.where(np.isfinite(tps), tps, PENALTY * worst)
        else:
            cost = np.zeros(levels + 1)
        cost = cost.astype(np.float64)
        cost[:floor] = math.inf
        costs.append(cost)
    # Multiple-choice knapsack over levels: best[g] = least cost of the models so far in g levels.
    g = np.arange(levels + 1)
    idx = g[:, None] - g[None, :]          # (total, this model's levels)
    valid = idx >= 0
    best = costs[0].copy()
    picks = []
    for cost in costs[1:]:
        total = np.where(valid, best[np.clip(idx, 0, None)] + cost[None, :], math.inf)
        picks.append(np.argmin(total, axis=1))  # first minimum: the fewest levels
        best = total[g, picks[-1]]
    # The least total cost, reached with the fewest levels; then walk the picks back.
    end = int(np.flatnonzero(best == best.min())[0]) if np.isfinite(best.min()) else levels
    chosen = [0] * len(wants)
    for i in range(len(wants) - 1, 0, -1):
        chosen[i] = int(picks[i - 1][end])
        end -= chosen[i]
    chosen[0] = end
    shares = {w.name: int(grid[c]) for w, c in zip(wants, chosen)}
    _spread(shares, wants, budget)
    return shares


def _spread(shares: dict[str, int], wants: Sequence[Want], budget: int) -> None:
    """Give what no model's cost needed to the busy models, by weighted demand (else to all)."""
    left = budget - sum(shares.values())
    if left <= 0:
        return
    busy = [w for w in wants if w.samples > 0] or list(wants)
    weights = [w.weight * max(w.samples, 1) for w in busy]
    total = sum(weights)
    given = 0
    for w, weight in zip(busy, weights):
        extra = int(left * weight / total)
        shares[w.name] += extra
        given += extra
    shares[busy[0].name] += left - given  # rounding: the sum is exactly the budget
