"""Step ``graphs``: the whole model as one CUDA graph against eager torch, at one sample.

Each item is a ``python -m bench.graph_pass --json`` of its own (a process of its own): eager
``model(x)`` and the graph's call timed interleaved, the graph's output against
``model(x)``. On CUDA the checks are that the graph ran and its output is within the
dtype's tolerance; the speed-up is a figure for docs/benchmarks.md, not a check (timings are
never pass/fail). On the CPU graphs cannot run: the record says why and times eager alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.gpu.config import Config
from bench.gpu.record import Deadline, Record, run


def main(cfg: Config, work: Path, rec: Record, deadline: Deadline) -> None:
    for item in cfg.graphs:
        if not deadline.allows(item.estimate_s):
            rec.skip(f"graphs {item.label}", f"{deadline.left():.0f} s left of the call")
            continue
        cmd = [sys.executable, "-m", "bench.graph_pass", "--model", item.model, *item.shape_arg,
               "--device", cfg.device, "--dtype", item.dtype, "--samples", str(item.batch),
               "--repeat", str(item.repeat), "--json"]
        ran = run(cmd, timeout_s=deadline.left(), env=cfg.vbs_env(work))
        row: dict[str, Any] = {"label": item.label, "model": item.model, "dtype": item.dtype,
                               "rc": ran.rc, "wall_s": ran.seconds}
        if ran.ok:
            row.update(json.loads(ran.output.strip().splitlines()[-1]))
        else:
            row["error"] = ran.tail(1500)
        rec.item(row)
        rec.check(f"graphs {item.label}: ran", ran.ok, row.get("error", "")[-300:])
        if cfg.device == "cuda" and ran.ok:
            rec.check(f"graphs {item.label}: the graph ran", "graph" in row,
                      row.get("graph_unavailable", ""))
            rec.check(f"graphs {item.label}: output equals model(x) within tolerance",
                      bool(row.get("within_tolerance")), f"max |error| {row.get('max_abs_error')}")
