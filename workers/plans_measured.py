"""``vbs bench``: vbs, paper, greedy, fbs and fbs-best side by side on the real model, measured.

    vbs bench --model googlenet --batch 12 --memory 15MB:40MB:5MB [--device cpu|cuda]
              [--repeat N] [--out DIR] [--json]

The tables of every strategy are built from the profile (as `vbs plan` builds them), and every
(strategy, budget) runs the plan its table gives for that budget: the one a worker would run,
keyed by the executor's exact peak. The default budgets (``auto``) run from where fbs-best can
run one sample at a time to where fbs runs the whole request at once. Runs are interleaved
in one process, every configuration once per round in an order shuffled anew each round
(seeded), so that drift hits every strategy alike and none always runs right after the same
other; a plan that several strategies or budgets share is one configuration, its rows
sharing its samples (the same plan measured twice differs by noise alone) (torch's OpenMP threads spin on for a while after a plan's torch steps, into the next
run's ONNX Runtime call):
measured time per sample (median, with the spread), measured peak (torch profiler on CPU,
max_memory_allocated on CUDA: what the executor and torch allocate), the walk's prediction
of that recomputed here, the table's claimed peak (which adds what ONNX Runtime holds inside
its calls, where steps run there), the DP's figure, predicted time, the largest absolute error against plain ``model(x)``,
and the gain over fbs-best (the headline) and over fbs. Also the executor's overhead against
plain ``model(x)`` when every unit runs at the full request (no sub-batching), and the mean
absolute percentage error of predicted time and peak over all runs. ``--out`` writes CSV, JSON
and PNG plots: time per sample against memory for every strategy (the paper's Figure 7) and
the batch size of every unit (its Figure 9).
"""

from __future__ import annotations

import csv
import json
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from core.errors import InfeasibleError
from core.units import Capture
from core import runtimes as rt
from core.runtimes import TORCH
from core.runtimes.base import RuntimeOptions
from planner.solver.compare import BASELINE, STRATEGIES
from core.walk import executor_peak
from core.sizes import format_bytes
from core.program import Plan
from core.runs import plan_shape
from core.table import PlanTable
from core.tree import Profile, iter_layers
from workers.executor import execute
from workers.plan_selection import timed


@dataclass
class Row:
    """One (strategy, budget, request size): the `vbs bench --json` contract (docs/architecture.md)."""

    model: str
    strategy: str
    memory_budget: int
    batch: int
    feasible: bool
    time_per_sample_measured: float | None = None
    time_per_sample_spread: float | None = None  # (max - min) / median of the repeats
    time_per_sample_predicted: float | None = None
    time_per_sample_table: float | None = None  # what `vbs plan` measured (the selection's)
    peak_bytes_measured: int | None = None
    peak_bytes_predicted: int | None = None  # the executor's walk, recomputed: what torch sees
    peak_bytes_claimed: int | None = None    # the table's figure for the plan that ran
    peak_bytes_model: int | None = None      # the DP's model of memory for the same program
    max_abs_error: float | None = None
    gain_over_fbs_best: float | None = None
    gain_over_fbs: float | None = None
    plan_id: str | None = None
    runtimes: list[str] | None = None  # the unit runtimes its steps ran on
    calls: int | None = None  # runtime calls its runs make
    uniform_batch: int | None = None  # fbs and fbs-best: the uniform batch that ran
    shape: str | None = None  # what each call and step runs (core.runs.plan_shape)
    reason: str = ""


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


