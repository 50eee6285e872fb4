"""Measure one unit or join: time as the median of repeats, workspace as the peak beyond output.

Time: CUDA events on GPU, ``perf_counter`` on CPU, after warm-up runs; every run gets a fresh
copy of the recorded input (made outside the timed region), because units may work in place.
Workspace: on CUDA the peak allocated while the unit runs beyond what was held before
(``max_memory_allocated``, which includes cuDNN's workspace); on CPU the torch profiler's
memory events (planner.profiling.cpu_memory), all regions in one profiling session.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from planner.profiling.cpu_memory import region_peaks

REGION = "vbs::"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(run: Callable[[], Any], prepare: Callable[[], Any], device: torch.device,
                warmup: int, repeats: int) -> float:
    """Median seconds of ``run(prepare())`` over ``repeats`` runs after ``warmup`` runs."""
    samples: list[float] = []
    with torch.inference_mode():
        for k in range(warmup + repeats):
            arg = prepare()
            _sync(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run(arg)
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                run(arg)
                elapsed = time.perf_counter() - t0
            del arg
            if k >= warmup:
                samples.append(elapsed)
    return float(statistics.median(samples))


def cuda_peak(run: Callable[[Any], Any], arg: Any, device: torch.device) -> int:
    """Bytes allocated at the peak of ``run(arg)`` beyond what was allocated before it."""
    with torch.inference_mode():
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = run(arg)
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
    return max(0, int(peak))


def cpu_peaks(jobs: Iterable[tuple[str, Callable[[Any], Any], Callable[[], Any]]],
              progress: Callable[[], None] = lambda: None) -> dict[str, int]:
    """Peak bytes of every job ``(label, run, prepare)``, in one torch profiler session."""
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for label, run, prepare in jobs:
            arg = prepare()
            with record_function(REGION + label):
                out = run(arg)
            del out, arg
            progress()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="vbs-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    return {k[len(REGION):]: v for k, v in region_peaks(events, REGION).items()}
