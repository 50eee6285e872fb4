"""Whether a model's int8 units run faster than its float32 ones on this machine: measured once
and kept beside the profiles.

Why: int8 is not faster everywhere. Each int8 unit quantizes its input and dequantizes its
output; on small models that costs more than the int8 kernels save (on a 2-vCPU AMD EPYC
without AVX-512, shufflenet_v2_x0_5 and mnasnet0_5 ran 1.2-1.7x slower all int8 than all
float32: docs/benchmarks.md, section 13). So `--precision auto` keeps int8 only where the
whole model, composed with its int8 units, measured at least ``MIN_SPEEDUP`` faster per sample
than in float32 (one call at one sample and one at ``BATCH``, interleaved rounds, vbs-serve's
session options); `--precision int8` keeps it whatever it measured, and says so. The verdict
is cached by what decides it (the model's tree, its int8 units, the calibration samples, this
CPU, ONNX Runtime's version), so every process that captures the model again (`vbs plan`'s
load measurement, a torch worker) makes the same choice and finds the same tables.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from core.runtimes.onnx_compose import CannotCompose, UnitGraphs
from core.runtimes.ort_sessions import session_options
from core.tree import node_to_json
from core.units import Capture
from planner.profiling.profiler import device_name

log = logging.getLogger("vbs.plan")

MIN_SPEEDUP = 1.05  # int8 moves the answer: auto takes it only for a gain beyond the noise
BATCH = 8  # the batch its calls are also measured at (and one sample)
WARMUP, ROUNDS = 2, 5
FOLDER = "precision-speed"


def keeps_int8(speedup: float) -> bool:
    """Whether ``--precision auto`` keeps the guard's int8 units at a measured ``speedup``
    (float32's time over int8's; 0: not measured, the guard's choice stands)."""
    return speedup == 0.0 or speedup >= MIN_SPEEDUP


def measured_speedup(capture: Capture, float32: UnitGraphs, mixed: UnitGraphs,
                     int8: tuple[str, ...], digest: str, sample: np.ndarray,
                     cache: Path | None) -> float:
    """float32's time over ``mixed``'s (the model with units ``int8`` in int8), per sample,
    from ``cache`` where this machine measured it before, else measured now and kept there;
    0.0 where the whole model does not compose into one graph (not measured)."""
    path = None
    if cache is not None:
        path = cache / FOLDER / f"{_key(capture, int8, digest)}.json"
        try:
            return float(json.loads(path.read_text())["speedup"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not measured here yet (or unreadable): measure it
    value = _measure(float32, mixed, sample)
    if path is not None and value > 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"speedup": value}))
        tmp.replace(path)
    return value


def _key(capture: Capture, int8: tuple[str, ...], digest: str) -> str:
    key = {"tree": node_to_json(capture.tree, measured=False), "model": capture.model.spec.name,
           "input_shape": list(capture.input_shape), "int8": sorted(int8),
           "calibration": digest, "device": device_name(capture.model.device),
           "onnxruntime": ort.__version__, "batch": BATCH, "rounds": ROUNDS}
    blob = json.dumps(key, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _measure(float32: UnitGraphs, mixed: UnitGraphs, sample: np.ndarray) -> float:
    """Both graphs of the whole model timed in interleaved rounds, at one sample and at
    ``BATCH``: float32's seconds per sample (the two sizes' summed) over int8's."""
    nodes = float32.shapes.tree.children
    try:
        graphs = {"float32": float32.compose(nodes), "int8": mixed.compose(nodes)}
    except CannotCompose as exc:
        log.info("int8's speed not measured: the model is not one graph (%s)", exc)
        return 0.0
    threads = torch.get_num_threads()
    sessions = {name: ort.InferenceSession(g.SerializeToString(), session_options(threads),
                                           providers=["CPUExecutionProvider"])
                for name, g in graphs.items()}
    feeds = {b: {"x": np.ascontiguousarray(np.resize(sample, (b, *sample.shape[1:])),
                                           dtype=np.float32)} for b in (1, BATCH)}
    seen: dict[tuple[str, int], list[float]] = {(n, b): [] for n in sessions for b in feeds}
    order = [(n, b) for n in sessions for b in feeds]
    for k in range(WARMUP + ROUNDS):
        for name, b in (order if k % 2 else order[::-1]):  # drift hits both alike
            t0 = time.perf_counter()
            sessions[name].run(None, feeds[b])
            if k >= WARMUP:
                seen[name, b].append(time.perf_counter() - t0)

    def per_sample(name: str) -> float:
        return sum(statistics.median(seen[name, b]) / b for b in feeds)

    return round(per_sample("float32") / per_sample("int8"), 3)


__all__ = ["MIN_SPEEDUP", "keeps_int8", "measured_speedup"]
