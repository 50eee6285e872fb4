"""``vbs show``, and the model arguments it shares with ``vbs plan`` (``workers.cli_plan``).

    vbs show --model NAME --memory 30MB --batch 12 [--store ...]
    vbs show --model NAME --memory 10MB:60MB:10MB --batch 12      (a sweep over budgets)
    vbs show --model NAME [--model ...] --html plans.html [--batch 12]  (the page, one file)
    vbs show --profile resnet50.json --html plans.html                 (from a profile alone)
    vbs show --model NAME --export-table T.json --export-profile P.json (for `vbs solve --table`)

``show`` prints, from the tables `vbs plan` stored, the plan for a budget and request size of
every strategy side by side, vbs's gain over each (the headline against fbs-best), and per
unit the batch sizes of its phases and the memory left unused (the paper's Table III). With
``--html FILE`` it writes the service's page (``/ui``) as one self-contained file with those
tables' plans embedded: the same plan pictures, with a memory slider, for someone without a
running service (``planner.view``). ``--profile FILE`` takes the tables from a profile (solved
now, no model or torch needed).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from core.errors import UsageError
from planner.settings import Settings, split_model_entry


def model_specs(args: argparse.Namespace, settings: Settings) -> list[tuple[str, Any]]:
    """(served name, ModelSpec) for every --model, else every VBS_MODELS entry."""
    from core.spec import ModelSpec
    from core.shapes import parse_shape

    entries = args.model or list(settings.models)
    if not entries:
        raise UsageError("no model given: pass --model NAME (or set VBS_MODELS)")
    out = []
    for entry in entries:
        try:
            served, name, shape = split_model_entry(entry)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        if args.input_shape:
            shape = parse_shape(args.input_shape)
        # --weights, else VBS_WEIGHTS: what a worker without torch serves is what is compiled here
        weights = Path(args.weights) if args.weights else settings.weights
        out.append((served, ModelSpec(name=name, input_shape=shape, dtype=settings.dtype,
                                      device=settings.device, weights=weights)))
    return out


def _tables_of_profile(args: argparse.Namespace, settings: Settings) -> list[tuple[str, Any, Any]]:
    """(name, profile, tables) solved now from ``--profile`` (no store, no torch)."""
    from planner.pipeline import strategies
    from planner.solver.tables import build_tables
    from core.tree import load_profile

    profile = load_profile(args.profile)
    solver = args.solver or settings.solver
    tables = build_tables(profile, strategies(solver), objective=args.objective or settings.objective,
                          slot_bytes=settings.slot_bytes or None, slot_count=settings.slot_count)
    name = str(profile.meta.get("model") or Path(args.profile).stem)
    return [(name, profile, tables)]


def _tables_of_models(args: argparse.Namespace, settings: Settings, every: bool
                      ) -> list[tuple[str, Any, Any]]:
    """(served name, profile, tables) of each --model (or only the first), from the store or
    profiled, solved and published as `vbs plan` would."""
    from planner.pipeline import prepare
    from planner.store import open_store

    specs = model_specs(args, settings)
    store = open_store(settings.store_location)
    out = []
    try:
        for served, spec in specs if every else specs[:1]:
            prepared = prepare(spec, settings, store,
                               batch_max=max(args.batch_max or settings.batch_max, args.batch or 1),
                               solver=args.solver or settings.solver,
                               objective=args.objective or settings.objective,
                               progress=not args.quiet)
            out.append((served, prepared.profile, dict(prepared.tables)))
    finally:
        store.close()
    return out


def _export(args: argparse.Namespace, settings: Settings, model: tuple[str, Any, Any]) -> None:
    """``--export-table`` / ``--export-profile``: the served solver's table (with the
    measurements `vbs plan` chose its rows by) and the profile it was planned from, as JSON:
    what `vbs solve --profile P --table T` answers from, as a worker would."""
    import json

    from core.tree import profile_to_json

    served, profile, tables = model
    solver = args.solver or settings.solver
    for path, what, doc in ((args.export_table, f"{solver}'s table", lambda: tables[solver].to_json()),
                            (args.export_profile, "its profile", lambda: profile_to_json(profile))):
        if not path:
            continue
        try:
            Path(path).write_text(json.dumps(doc()), encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {path} ({exc.strerror}); give a path in a writable "
                             "directory") from exc
        print(f"wrote {path}: {served}: {what}")


def _write_html(args: argparse.Namespace, models: list[tuple[str, Any, Any]]) -> int:
    from planner.view.data import book
    from planner.view.page import render_page

    solver = args.solver
    books = []
    for name, profile, tables in models:
        served = solver if solver in tables else next(iter(tables))
        meta = {k: profile.meta[k] for k in ("model", "input_shape", "dtype", "device")
                if k in profile.meta}
        books.append(book(name, profile, tables, served,
                          sizes=[args.batch] if args.batch else None, meta=meta))
    title = "vbs-serve plans: " + ", ".join(name for name, _, _ in models)
    path = Path(args.html)
    try:
        path.write_text(render_page(books, title=title), encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--html {path}: cannot write it ({exc.strerror}); give a path in a "
                         "writable directory") from exc
    plans = sum(len(s["plans"]) for b in books for s in b["strategies"].values())
    print(f"wrote {path} ({path.stat().st_size} bytes): {len(books)} model(s), {plans} plans; "
          "open it in a browser, no service needed")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from core.precision import Precision
    from planner.cli import settings_from
    from planner.solver.compare import budget_range, compare, render, render_sweep, sweep
    from core.sizes import parse_budgets, parse_bytes

    settings = settings_from(args)
    if args.profile and args.model:
        raise UsageError("give --model or --profile, not both")
    exporting = args.export_table or args.export_profile
    if not args.html and not exporting and (args.memory is None or args.batch is None):
        raise UsageError("--memory and --batch are needed (or --html FILE for the page with "
                         "every budget, or --export-table / --export-profile FILE)")
    if args.profile:
        models = _tables_of_profile(args, settings)
    else:
        models = _tables_of_models(args, settings, every=bool(args.html))
    if exporting:
        _export(args, settings, models[0])
        if args.memory is None or args.batch is None:
            return 0
    if args.html:
        args.solver = args.solver or settings.solver
        return _write_html(args, models)
    served, profile, tables = models[0]
    precision = Precision.from_json(profile.meta.get("precision"))
    if precision.int8:  # which units the plans below run in int8 (on ONNX Runtime)
        print(f"{served}: int8 units (on ONNX Runtime; the rest float32): "
              f"{', '.join(precision.int8)}; top-1 agreement {100 * precision.agreement:.1f}% "
              f"with float32 on {precision.held_out} held-out samples")
    elif precision.half:
        print(f"{served}: {precision.dtype}, every unit on torch; top-1 agreement "
              f"{100 * precision.agreement:.1f}% with float32 on {precision.held_out} held-out "
              "samples")
    if any(c in args.memory for c in ":,") or args.memory.startswith("auto"):
        # A sweep: from where fbs-best runs one sample at a time to where fbs runs r at once.
        low, high = budget_range(tables, args.batch)
        budgets = parse_budgets(args.memory, low, high)
        print(render_sweep(sweep(tables, args.batch, budgets), title=served))
        return 0
    result = compare(tables, args.batch, parse_bytes(args.memory))
    print(render(result, title=served))
    return 0


def add_common_args(p: argparse.ArgumentParser) -> None:
    from planner.cli import add_precision_args, add_runtime_arg

    p.add_argument("--model", action="append",
                   help="[ALIAS=]NAME[@C,H,W]; repeat for several (default: VBS_MODELS)")
    p.add_argument("--input-shape", help="per-sample input shape for every model, C,H,W or C,T,H,W")
    p.add_argument("--weights", help="a state_dict file, loaded with weights_only=True")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--cache-dir", help="where profiles are cached (default: VBS_CACHE_DIR)")
    p.add_argument("--store", help="redis://[:password@]host:port/db or a directory (default: VBS_STORE)")
    p.add_argument("--solver", choices=["vbs", "paper", "fbs", "fbs-best", "greedy"],
                   help="the served solver (default: VBS_SOLVER, vbs)")
    p.add_argument("--objective", choices=["time", "energy"],
                   help="what the tables minimise (default: VBS_OBJECTIVE, time)")
    add_runtime_arg(p)
    add_precision_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_parser(sub: Any) -> None:
    from planner.cli import positive_int

    p = sub.add_parser("show", help="one plan beside paper, greedy, fbs and fbs-best, per unit "
                                    "(Table III); --html: the page as a file")
    add_common_args(p)
    p.add_argument("--memory",
                   help="budget: bytes or 30MB, 1.5GiB; or a sweep: 10MB:60MB:10MB, a list, auto[:N]")
    p.add_argument("--batch", type=positive_int,
                   help="request size (with --html: the only one in the file; default all)")
    p.add_argument("--html", type=Path, metavar="FILE",
                   help="write the plan pictures (the service's /ui page, every budget) to FILE")
    p.add_argument("--profile", type=Path, metavar="FILE",
                   help="a vbs.profile/1 JSON to take the tables from, instead of --model")
    p.add_argument("--batch-max", type=positive_int, help="largest request size of the table")
    p.add_argument("--export-table", type=Path, metavar="FILE",
                   help="write the served solver's table as JSON (with what `vbs plan` measured "
                        "to choose its rows): `vbs solve --table FILE` answers as it does")
    p.add_argument("--export-profile", type=Path, metavar="FILE",
                   help="write the profile the tables were planned from (`vbs solve --profile`)")
    p.set_defaults(func=cmd_show)
