"""A half precision as a model's precision: torch runs the whole model in bfloat16 or float16,
guarded on held-out calibration samples as int8 is, and, for `auto`, kept only where it
measured fastest here.

Why the whole model, and torch: ONNX Runtime has no bfloat16 CPU kernels, a CUDA model's units
are torch's (or its CUDA graphs'), and torch runs a model captured at that dtype (the path
`--dtype` takes), so the profile, the DP and the executor price and run it as any other model.
What this adds is the guard (top-1 agreement with float32 on the held-out samples, and the
largest difference, as for int8) and the measurement: a half precision pays only where the
device has its kernels (bfloat16: AVX512-BF16 or AMX, a CUDA device from Ampere on; float16:
CUDA, or a CPU with AVX512-FP16 or AMX-FP16; elsewhere torch emulates it, slower than
float32), and not on every model even there (on the CPU torch's calls cost more than ONNX
Runtime's on a small model, and bfloat16 loses to int8 units where the guard keeps them on a
CPU with VNNI: docs/benchmarks.md, section 13). So `auto` times float32 (ONNX Runtime's and
torch's), the int8 units the guard kept and each half precision the device runs natively in
the same rounds (``planner.precision_speed``) and takes the fastest half only where it is the
fastest of them, by at least ``MIN_SPEEDUP`` over float32.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import torch

from core.errors import ModelError, UsageError
from core.precision import BFLOAT16, FLOAT32, HALF, Precision
from core.runner import run_node
from core.runtimes.onnx_compose import CannotCompose, UnitGraphs
from core.units import MODULE_GATE, Capture
from planner.calibration import Calibration
from planner.precision_speed import MIN_SPEEDUP, measured_times, session_run

log = logging.getLogger("vbs.plan")


@dataclass(frozen=True)
class Candidate:
    """A half precision for one model: its capture (with what the guard measured) and why it
    is, or is not, the precision to serve."""

    capture: Capture
    kept: bool
    why: str


def native(device: torch.device, dtype: str) -> bool:
    """Whether ``device`` has kernels of ``dtype`` (bfloat16 or float16). bfloat16: a CPU with
    AVX512-BF16 or AMX (oneDNN's check), a CUDA device from Ampere on; float16: any CUDA
    device torch runs, a CPU with AVX512-FP16 or AMX-FP16."""
    if dtype not in HALF:
        raise ValueError(f"{dtype!r} is not a half precision ({', '.join(HALF)})")
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported()) if dtype == BFLOAT16 else True
    if dtype == BFLOAT16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


# what a device lacks where torch only emulates a half precision's kernels (``native``'s checks)
_KERNELS = {("cpu", "bfloat16"): "AVX512-BF16 or AMX",
            ("cpu", "float16"): "AVX512-FP16 or AMX-FP16",
            ("cuda", "bfloat16"): "compute capability 8.0 or newer"}


def natives(device: torch.device) -> tuple[str, ...]:
    """The half precisions ``device`` has kernels of (what `auto` weighs there)."""
    return tuple(d for d in HALF if native(device, d))


def in_half(capture: Capture, samples: Calibration, max_error: float, dtype: str,
            half: Capture | None = None) -> Candidate:
    """``capture``'s model captured again at ``dtype`` (``half`` where it was already), with
    the guard's measure of it against float32 on the held-out samples; ``kept`` where top-1
    moved on at most ``max_error`` of them."""
    if capture.model.spec.dtype != FLOAT32:
        raise UsageError(f"--precision {dtype} casts a float32 model; this one is "
                         f"{capture.model.spec.dtype} (plan it with --dtype float32)")
    half = half or _recaptured(capture, dtype)
    x = torch.from_numpy(samples.held_out)
    want = _whole(capture, x).float()
    got = _whole(half, x).float()
    agree = float((got.reshape(len(x), -1).argmax(1)
                   == want.reshape(len(x), -1).argmax(1)).float().mean())
    error = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
    kept = 1.0 - agree <= max_error
    why = (f"{dtype} kept top-1 within {max_error:g} of float32" if kept else
           f"{dtype} moved top-1 on {100 * (1 - agree):.1f}% of the held-out samples, more "
           f"than {max_error:g}")
    precision = Precision((), samples.digest, agree, error, len(x), max_error, why,
                          dtype=dtype)
    return Candidate(replace(half, precision=precision, held_out=samples.held_out), kept, why)


def asked(capture: Capture, dtype: str, samples: Calibration, max_error: float) -> Capture:
    """``--precision bfloat16|float16``: the model captured again at ``dtype`` where its guard
    held (saying so where the device only emulates its kernels), else float32 saying why."""
    half = in_half(capture, samples, max_error, dtype)
    if not half.kept:
        return replace(capture, precision=replace(half.capture.precision, dtype=FLOAT32,
                                                  why=f"{half.why}: float32"))
    if not native(capture.model.device, dtype):
        kernels = _KERNELS.get((capture.model.device.type, dtype), "its kernels")
        return replace(half.capture, precision=replace(
            half.capture.precision, why=f"{half.why}; this device has no {dtype} kernels "
                                        f"({kernels}): torch emulates them, slower than "
                                        "float32"))
    return half.capture


def fastest(float32: Capture, int8: Capture, graphs: UnitGraphs | None,
            mixed: UnitGraphs | None, samples: Calibration, max_error: float,
            cache: Path | None) -> Capture:
    """`auto`'s choice: the half precision (of those the device runs natively) that measured
    the fastest of float32 (ONNX Runtime's whole graph ``graphs`` where it composes, and
    torch's), the int8 units kept (``mixed``) and the half precisions, by at least
    ``MIN_SPEEDUP`` over float32, and its guard held (where the fastest half's guard failed,
    the next that qualifies is guarded in its place); else ``int8`` (the int8 choice, which may
    be float32), its ``why`` saying what the half precisions measured. The model is captured
    at a half precision only to be timed (once per machine: the times are cached) and where it
    won; a worker that reads the times from the cache and finds int8 faster does neither."""
    halves = natives(float32.model.device)
    if not halves:
        return int8
    captured: dict[str, Capture] = {}

    def half(dtype: str) -> Capture:
        if dtype not in captured:
            captured[dtype] = _recaptured(float32, dtype)
        return captured[dtype]

    composes = {"float32": graphs, "int8": mixed if int8.precision.int8 else None}
    failed: dict[str, str] = {}

    def runs() -> dict[str, Callable[[np.ndarray], object]]:
        out = {"float32 torch": _torch_run(float32)}
        for d in halves:
            try:
                out[d] = _torch_run(half(d))
            except ModelError as exc:  # not weighed: the rest are, as without it
                failed[d] = f"{d} was not timed: the model at {d} {exc}"
                log.info("%s: %s", float32.model.spec.name, failed[d])
        for name, g in composes.items():
            composed = None if g is None else _composed(g)
            if composed is not None:
                out[name] = session_run(composed)
        return out

    names = ("float32 torch", *halves, *(n for n, g in composes.items() if g is not None))
    seconds = measured_times(float32, names, runs, int8.precision.int8, samples.digest,
                             samples.fit, cache)
    untimed = [failed.get(d, f"{d} was not timed (it could not be captured where it was "
                             "measured)") for d in halves if d not in seconds]
    chosen = _first_guarded(float32, int8, seconds, tuple(d for d in halves if d in seconds),
                            half, samples, max_error)
    return _noted(chosen, "; ".join(untimed)) if untimed else chosen


def _first_guarded(float32: Capture, int8: Capture, seconds: dict[str, float],
                   halves: tuple[str, ...], half: Callable[[str], Capture],
                   samples: Calibration, max_error: float) -> Capture:
    """The fastest of ``halves`` that beat every other candidate in ``seconds`` and float32 by
    ``MIN_SPEEDUP`` and whose guard held; a faster one the guard refused (float16's narrow
    range, say) gives way to the next. Else ``int8``, saying why."""
    best_float = min(v for k, v in seconds.items() if k.startswith("float32"))
    rivals = {k: v for k, v in seconds.items() if k not in halves}
    rival = min(rivals, key=rivals.__getitem__)
    measured = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in sorted(seconds.items()))
    notes: list[str] = []
    for dtype in sorted(halves, key=seconds.__getitem__):
        speedup = round(best_float / seconds[dtype], 3)
        if rivals[rival] <= seconds[dtype]:
            notes.append(f"{dtype} ran {speedup:.2f}x float32's speed, {rival} faster "
                         f"(ms a sample: {measured})")
            break
        if speedup < MIN_SPEEDUP:
            notes.append(f"{dtype} ran {speedup:.2f}x float32's speed, below the "
                         f"{MIN_SPEEDUP:g}x wanted (ms a sample: {measured})")
            break
        guarded = in_half(float32, samples, max_error, dtype, half(dtype))
        if not guarded.kept:
            notes.append(guarded.why)
            continue
        why = (f"auto: {dtype} ran {speedup:.2f}x float32's speed here, the fastest"
               f"{' guarded' if notes else ''} (ms a sample: {measured}); {guarded.why}"
               + "".join(f"; {n}" for n in notes))
        log.info("%s: %s", float32.model.spec.name, why)
        return replace(guarded.capture, precision=replace(guarded.capture.precision, why=why,
                                                          speedup=speedup))
    return _noted(int8, "; ".join(notes))


def _noted(chosen: Capture, note: str) -> Capture:
    return replace(chosen, precision=replace(chosen.precision,
                                             why=f"{chosen.precision.why}; {note}"))


def _recaptured(capture: Capture, dtype: str) -> Capture:
    """The model of ``capture`` loaded and captured again at ``dtype``."""
    from planner.graph.capture import capture as capture_of
    from planner.models import load_model

    return capture_of(load_model(replace(capture.model.spec, dtype=dtype)))


def _whole(capture: Capture, x: torch.Tensor) -> torch.Tensor:
    """The model's output on ``x`` (float32 samples), run unit by unit as the executor's
    torch steps run them, at the capture's dtype."""
    with torch.inference_mode(), MODULE_GATE.running():
        model = capture.model
        return run_node(capture, capture.tree,
                        x.to(device=model.device, dtype=model.torch_dtype)).cpu()


def _torch_run(capture: Capture) -> Callable[[np.ndarray], object]:
    return lambda x: _whole(capture, torch.from_numpy(x))


def _composed(graphs: UnitGraphs) -> onnx.ModelProto | None:
    try:
        return graphs.compose(graphs.shapes.tree.children)
    except CannotCompose:
        return None


__all__ = ["Candidate", "asked", "fastest", "in_half", "native", "natives"]
