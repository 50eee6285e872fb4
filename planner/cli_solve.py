"""``vbs solve``: plan one request from a profile file, without torch (it starts fast).

    vbs solve --profile FILE --memory BYTES --batch R [--slot-bytes N]
              [--solver vbs|paper|fbs|greedy] [--objective time|energy] [--table FILE] [--json]

With ``--json`` it prints one JSON object: ``feasible``, ``time_total``, ``time_per_sample``,
``peak_bytes``, ``program`` (a list of ``{"unit", "samples"}``, each naming its ``runtime``
where the profile measured several), ``solver``, ``memory_budget``, ``slot_bytes`` (and
``objective``, ``cost``, ``plan_id``, and ``runs`` with ``calls`` where steps run as runtime
calls: ``time_total`` prices every call, as the executor pays it). When nothing
fits, ``feasible`` is false, the plan fields are null, ``reason`` says what is missing, and
the exit code is still 0. Bad input raises UsageError or ProfileError (exit code 2 from
``vbs``). Without ``--json`` it prints a readable table: per unit the batch size of each of
its steps and the least memory left unused while it ran (the paper's Table III).

With ``--table FILE`` (a table `vbs show --export-table` wrote, of the same profile) it answers
as that table does instead of printing the DP's own optimum: the tables rebuilt from the
profile at the table's slot size, the rows chosen by the measurements `vbs plan` kept in it
(``planner.solver.selection.chosen``, the code `vbs plan` publishes with), then looked up as a
worker looks up (the request not counted: its caller holds it); the JSON adds
``time_measured``, the median `vbs plan` measured, where it measured the plan.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from planner.cli import positive_int
from core.errors import InfeasibleError, UsageError, VbsError
from core.sizes import check_slot_bytes, format_bytes, parse_bytes
from planner.solver.model import OBJECTIVES, SOLVERS, build_instance
from core.runs import plan_shape
from planner.solver.simulate import simulate
from core.tree import load_profile


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``solve`` subcommand to a ``vbs`` parser's subparsers."""
    p = subparsers.add_parser("solve", help="plan one request within a memory budget (no torch)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--profile", required=True, help="a vbs.profile/1 JSON file")
    p.add_argument("--memory", required=True,
                   help="memory budget: bytes or a size such as 30MB, 1.5GB, 512KiB, 2GiB")
    p.add_argument("--batch", required=True, type=positive_int, help="request size r (1..batch_max)")
    p.add_argument("--slot-bytes", default=None,
                   help="memory slot size (default: 1/512 of the all-at-batch_max plan's need)")
    p.add_argument("--solver", choices=SOLVERS, default="vbs", help="default: vbs")
    p.add_argument("--objective", choices=OBJECTIVES, default="time", help="default: time")
    p.add_argument("--table", metavar="FILE",
                   help="answer as a table of this profile does (a vbs.table/3 JSON, as `vbs "
                        "show --model M --export-table FILE` writes it): rebuilt from the "
                        "profile at its slot size, its rows chosen by the measurements `vbs plan` "
                        "kept in it, then looked up; the plan and time a worker would run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Solve and print; an infeasible request is an answer (exit 0), not an error."""
    from planner.solver.solve import default_slot_bytes, solve  # the DP (numba) only here

    memory = parse_bytes(args.memory)  # sizes are read here so bad text is a UsageError
    slot_arg = parse_bytes(args.slot_bytes) if args.slot_bytes is not None else None
    profile = load_profile(args.profile)
    if args.table is not None:
        return _as_table(args, profile, memory, slot_arg)
    inst = build_instance(profile, args.objective)
    if args.batch > inst.batch_max:
        raise UsageError(f"--batch {args.batch} is larger than the profile's batch_max "
                         f"{inst.batch_max}; profile with --batch-max {args.batch} or more")
    slot = check_slot_bytes(slot_arg) if slot_arg is not None else default_slot_bytes(inst)
    try:
        plan = solve(inst, args.batch, memory, solver=args.solver, objective=args.objective,
                     slot_bytes=slot)
    except InfeasibleError as exc:
        return _infeasible(args, memory, slot, exc)
    if args.json:
        print(json.dumps(plan.to_json()))
        return 0
    sim = simulate(inst, plan.program, args.batch, memory, slot_bytes=slot, runs=plan.runs)
    print(f"{plan.solver} plan: {plan.batch} samples in {format_bytes(plan.budget_bytes)} "
          f"({plan.budget_bytes} bytes; slots of {slot} bytes), objective {plan.objective}")
    print(f"time {plan.time_total:.6g} s total, {plan.time_per_sample:.6g} s per sample; "
          f"peak {format_bytes(plan.modelled_bytes)} ({plan.modelled_bytes} bytes); "
          f"{len(plan.program)} steps, {plan.calls} runtime calls; plan {plan.plan_id}")
    print(f"runs: {plan_shape(plan.program.steps, plan.runs)}")
    width = max(len(u.name) for u in sim.units)
    print(f"{'unit':<{width}}  {'unused (min)':>12}  batch of each step")
    for u in sim.units:
        batches = " ".join(str(b) for b in u.batches)
        print(f"{u.name:<{width}}  {format_bytes(min(u.unused_bytes)):>12}  {batches}")
    return 0


def _as_table(args: argparse.Namespace, profile: Any, memory: int, slot_arg: int | None) -> int:
    """``--table``: the table's answer for (batch, memory), made from the profile and the
    measurements the table keeps, by the code `vbs plan` publishes with (solve = table)."""
    from planner.solver.compare import BASELINE
    from planner.solver.selection import LARGER, chosen
    from planner.solver.tables import build_tables

    given = _read_table(args.table)
    if given.fingerprint and profile.fingerprint and given.fingerprint != profile.fingerprint:
        raise UsageError(f"--table {args.table} was planned from profile {given.fingerprint}, "
                         f"not {profile.fingerprint} (--profile {args.profile}): give the "
                         "profile `vbs plan` planned it from (`vbs profile ... --out FILE`)")
    if args.solver != given.solver or args.objective != given.objective:
        raise UsageError(f"--table {args.table} is {given.solver}'s table for {given.objective}: "
                         f"pass --solver {given.solver} --objective {given.objective}")
    if slot_arg is not None and slot_arg != given.slot_bytes:
        raise UsageError(f"--table {args.table} was solved in slots of {given.slot_bytes} "
                         f"bytes: leave --slot-bytes out or pass {given.slot_bytes}")
    if args.batch > given.batch_max:
        raise UsageError(f"--batch {args.batch} is larger than the table's batch_max "
                         f"{given.batch_max}")
    # measured: fbs-best's and fbs's tables too, the rivals `vbs plan` measured them against
    solvers = tuple(dict.fromkeys((given.solver, BASELINE, LARGER) if given.measurements
                                  else (given.solver,)))
    tables = build_tables(profile, solvers, objective=given.objective,
                          slot_bytes=given.slot_bytes)
    if given.measurements is not None:
        tables, _ = chosen(tables, given.solver, given.measurements, sizes=(args.batch,))
    try:
        plan = tables[given.solver].lookup(args.batch, memory)
    except InfeasibleError as exc:
        return _infeasible(args, memory, given.slot_bytes, exc)
    if args.json:
        print(json.dumps(plan.to_json()))
        return 0
    measured = (f"measured {plan.time_measured:.6g} s by `vbs plan` (predicted "
                f"{plan.time_total:.6g} s)" if plan.time_measured is not None
                else f"predicted {plan.time_total:.6g} s (not measured)")
    print(f"{plan.solver} table's plan: {plan.batch} samples in {format_bytes(memory)} "
          f"({memory} bytes)")
    print(f"time {measured}; peak {format_bytes(plan.peak_bytes)} ({plan.peak_bytes} bytes, as "
          f"the executor allocates); {len(plan.program)} steps, {plan.calls} runtime calls; "
          f"plan {plan.plan_id}")
    print(f"runs: {plan_shape(plan.program.steps, plan.runs)}")
    return 0


def _read_table(path: str) -> Any:
    from core.errors import TableFormatError
    from core.table import PlanTable

    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--table {path}: cannot read a JSON table there ({exc})") from exc
    try:
        return PlanTable.from_json(raw)
    except TableFormatError as exc:
        raise UsageError(f"--table {path}: {exc}") from exc


def _infeasible(args: argparse.Namespace, memory: int, slot: int, exc: Exception) -> int:
    if args.json:
        print(json.dumps({"feasible": False, "solver": args.solver, "objective": args.objective,
                          "batch": args.batch, "memory_budget": memory, "slot_bytes": slot,
                          "time_total": None, "time_per_sample": None, "cost": None,
                          "peak_bytes": None, "plan_id": None, "program": None,
                          "reason": str(exc)}))
    else:
        print(f"{args.solver}: infeasible: {exc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m planner.cli_solve ...``: the same as ``vbs solve ...``."""
    parser = argparse.ArgumentParser(prog="vbs")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["solve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except VbsError as exc:
        print(f"vbs solve: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
