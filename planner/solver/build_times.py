"""Time plan-table builds on synthetic trees; compare plain Python with the numba kernels.

    python -m planner.solver.build_times [--quick] [--repeat N] [--profile FILE ...] [--markdown]

Prints one row per case and solver: units, blocks, B, slots, the DP alone, the full table
build (the DP again, then every candidate program laid out and the frontier kept: it contains
a DP, so it takes longer), plans kept, serialised size, DP memory. With ``--repeat N`` every
(case, solver) is timed N times, interleaved round-robin so drift hits all alike, and the
median is shown with the range. Then the plain-Python recurrences against the fast kernels on
one small instance (same values, checked). ``time_builds()`` returns the rows for callers.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from planner.solver.dp import ChainTables
from planner.solver.model import build_instance
from planner.solver.plain import plain_top
from planner.solver.solve import default_slot_bytes, table_slots
from planner.solver.synthetic import chain_like, googlenet_like, resnet50_like
from planner.solver.tables import build_table
from core.tree import Parallel, Profile, iter_layers, iter_nodes, load_profile


@dataclass(frozen=True)
class BenchRow:
    """One timed table build."""

    case: str
    solver: str
    units: int
    blocks: int
    batch_max: int
    slots: int
    dp_s: float                      # median
    table_s: float                   # median
    plans: int
    table_bytes: int
    dp_mbytes: float
    dp_range: tuple[float, float] = (0.0, 0.0)     # min, max over the rounds
    table_range: tuple[float, float] = (0.0, 0.0)


def _time(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _warm() -> None:
    """Compile (or load from numba's cache) every kernel once, outside the timings."""
    build_table(chain_like(4, 4), solver="vbs", slot_count=8)
    build_table(chain_like(4, 4), solver="paper", slot_count=8)
    build_table(googlenet_like(4), solver="vbs", slot_count=8)


def time_builds(cases: list[tuple[str, Profile]] | None = None,
                solvers: tuple[str, ...] = ("vbs", "paper"), repeat: int = 1) -> list[BenchRow]:
    """Time the DP alone and the whole table build for every case and solver, ``repeat``
    rounds interleaved; medians with their ranges."""
    import statistics

    _warm()
    if cases is None:
        cases = [("googlenet-like", googlenet_like(32)), ("resnet50-like", resnet50_like(32)),
                 ("chain-150", chain_like(150, 32))]
    insts = {name: build_instance(profile) for name, profile in cases}
    dp_times: dict[tuple[str, str], list[float]] = {}
    table_times: dict[tuple[str, str], list[float]] = {}
    facts: dict[tuple[str, str], tuple[int, int, float]] = {}
    for _ in range(repeat):
        for name, _profile in cases:
            inst = insts[name]
            slot = default_slot_bytes(inst)
            M = table_slots(inst, slot)
            for solver in solvers:
                dp_s, tables = _time(lambda: ChainTables(inst, solver, slot, M))
                mbytes = sum(a.nbytes for a in (tables.T, tables.E, tables.EX, tables.RC,  # type: ignore[attr-defined]
                                                tables.RN, tables.RB)) / 1e6  # type: ignore[attr-defined]
                del tables
                table_s, table = _time(lambda: build_table(inst, solver=solver, slot_bytes=slot))
                dp_times.setdefault((name, solver), []).append(dp_s)
                table_times.setdefault((name, solver), []).append(table_s)
                facts[(name, solver)] = (len(table.plans), len(table.to_bytes()), mbytes)  # type: ignore[attr-defined]
                del table
    rows = []
    for name, profile in cases:
        inst = insts[name]
        M = table_slots(inst, default_slot_bytes(inst))
        units = sum(1 for _ in iter_layers(profile.root))
        blocks = sum(isinstance(n, Parallel) for n in iter_nodes(profile.root))
        for solver in solvers:
            dps, tabs = dp_times[(name, solver)], table_times[(name, solver)]
            plans, size, mbytes = facts[(name, solver)]
            rows.append(BenchRow(name, solver, units, blocks, inst.batch_max, M,
                                 statistics.median(dps), statistics.median(tabs), plans, size,
                                 mbytes, (min(dps), max(dps)), (min(tabs), max(tabs))))
    return rows


def plain_vs_fast(profile: Profile | None = None, slots: int = 256) -> tuple[float, float]:
    """(plain seconds, fast seconds) for every OPT[root, r, m] of a small instance; equal values."""
    _warm()
    profile = profile or chain_like(30, 16, seed=1)
    inst = build_instance(profile)
    slot = default_slot_bytes(inst, slots)
    M = table_slots(inst, slot)
    plain_s, plain = _time(lambda: plain_top(inst, "vbs", slot, M))
    fast_s, fast = _time(lambda: ChainTables(inst, "vbs", slot, M).top())
    if not np.array_equal(np.array(plain)[1:], fast[1:]):  # type: ignore[index]
        raise AssertionError("plain and fast recurrences disagree")
    return plain_s, fast_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="trees only (no 150-unit chain)")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds (median shown)")
    parser.add_argument("--markdown", action="store_true", help="the table as Markdown")
    parser.add_argument("--profile", action="append", default=[],
                        help="also time a measured profile (vbs.profile/1 file); repeatable")
    args = parser.parse_args(argv)
    cases = [("googlenet-like", googlenet_like(32)), ("resnet50-like", resnet50_like(32))]
    if not args.quick:
        cases.append(("chain-150", chain_like(150, 32)))
    for path in args.profile:
        measured = load_profile(path)
        cases.append((f"{measured.meta.get('model', path)} (measured)", measured))
    rows = time_builds(cases, repeat=max(1, args.repeat))
    if args.markdown:
        print("| tree | solver | units | blocks | B | slots | DP (s) | full table (s) | plans kept "
              "| serialised (bytes) | DP memory (MB) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r.case} | {r.solver} | {r.units} | {r.blocks} | {r.batch_max} | {r.slots} | "
                  f"{r.dp_s:.2f} ({r.dp_range[0]:.2f}-{r.dp_range[1]:.2f}) | "
                  f"{r.table_s:.2f} ({r.table_range[0]:.2f}-{r.table_range[1]:.2f}) | "
                  f"{r.plans} | {r.table_bytes} | {r.dp_mbytes:.0f} |")
    else:
        print(f"{'case':<26} {'solver':<6} {'units':>5} {'blocks':>6} {'B':>3} {'slots':>5} "
              f"{'DP s':>7} {'table s':>8} {'plans':>6} {'bytes':>9} {'DP MB':>7}")
        for r in rows:
            print(f"{r.case:<26} {r.solver:<6} {r.units:>5} {r.blocks:>6} {r.batch_max:>3} "
                  f"{r.slots:>5} {r.dp_s:>7.2f} {r.table_s:>8.2f} {r.plans:>6} {r.table_bytes:>9} "
                  f"{r.dp_mbytes:>7.0f}")
    print("\nplain Python vs numba, vbs, every OPT[root, r, m] (values checked equal):")
    for name, profile in (("googlenet-like B=16", googlenet_like(16, seed=1)),
                          ("chain-30 B=16", chain_like(30, 16, seed=1))):
        plain_s, fast_s = plain_vs_fast(profile, 256)
        print(f"  {name:<20} 256 slots: plain {plain_s:7.2f} s   numba {fast_s:7.4f} s   "
              f"({plain_s / fast_s:.0f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