def run_bench(capture: Capture, profile: Profile, tables: dict[str, PlanTable], r: int,
              budgets: list[int],
              repeat: int, strategies: tuple[str, ...] = STRATEGIES,
              log: Callable[[str], None] = print
              ) -> tuple[list[Row], dict[str, Any], dict[tuple[str, int], Plan]]:
    """Look up, run interleaved, and measure every (strategy, budget); returns the rows, a
    summary, and the plan that ran for every (strategy, budget)."""
    budgets = list(dict.fromkeys(budgets))  # a budget given twice is one row per strategy
    model = capture.model
    device = model.device
    named = {name for t in tables.values() for name in t.runtimes}
    loaded = {name: rt.load(name, capture, RuntimeOptions())
              for name in sorted(named) if rt.KINDS[name].calls}
    x = model.example(r, seed=7)
    with torch.inference_mode():
        expected = model.module(x)
    rows, configs = _look_up(profile, tables, r, budgets, strategies, model.spec.name)
    def job(plan: Plan) -> Callable[[], torch.Tensor]:
        return lambda: execute(capture, plan.program.steps, x, plan.split_map, plan.run_map,
                               loaded)

    # one configuration per distinct plan: a plan that several strategies or budgets share
    # runs once per round and its rows share its samples (two measurements of one plan
    # differ by the machine's noise alone, and a gain between them is 1.00x by construction)
    distinct = {plan.plan_id: plan for _, plan in configs}
    errors = {}
    for plan_id, plan in distinct.items():  # warm-up, and the error against model(x)
        y = job(plan)()
        errors[plan_id] = float((y.float() - expected.float()).abs().max())
    uniform = tables["fbs"].lookup(r, tables["fbs"].top_bytes)  # every unit at r: no sub-batching
    plain_times: list[float] = []
    uniform_times: list[float] = []
    samples: dict[str, list[float]] = {plan_id: [] for plan_id in distinct}
    order = list(distinct.items())
    shuffle = random.Random(0).shuffle
    for k in range(repeat):
        log(f"round {k + 1}/{repeat}")
        shuffle(order)
        for plan_id, plan in order:
            samples[plan_id].append(timed(device, job(plan)) / r)
        with torch.inference_mode():
            plain_times.append(timed(device, lambda: model.module(x)) / r)
        uniform_times.append(timed(device, job(uniform)) / r)
    peaks = _peak_runner(device)([(plan_id, job(p)) for plan_id, p in distinct.items()])
    for row, plan in configs:
        ts = samples[plan.plan_id]
        med = statistics.median(ts)
        row.max_abs_error = errors[plan.plan_id]
        row.time_per_sample_measured = med
        row.time_per_sample_spread = (max(ts) - min(ts)) / med if med else None
        row.peak_bytes_measured = peaks[plan.plan_id]
    _gains(rows, budgets)
    summary = _summary(model.spec.name, r, device, repeat, [row for row, _ in configs],
                       plain_times, uniform_times)
    # what the runtimes kept between calls for every plan that ran (sessions, CUDA graphs
    # and their pool): outside the plans' claims, as a worker counts it
    summary["runtime_held_bytes"] = {name: units.held_bytes for name, units in loaded.items()}
    return rows, summary, {(row.strategy, row.memory_budget): plan for row, plan in configs}


def _look_up(profile: Profile, tables: dict[str, PlanTable], r: int, budgets: list[int],
             strategies: tuple[str, ...], name: str) -> tuple[list[Row], list[tuple[Row, Plan]]]:
    """A row for every (budget, strategy), with its plan's figures where one fits."""
    rows: list[Row] = []
    configs: list[tuple[Row, Plan]] = []
    for budget in budgets:
        for strategy in strategies:
            row = Row(name, strategy, budget, r, feasible=False)
            table = tables[strategy]
            try:
                plan = table.lookup(r, budget)
            except InfeasibleError as exc:
                row.reason = " ".join(str(exc).split())
                rows.append(row)
                continue
            row.feasible = True
            row.plan_id = plan.plan_id
            row.runtimes = sorted({s.runtime or TORCH for s in plan.program.steps})
            row.calls = plan.calls
            row.shape = plan_shape(plan.program.steps, plan.runs, limit=12)
            if strategy in ("fbs", BASELINE):
                row.uniform_batch = plan.program.steps[0].samples
            row.time_per_sample_predicted = plan.time_per_sample
            if plan.time_measured is not None:
                row.time_per_sample_table = plan.time_measured / r
            row.peak_bytes_claimed = plan.peak_bytes
            row.peak_bytes_model = plan.modelled_bytes
            row.peak_bytes_predicted = executor_peak(profile.root, plan.program.steps, r,
                                                     granule=table.granule, splits=plan.split_map,
                                                     runs=plan.run_map, inside=False)
            rows.append(row)
            configs.append((row, plan))

    return rows, configs


def _gains(rows: list[Row], budgets: list[int]) -> None:
    """Each row's measured speed-up over fbs-best and fbs at its budget."""
    for budget in budgets:
        here = {row.strategy: row for row in rows if row.memory_budget == budget and row.feasible}
        for row in here.values():
            for base, attr in ((BASELINE, "gain_over_fbs_best"), ("fbs", "gain_over_fbs")):
                if base in here and row.time_per_sample_measured:
                    setattr(row, attr, here[base].time_per_sample_measured  # type: ignore[operator]
                            / row.time_per_sample_measured)


def time_errors(done: list[Row]) -> dict[str, float | None]:
    """How far the times of the plans a worker runs (vbs, fbs-best) were from what ran: the
    prediction's MAPE, and the same split in two: the median of measured over predicted (one
    factor for the whole run: the machine's speed now against the profile's) and the MAPE left
    once every prediction is scaled by it (what the prices get wrong between plans); and the
    table's time where the selection measured it (before the bench, in its own rounds)."""
    served = [(r.time_per_sample_predicted, r.time_per_sample_measured) for r in done
              if r.strategy in ("vbs", BASELINE) and r.time_per_sample_predicted is not None
              and r.time_per_sample_measured]
    scale = _scale(served)
    return {
        "served_time_mape": _mape(served),
        "served_time_scale": scale,
        "served_time_scaled_mape": _mape([(p * scale, m) for p, m in served]) if scale else None,
        "table_time_mape": _mape([(r.time_per_sample_table, r.time_per_sample_measured)
                                  for r in done if r.time_per_sample_table is not None]),
    }


