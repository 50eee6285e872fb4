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
from planner.cli import add_model_args, add_runtime_arg, load_capture, settings_from
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
       "slices mean", "torch, pause")
# "torch, pause": right after a pass on torch and a pause of PAUSE_S, in which torch's idle
# OpenMP threads stop spinning (libgomp spins a while before it sleeps)
PAUSE_S = 0.05


def _run_figures(profile) -> tuple[str, str, list[float]]:
    runs = profile.meta["runtimes"][rt.ONNXRUNTIME]["runs"]
    if len(runs) != 1:
        raise SystemExit(f"the model has {len(runs)} runs on ONNX Runtime: pick one of one run")
    return runs[0]["first"], runs[0]["last"], runs[0]["seconds"]


def _timings(cap, session, first: str, last: str, batches: list[int], rounds: int
             ) -> dict[tuple[int, str], list[float]]:
    """Seconds of one call of the run ``first..last`` per (batch, way of ``HOW``), a round each."""
    xs = {b: cap.model.example(b, seed=100 + b) for b in batches}
    big = cap.model.example(RUN_CALLS * max(batches), seed=99)  # samples of their own
    outs = {b: session.output(session.nodes(first, last)[-1], xs[b], b) for b in batches}

    def call(b: int) -> float:
        t = time.perf_counter()
        session.run(first, last, xs[b], outs[b])
        return time.perf_counter() - t

    def slices(b: int) -> list[float]:
        ts = []
        for i in range(RUN_CALLS):
            x = big[i * b:(i + 1) * b]
            t = time.perf_counter()
            session.run(first, last, x, session.output(session.nodes(first, last)[-1], x, b))
            ts.append(time.perf_counter() - t)
        return ts

    other = {b: batches[(batches.index(b) + 1) % len(batches)] for b in batches}
    ways = {
        "same input": lambda b: (call(b), statistics.median(call(b) for _ in range(RUN_CALLS)))[1],
        "alone": call,
        "after other": lambda b: (call(other[b]), call(b))[1],
        "after torch": lambda b: (run_node(cap, cap.tree, xs[b]), call(b))[1],
        "slices 1st": lambda b: (call(other[b]), slices(b)[0])[1],
        "slices next": lambda b: (call(other[b]), statistics.median(slices(b)[1:]))[1],
        "slices mean": lambda b: (call(other[b]), statistics.fmean(slices(b)))[1],
        "torch, pause": lambda b: (run_node(cap, cap.tree, xs[b]), time.sleep(PAUSE_S),
                                   call(b))[2],
    }
    jobs = [(b, how) for b in batches for how in HOW]
    seconds: dict[tuple[int, str], list[float]] = {j: [] for j in jobs}
    with torch.inference_mode():
        for b in batches:
            call(b)
        for i in range(rounds):
            random.Random(i).shuffle(jobs)
            for b, how in jobs:
                seconds[b, how].append(ways[how](b))
    return seconds


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    add_runtime_arg(p)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    settings = settings_from(args)
    cap = load_capture(args, settings)
    options = options_from(settings, batch_max=args.batch)
    batches = sorted({1, 2, 3, 4, args.batch // 2, args.batch} & set(range(1, args.batch + 1)))
    t0 = time.perf_counter()
    first, last, figure = _run_figures(measure(cap, options, progress=False))
    profiled_s = time.perf_counter() - t0
    session = rt.load(rt.ONNXRUNTIME, cap, RuntimeOptions())
    seconds = _timings(cap, session, first, last, batches, args.rounds)
    session.release()
    _, _, again = _run_figures(measure(cap, options, progress=False))
    print(f"{cap.model.spec.name} ({settings.precision}), run {first}..{last}, {args.rounds} "
          f"rounds, threads {torch.get_num_threads()}, profile {profiled_s:.0f} s")
    print(" | ".join(f"{h:>14}" for h in ["batch", "profile", "2nd profile", *HOW]))
    for b in batches:
        row = [f"{b:>14}", f"{1e3 * figure[b - 1]:>14.3f}", f"{1e3 * again[b - 1]:>14.3f}"]
        for how in HOW:
            med = statistics.median(seconds[b, how])
            row.append(f"{1e3 * med:>7.3f} {100 * (med / figure[b - 1] - 1):>+5.0f}%")
        print(" | ".join(row))
    print("(each cell: median ms, and its difference from the profile's figure)")


if __name__ == "__main__":
    main()
