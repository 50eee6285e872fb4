"""Where a plan's measured CUDA peak passes what its table claims, which allocations made it.

    python -m bench.gpu.peak_trace --model mobilenet_v2 --batch 12 [--memory auto:6]
                                   [--strategies vbs,fbs-best] [--device cuda]

Profiles as `vbs bench` does (same cache), builds the tables, and for every (strategy, budget)
runs the plan once more under ``torch.cuda.memory._record_memory_history``: the allocator's own
trace, replayed, gives the live allocations at the peak with the Python frames that made them.
A plan whose measured peak equals its claim prints one line; one over it prints what was live.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

PROJECT = ("/core/", "/workers/", "/planner/", "torch/nn/", "torch/_tensor")


def replay(trace: list[dict[str, Any]]) -> tuple[int, list[tuple[int, list[dict[str, Any]]]]]:
    """The highest allocated total the trace reaches (relative to its start) and the
    allocations it made that were live at that moment: (size, frames), largest first."""
    cur = top = 0
    live: dict[int, tuple[int, list[dict[str, Any]]]] = {}
    at_top: dict[int, tuple[int, list[dict[str, Any]]]] = {}
    for e in trace:
        action = e.get("action")
        if action == "alloc":
            cur += int(e["size"])
            live[int(e["addr"])] = (int(e["size"]), e.get("frames") or [])
            if cur > top:
                top, at_top = cur, dict(live)
        elif action == "free_requested":
            cur -= int(e["size"])
            live.pop(int(e["addr"]), None)
    return top, sorted(at_top.values(), key=lambda a: -a[0])


def where(frames: list[dict[str, Any]], n: int = 4) -> str:
    mine = [f for f in frames if any(p in f.get("filename", "") for p in PROJECT)]
    return " <- ".join(f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}"
                       f":{f['line']} {f['name']}" for f in (mine or frames)[:n])


def main(argv: list[str] | None = None) -> int:
    from planner.cli import add_model_args, add_runtime_arg, load_capture, settings_from
    from planner.pipeline import options_from
    from planner.profiling.profiler import cached_profile
    from planner.solver.compare import STRATEGIES, budget_range
    from planner.solver.tables import build_tables
    from core.errors import InfeasibleError
    from core.sizes import format_bytes, parse_budgets
    from workers.executor import execute

    parser = argparse.ArgumentParser(prog="python -m bench.gpu.peak_trace",
                                     description=__doc__.splitlines()[0])
    add_model_args(parser)
    add_runtime_arg(parser)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--memory", default="auto:6")
    parser.add_argument("--strategies", default="vbs,fbs-best")
    args = parser.parse_args(argv)
    settings = settings_from(args)
    cap = load_capture(args, settings)
    device = cap.model.device
    if device.type != "cuda":
        raise SystemExit("peak_trace reads the CUDA allocator's trace: --device cuda")
    options = options_from(settings, batch_max=args.batch)
    profile, _ = cached_profile(cap, options, settings.profile_cache, progress=False)
    tables = build_tables(profile, STRATEGIES)
    budgets = parse_budgets(args.memory, *budget_range(tables, args.batch))
    x = cap.model.example(args.batch, seed=7)
    print(f"{cap.model.spec.name} r={args.batch} on {torch.cuda.get_device_name(device)}, "
          f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"tf32 conv {torch.backends.cudnn.allow_tf32}")
    for budget in budgets:
        for strategy in args.strategies.split(","):
            try:
                plan = tables[strategy].lookup(args.batch, budget)
            except InfeasibleError:
                continue

            def job() -> None:
                execute(cap, plan.program.steps, x, plan.split_map, plan.run_map)

            for _ in range(2):
                job()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
            job()
            torch.cuda.synchronize(device)
            measured = torch.cuda.max_memory_allocated(device) - base
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            trace = snap["device_traces"][device.index or 0]
            top, live = replay(trace)
            head = (f"{format_bytes(budget):>10} {strategy:8} claimed {plan.peak_bytes} "
                    f"measured {measured} (replayed {top}) over by {measured - plan.peak_bytes}")
            print(head)
            if measured > plan.peak_bytes:
                for size, frames in live[:12]:
                    print(f"    {size:>10}  {where(frames)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
