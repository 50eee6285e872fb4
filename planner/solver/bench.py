"""Time plan-table builds on synthetic trees; compare plain Python with the numba kernels.

    python -m planner.solver.bench [--quick] [--profile FILE ...]

Prints one row per case: units, blocks, B, slots, the DP time, the read-out time (every
breakpoint's program), plans kept, serialised size, peak DP memory. Then the plain-Python
recurrences against the fast kernels on one small instance (same values, checked).
``bench()`` returns the rows for callers (the lead's ``vbs bench`` or docs).
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
from planner.solver.table import build_table
from planner.tree import Parallel, Profile, iter_layers, iter_nodes, load_profile


@dataclass(frozen=True)
class BenchRow:
    """One timed table build."""

    case: str
    solver: str
    units: int
    blocks: int
    batch_max: int
    slots: int
    dp_s: float
    table_s: float
    plans: int
    table_bytes: int
    dp_mbytes: float


def _time(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _warm() -> None:
    """Compile (or load from numba's cache) every kernel once, outside the timings."""
    build_table(chain_like(4, 4), solver="vbs", slot_count=8)
    build_table(chain_like(4, 4), solver="paper", slot_count=8)
    build_table(googlenet_like(4), solver="vbs", slot_count=8)


def bench(cases: list[tuple[str, Profile]] | None = None, solvers: tuple[str, ...] = ("vbs", "paper")
          ) -> list[BenchRow]:
    """Time the DP alone and the whole table build for every case and solver."""
    _warm()
    if cases is None:
        cases = [("googlenet-like", googlenet_like(32)), ("resnet50-like", resnet50_like(32)),
                 ("chain-150", chain_like(150, 32))]
    rows = []
    for name, profile in cases:
        inst = build_instance(profile)
        slot = default_slot_bytes(inst)
        M = table_slots(inst, slot)
        units = sum(1 for _ in iter_layers(profile.root))
        blocks = sum(isinstance(n, Parallel) for n in iter_nodes(profile.root))
        for solver in solvers:
            dp_s, tables = _time(lambda: ChainTables(inst, solver, slot, M))
            mbytes = (tables.T.nbytes + tables.E.nbytes) / 1e6  # type: ignore[attr-defined]
            del tables
            table_s, table = _time(lambda: build_table(inst, solver=solver, slot_bytes=slot))
            rows.append(BenchRow(name, solver, units, blocks, inst.batch_max, M, dp_s, table_s,
                                 len(table.plans), len(table.to_bytes()), mbytes))  # type: ignore[attr-defined]
            del table
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
    parser.add_argument("--profile", action="append", default=[],
                        help="also time a measured profile (vbs.profile/1 file); repeatable")
    args = parser.parse_args(argv)
    cases = [("googlenet-like", googlenet_like(32)), ("resnet50-like", resnet50_like(32))]
    if not args.quick:
        cases.append(("chain-150", chain_like(150, 32)))
    for path in args.profile:
        measured = load_profile(path)
        cases.append((str(measured.meta.get("model", path)), measured))
    print(f"{'case':<15} {'solver':<6} {'units':>5} {'blocks':>6} {'B':>3} {'slots':>5} "
          f"{'DP s':>7} {'table s':>8} {'plans':>6} {'bytes':>9} {'DP MB':>7}")
    for r in bench(cases):
        print(f"{r.case:<15} {r.solver:<6} {r.units:>5} {r.blocks:>6} {r.batch_max:>3} {r.slots:>5} "
              f"{r.dp_s:>7.2f} {r.table_s:>8.2f} {r.plans:>6} {r.table_bytes:>9} {r.dp_mbytes:>7.0f}")
    print("plain Python vs numba, vbs, every OPT[root, r, m] (values checked equal):")
    for name, profile in (("googlenet-like B=16", googlenet_like(16, seed=1)),
                          ("chain-30 B=16", chain_like(30, 16, seed=1))):
        plain_s, fast_s = plain_vs_fast(profile, 256)
        print(f"  {name:<20} 256 slots: plain {plain_s:7.2f} s   numba {fast_s:7.4f} s   "
              f"({plain_s / fast_s:.0f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