def _summary(name: str, r: int, device: torch.device, repeat: int, done: list[Row],
             plain_times: list[float], uniform_times: list[float]) -> dict[str, Any]:
    """What the rows say together: the executor's overhead and how far predictions were."""
    summary = {
        "model": name, "batch": r, "device": str(device), "repeat": repeat,
        "plain_model_time_per_sample": statistics.median(plain_times),
        "uniform_plan_time_per_sample": statistics.median(uniform_times),
        "executor_overhead": statistics.median(uniform_times) / statistics.median(plain_times) - 1,
        "time_mape": _mape([(r.time_per_sample_predicted, r.time_per_sample_measured) for r in done]),
        **time_errors(done),
        # against what the walk says torch allocates: the claim itself where every step runs on
        # torch; where steps run on ONNX Runtime the claim adds what it holds inside its calls,
        # which no torch counter sees (tests/core/test_runtimes.py checks that against RSS)
        "peak_mape": _mape([(r.peak_bytes_predicted, r.peak_bytes_measured) for r in done]),
        "model_peak_mape": _mape([(r.peak_bytes_model, r.peak_bytes_measured) for r in done]),
        "claimed_equals_measured": sum(1 for r in done if r.peak_bytes_claimed == r.peak_bytes_measured),
        "predicted_equals_measured": sum(1 for r in done
                                         if r.peak_bytes_predicted == r.peak_bytes_measured),
        "runs": len(done),
        "budget_exceeded": sum(1 for r in done if (r.peak_bytes_measured or 0) > r.memory_budget),
    }
    return summary


def _scale(pairs: list[tuple[float, float]]) -> float | None:
    """The median of measured over predicted (None without pairs)."""
    return statistics.median(m / p for p, m in pairs) if pairs else None


def _mape(pairs: list[tuple[Any, Any]]) -> float | None:
    errs = [abs(p - m) / m for p, m in pairs if p is not None and m]
    return 100 * statistics.fmean(errs) if errs else None


def render(rows: list[Row], summary: dict[str, Any]) -> str:
    lines = [f"{summary['model']}  r={summary['batch']}  on {summary['device']}  "
             f"({summary['repeat']} interleaved rounds)",
             f"{'budget':>10} {'strategy':8} {'measured':>11} {'spread':>7} {'predicted':>11} "
             f"{'peak meas.':>11} {'claimed':>11} {'max err':>9} {'vs ' + BASELINE:>11} {'vs fbs':>7}"]
    for row in rows:
        if not row.feasible:
            lines.append(f"{format_bytes(row.memory_budget):>10} {row.strategy:8} infeasible")
            continue
        lines.append(
            f"{format_bytes(row.memory_budget):>10} {row.strategy:8} "
            f"{row.time_per_sample_measured * 1e3:>8.2f} ms {100 * (row.time_per_sample_spread or 0):>6.1f}% "
            f"{row.time_per_sample_predicted * 1e3:>8.2f} ms {format_bytes(row.peak_bytes_measured):>11} "
            f"{format_bytes(row.peak_bytes_claimed):>11} {row.max_abs_error:>9.2e} "
            f"{(f'{row.gain_over_fbs_best:.2f}x' if row.gain_over_fbs_best else '-'):>11} "
            f"{(f'{row.gain_over_fbs:.2f}x' if row.gain_over_fbs else '-'):>7}")
    lines.append("the plans that ran (fbs-best: its uniform batch; vbs: what each call runs, "
                 "first..last unit: batch sizes)")
    for budget in sorted({row.memory_budget for row in rows}):
        here = {row.strategy: row for row in rows if row.memory_budget == budget and row.feasible}
        best, vbs = here.get(BASELINE), here.get("vbs")
        lines.append(f"{format_bytes(budget):>10} {BASELINE} "
                     f"{best.uniform_batch if best else '-'} ({best.calls if best else 0} calls); "
                     f"vbs ({vbs.calls if vbs else 0} calls) {vbs.shape if vbs else '-'}")
    lines.append(f"plain model(x): {summary['plain_model_time_per_sample'] * 1e3:.2f} ms/sample; executor at "
                 f"uniform batch: {summary['uniform_plan_time_per_sample'] * 1e3:.2f} ms/sample "
                 f"(overhead {100 * summary['executor_overhead']:+.1f}%)")
    tm, pm = summary["time_mape"], summary["peak_mape"]
    lines.append(f"MAPE predicted vs measured: time {tm:.1f}%, peak {pm:.2f}% (the walk's figure "
                 f"for what torch allocates = measured in {summary['predicted_equals_measured']} of "
                 f"{summary['runs']} runs; the claim, which adds what ONNX Runtime holds inside its "
                 f"calls, = measured in {summary['claimed_equals_measured']}; the DP's model "
                 f"{summary['model_peak_mape']:.1f}%); runs over budget: {summary['budget_exceeded']}"
                 if tm is not None else "no runs")
    if tm is not None and _served_mapes(summary):
        lines.append(f"time MAPE of the plans a worker runs:{_served_mapes(summary)}")
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
            batch_of: dict[str, int] = {}
            for step in plan.program.steps:
                batch_of[step.unit] = max(batch_of.get(step.unit, 0), step.samples)
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


