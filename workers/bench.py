"""``vbs bench``: vbs, paper, greedy and fbs side by side on the real model, measured.

    vbs bench --model googlenet --batch 12 --memory 15MB:40MB:5MB [--device cpu|cuda]
              [--repeat N] [--out DIR] [--json]

For every budget and strategy: the strategy's plan (stepped down, as a worker would, until the
executor's peak fits the budget), then runs interleaved in one process (round-robin over all
configurations, so drift hits every strategy alike): measured time per sample (median, with
the spread), measured peak (torch profiler on CPU, max_memory_allocated on CUDA), predicted
time and peak, the largest absolute error against plain ``model(x)``, and the gain over fbs.
Also the executor's overhead against plain ``model(x)`` when every unit runs at the full
request (the plan needs no sub-batching), and the mean absolute percentage error of
predicted time and peak over all runs. ``--out`` writes CSV, JSON and PNG plots: time per
sample against memory for every strategy (the paper's Figure 7) and the batch size of every
unit (its Figure 9).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from planner.errors import InfeasibleError
from planner.graph.capture import Capture
from planner.solver.memory import format_bytes, parse_budgets, slots_down
from planner.solver import baselines
from planner.solver.model import build_instance
from planner.solver.program import Plan, Step
from planner.solver.simulate import simulate
from planner.solver.solve import solve
from planner.tree import Profile, iter_layers
from workers.executor import execute
from workers.walk import BufferPlan, plan_splits

STRATEGIES = ("vbs", "paper", "greedy", "fbs")


@dataclass
class Row:
    """One (strategy, budget, request size): DESIGN.md's `vbs bench --json` contract."""

    model: str
    strategy: str
    memory_budget: int
    batch: int
    feasible: bool
    time_per_sample_measured: float | None = None
    time_per_sample_spread: float | None = None  # (max - min) / median of the repeats
    time_per_sample_predicted: float | None = None
    peak_bytes_measured: int | None = None
    peak_bytes_predicted: int | None = None  # the executor's walk (what it allocates)
    peak_bytes_claimed: int | None = None    # the solver's model of memory
    max_abs_error: float | None = None
    gain_over_fbs: float | None = None
    plan_id: str | None = None
    reason: str = ""


def fit_plan(profile: Profile, ws: dict[str, tuple[int, ...]], r: int, budget: int,
             solver: str) -> tuple[Plan, BufferPlan]:
    """The strategy's plan whose executor peak fits ``budget``: solve, and while the executor
    would need more, solve again below by the excess (what a worker does with its table)."""
    target = budget
    while True:
        plan = solve(profile, r, target, solver=solver)
        buffers = plan_splits(profile.root, ws, plan.program.steps, r)
        if buffers.peak <= budget:
            return plan, buffers
        lower = slots_down(target - (buffers.peak - budget), plan.slot_bytes) * plan.slot_bytes
        target = min(lower, target - plan.slot_bytes)
        if target <= 0:
            raise InfeasibleError(f"{solver}: no plan of {r} samples runs within {budget} bytes")


def _peak_runner(device: torch.device) -> Callable[[list[tuple[str, Callable[[], Any]]]], dict[str, int]]:
    if device.type == "cuda":
        def cuda(jobs: list[tuple[str, Callable[[], Any]]]) -> dict[str, int]:
            out = {}
            for label, job in jobs:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                job()
                torch.cuda.synchronize(device)
                out[label] = int(torch.cuda.max_memory_allocated(device) - base)
            return out
        return cuda

    def cpu(jobs: list[tuple[str, Callable[[], Any]]]) -> dict[str, int]:
        from planner.profiling.measure import cpu_peaks
        return cpu_peaks([(label, lambda _, j=job: j(), lambda: None) for label, job in jobs])
    return cpu


