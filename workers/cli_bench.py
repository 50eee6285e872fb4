"""``vbs bench``'s flags and command; the benchmark itself is ``workers.plans_measured``
(imported when the command runs, so building the ``vbs`` parser loads no torch)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from planner.cli import (add_model_args, add_precision_args, add_runtime_arg, load_capture,
                         positive_int, settings_from)


def cmd_bench(args: argparse.Namespace) -> int:
    from planner.pipeline import options_from
    from planner.profiling.profiler import cached_profile
    from planner.solver.compare import STRATEGIES, budget_range
    from core.sizes import parse_budgets
    from planner.solver.tables import build_tables
    from workers.plan_selection import selected
    from workers.plans_measured import render, run_bench, write_outputs

    settings = settings_from(args)
    cap = load_capture(args, settings)
    options = options_from(settings, batch_max=max(args.batch, args.batch_max or args.batch))
    profile, _ = cached_profile(cap, options, settings.profile_cache, progress=not args.json)
    log = (lambda _m: None) if args.json else (lambda m: print(m, file=sys.stderr))
    log("building the tables of " + ", ".join(STRATEGIES))
    tables = build_tables(profile, STRATEGIES, slot_bytes=settings.slot_bytes or None,
                          slot_count=settings.slot_count)
    if settings.select_rounds:  # vbs's row chosen by measurement, as `vbs plan` chooses it
        log(f"measuring vbs's and fbs-best's plans of {args.batch} samples "
            f"({settings.select_rounds} rounds), as `vbs plan` does before it publishes")
        tables = selected(cap, tables, "vbs", settings.select_rounds, sizes=(args.batch,),
                          margin=settings.select_margin, note=log)
    low, high = budget_range(tables, args.batch)
    budgets = parse_budgets(args.memory, low, high)
    rows, summary, plans = run_bench(cap, profile, tables, args.batch, budgets, args.repeat, log=log)
    if args.out:
        write_outputs(Path(args.out), rows, summary, profile, plans)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(render(rows, summary))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="vbs, paper, greedy, fbs and fbs-best side by side on the "
                                     "real model")
    add_model_args(p)
    add_runtime_arg(p)
    add_precision_args(p)
    p.add_argument("--batch", type=positive_int, required=True, help="request size")
    p.add_argument("--memory", default="auto",
                   help="budgets: START:STOP:STEP (15MB:40MB:5MB), a list (10MB,20MB) or auto[:N] "
                        "(N budgets, default 10, from where fbs-best runs one sample at a time "
                        "to where fbs runs the request at once, denser at the bottom)")
    p.add_argument("--batch-max", type=positive_int, help="profile up to this batch (default: --batch)")
    p.add_argument("--repeat", type=positive_int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--select-rounds", type=int, metavar="N",
                   help="rounds vbs's plans run against fbs-best's before the bench, as `vbs "
                        "plan` chooses them (0: the table as solved; default: VBS_SELECT_ROUNDS, 3)")
    p.add_argument("--select-margin", type=float, metavar="F",
                   help="how much faster than fbs-best's another plan must measure to take a "
                        "budget (default: VBS_SELECT_MARGIN, 0.10)")
    p.add_argument("--out", help="write CSV, JSON and PNG plots here")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_bench)