def markdown(data: dict[str, Any]) -> str:
    """One `vbs bench --out` JSON file as the Markdown table of docs/benchmarks.md."""
    rows, s = data["rows"], data["summary"]
    strategies = [st for st in STRATEGIES if any(r["strategy"] == st for r in rows)]
    out = [f"#### {s['model']} (r = {s['batch']}, {s['repeat']} interleaved rounds)", "",
           "| budget (MiB) | " + " | ".join(f"{st} measured / predicted (ms)" for st in strategies)
           + f" | {BASELINE} batch | vbs calls | vbs vs {BASELINE} | vbs vs fbs "
             "| vbs peak: measured = walk's (claimed) (MiB) |",
           "|---" * (len(strategies) + 6) + "|"]
    shapes = []
    for budget in sorted({r["memory_budget"] for r in rows}):
        cells, vbs, best = [], None, None
        for st in strategies:
            r = next(x for x in rows if x["memory_budget"] == budget and x["strategy"] == st)
            if not r["feasible"]:
                cells.append("infeasible")
                continue
            cells.append(f"{r['time_per_sample_measured'] * 1e3:.2f} / "
                         f"{r['time_per_sample_predicted'] * 1e3:.2f}")
            vbs = r if st == "vbs" else vbs
            best = r if st == BASELINE else best
        if vbs and vbs.get("shape"):
            shapes.append(f"- {budget / 2**20:.1f} MiB: {vbs['shape']}")

        def gain(key: str) -> str:
            return f"{vbs[key]:.2f}x" if vbs and vbs.get(key) else "—"

        peak = (f"{vbs['peak_bytes_measured'] / 2**20:.2f} = "
                f"{vbs['peak_bytes_predicted'] / 2**20:.2f} ({vbs['peak_bytes_claimed'] / 2**20:.2f})"
                if vbs else "—")
        out.append(f"| {budget / 2**20:.1f} | " + " | ".join(cells) +
                   f" | {(best or {}).get('uniform_batch') or '—'} | {(vbs or {}).get('calls') or '—'}"
                   f" | {gain('gain_over_fbs_best')} | {gain('gain_over_fbs')} | {peak} |")
    out += ["", f"Plain `model(x)` {s['plain_model_time_per_sample'] * 1e3:.1f} ms/sample; the executor "
            f"at a uniform batch of {s['batch']} {s['uniform_plan_time_per_sample'] * 1e3:.1f} ms/sample "
            f"({100 * s['executor_overhead']:+.1f}%). MAPE of predicted time {s['time_mape']:.1f}%"
            f"{_served_mapes(s)}; "
            f"peak measured = the walk's figure for what torch allocates in "
            f"{s['predicted_equals_measured']} of {s['runs']} runs (MAPE {s['peak_mape']:.2f}%; the "
            f"claim, which adds what ONNX Runtime holds inside its calls, = measured in "
            f"{s['claimed_equals_measured']}; the DP's own figure {s['model_peak_mape']:.1f}%); "
            f"runs over budget: {s['budget_exceeded']}.", ""]
    if shapes:
        out += ["The vbs plans (what each call runs, first..last unit: batch sizes):", "", *shapes, ""]
    return "\n".join(out)


def _served_mapes(s: dict[str, Any]) -> str:
    """The MAPEs of the plans a worker runs, where the run recorded them."""
    parts = []
    if s.get("served_time_mape") is not None:
        parts.append(f"vbs and fbs-best {s['served_time_mape']:.1f}%")
    if s.get("served_time_scale") is not None:
        parts.append(f"measured over predicted, their median {s['served_time_scale']:.2f}x; "
                     f"scaled by it, {s['served_time_scaled_mape']:.1f}%")
    if s.get("table_time_mape") is not None:
        parts.append(f"the time `vbs plan` measured (the table's) against the bench's "
                     f"{s['table_time_mape']:.1f}%")
    return f" ({'; '.join(parts)})" if parts else ""


if __name__ == "__main__":  # python -m workers.plans_measured FILE.json ...: the Markdown of saved runs
    import sys

    for path in sys.argv[1:]:
        print(markdown(json.loads(Path(path).read_text())))
