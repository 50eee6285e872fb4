"""How a unit's graph is quantized: a BatchNormalization's scale per channel (ONNX Runtime's
quantizer takes axis 1 for normalizations, out of range for BN's 1-d scale: it warned once per
BN and fell back to one scale for all channels)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from planner.precision import OPSET, _quantize

C = 64  # channels: the BN's scale is as large as a weight worth int8 (MIN_WEIGHT)


def _bn_unit() -> onnx.ModelProto:
    """A pre-activation unit as densenet's: a BatchNormalization with scales that span 1e3."""
    rng = np.random.default_rng(0)
    scale = np.geomspace(1e-2, 10, C).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in (
        (scale, "scale"), (rng.normal(size=C).astype(np.float32), "bias"),
        (rng.normal(size=C).astype(np.float32), "mean"),
        (rng.uniform(0.5, 2, C).astype(np.float32), "var"))]
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"])
    graph = helper.make_graph(
        [node], "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", C, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", C, 4, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def test_a_batch_norms_scale_is_quantized_per_channel_without_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    x = np.random.default_rng(1).normal(size=(16, C, 4, 4)).astype(np.float32)
    with caplog.at_level(logging.WARNING):
        quantized = _quantize(_bn_unit(), x, tmp_path)
    assert quantized is not None
    assert not [r for r in caplog.records if "out-of-range" in r.getMessage()]
    inits = {t.name: numpy_helper.to_array(t) for t in quantized.graph.initializer}
    (dq,) = [n for n in quantized.graph.node
             if n.op_type == "DequantizeLinear" and inits.get(n.input[0]) is not None
             and inits[n.input[0]].dtype == np.int8 and inits[n.input[0]].shape == (C,)]
    assert inits[dq.input[1]].shape == (C,)  # one scale a channel, not one for all
    assert {a.name: a.i for a in dq.attribute}.get("axis", 1) == 0
