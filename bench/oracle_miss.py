"""How often the solvers miss the true optimum: random tiny chains against the exhaustive oracle.

    python bench/oracle_miss.py [--count 16000] [--seed 0] [--priced]

Draws random chains (1-5 units, B <= 5, sizes 0-3 bytes per sample, workspaces 0-4 bytes,
times 1-10, a request size r <= B and a budget between "one sample through the hungriest
unit" minus one and "all r at once", the distribution of ``tests/planner/test_solver_oracle.py``)
until ``--count`` of them are feasible (the oracle finds a schedule), with slots of 1 byte so
every comparison is exact. The oracle (``planner/solver/oracle.py``: Dijkstra over the states
"samples waiting at each boundary") gives the best sequential schedule; the paper's DP and
vbs are solved for the same instance. Prints, per solver, instances where it is slower than the
optimum (a miss), where it finds no schedule at all, and the largest relative excess.
``--priced``: the model that runs on ONNX Runtime, each chain's units measured on it too
(``planner.solver.synthetic.with_runtime``; some it does not take) with a call of 0-6 time
units plus 0, 0.5 or 1 per byte in and out: the oracle and the DPs price every call and cut.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from core.errors import InfeasibleError
from core.tree import Profile
from planner.solver.oracle import chain_profile, oracle
from planner.solver.solve import solve
from planner.solver.synthetic import with_runtime

SOLVERS = ("paper", "vbs")
TOL = 1e-9


def draw(rng: np.random.Generator) -> tuple[object, int, int]:
    n = int(rng.integers(1, 6))
    B = int(rng.integers(1, 6))
    sizes = [int(rng.integers(0, 4)) for _ in range(n + 1)]
    layers = []
    for k in range(n):
        times = [float(rng.integers(1, 11)) for _ in range(B)]
        ws = [int(rng.integers(0, 5)) for _ in range(B)]
        layers.append((sizes[k], sizes[k + 1], times, ws))
    r = int(rng.integers(1, B + 1))
    lo = max(sizes[0] * r, max(i + w[0] + o for i, o, _, w in layers))
    hi = max(i * r + w[r - 1] + o * r for i, o, _, w in layers)
    budget = int(rng.integers(max(0, lo - 1), max(lo, hi) + 1))
    return chain_profile(layers, batch_max=B), r, budget


def priced(profile: Profile, rng: np.random.Generator) -> Profile:
    """``profile`` with ONNX Runtime's measurements and a call cost of the chain's scale."""
    B = profile.batch_max
    ort = with_runtime(profile, int(rng.integers(1 << 30)),
                           choice=str(rng.choice(["auto", "onnxruntime"])))
    meta = dict(ort.meta)
    meta["runtimes"] = {"onnxruntime": {
        "version": "synthetic", "call_s": [float(rng.integers(0, 7)) for _ in range(B)],
        "byte_s": [float(rng.choice([0.0, 0.5, 1.0])) for _ in range(B)]}}
    return Profile(batch_max=B, root=ort.root, meta=meta)


def cost(profile: object, r: int, budget: int, solver: str) -> float:
    try:
        return solve(profile, r, budget, solver=solver, slot_bytes=1).cost
    except InfeasibleError:
        return math.inf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=16000, help="feasible instances to draw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--priced", action="store_true",
                    help="units on ONNX Runtime too, every call and cut priced")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    drawn = feasible = 0
    misses = {s: 0 for s in SOLVERS}
    none = {s: 0 for s in SOLVERS}
    worst = {s: 0.0 for s in SOLVERS}
    while feasible < args.count:
        profile, r, budget = draw(rng)
        if args.priced:
            profile = priced(profile, rng)
        drawn += 1
        best, _ = oracle(profile, r, budget)
        if best == math.inf:
            continue
        feasible += 1
        for solver in SOLVERS:
            got = cost(profile, r, budget, solver)
            if got == math.inf:
                none[solver] += 1
                misses[solver] += 1
            elif got > best + TOL:
                misses[solver] += 1
                worst[solver] = max(worst[solver], got / best - 1)
    elapsed = time.perf_counter() - t0
    kind = "priced " if args.priced else ""
    print(f"{feasible} feasible random {kind}chains ({drawn} drawn, seed {args.seed}, "
          f"{elapsed:.0f} s)\n")
    print("| solver | slower than the optimum | of which: no schedule found | largest excess |")
    print("|---|---|---|---|")
    for solver in SOLVERS:
        print(f"| {solver} | {misses[solver]} ({100 * misses[solver] / feasible:.3f}%) | "
              f"{none[solver]} | {100 * worst[solver]:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
