"""Step ``energy``: vbs's table planned for energy beside its table planned for time, both run.

Per model: a profile on the device (time, workspaces), every unit's energy at a few batch sizes
from the device's counter (``planner.profiling.energy``: NVML's board energy on CUDA), then the
tables of both objectives. At each budget the plan for time and the plan for energy (and
fbs-best's, the reference) run interleaved, each repeated for a window of the counter: time
and energy per sample, measured beside what the profile predicts. A CPU has no energy counter
here, so the rehearsal reads process CPU time through the same meter (``cpu-s``): the same
measurement, planning and runs, in CPU-seconds, not joules, and the summary says so.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

from bench.gpu.config import Config, Run
from bench.gpu.record import Deadline, Record

class CpuTimeCounter:
    """The rehearsal's stand-in where no energy counter exists: CPU-seconds of this process."""

    name = "process CPU time (a stand-in: the CPU has no energy counter here; not energy)"
    unit = "cpu-s"

    def read(self) -> float:
        return time.process_time()


def predicted_energy(profile: Any, steps: Any) -> float:
    """What the profile says a program spends: each step's node at its samples."""
    from core.tree import iter_nodes

    energy = {n.name: n.energy for n in iter_nodes(profile.root) if getattr(n, "energy", ())}
    return sum(energy[s.unit][s.samples - 1] for s in steps if s.unit in energy)


