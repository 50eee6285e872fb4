"""Whether a model's int8 units run faster than its float32 ones on this machine: measured once
and kept beside the profiles.

Why: int8 is not faster everywhere. Each int8 unit quantizes its input and dequantizes its
output; on small models that costs more than the int8 kernels save (on a 2-vCPU AMD EPYC
without AVX-512, shufflenet_v2_x0_5 and mnasnet0_5 ran 1.2-1.7x slower all int8 than all
float32: docs/benchmarks.md, section 13). So `--precision auto` keeps int8 only where the
whole model, composed with its int8 units, measured at least ``MIN_SPEEDUP`` faster per sample
than in float32 (one call at each of ``SIZES``, the batches a server of up to ``BATCH`` forms,
interleaved rounds, vbs-serve's session options); `--precision int8` keeps it whatever it
measured, and says so. The verdict is cached by what decides it (the model's tree, its int8
units, the calibration samples, this CPU, ONNX Runtime's version), so every process that
captures the model again (`vbs plan`'s load measurement, a torch worker) makes the same choice
and finds the same tables.
Where the device has half-precision kernels, ``measured_times`` times torch's bfloat16 or
float16 model beside float32 (ONNX Runtime's and torch's) and the int8 units, in the same
rounds, for `auto`'s choice among them (``planner.precision_half``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from core.precision import HALF
from core.runtimes.onnx_compose import CannotCompose, UnitGraphs
from core.runtimes.ort_sessions import session_options
from core.tree import node_to_json
from core.units import Capture
from planner.profiling.profiler import device_name

log = logging.getLogger("vbs.plan")

MIN_SPEEDUP = 1.05  # int8 moves the answer: auto takes it only for a gain beyond the noise
BATCH = 8  # the largest batch its calls are measured at
# the batches a server of up to BATCH forms, powers of two (8 closed-loop clients make cohorts
# of 4, one client batches of one), priced per sample of them all: 1 and 8 alone, their times
# a sample summed, weighed a sample at one as much as eight, and put int8 15-30% ahead of
# bfloat16 on resnext50_32x4d on AMX, where 8 clients were served 1.06-1.09x faster in bfloat16
# (docs/benchmarks.md, section 13)
SIZES = (1, 2, 4, BATCH)
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
    path = None if cache is None else cache / FOLDER / f"{_key(capture, int8, digest)}.json"
    found = _read(path)
    if found is not None and "speedup" in found:
        return float(found["speedup"])
    value = _measure(float32, mixed, sample)
    if value > 0:
        _write(path, {"speedup": value})
    return value


def measured_times(capture: Capture, names: tuple[str, ...],
                   runs: Callable[[], dict[str, Callable[[np.ndarray], object]]],
                   int8: tuple[str, ...], digest: str, sample: np.ndarray,
                   cache: Path | None) -> dict[str, float]:
    """Seconds per sample of the candidates ``names`` (float32 on ONNX Runtime and on torch,
    the int8 units, torch at a half precision), from ``cache`` where this machine measured them
    before, else ``runs()`` (a name to a call of the whole model on an array of samples; a
    graph that does not compose is left out) timed in the same interleaved rounds at each of
    ``SIZES``, and kept there."""
    key = _key(capture, int8, digest, runs=sorted(names), **_layout(capture, names))
    path = None if cache is None else cache / FOLDER / f"{key}.json"
    found = _read(path)
    if found is not None and isinstance(found.get("seconds"), dict):
        return {name: float(v) for name, v in found["seconds"].items()}
    seconds, by_size = _per_sample(runs(), sample)
    _write(path, {"seconds": seconds, "by_size": by_size})  # by_size: what each size paid
    return seconds


def _layout(capture: Capture, names: tuple[str, ...]) -> dict[str, str]:
    """What the key says of a half precision's layout, where it is timed on the CPU
    (channels_last since it runs so: ``planner.models.channels_last``; times of before are
    not its)."""
    if capture.model.device.type != "cpu":
        return {}
    return {f"{dtype}_layout": "channels_last" for dtype in HALF if dtype in names}


def _read(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not measured here yet (or unreadable): measure it
    return found if isinstance(found, dict) else None


def _write(path: Path | None, value: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def _key(capture: Capture, int8: tuple[str, ...], digest: str, **more: object) -> str:
    key = {"tree": node_to_json(capture.tree, measured=False), "model": capture.model.spec.name,
           "input_shape": list(capture.input_shape), "int8": sorted(int8),
           "calibration": digest, "device": device_name(capture.model.device),
           "onnxruntime": ort.__version__, "batch": BATCH, "sizes": list(SIZES),
           "rounds": ROUNDS, **more}
    if more:  # torch's kernels are timed too
        key["torch"] = torch.__version__
    blob = json.dumps(key, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _measure(float32: UnitGraphs, mixed: UnitGraphs, sample: np.ndarray) -> float:
    """Both graphs of the whole model timed in interleaved rounds at each of ``SIZES``:
    float32's seconds per sample over int8's."""
    nodes = float32.shapes.tree.children
    try:
        graphs = {"float32": float32.compose(nodes), "int8": mixed.compose(nodes)}
    except CannotCompose as exc:
        log.info("int8's speed not measured: the model is not one graph (%s)", exc)
        return 0.0
    seconds, _ = _per_sample({name: session_run(g) for name, g in graphs.items()}, sample)
    return round(seconds["float32"] / seconds["int8"], 3)


def session_run(graph: object) -> Callable[[np.ndarray], object]:
    """A call of ``graph`` (an ONNX model of the whole model, input ``x``) in a session made as
    vbs-serve makes its own."""
    session = ort.InferenceSession(graph.SerializeToString(),  # type: ignore[attr-defined]
                                   session_options(torch.get_num_threads()),
                                   providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"x": x})


def _per_sample(runs: dict[str, Callable[[np.ndarray], object]], sample: np.ndarray
                ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Each run timed in interleaved rounds at each of ``SIZES``: its seconds per sample over
    one call of each size (their medians' sum over the samples they ran: each sample weighs
    alike, as in a loaded server's stream, where most samples ride in the larger batches), and
    by size."""
    feeds = {b: np.ascontiguousarray(np.resize(sample, (b, *sample.shape[1:])),
                                     dtype=np.float32) for b in SIZES}
    seen: dict[tuple[str, int], list[float]] = {(n, b): [] for n in runs for b in feeds}
    order = [(n, b) for n in runs for b in feeds]
    for k in range(WARMUP + ROUNDS):
        for name, b in (order if k % 2 else order[::-1]):  # drift hits all alike
            t0 = time.perf_counter()
            runs[name](feeds[b])
            if k >= WARMUP:
                seen[name, b].append(time.perf_counter() - t0)
    by_size = {name: {str(b): round(statistics.median(seen[name, b]) / b, 6) for b in feeds}
               for name in runs}
    for name, sizes in by_size.items():
        log.info("%s: ms a sample by batch: %s", name,
                 ", ".join(f"{b}: {1e3 * v:.2f}" for b, v in sizes.items()))
    return ({name: round(sum(statistics.median(seen[name, b]) for b in feeds) / sum(feeds), 6)
             for name in runs}, by_size)


__all__ = ["BATCH", "MIN_SPEEDUP", "SIZES", "keeps_int8", "measured_speedup", "measured_times",
           "session_run"]
