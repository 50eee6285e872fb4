"""How long profiling takes, and how much a grid of batch sizes loses by interpolating.

    python -m planner.profiling.bench --model resnet50 --model googlenet --batch-max 16

For each model: one full profile (every b = 1..B) and one grid profile, both uncached, each
timed; then the interpolation error of the grid profile against the full one over the batch
sizes the grid did not measure (mean and max absolute percentage error of time(u,b), all
units). Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from planner.graph.capture import capture
from planner.models import ModelSpec, load_model
from planner.profiling.grid import batch_grid
from planner.profiling.profiler import ProfileOptions, device_name, measure
from planner.tree import iter_layers


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
        t0 = time.perf_counter()
        full = measure(cap, ProfileOptions(args.batch_max, repeats=args.repeats), progress=False)
        t_full = time.perf_counter() - t0
        t0 = time.perf_counter()
        grid = measure(cap, ProfileOptions(args.batch_max, repeats=args.repeats, grid=True), progress=False)
        t_grid = time.perf_counter() - t0
        measured = set(batch_grid(args.batch_max, True))
        errors = [abs(g - f) / f
                  for lf, lg in zip(iter_layers(full.root), iter_layers(grid.root))
                  for b, (f, g) in enumerate(zip(lf.time, lg.time), start=1)
                  if b not in measured and f > 0]
        whole_f = sum(sum(l.time) for l in iter_layers(full.root))
        whole_g = sum(sum(l.time) for l in iter_layers(grid.root))
        rows.append((name, full.meta["units"], t_full, len(measured), t_grid,
                     100 * statistics.fmean(errors) if errors else 0.0,
                     100 * max(errors) if errors else 0.0, 100 * abs(whole_g - whole_f) / whole_f))
    print(f"Machine: {device_name(torch.device(args.device))}, torch {torch.__version__}, "
          f"B = {args.batch_max}, {args.repeats} repeats\n")
    print("| model | units | full profile (s) | grid points | grid profile (s) | "
          "interp. error mean | max | error of summed time |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]} | {r[4]:.1f} | {r[5]:.1f}% | {r[6]:.1f}% | {r[7]:.1f}% |")


if __name__ == "__main__":
    main()
