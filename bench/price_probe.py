"""Where a plan's predicted time parts from what it measures (issue 58, "prices closer to the
truth"): every uniform plan of fbs-best at r samples, with, side by side in one process and
interleaved rounds, what the profile recorded for its call, that call timed alone now, and the
plan run in the executor as `vbs plan`'s selection runs it.

    .venv/bin/python bench/price_probe.py --model mnasnet0_75 --batch 8 [--rounds 5]

Why a probe and not a test: timings go in benchmarks (docs/benchmarks.md section 3).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import torch

from core import runtimes as rt
from core.runtimes.base import RuntimeOptions
from planner.cli import add_model_args, add_runtime_arg, load_capture, settings_from
from planner.pipeline import options_from
from planner.profiling.profiler import cached_profile
from planner.solver.compare import BASELINE
from planner.solver.tables import build_tables
from workers.executor import execute
from workers.plan_selection import timed


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    add_runtime_arg(p)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    settings = settings_from(args)
    cap = load_capture(args, settings)
    options = options_from(settings, batch_max=args.batch)
    profile, _ = cached_profile(cap, options, settings.profile_cache, progress=False)
    table = build_tables(profile, ("fbs",))["fbs"]
    r = args.batch
    runs = (profile.meta.get("runtimes", {}).get(rt.ONNXRUNTIME) or {}).get("runs") or []
    loaded = {name: rt.load(name, cap, RuntimeOptions())
              for name in table.runtimes if rt.KINDS[name].calls}
    ort = loaded.get(rt.ONNXRUNTIME)
    x = cap.model.example(r, seed=7)
    jobs: dict[str, tuple[float, int, object]] = {}
    seen = set()
    for index in table.row(r).plans.tolist():
        tp = table.plans[index]
        if tp.plan_id in seen:
            continue
        seen.add(tp.plan_id)
        plan = table.plan(index, r, tp.peak_bytes)
        c = max(s.samples for s in plan.program.steps)
        job = (lambda pl=plan: execute(cap, pl.program.steps, x, pl.split_map, pl.run_map, loaded))
        jobs[f"plan c={c}"] = (tp.time_total, math.ceil(r / c), job)
        if ort is not None and len(runs) == 1:
            first, last = runs[0]["first"], runs[0]["last"]
            xc = x[:c].contiguous()
            out = ort.output(ort.nodes(first, last)[-1], xc, c)
            jobs[f"call c={c}"] = (runs[0]["seconds"][c - 1], 1,
                                   (lambda f=first, l=last, xc=xc, out=out: ort.run(f, l, xc, out)))
            n = math.ceil(r / c)
            pieces = [(x[i * c:(i + 1) * c].contiguous(),
                       ort.output(ort.nodes(first, last)[-1], x[i * c:(i + 1) * c], min(c, r - i * c)))
                      for i in range(n)]

            def calls(f=first, l=last, pieces=pieces):
                for xi, oi in pieces:
                    ort.run(f, l, xi, oi)
            jobs[f"calls c={c}"] = (tp.time_total, n, calls)
    seconds: dict[str, list[float]] = {k: [] for k in jobs}
    order = list(jobs)
    with torch.inference_mode():
        for k in order:
            jobs[k][2]()
        for i in range(args.rounds):
            random.Random(i).shuffle(order)
            for k in order:
                seconds[k].append(timed(cap.model.device, jobs[k][2]))
    print(f"{cap.model.spec.name} r={r}, {args.rounds} rounds, threads {torch.get_num_threads()}")
    print(f"{'what':<12} {'profile/predicted ms':>20} {'measured ms':>12} {'spread':>7} "
          f"{'error':>7} {'per call ms':>12}")
    for k in sorted(jobs, key=lambda k: (int(k.split("=")[1]), k)):
        want, calls, _ = jobs[k]
        med = statistics.median(seconds[k])
        spread = (max(seconds[k]) - min(seconds[k])) / med
        print(f"{k:<12} {1e3 * want:>20.2f} {1e3 * med:>12.2f} {100 * spread:>6.0f}% "
              f"{100 * (med - want) / want:>+6.1f}% {1e3 * med / calls:>12.2f}")
    for units in loaded.values():
        units.release()


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
