"""How long profiling takes, how much a grid of batch sizes loses, and how noisy timing is.

    python -m planner.profiling.grid_vs_full --model resnet50 --model googlenet --batch-max 16

For each model: two full profiles (every b = 1..B) and one grid profile, all uncached and
timed. The interpolation error is measured inside ONE full profile: the times at the grid's
batch sizes are interpolated (planner.profiling.grid.fill_time) and compared with what was
measured at the other batch sizes, so it is the error of interpolating, not of timing twice.
The run-to-run difference of the two full profiles is reported beside it: it says how much
of any prediction error is this machine's timing noise. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from planner.graph.capture import capture
from core.spec import ModelSpec
from planner.models import load_model
from planner.profiling.grid import batch_grid, fill_time
from planner.profiling.profiler import ProfileOptions, device_name, measure
from core.tree import Profile, iter_layers


def _pct(values: list[float]) -> tuple[float, float]:
    return 100 * statistics.fmean(values), 100 * max(values)


def interpolation_errors(full: Profile, grid: list[int]) -> list[float]:
    """|interpolated - measured| / measured at every (unit, b) the grid does not measure."""
    errors = []
    for layer in iter_layers(full.root):
        known = {b: layer.time[b - 1] for b in grid}
        filled = fill_time(known, full.batch_max)
        errors += [abs(filled[b - 1] - layer.time[b - 1]) / layer.time[b - 1]
                   for b in range(1, full.batch_max + 1) if b not in known and layer.time[b - 1] > 0]
    return errors


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--batch-max", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    rows = []
    for name in args.model:
        cap = capture(load_model(ModelSpec(name, device=args.device)))
        full_opts = ProfileOptions(args.batch_max, repeats=args.repeats)
        t0 = time.perf_counter()
        full = measure(cap, full_opts, progress=False)
        t_full = time.perf_counter() - t0
        again = measure(cap, full_opts, progress=False)
        t0 = time.perf_counter()
        measure(cap, ProfileOptions(args.batch_max, repeats=args.repeats, grid=True), progress=False)
        t_grid = time.perf_counter() - t0
        grid = batch_grid(args.batch_max, True)
        interp = interpolation_errors(full, grid)
        noise = [abs(b.time[k] - a.time[k]) / a.time[k]
                 for a, b in zip(iter_layers(full.root), iter_layers(again.root))
                 for k in range(args.batch_max) if a.time[k] > 0]
        whole = [abs(sum(b.time[k] for b in iter_layers(again.root)) -
                     sum(a.time[k] for a in iter_layers(full.root))) /
                 sum(a.time[k] for a in iter_layers(full.root)) for k in range(args.batch_max)]
        rows.append((name, full.meta["units"], t_full, len(grid), t_grid, *_pct(interp),
                     *_pct(noise), 100 * statistics.fmean(whole)))
    print(f"Machine: {device_name(torch.device(args.device))}, torch {torch.__version__}, "
          f"B = {args.batch_max}, {args.repeats} repeats\n")
    print("| model | units | full profile (s) | grid points | grid profile (s) | interpolation "
          "error mean | max | run-to-run, per (unit, b) mean | max | run-to-run, whole network |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]} | {r[4]:.1f} | {r[5]:.1f}% | {r[6]:.1f}% | "
              f"{r[7]:.1f}% | {r[8]:.1f}% | {r[9]:.1f}% |")


if __name__ == "__main__":
    main()
