"""Precision per unit: the units ONNX Runtime runs in int8, quantized from the user's
calibration samples, and the guard that keeps float32 the units that cost the answer most.

Why here, before the profile: an int8 unit is other kernels (ONNX Runtime's static QDQ graph,
per-channel int8 weights, uint8 activations), so it is measured as it will run, and the DP
prices it like any other unit; its weights take a quarter of the bytes, which the memory model
counts from the graphs. Each unit's graph is quantized alone, calibrated on the activations the
float32 model gives at its input on the user's samples (so a unit's scales are what serving
meets, whatever runs before it); a weightless ReLU becomes a quantize and a dequantize at
its output's scale, so that a join before it runs in int8 as in a model quantized whole
(``AROUND``). The guard then runs the model with every int8 unit on
held-out samples against float32: top-1 agreement and the largest difference, relative to the
output's scale. While the disagreement is above ``max_error``, the units whose own output moved
most go back to float32 (one, then twice as many, ...), and the guard runs again. What it
measured is kept in ``core.precision.Precision``, in the fingerprint, the table's profile and
the compiled model.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import torch
from onnx import TensorProto

from core.errors import UsageError
from core.precision import AUTO, FLOAT, FLOAT32, HALF, Precision, check_choice
from core.runner import run_node, run_unit
from core.runtimes.onnx_compose import OPSET, UnitGraphs
from core.runtimes.onnx_graphs import export_units
from core.runtimes.onnxrt import unavailable
from core.tree import Layer
from core.units import MODULE_GATE, Capture
from planner.calibration import Calibration, read_calibration
from planner.precision_half import asked, fastest
from planner.precision_speed import MIN_SPEEDUP, keeps_int8, measured_speedup

log = logging.getLogger("vbs.plan")

CHUNK = 8  # calibration samples per batch the calibrator reads
# a BatchNormalization's scale per channel along its only axis: the quantizer's default axis
# for normalizations is 1, out of range for BN's 1-d scale, so it warned once per BN and
# quantized the scale per tensor (densenet161's pre-activation BNs, 82 of them)
EXTRA = {"QDQOpTypePerChannelSupportToAxis": {"BatchNormalization": 0}}
MIN_WEIGHT = 64  # elements: a unit with no int8 weight this large gains nothing from QDQ...
# ... except a weightless ReLU between int8 units: ONNX Runtime's quantizer leaves it float32,
# so the tensors around it went back to float32 and, before it, a block's join too (resnet50's
# ReLU after each residual add: the add and the ReLU ran float32 with a dequantize and a
# quantize each side, 10% of the int8 model's time). Quantized (``_around``), ONNX Runtime
# fuses the join into QLinearAdd (docs/benchmarks.md, section 13). A max pool so quantized
# was not fused (it stays float32); other weightless ops were not measured
AROUND = frozenset({"Relu"})


@dataclass(frozen=True)
class _Unit:
    """A unit's int8 graph, its session, and how far its own output moved from float32's on
    the samples."""

    graph: onnx.ModelProto
    session: ort.InferenceSession
    error: float  # ||int8 - float32|| / ||float32|| on the calibration samples


def with_precision(capture: Capture, choice: str, calibration: Path | None,
                   max_error: float, cache: Path | None = None) -> Capture:
    """``capture`` with its units' graphs at ``choice`` (``core.precision.CHOICES``): float32 as
    it is; int8 (and auto, given samples) quantized from ``calibration`` and guarded; bfloat16
    or float16 (and auto, where the device has their kernels and one measured fastest here:
    ``planner.precision_half``) the model captured again at that dtype and guarded; auto
    without samples, or where nothing runs faster here (``planner.precision_speed``, its
    verdicts kept in ``cache``), float32, saying why."""
    check_choice(choice)
    if choice == FLOAT32:
        return capture
    if calibration is None:
        if choice != AUTO:
            raise UsageError(f"--precision {choice} needs --calibration DIR: samples of the "
                             "model's input (.npy or images) that its error is measured on "
                             "(and int8's scales fitted on)")
        return replace(capture, precision=replace(
            FLOAT, why="auto: no calibration samples (--calibration DIR), so float32"))
    samples = read_calibration(calibration, capture.model.spec.name, capture.input_shape)
    if choice in HALF:
        return asked(capture, choice, samples, max_error)
    int8 = _int8(capture, choice, samples, max_error, cache)
    if choice == AUTO and capture.model.spec.dtype == FLOAT32:  # the half precisions weighed
        return fastest(capture, int8.capture, int8.graphs, int8.mixed, samples, max_error,
                       cache)
    return int8.capture


@dataclass(frozen=True)
class _Int8:
    """The int8 choice: the capture it gives (int8 units, or float32 saying why), and the
    whole model's float32 and mixed graphs where it made them (for the half precisions'
    comparison)."""

    capture: Capture
    graphs: UnitGraphs | None = None
    mixed: UnitGraphs | None = None


def _int8(capture: Capture, choice: str, samples: Calibration, max_error: float,
          cache: Path | None) -> _Int8:
    why = unavailable(capture)
    if why and choice == AUTO:
        return _Int8(replace(capture, precision=replace(
            FLOAT, why=f"auto: int8 units run on ONNX Runtime, and {why}; so float32")))
    if why:
        raise UsageError(f"--precision {choice}: int8 units run on ONNX Runtime, and {why}")
    t0 = time.perf_counter()
    graphs = export_units(capture)
    units = _quantize_units(capture, graphs, samples)
    precision, kept = _guard(capture, graphs, units, samples, max_error)
    mixed = UnitGraphs(graphs.shapes, {**graphs.units, **{n: units[n].graph for n in kept}},
                       graphs.joins, graphs.failed)
    if kept:
        speedup = measured_speedup(capture, graphs, mixed, kept, samples.digest, samples.fit,
                                   cache)
        precision = replace(precision, speedup=speedup)
        if not keeps_int8(speedup):
            slower = (f"the whole model with its {len(kept)} int8 units ran {speedup:.2f}x "
                      f"float32's speed here ({MIN_SPEEDUP:g}x wanted)")
            if choice == AUTO:
                log.info("%s: %s; so float32", capture.model.spec.name, slower)
                return _Int8(replace(capture, precision=replace(
                    FLOAT, why=f"auto: {slower}; so float32", speedup=speedup)), graphs)
            precision = replace(precision, why=f"{precision.why}; below {MIN_SPEEDUP:g}x "
                                               "float32's speed: --precision auto would run "
                                               "float32")
    log.info("%s: %d of %d units int8 (top-1 agreement %.1f%% on %d held-out samples, largest "
             "difference %.3g of the output's scale) in %.1f s", capture.model.spec.name,
             len(kept), len(graphs.units), 100 * precision.agreement, precision.held_out,
             precision.error, time.perf_counter() - t0)
    return _Int8(replace(capture, graphs=mixed, precision=precision, held_out=samples.held_out),
                 graphs, mixed)


def _quantize_units(capture: Capture, graphs: UnitGraphs, samples: Calibration
                    ) -> dict[str, _Unit]:
    """Every unit that quantizes with an int8 weight (and every weightless ReLU), calibrated on
    its input in the float32 model over the fit samples."""
    out: dict[str, _Unit] = {}
    with tempfile.TemporaryDirectory(prefix="vbs-int8-") as work:
        def runner(unit: Layer, x: torch.Tensor, own: bool) -> torch.Tensor:
            y = run_unit(capture, unit, x)
            graph = graphs.units.get(unit.name)
            if graph is not None:
                found = _quantize(graph, x.contiguous().numpy(), Path(work))
                if found is not None:
                    session = _session(found)
                    out[unit.name] = _Unit(found, session, _relative(_run(session, x), y))
            return y

        x = torch.from_numpy(samples.fit).to(capture.model.torch_dtype)
        with torch.inference_mode(), MODULE_GATE.running():
            run_node(capture, capture.tree, x, runner=runner)
    return out


def _quantize(graph: onnx.ModelProto, inputs: np.ndarray, work: Path) -> onnx.ModelProto | None:
    """``graph`` with static QDQ int8 (per-channel weights), calibrated on ``inputs``; a
    weightless ReLU as its quantize/dequantize pair (``_around``); None where it holds no int8
    weight of ``MIN_WEIGHT`` elements otherwise, or the quantizer fails on it."""
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._chunks: Iterator[np.ndarray] = iter(np.array_split(
                inputs, max(1, len(inputs) // CHUNK)))

        def get_next(self) -> dict[str, np.ndarray] | None:
            chunk = next(self._chunks, None)
            return None if chunk is None else {"x": np.ascontiguousarray(chunk)}

    if not any(math.prod(t.dims) >= MIN_WEIGHT for t in graph.graph.initializer):
        return _around(graph, inputs)
    source, pre, out = work / "unit.onnx", work / "pre.onnx", work / "int8.onnx"
    onnx.save(graph, source)
    try:
        quant_pre_process(str(source), str(pre), skip_symbolic_shape=True)
    except Exception:  # noqa: BLE001 - its optional clean-up only: quantize the graph as it is
        pre = source
    try:
        quantize_static(str(pre), str(out), Reader(), quant_format=QuantFormat.QDQ,
                        per_channel=True, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, extra_options=EXTRA)
    except Exception as exc:  # noqa: BLE001 - the quantizer's failure: the unit stays float32
        log.info("a unit stays float32: its graph does not quantize (%s)", exc)
        return None
    quantized = onnx.load(str(out))
    opset = next((o.version for o in quantized.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset > OPSET or any(n.domain not in ("", "ai.onnx") for n in quantized.graph.node):
        return None  # ops a composed run (the default domain at OPSET) does not hold
    if not any(t.data_type == TensorProto.INT8 and math.prod(t.dims) >= MIN_WEIGHT
               for t in quantized.graph.initializer):
        return None
    del quantized.opset_import[:]  # the optimiser's declared domains, none of them used
    quantized.opset_import.append(onnx.helper.make_opsetid("", OPSET))
    return quantized


def _around(graph: onnx.ModelProto, inputs: np.ndarray) -> onnx.ModelProto | None:
    """A weightless ReLU unit as a quantize and a dequantize at its output's scale (uint8, zero
    point 0, from what its outputs on ``inputs`` span, as the quantizer's MinMax calibration
    computes it): uint8 at that scale holds no negative, so quantizing its input there is the
    ReLU, as ONNX Runtime's quantizer folds a ReLU into the op before it. A join before it then
    quantizes straight to what the next unit reads (one pair of quantize and dequantize between
    two units, which ONNX Runtime drops, and the join fused: QLinearAdd). None for any other
    op (``AROUND``)."""
    if not graph.graph.node or any(n.op_type not in AROUND or n.domain not in ("", "ai.onnx")
                                   for n in graph.graph.node):
        return None
    outputs = _session(graph).run(None, {"x": inputs})[0]
    quantized = onnx.ModelProto()
    quantized.CopyFrom(graph)
    nodes, consts = _qdq("x", "y_q", "y", outputs)
    del quantized.graph.node[:]
    quantized.graph.node.extend(nodes)
    quantized.graph.initializer.extend(consts)
    return quantized


def _qdq(source: str, q: str, dq: str, values: np.ndarray
         ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """QuantizeLinear ``source`` -> ``q`` and DequantizeLinear ``q`` -> ``dq`` at uint8, scale
    and zero point from the range of ``values`` as ONNX Runtime's quantizer computes them (so a
    pair of them between two units is the same, and it drops it), and their initializers."""
    from onnxruntime.quantization.quant_utils import compute_scale_zp, get_qmin_qmax_for_qType

    low, high = get_qmin_qmax_for_qType(TensorProto.UINT8)
    zero, scale = compute_scale_zp(np.array(values.min(), np.float32),
                                   np.array(values.max(), np.float32), low, high)
    names = (f"{source}_scale", f"{source}_zero_point")
    return ([onnx.helper.make_node("QuantizeLinear", [source, *names], [q], name=f"{q}_node"),
             onnx.helper.make_node("DequantizeLinear", [q, *names], [dq], name=f"{dq}_node")],
            [onnx.numpy_helper.from_array(np.array(scale, dtype=np.float32), names[0]),
             onnx.numpy_helper.from_array(np.array(zero, dtype=np.uint8), names[1])])


def _session(graph: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    return ort.InferenceSession(graph.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(session.run(None, {"x": x.contiguous().numpy()})[0])


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    norm = float(want.float().norm())
    return float((got.float() - want.float()).norm()) / max(norm, 1e-12)


def _guard(capture: Capture, graphs: UnitGraphs, units: dict[str, _Unit], samples: Calibration,
           max_error: float) -> tuple[Precision, tuple[str, ...]]:
    """The int8 units kept and what the model measured with them on the held-out samples:
    while top-1 disagreement with float32 exceeds ``max_error``, the units whose output moved
    most go back to float32, one, then twice as many, until it holds (or none is left)."""
    x = torch.from_numpy(samples.held_out).to(capture.model.torch_dtype)
    with torch.inference_mode(), MODULE_GATE.running():
        want = run_node(capture, capture.tree, x)

        def measure(kept: tuple[str, ...]) -> tuple[float, float]:
            def runner(unit: Layer, y: torch.Tensor, own: bool) -> torch.Tensor:
                if unit.name in kept:
                    return _run(units[unit.name].session, y)
                return run_unit(capture, unit, y)

            got = run_node(capture, capture.tree, x, runner=runner)
            agree = float((got.reshape(len(x), -1).argmax(1)
                           == want.reshape(len(x), -1).argmax(1)).float().mean())
            scale = max(1.0, float(want.abs().max()))
            return agree, float((got - want).abs().max()) / scale

        order = sorted(units, key=lambda n: units[n].error, reverse=True)
        dropped = 0
        kept = tuple(order)
        agree, error = measure(kept)
        while kept and 1.0 - agree > max_error:
            dropped = min(len(order), max(1, 2 * dropped))
            kept = tuple(order[dropped:])
            agree, error = measure(kept) if kept else (1.0, 0.0)
    if not units:
        why = "no unit has an int8 graph (no weight quantized): float32"
    elif kept:
        why = (f"int8 where it kept top-1 within {max_error:g} of float32"
               + (f"; {dropped} units that moved the answer most stay float32" if dropped else ""))
    else:
        why = f"every int8 unit set moved top-1 by more than {max_error:g}: float32"
    layers = [n for n in graphs.units if n in kept]
    return Precision(tuple(layers), samples.digest, agree, error, len(x), max_error, why), \
        tuple(layers)


__all__ = ["with_precision"]
