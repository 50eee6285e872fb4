"""Run in a child process by ``test_runtimes``: the resident memory plans with ONNX Runtime
steps really take, against the table's claim.

Every allocation of at least a page is its own mapping, returned when freed (the parent sets
glibc's mmap and trim thresholds), and ONNX Runtime's sessions have no arena, so the growth of
the peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) while a plan runs is
what it allocates: the executor's tensors, torch's workspaces and ONNX Runtime's memory inside
its calls. Prints one JSON object per plan run.

    python -m tests.core.rss_child MODEL C,H,W BATCH_MAX
"""

from __future__ import annotations

import gc
import json
import sys

import torch

from planner.graph.capture import capture
from core.loaded import ModelSpec
from planner.models import load_model
from planner.profiling.profiler import ProfileOptions, measure
from core.runtimes.onnxrt import OrtUnits
from core.runtimes.ort_memory import reset_peak, status_bytes
from planner.solver.tables import build_table
from workers.executor import execute


def main(name: str, shape: tuple[int, ...], batch_max: int) -> None:
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec(name, input_shape=shape)))
    profile = measure(cap, ProfileOptions(batch_max=batch_max, repeats=1, warmup=0,
                                          runtime="onnxruntime"), progress=False)
    table = build_table(profile, slot_count=64)
    ort = OrtUnits(cap, arena=False)
    for fraction in (1.0, 0.5, 0.25):
        limit = max(int(table.min_peaks[0]), int(table.top_bytes * fraction))
        for r in (1, batch_max):
            fit = table.largest_fitting(r, limit)
            plan = table.plan(table.find(fit, limit), fit, limit)
            x = cap.model.example(fit, seed=fit)
            run = (lambda: execute(cap, plan.program.steps, x, plan.split_map, plan.run_map,
                                   {ort.name: ort}))
            run(), run()  # sessions built, first-call allocations made
            gc.collect()
            base = status_bytes("VmRSS")
            reset_peak()
            y = run()
            peak = status_bytes("VmHWM") - base
            del y
            print(json.dumps({"batch": fit, "limit": limit, "claim": plan.peak_bytes,
                              "peak": peak, "runs": len(plan.runs),
                              "onnxruntime": sum(s.runtime == "onnxruntime"
                                                 for s in plan.program.steps)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(v) for v in sys.argv[2].split(",")), int(sys.argv[3]))
