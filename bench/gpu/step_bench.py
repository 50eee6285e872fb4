"""Step ``bench``: `vbs bench` of every model and dtype, every strategy at every budget.

Each is a `vbs bench --out` of its own (profile at the request size, the five strategies'
tables, every (strategy, budget) run interleaved; ``workers.plans_measured``). The record keeps its
summary and rows, and per model the figures the summary tables need: runs over budget (must
be 0), MAPE of predicted time and peak, how often the table's claimed peak was the measured
one, and vbs's largest measured gain over fbs (the paper's baseline) and over fbs-best.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.gpu.config import Config
from bench.gpu.record import VBS, Deadline, Record, run


def gains(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """vbs's largest measured gain over fbs and over fbs-best, and at which budget; as the paper
    states it too (the reduction of time per sample, %)."""
    out: dict[str, Any] = {}
    for key, base in (("gain_over_fbs", "fbs"), ("gain_over_fbs_best", "fbs-best")):
        cells = [r for r in rows if r["strategy"] == "vbs" and r.get(key)]
        if not cells:
            out[base] = None
            continue
        best = max(cells, key=lambda r: r[key])
        out[base] = {"gain": best[key], "reduction_pct": 100 * (1 - 1 / best[key]),
                     "budget": best["memory_budget"]}
    return out


def captured(rows: list[dict[str, Any]]) -> dict[str, int]:
    """How many plans were feasible, ran (timed), and ran runtime calls (with --runtime
    cudagraph: CUDA graphs, each captured, or the bench would have failed)."""
    feasible = [r for r in rows if r.get("feasible")]
    ran = [r for r in feasible if r.get("time_per_sample_measured")]
    calls = [r for r in ran if r.get("calls")]
    return {"feasible": len(feasible), "ran": len(ran), "with_calls": len(calls),
            "calls": sum(int(r["calls"]) for r in calls)}


def main(cfg: Config, work: Path, rec: Record, deadline: Deadline) -> None:
    for item in cfg.benches:
        if not deadline.allows(item.estimate_s):
            rec.skip(f"bench {item.label}", f"{deadline.left():.0f} s left of the call")
            continue
        out = work / "bench" / f"{item.model}-{item.dtype}-{cfg.runtime_of(item)}"
        cmd = [*VBS, "bench", "--model", item.model, *item.shape_arg, "--batch", str(item.batch),
               "--batch-max", str(item.batch_max), "--memory", item.memory,
               "--repeat", str(item.repeat), "--device", cfg.device, "--dtype", item.dtype,
               "--runtime", cfg.runtime_of(item), "--out", str(out)]
        ran = run(cmd, timeout_s=deadline.left(), env=cfg.vbs_env(work))
        row: dict[str, Any] = {"label": item.label, "model": item.model, "dtype": item.dtype,
                               "runtime": cfg.runtime_of(item),
                               "batch": item.batch, "memory": item.memory, "rc": ran.rc,
                               "wall_s": ran.seconds}
        result = out / f"{item.model}.json"
        if ran.ok and result.exists():
            data = json.loads(result.read_text())
            s = data["summary"]
            row.update(summary=s, rows=data["rows"], gains=gains(data["rows"]),
                       plans=captured(data["rows"]),
                       runtimes=sorted({rt for r in data["rows"] for rt in r.get("runtimes") or ()}))
            rec.item(row)
            rec.check(f"bench {item.label}: no run over its budget", s["budget_exceeded"] == 0,
                      f"{s['budget_exceeded']} of {s['runs']} runs over budget")
            rec.check(f"bench {item.label}: runs", s["runs"] > 0, f"{s['runs']} runs")
        else:
            row["error"] = ran.tail(2000)
            rec.item(row)
            rec.check(f"bench {item.label}", False, row["error"][-300:])
