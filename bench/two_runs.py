"""What a plan of two runs can gain over the uniform batch that fits the same memory, here.

    python bench/two_runs.py [--model mnasnet0_5] [--batch 16] [--early 1,2,4]
                             [--rounds 15] [--calls 5] [--top 2]

Every uniform batch c (ONNX Runtime's longest runs, as fbs-best runs them) and every plan of
two runs (the root series' first k units on sub-batches of c, the rest on all samples at once,
one call each) is priced as the table prices it (``planner.solver.pricing``) and laid out as
the executor runs it (its claimed peak, ``core.walk``). The uniform batches and, for each c,
the ``--top`` two-run plans of least predicted time and the one of least peak run in the
executor (``workers.executor.execute``, outputs checked against ``model(x)``), interleaved:
``--rounds`` rounds of ``--calls`` runs each. Prints each plan's claimed peak, predicted and
measured time per sample (median of the rounds, min-max), and its measured gain over the
fastest measured uniform batch whose peak fits in its own: the most any plan of this family
gains at its budget on this machine. The profile is the cached one (`vbs profile`, the
settings' cache directory) or measured now.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.loaded import ModelSpec
from core.program import Step
from core.runtimes import ONNXRUNTIME
from core.runtimes.onnxrt import OrtUnits
from core.walk import layout
from planner.graph.capture import capture
from planner.models import apply_threads, load_model
from planner.pipeline import options_from
from planner.profiling.profiler import cached_profile
from planner.settings import Settings
from planner.solver import baselines
from planner.solver.model import Instance, Unit
from planner.solver.solve import instance_of
from workers.executor import execute


@dataclass(frozen=True)
class Candidate:
    label: str
    early: int  # the early run's sub-batch size (0: a uniform batch)
    steps: tuple[Step, ...]
    runs: tuple[tuple[int, int], ...]
    predicted: float  # seconds per sample, the table's pricing
    peak: int         # claimed bytes, the walk's with what ONNX Runtime holds inside its calls


def _phase(units: Sequence[Unit], samples: int) -> list[Step]:
    steps: list[Step] = []
    for unit in units:
        baselines._uniform_phase_whole(unit, samples, ONNXRUNTIME, steps)
    return steps


def candidates(inst: Instance, r: int, early: list[int]) -> list[Candidate]:
    """Every uniform batch and every two-run plan (cut after root unit k, early at c)."""
    root = inst.root
    programs: list[tuple[str, int, tuple[tuple[Step, ...], tuple[tuple[int, int], ...]]]] = []
    for c in sorted({1, 2, 4, 8, r} | set(early)):
        if c <= r:
            programs.append((f"uniform {c}", 0, baselines.fbs_program(inst, c, r, "runs")))
    for k in range(1, root.n):
        for c in early:
            steps: list[Step] = []
            runs: list[tuple[int, int]] = []
            for p in [*baselines.fbs_phases(c, r), None]:
                part = _phase(root.units[:k], p) if p else _phase(root.units[k:], r)
                runs.append((len(steps), len(steps) + len(part) - 1))
                steps += part
            programs.append((f"{root.units[0].name}..{root.units[k - 1].name} at {c}, "
                             f"{root.units[k].name}..{root.units[-1].name} at {r}", c,
                             (tuple(steps), tuple(runs))))
    out = []
    for label, c, (steps, runs) in programs:
        lay = layout(inst.tree, steps, r, granule=inst.granule, runs=runs,  # type: ignore[arg-type]
                     measured=inst.run_memory)
        out.append(Candidate(label, c, tuple(steps), tuple(runs),
                             inst.time_pricing.program(steps, runs) / r, lay.peak))
    return out


def chosen(cands: list[Candidate], early: list[int], top: int) -> list[Candidate]:
    """The uniform batches, and per early batch size the fastest predicted two-run plans and
    the one of least peak."""
    picked = [c for c in cands if not c.early]
    for c in early:
        two = [x for x in cands if x.early == c]
        picked += sorted(two, key=lambda x: x.predicted)[:top]
        least = min(two, key=lambda x: (x.peak, x.predicted), default=None)
        if least is not None and least not in picked:
            picked.append(least)
    return picked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mnasnet0_5")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--early", default="1,2,4", help="sub-batch sizes of the early run")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=5, help="runs of each plan per round")
    ap.add_argument("--top", type=int, default=2, help="two-run plans measured per early size")
    args = ap.parse_args()
    early = [int(v) for v in args.early.split(",")]
    settings = Settings()
    apply_threads(settings.threads)
    cap = capture(load_model(ModelSpec(args.model)))
    profile, _ = cached_profile(cap, options_from(settings, args.batch), settings.profile_cache,
                                progress=False)
    inst = instance_of(profile, "time")
    picked = chosen(candidates(inst, args.batch, early), early, args.top)
    ort = OrtUnits(cap)
    x = cap.model.example(args.batch, seed=7)
    times: dict[str, list[float]] = {c.label: [] for c in picked}
    with torch.inference_mode():
        want = cap.model.module(x)
        for c in picked:  # warm-up (sessions), and the outputs checked
            got = execute(cap, c.steps, x, None, dict(c.runs), {ort.name: ort})
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
        for _ in range(args.rounds):
            for c in picked:
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    execute(cap, c.steps, x, None, dict(c.runs), {ort.name: ort})
                times[c.label].append((time.perf_counter() - t0) / args.calls / args.batch)
    measured = {label: statistics.median(ts) for label, ts in times.items()}
    uniform = [c for c in picked if not c.early]
    print(f"{args.model}, r = {args.batch}, {args.rounds} interleaved rounds of {args.calls} "
          f"runs; ms per sample")
    print("| plan | claimed peak (MiB) | predicted | measured (min-max) | "
          "the fastest uniform batch that fits | gain over it, measured |")
    print("|---|---|---|---|---|---|")
    for c in sorted(picked, key=lambda c: c.peak):
        fits = [u for u in uniform if u.peak <= c.peak]
        best = min(fits, key=lambda u: measured[u.label], default=None)
        ts = times[c.label]
        gain = f"{measured[best.label] / measured[c.label]:.2f}x" if best else "-"
        print(f"| {c.label} | {c.peak / 2**20:.2f} | {c.predicted * 1e3:.2f} | "
              f"{measured[c.label] * 1e3:.2f} ({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}) | "
              f"{best.label if best else '-'} | {gain} |")


if __name__ == "__main__":
    main()
