"""Is a run's profiled time low because of when it was measured, or of what state it ran in?
(issue 58, "prices closer to the truth": bench/price_probe.py found small calls 16-30% above
the profile's figure minutes later in the same process, and could not tell the two apart.)

One process: the profile measured (not cached), a session made after it, then rounds in
shuffled order of every batch size timed each way of ``HOW``, and a second profile at the end
(its figure beside the first's says how far the profile itself moves). Each cell: the median
of the rounds, and its difference from the first profile's figure.

    .venv/bin/python bench/price_state.py --model regnet_x_800mf --batch 8 [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from core import runtimes as rt
from core.runner import run_node
from core.runtimes.base import RuntimeOptions
from planner.cli import load_capture, settings_from
from planner.pipeline import options_from
from planner.profiling.profiler import RUN_CALLS, measure


# How a call is timed: as the profiler did up to its ONNX Runtime method 7 (the median of
# ``RUN_CALLS`` calls, each after an identical one on the same input); alone, in the round's
# shuffled order; right after a call of another batch size; of ``RUN_CALLS`` calls on samples of
# their own into outputs of their own after a call of another batch size (as a plan's calls
# meet them), the first, the median of the others, and the mean of all (what the profiler
# times from its method 9, after one call not timed); and right after a pass of the model on
# torch, as the profiler's passes ran before its run's calls
HOW = ("same input", "alone", "after other", "after torch", "slices 1st", "slices next",
       "slices mean")


def _run_figures(profile) -> tuple[str, str, list[float]]:
    runs = profile.meta["runtimes"][rt.ONNXRUNTIME]["runs"]
    if len(runs) != 1:
        raise SystemExit(f"the model has {len(runs)} runs on ONNX Runtime: pick one of one run")
    return runs[0]["first"], runs[0]["last"], runs[0]["seconds"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--input-shape")
    p.add_argument("--weights")
    p.add_argument("--dtype")
    p.add_argument("--device")
    p.add_argument("--cache-dir")
    p.add_argument("--runtime")
    args = p.parse_args()
    settings = settings_from(args)
    cap = load_capture(args, settings)
    options = options_from(settings, batch_max=args.batch)
    batches = sorted({1, 2, 3, 4, args.batch // 2, args.batch} - {0})
    xs = {b: cap.model.example(b, seed=100 + b) for b in batches}
    big = cap.model.example(RUN_CALLS * max(batches), seed=99)  # distinct slices, as a plan's
    sessions = {}
    t0 = time.perf_counter()
    first_profile = measure(cap, options, progress=False)
    profiled_s = time.perf_counter() - t0
    first, last, figure = _run_figures(first_profile)
    sessions["late"] = rt.load(rt.ONNXRUNTIME, cap, RuntimeOptions())
    outs = {}
    with torch.inference_mode():
        for name, s in sessions.items():
            for b in batches:
                outs[name, b] = s.output(s.nodes(first, last)[-1], xs[b], b)
                s.run(first, last, xs[b], outs[name, b])

        def call(name: str, b: int) -> float:
            t = time.perf_counter()
            sessions[name].run(first, last, xs[b], outs[name, b])
            return time.perf_counter() - t

        def slices(name: str, b: int) -> list[float]:
            s, ts = sessions[name], []
            for i in range(RUN_CALLS):
                x = big[i * b:(i + 1) * b]
                t = time.perf_counter()
                s.run(first, last, x, s.output(s.nodes(first, last)[-1], x, b))
                ts.append(time.perf_counter() - t)
            return ts

        other = {b: batches[(batches.index(b) + 1) % len(batches)] for b in batches}
        jobs = [(name, b, how) for name in sessions for b in batches for how in HOW]
        seconds: dict[tuple[str, int, str], list[float]] = {j: [] for j in jobs}
        for i in range(args.rounds):
            random.Random(i).shuffle(jobs)
            for name, b, how in jobs:
                if how == "same input":
                    call(name, b)
                    seconds[name, b, how].append(
                        statistics.median(call(name, b) for _ in range(RUN_CALLS)))
                elif how == "alone":
                    seconds[name, b, how].append(call(name, b))
                elif how == "after other":
                    call(name, other[b])
                    seconds[name, b, how].append(call(name, b))
                elif how == "after torch":
                    run_node(cap, cap.tree, xs[b])
                    seconds[name, b, how].append(call(name, b))
                elif how == "slices 1st":
                    call(name, other[b])
                    seconds[name, b, how].append(slices(name, b)[0])
                elif how == "slices next":
                    call(name, other[b])
                    seconds[name, b, how].append(statistics.median(slices(name, b)[1:]))
                else:
                    call(name, other[b])
                    seconds[name, b, how].append(statistics.fmean(slices(name, b)))
    second_profile = measure(cap, options, progress=False)
    _, _, again = _run_figures(second_profile)
    print(f"{cap.model.spec.name} ({settings.precision}), run {first}..{last}, {args.rounds} "
          f"rounds, threads {torch.get_num_threads()}, profile {profiled_s:.0f} s")
    head = ["batch", "profile", "2nd profile"] + [f"{n} {h}" for n in sessions for h in HOW]
    print(" | ".join(f"{h:>14}" for h in head))
    for b in batches:
        row = [f"{b:>14}", f"{1e3 * figure[b - 1]:>14.3f}", f"{1e3 * again[b - 1]:>14.3f}"]
        for n in sessions:
            for h in HOW:
                ts = seconds[n, b, h]
                med = statistics.median(ts)
                row.append(f"{1e3 * med:>7.3f} {100 * (med / figure[b - 1] - 1):>+5.0f}%")
        print(" | ".join(row))
    print("(each cell: median ms, and its difference from the profile's figure)")
    for s in sessions.values():
        s.release()


if __name__ == "__main__":
    main()