def _time(device: torch.device, fn: Callable[[], Any]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    y = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    del y
    return time.perf_counter() - t0


def run_bench(capture: Capture, profile: Profile, r: int, budgets: list[int], repeat: int,
              strategies: tuple[str, ...] = STRATEGIES, log: Callable[[str], None] = print
              ) -> tuple[list[Row], dict[str, Any], dict[tuple[str, int], Plan]]:
    """Plan, run interleaved, and measure every (strategy, budget); returns the rows, a
    summary, and the plan that ran for every (strategy, budget)."""
    model = capture.model
    device = model.device
    ws = {layer.name: layer.ws for layer in iter_layers(profile.root)}
    x = model.example(r, seed=7)
    with torch.inference_mode():
        expected = model.module(x)
    rows: list[Row] = []
    configs: list[tuple[Row, Plan, BufferPlan]] = []
    for budget in budgets:
        for strategy in strategies:
            row = Row(model.spec.name, strategy, budget, r, feasible=False)
            try:
                plan, buffers = fit_plan(profile, ws, r, budget, strategy)
            except InfeasibleError as exc:
                row.reason = " ".join(str(exc).split())
                rows.append(row)
                continue
            row.feasible = True
            row.plan_id = plan.plan_id
            row.time_per_sample_predicted = plan.time_per_sample
            row.peak_bytes_predicted = buffers.peak
            row.peak_bytes_claimed = plan.peak_bytes
            rows.append(row)
            configs.append((row, plan, buffers))

    def job(plan: Plan, buffers: BufferPlan) -> Callable[[], torch.Tensor]:
        return lambda: execute(capture, plan.program.steps, x, buffers.splits)

    for row, plan, buffers in configs:  # warm-up, and the error against model(x)
        y = job(plan, buffers)()
        row.max_abs_error = float((y.float() - expected.float()).abs().max())
    uniform = solve(profile, r, 1 << 62, solver="fbs")  # every unit at batch r: no sub-batching
    plain_times: list[float] = []
    uniform_times: list[float] = []
    samples: dict[int, list[float]] = {id(row): [] for row, _, _ in configs}
    for k in range(repeat):
        log(f"round {k + 1}/{repeat}")
        for row, plan, buffers in configs:
            samples[id(row)].append(_time(device, job(plan, buffers)) / r)
        with torch.inference_mode():
            plain_times.append(_time(device, lambda: model.module(x)) / r)
        uniform_times.append(_time(device, lambda: execute(capture, uniform.program.steps, x)) / r)
    peaks = _peak_runner(device)([(str(i), job(p, b)) for i, (_, p, b) in enumerate(configs)])
    for i, (row, _, _) in enumerate(configs):
        ts = samples[id(row)]
        med = statistics.median(ts)
        row.time_per_sample_measured = med
        row.time_per_sample_spread = (max(ts) - min(ts)) / med if med else None
        row.peak_bytes_measured = peaks[str(i)]
    for budget in budgets:
        fbs = next((row for row in rows if row.memory_budget == budget and row.strategy == "fbs"
                    and row.feasible), None)
        for row in rows:
            if row.memory_budget == budget and row.feasible and fbs and row.time_per_sample_measured:
                row.gain_over_fbs = fbs.time_per_sample_measured / row.time_per_sample_measured  # type: ignore[operator]
    done = [row for row, _, _ in configs]
    summary = {
        "model": model.spec.name, "batch": r, "device": str(device), "repeat": repeat,
        "plain_model_time_per_sample": statistics.median(plain_times),
        "uniform_plan_time_per_sample": statistics.median(uniform_times),
        "executor_overhead": statistics.median(uniform_times) / statistics.median(plain_times) - 1,
        "time_mape": _mape([(r.time_per_sample_predicted, r.time_per_sample_measured) for r in done]),
        "peak_mape": _mape([(r.peak_bytes_predicted, r.peak_bytes_measured) for r in done]),
        "claimed_peak_mape": _mape([(r.peak_bytes_claimed, r.peak_bytes_measured) for r in done]),
        "budget_exceeded": sum(1 for r in done if (r.peak_bytes_measured or 0) > r.memory_budget),
    }
    return rows, summary, {(row.strategy, row.memory_budget): plan for row, plan, _ in configs}


def _mape(pairs: list[tuple[Any, Any]]) -> float | None:
    errs = [abs(p - m) / m for p, m in pairs if p is not None and m]
    return 100 * statistics.fmean(errs) if errs else None


def render(rows: list[Row], summary: dict[str, Any]) -> str:
    lines = [f"{summary['model']}  r={summary['batch']}  on {summary['device']}  "
             f"({summary['repeat']} interleaved rounds)",
             f"{'budget':>10} {'strategy':8} {'measured':>11} {'spread':>7} {'predicted':>11} "
             f"{'peak meas.':>11} {'peak pred.':>11} {'max err':>9} {'vs fbs':>7}"]
    for row in rows:
        if not row.feasible:
            lines.append(f"{format_bytes(row.memory_budget):>10} {row.strategy:8} infeasible")
            continue
        lines.append(
            f"{format_bytes(row.memory_budget):>10} {row.strategy:8} "
            f"{row.time_per_sample_measured * 1e3:>8.2f} ms {100 * (row.time_per_sample_spread or 0):>6.1f}% "
            f"{row.time_per_sample_predicted * 1e3:>8.2f} ms {format_bytes(row.peak_bytes_measured):>11} "
            f"{format_bytes(row.peak_bytes_predicted):>11} {row.max_abs_error:>9.2e} "
            f"{(f'{row.gain_over_fbs:.2f}x' if row.gain_over_fbs else '-'):>7}")
    lines.append(f"plain model(x): {summary['plain_model_time_per_sample'] * 1e3:.2f} ms/sample; executor at "
                 f"uniform batch: {summary['uniform_plan_time_per_sample'] * 1e3:.2f} ms/sample "
                 f"(overhead {100 * summary['executor_overhead']:+.1f}%)")
    tm, pm = summary["time_mape"], summary["peak_mape"]
    lines.append(f"MAPE predicted vs measured: time {tm:.1f}%, peak {pm:.2f}% "
                 f"(solver's claimed peak {summary['claimed_peak_mape']:.1f}%); "
                 f"runs over budget: {summary['budget_exceeded']}" if tm is not None else "no runs")
    return "\n".join(lines)


def write_outputs(out: Path, rows: list[Row], summary: dict[str, Any], profile: Profile,
                  plans: dict[tuple[str, int], Plan]) -> None:
    """CSV, JSON and the two plots."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    name = summary["model"]
    data = [asdict(r) for r in rows]
    (out / f"{name}.json").write_text(json.dumps({"summary": summary, "rows": data}, indent=1))
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(data[0]))
        writer.writeheader()
        writer.writerows(data)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy in STRATEGIES:
        pts = [(r.memory_budget / 2**20, r.time_per_sample_measured * 1e3, r.time_per_sample_predicted * 1e3)
               for r in rows if r.strategy == strategy and r.feasible]
        if pts:
            xs, ms, ps = zip(*pts)
            line, = ax.plot(xs, ms, marker="o", label=f"{strategy} measured")
            ax.plot(xs, ps, linestyle="--", color=line.get_color(), alpha=0.6, label=f"{strategy} predicted")
    _save(plt, fig, ax, "memory budget (MiB)", "time per sample (ms)",
          f"{name}, request of {summary['batch']} on {summary['device']}",
          out / f"{name}-time-vs-memory.png")
    # Figure 9: the largest batch of every unit in the vbs plan that ran at every budget.
    vbs = [r for r in rows if r.strategy == "vbs" and r.feasible]
    if vbs:
        fig, ax = plt.subplots(figsize=(max(7, len(list(iter_layers(profile.root))) * 0.08), 4))
        names = [layer.name for layer in iter_layers(profile.root)]
        for row in vbs:
            plan = plans[(row.strategy, row.memory_budget)]
            sim = simulate(profile, plan.program, row.batch, plan.budget_bytes, slot_bytes=plan.slot_bytes)
            batch_of = {u.name: max(u.batches, default=0) for u in sim.units}
            ax.plot(range(len(names)), [batch_of.get(n, 0) for n in names], marker=".",
                    label=format_bytes(row.memory_budget))
        _save(plt, fig, ax, "unit (execution order)", "largest batch size",
              f"{name}: vbs batch size per unit", out / f"{name}-batch-per-unit.png")


def _save(plt: Any, fig: Any, ax: Any, xlabel: str, ylabel: str, title: str, path: Path) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_bench(args: argparse.Namespace) -> int:
    import sys

    from planner.cli import load_capture, settings_from
    from planner.profiling.profiler import cached_profile
    from planner.pipeline import options_from

    settings = settings_from(args)
    cap = load_capture(args, settings)
    options = options_from(settings, batch_max=max(args.batch, args.batch_max or args.batch))
    profile, _ = cached_profile(cap, options, settings.profile_cache, progress=not args.json)
    ws = {layer.name: layer.ws for layer in iter_layers(profile.root)}
    # From where fbs runs the request one sample at a time to where it runs it all at once.
    inst = build_instance(profile)
    one_by_one = [Step(u, c) for u, c in baselines.fbs_program(inst, 1, args.batch)]
    low = plan_splits(profile.root, ws, one_by_one, args.batch).peak
    full = solve(profile, args.batch, 1 << 62, solver="fbs")
    high = plan_splits(profile.root, ws, full.program.steps, args.batch).peak
    budgets = parse_budgets(args.memory, low, high)
    log = (lambda _m: None) if args.json else (lambda m: print(m, file=sys.stderr))
    rows, summary, plans = run_bench(cap, profile, args.batch, budgets, args.repeat, log=log)
    if args.out:
        write_outputs(Path(args.out), rows, summary, profile, plans)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(render(rows, summary))
    return 0


def add_parser(sub: Any) -> None:
    from planner.cli import _positive, add_model_args

    p = sub.add_parser("bench", help="vbs, paper, greedy and fbs side by side on the real model")
    add_model_args(p)
    p.add_argument("--batch", type=_positive, required=True, help="request size")
    p.add_argument("--memory", default="auto",
                   help="budgets: START:STOP:STEP (15MB:40MB:5MB), a list (10MB,20MB) or auto[:N]")
    p.add_argument("--batch-max", type=_positive, help="profile up to this batch (default: --batch)")
    p.add_argument("--repeat", type=_positive, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--out", help="write CSV, JSON and PNG plots here")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_bench)


def markdown(data: dict[str, Any]) -> str:
    """One `vbs bench --out` JSON file as the Markdown table of docs/benchmarks.md."""
    rows, s = data["rows"], data["summary"]
    strategies = [st for st in STRATEGIES if any(r["strategy"] == st for r in rows)]
    out = [f"#### {s['model']} (r = {s['batch']}, {s['repeat']} interleaved rounds)", "",
           "| budget (MiB) | " + " | ".join(f"{st} measured / predicted (ms)" for st in strategies)
           + " | vbs vs fbs (measured) | vbs peak measured = predicted (MiB) |",
           "|---" * (len(strategies) + 3) + "|"]
    for budget in sorted({r["memory_budget"] for r in rows}):
        cells, gain, peak = [], None, None
        for st in strategies:
            r = next(x for x in rows if x["memory_budget"] == budget and x["strategy"] == st)
            if not r["feasible"]:
                cells.append("infeasible")
                continue
            cells.append(f"{r['time_per_sample_measured'] * 1e3:.1f} / "
                         f"{r['time_per_sample_predicted'] * 1e3:.1f}")
            if st == "vbs":
                gain = r["gain_over_fbs"]
                peak = f"{r['peak_bytes_measured'] / 2**20:.1f} = {r['peak_bytes_predicted'] / 2**20:.1f}"
        out.append(f"| {budget / 2**20:.1f} | " + " | ".join(cells) +
                   f" | {f'{gain:.2f}x' if gain else '—'} | {peak or '—'} |")
    out += ["", f"Plain `model(x)` {s['plain_model_time_per_sample'] * 1e3:.1f} ms/sample; the executor "
            f"at a uniform batch of {s['batch']} {s['uniform_plan_time_per_sample'] * 1e3:.1f} ms/sample "
            f"({100 * s['executor_overhead']:+.1f}%). MAPE of predicted time {s['time_mape']:.1f}%, "
            f"of predicted peak {s['peak_mape']:.2f}% (of the solver's claimed peak "
            f"{s['claimed_peak_mape']:.1f}%); runs over budget: {s['budget_exceeded']}.", ""]
    return "\n".join(out)


if __name__ == "__main__":  # python -m workers.bench FILE.json ...: the Markdown of saved runs
    import sys

    for path in sys.argv[1:]:
        print(markdown(json.loads(Path(path).read_text())))
