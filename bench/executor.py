"""What the executor costs next to the model's own forward, every unit at the whole batch.

    python bench/executor.py [--models mobilenet_v2,resnet50] [--batches 1,8] [--rounds 20]
                             [--tree DIR]

For each model and batch size b (random weights, 3x224x224, torch's default threads): plain
``model(x)`` and ``workers.executor.execute`` running the uniform program (every unit and
block of the captured tree on all b samples, the plan every table holds for one sample and
the fbs plan of b), interleaved in one process, ``--rounds`` times after two warm-up rounds;
medians, their ratio, and the spread of the ratio over the rounds (runs differ from run to
run, so one ratio alone says little). Outputs are compared too (bit-exact is expected: every unit at the whole batch).

``--tree DIR`` imports ``planner`` and ``workers`` from another checkout, such as a
``git worktree add /tmp/before <commit>`` of an earlier commit, to compare executors with the
same command.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mobilenet_v2,resnet50")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose executor runs")
    args = ap.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))

    import torch

    from planner.graph.capture import capture
    from core.loaded import ModelSpec
    from planner.models import load_model
    from core.program import Step
    from core.tree import Layer, Parallel, iter_nodes
    from workers.executor import execute

    print(f"executor of {args.tree.resolve()}")
    print("| model | batch | model(x) (ms) | executor (ms) | executor / model(x), median "
          "(min-max over rounds) | max abs error |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        loaded = load_model(ModelSpec(name=name))
        cap = capture(loaded)
        for b in (int(v) for v in args.batches.split(",")):
            steps = [Step(n.name, b) for n in iter_nodes(cap.tree)
                     if isinstance(n, (Layer, Parallel))]
            x = loaded.example(b)
            with torch.inference_mode():
                error = float((loaded.module(x) - execute(cap, steps, x)).abs().max())
            plain: list[float] = []
            ours: list[float] = []
            for k in range(args.rounds + 2):
                t0 = time.perf_counter()
                with torch.inference_mode():
                    loaded.module(x)
                t1 = time.perf_counter()
                execute(cap, steps, x)
                t2 = time.perf_counter()
                if k >= 2:
                    plain.append(t1 - t0)
                    ours.append(t2 - t1)
            ratios = sorted(o / p for o, p in zip(ours, plain))
            print(f"| {name} | {b} | {1e3 * statistics.median(plain):.2f} | "
                  f"{1e3 * statistics.median(ours):.2f} | {statistics.median(ratios):.3f} "
                  f"({ratios[0]:.3f}-{ratios[-1]:.3f}) | {error:.1e} |", flush=True)


if __name__ == "__main__":
    main()