def fitting_grid(grid: list[int], units: int, per_s: float, share_s: float) -> list[int]:
    """The batch sizes to measure energy at within about half of ``share_s``: the counter's
    tick sets what one (unit, b) costs, so a coarse counter gets fewer sizes (1 and B at least;
    the rest are interpolated)."""
    grid = list(grid)
    while len(grid) > 2 and units * len(grid) * per_s > 0.5 * share_s:
        grid.pop(len(grid) // 2)
    return grid


def _profiled(cfg: Config, item: Run, share_s: float) -> tuple[Any, Any, Any, Any, Any]:
    """The model captured and profiled, with energy per unit measured on ``cfg``'s counter:
    (capture, profile, counter, clock, energy meta)."""
    from core.loaded import ModelSpec
    from core.tree import iter_layers
    from planner.graph.capture import capture
    from planner.models import load_model
    from planner.profiling import energy
    from planner.profiling.profiler import ProfileOptions, measure

    cap = capture(load_model(ModelSpec(item.model, input_shape=item.shape, dtype=item.dtype,
                                       device=cfg.device)))
    profile = measure(cap, ProfileOptions(batch_max=item.batch_max, repeats=cfg.profile_repeats,
                                          warmup=cfg.profile_warmup, runtime=cfg.runtime),
                      progress=False)
    counter = energy.NvmlCounter(cap.model.device) if cfg.device == "cuda" else CpuTimeCounter()
    clock = energy.calibrate(counter)
    window = max(cfg.energy_min_window_s, cfg.energy_window_ticks * clock.tick_s)
    grid = fitting_grid(energy.energy_grid(item.batch_max), len(list(iter_layers(cap.tree))),
                        window + 2 * clock.tick_s, share_s)
    spent, meta = energy.measure_units(cap, counter, grid, window_ticks=cfg.energy_window_ticks,
                                       min_window_s=cfg.energy_min_window_s, clock=clock)
    return cap, energy.with_energy(profile, spent, meta), counter, clock, meta


def _looked_up(profile: Any, item: Run) -> tuple[list[tuple[dict[str, Any], Any]], list[dict[str, Any]]]:
    """For every budget, the plan for time, for energy and fbs-best's: (cells with their plans,
    rows)."""
    from core.errors import InfeasibleError
    from core.sizes import parse_budgets
    from planner.solver.compare import budget_range
    from planner.solver.tables import build_tables

    tables = {"time": build_tables(profile, ("vbs", "fbs", "fbs-best"), objective="time"),
              "energy": build_tables(profile, ("vbs",), objective="energy")}
    r = item.batch
    configs, rows = [], []
    for budget in parse_budgets(item.memory, *budget_range(tables["time"], r)):
        row: dict[str, Any] = {"budget": budget, "plans": {}}
        for key, obj, solver in (("time", "time", "vbs"), ("energy", "energy", "vbs"),
                                 ("fbs-best", "time", "fbs-best")):
            try:
                plan = tables[obj][solver].lookup(r, budget)
            except InfeasibleError as exc:
                row["plans"][key] = {"feasible": False, "reason": str(exc)[:200]}
                continue
            cell = {"feasible": True, "plan_id": plan.plan_id, "peak_bytes": plan.peak_bytes,
                    "time_per_sample_predicted": plan.time_per_sample,
                    "energy_per_sample_predicted": predicted_energy(profile, plan.program.steps) / r}
            row["plans"][key] = cell
            configs.append((cell, plan))
        row["same_plan"] = row["plans"].get("time", {}).get("plan_id") == \
            row["plans"].get("energy", {}).get("plan_id")
        rows.append(row)
    return configs, rows


def _measured(cfg: Config, item: Run, cap: Any, meter: Any, window: float,
              configs: list[tuple[dict[str, Any], Any]]) -> None:
    """Each plan's time and energy per sample, as the median of ``item.repeat`` windows."""
    import torch

    from workers.executor import execute

    r = item.batch
    x = cap.model.example(r, seed=7)

    def job(plan: Any) -> Any:
        return lambda: execute(cap, plan.program.steps, x, plan.split_map, plan.run_map)

    repeats = {}
    with torch.inference_mode():
        for cell, plan in configs:  # warm-up, and how many runs fill the window
            job(plan)()
            meter.sync()
            t = time.perf_counter()
            job(plan)()
            meter.sync()
            repeats[id(cell)] = max(1, math.ceil(window / max(time.perf_counter() - t, 1e-6)))
        samples: dict[int, list[tuple[float, float]]] = {id(c): [] for c, _ in configs}
        for _ in range(item.repeat):
            for cell, plan in configs:
                n, run, took = repeats[id(cell)], job(plan), []

                def work(n: int = n, run: Any = run, took: list[float] = took) -> None:
                    start = time.perf_counter()
                    for _ in range(n):
                        run()
                    meter.sync()
                    took.append(time.perf_counter() - start)

                used = meter.spent(work)
                samples[id(cell)].append((took[0] / (n * r), used / (n * r)))
    for cell, _ in configs:
        cell["time_per_sample_measured"] = statistics.median(t for t, _ in samples[id(cell)])
        cell["energy_per_sample_measured"] = statistics.median(e for _, e in samples[id(cell)])
        cell["runs_per_window"] = repeats[id(cell)]


def _model(cfg: Config, item: Run, rec: Record, share_s: float) -> None:
    from planner.profiling import energy

    t0 = time.perf_counter()
    cap, profile, counter, clock, meta = _profiled(cfg, item, share_s)
    configs, rows = _looked_up(profile, item)
    planned_s = time.perf_counter() - t0
    meter = energy.Meter(counter, clock, energy.device_sync(cap.model.device))
    window = max(cfg.energy_min_window_s, cfg.energy_window_ticks * clock.tick_s)
    _measured(cfg, item, cap, meter, window, configs)
    rec.item({"label": item.label, "model": item.model, "dtype": item.dtype, "batch": item.batch,
              "counter": counter.name, "unit": counter.unit, "energy_meta": meta,
              "profile_s": profile.meta.get("elapsed_s"), "planned_s": round(planned_s, 2),
              "seconds": round(time.perf_counter() - t0, 2), "rows": rows})
    both = [row for row in rows if row["plans"].get("time", {}).get("feasible")
            and row["plans"].get("energy", {}).get("feasible")]
    rec.check(f"energy {item.label}: plans for time and for energy ran", bool(both),
              f"{len(both)} of {len(rows)} budgets")
    rec.check(f"energy {item.label}: the counter counted",
              all(c["energy_per_sample_measured"] > 0 for c, _ in configs),
              f"{counter.name}, tick {clock.tick_s:.4f} s")


def main(cfg: Config, work: Path, rec: Record, deadline: Deadline) -> None:
    for k, item in enumerate(cfg.energy):
        if not deadline.allows(item.estimate_s):
            rec.skip(f"energy {item.label}", f"{deadline.left():.0f} s left of the call")
            continue
        try:
            _model(cfg, item, rec, deadline.left() / (len(cfg.energy) - k))
        except Exception as exc:  # noqa: BLE001 - recorded; the next model still runs
            rec.item({"label": item.label, "error": f"{type(exc).__name__}: {exc}"})
            rec.check(f"energy {item.label}", False, f"{type(exc).__name__}: {exc}"[:400])
