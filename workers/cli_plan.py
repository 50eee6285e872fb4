"""``vbs plan``: profile (cached), solve, publish and compile every model, then measure what
each compiled model keeps loaded.

    vbs plan [--model [ALIAS=]NAME[@C,H,W] ...] --batch-max B [--store redis://...|DIR]
             [--weights FILE] [--solver vbs] [--objective time] [--grid] [--replan]

For every model (or VBS_MODELS): the one-shot job of docker compose and the Kubernetes planner
Job. It stores the served solver's table and those of the strategies compared with it (paper,
greedy, fbs, fbs-best); on the CPU the model compiled for the worker without torch with tables
that worker runs (``planner.pipeline.compile_served``), and what that worker keeps once it has
loaded it, with the load's time (``workers.load_cost``): so the service knows a model's cost
before its first load. It lives here, above the planner, because that last step loads the
model as a worker does.
"""

from __future__ import annotations

import argparse
from typing import Any

from planner.cli_plan import add_common_args, model_specs


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.cli import given_settings, runtime_lines, settings_from
    from planner.pipeline import prepare
    from planner.store import open_store

    settings = settings_from(args)
    store = open_store(settings.store_location)
    try:
        for served, spec in model_specs(args, settings):
            prepared = prepare(spec, settings, store, batch_max=args.batch_max,
                               solver=args.solver or settings.solver,
                               objective=args.objective or settings.objective,
                               grid=args.grid or None, replan=args.replan,
                               progress=not args.quiet, compile=True, served=served,
                               select=_select(settings.select_rounds,
                                              settings.select_margin))
            table = prepared.table
            how = "solved and published" if prepared.published else "already in the store"
            others = ", ".join(f"{s} {len(t.plans)}" for s, t in prepared.tables.items()
                               if s != table.solver)
            print(f"{served}: table {prepared.table_id} (r = 1..{table.batch_max}, "
                  f"{len(table.plans)} plans; also {others}) {how} at {store.location}")
            precision = prepared.capture.precision
            if not precision.chosen and precision.why:  # asked for int8, bfloat16 or auto: why not
                print(f"  precision: float32 ({precision.why})")
            for line in runtime_lines(prepared.profile):
                print(line)
            given = {"settings": given_settings(args), "batch_max": args.batch_max,
                     "grid": args.grid or None}
            print(_load_line(store, settings.store_location, served, spec, table, given))
    finally:
        store.close()
    return 0


def _select(rounds: int, margin: float) -> Any:
    """The tables' measured selection (``workers.plan_selection``) over ``rounds`` rounds."""
    from workers.plan_selection import selected

    return lambda capture, tables, solver: selected(capture, tables, solver, rounds,
                                                    margin=margin, note=print)


def _load_line(store: Any, location: str, served: str, spec: Any, table: Any,
               given: dict[str, Any]) -> str:
    """What the worker without torch keeps of ``served`` and how long it loads, measured and
    stored; or why it does not serve it (and what the torch worker keeps of it instead)."""
    from core.errors import TableNotFoundError, UsageError, VbsError
    from workers.load_cost import record_load

    try:
        cost = record_load(store, location, served, spec, table.solver, table.objective)
    except TableNotFoundError:  # not compiled (CUDA, a dtype ONNX Runtime does not run here)
        return "  the worker without torch does not serve it (not compiled)"
    except UsageError as exc:  # a plan with torch steps: served with torch
        why = " ".join(str(exc).split())
        return f"  the worker without torch does not serve it: {why}\n" + _torch_load_line(
            store, location, served, spec, table.solver, table.objective, given)
    except VbsError as exc:  # the tables stand; the service learns the cost at the first load
        return f"  what the worker without torch keeps not measured: {' '.join(str(exc).split())}"
    return (f"  loaded without torch: keeps {cost.kept_bytes / 2**20:.1f} MiB (weights "
            f"{cost.weights_bytes / 2**20:.1f}, sessions {cost.held_bytes / 2**20:.1f}, "
            f"batch buffer {cost.buffer_bytes / 2**20:.1f}), "
            f"{cost.load_s:.2f} s; a session asks {cost.making_factor:.2f}x its weights free "
            f"(stored for the service)")


def _torch_load_line(store: Any, location: str, served: str, spec: Any, solver: str,
                     objective: str, given: dict[str, Any]) -> str:
    """What the default worker keeps of a compiled model it serves with torch, torch's import
    counted, and what its load needs free (``workers.load_cost._measure_torch``), measured
    and stored."""
    from core.errors import VbsError
    from workers.load_cost import record_load

    try:
        cost = record_load(store, location, served, spec, solver, objective,
                           torch_settings=given)
    except VbsError as exc:
        return f"  what the torch worker keeps of it not measured: {' '.join(str(exc).split())}"
    return (f"  served with torch: keeps {cost.kept_bytes / 2**20:.1f} MiB with torch's import "
            f"(weights {cost.weights_bytes / 2**20:.1f}), its load needs "
            f"{cost.making_bytes / 2**20:.1f} MiB free (stored for the service)")


def add_parser(sub: Any) -> None:
    from planner.cli import positive_int

    p = sub.add_parser("plan", help="profile (cached), solve and publish plan tables")
    add_common_args(p)
    p.add_argument("--batch-max", type=positive_int, help="largest request size (default: VBS_BATCH_MAX)")
    p.add_argument("--grid", action="store_true",
                   help="profile a grid of batch sizes and interpolate (default: VBS_PROFILE_GRID)")
    p.add_argument("--replan", action="store_true", help="solve again even if the store has the table")
    p.add_argument("--select-rounds", type=int, metavar="N",
                   help="rounds every plan runs in the executor against the uniform batch "
                        "before the tables are published; another plan than fbs-best's takes a "
                        "budget only where it measured faster there (0: none; default: "
                        "VBS_SELECT_ROUNDS, 3)")
    p.add_argument("--select-margin", type=float, metavar="F",
                   help="how much faster than fbs-best's uniform plan another plan must measure "
                        "to take a budget (default: VBS_SELECT_MARGIN, 0.10)")
    p.set_defaults(func=cmd_plan)
