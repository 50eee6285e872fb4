"""Sessions made through ``core.runtimes.ort_weights.SharedWeights``: the same outputs as
sessions with their own weights, and one copy of the weights between them.

Memory is read as the process's resident set (VmRSS after ``malloc_trim``), with bounds
several times away from either outcome: a session that copied resnet18's weights would grow
the process by at least their 44.6 MiB (a plain session grows it by about twice that), and
sessions that share them grow it by a few MiB each (their plans, kernels, a packed copy of
the classifier's 2 MB Gemm weights).
"""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest
import torch

from core.loaded import ModelSpec
from planner.graph.capture import capture
from planner.models import load_model

ort = pytest.importorskip("onnxruntime")
from core.runtimes.onnx_graphs import export_units  # noqa: E402
from core.runtimes.ort_weights import SharedWeights  # noqa: E402

CPU = ["CPUExecutionProvider"]
SESSIONS = 8


@pytest.fixture(scope="module")
def runs() -> dict[str, object]:
    """resnet18 at 64 px: a prefix, a suffix and the whole of its root's children."""
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("resnet18", input_shape=(3, 64, 64))))
    graphs = export_units(cap)
    children = cap.tree.children
    return {"prefix": graphs.compose(children[:5]), "suffix": graphs.compose(children[9:]),
            "whole": graphs.compose(children)}


def session_options(threads: int) -> "ort.SessionOptions":
    """What vbs-serve's sessions are made with, as far as weights go: the whole optimiser
    (NCHWc layouts, the copies per session that SharedWeights avoids), 2 threads."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


def _environment() -> None:
    ort.set_default_logger_severity(3)


def _rss() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _weights(model) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def _input(model, batch: int) -> np.ndarray:
    dims = model.graph.input[0].type.tensor_type.shape.dim[1:]
    return np.random.default_rng(batch).standard_normal(
        (batch, *(d.dim_value for d in dims))).astype(np.float32)


def test_shared_sessions_compute_what_sessions_of_their_own_do(runs) -> None:
    _environment()
    shared = SharedWeights()
    for name, model in runs.items():
        plain = ort.InferenceSession(model.SerializeToString(), session_options(2),
                                     providers=CPU)
        mine = shared.session(model, session_options(2), CPU)
        for batch in (1, 3, 8):
            x = _input(model, batch)
            want = plain.run(None, {"x": x})[0]
            got = mine.run(None, {"x": x})[0]
            assert np.abs(got - want).max() <= 1e-5, (name, batch)
    # the three runs hold the model's weights once: every run's are among the whole's (the
    # classifier's, which each session packs and owns, in the file they are read from)
    assert 0 < shared.packed_bytes < 0.1 * _weights(runs["whole"])
    assert shared.held_bytes + shared.packed_bytes <= 1.03 * _weights(runs["whole"])
    assert shared.held_bytes + shared.packed_bytes >= 0.98 * _weights(runs["whole"])


def test_sessions_of_one_run_hold_its_weights_once(runs) -> None:
    _environment()
    model = runs["whole"]
    weights = _weights(model)  # 44.6 MiB
    x = _input(model, 8)
    shared = SharedWeights()
    kept = [shared.session(model, session_options(2), CPU)]
    kept[0].run(None, {"x": x})
    before = _rss()
    for _ in range(SESSIONS):
        kept.append(shared.session(model, session_options(2), CPU))
        kept[-1].run(None, {"x": x})
    grown = _rss() - before
    # copies would be SESSIONS x weights (8x); sharing leaves a few MiB a session
    assert grown < 2 * weights, f"{SESSIONS} sessions grew the process by {grown} bytes"
    assert shared.held_bytes <= 1.02 * weights
    # the control: the same reading sees a session's own copy of the weights
    before = _rss()
    plain = ort.InferenceSession(model.SerializeToString(), session_options(2), providers=CPU)
    plain.run(None, {"x": x})
    assert _rss() - before > 0.8 * weights


def test_a_weight_the_session_packs_is_held_once_not_beside_its_packed_copy() -> None:
    """A Gemm's weights (a classifier's: alexnet's are 94% of its bytes) are packed by ONNX
    Runtime as its session is made; shared, the original stayed beside the packed copy (the
    session grew the process by twice its weights). Given to the session as its own, it is
    freed once packed."""
    _environment()
    import onnx
    from onnx import helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4096, 2048)).astype(np.float32)  # 32 MiB
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)], "fc",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 2048])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4096])],
        [onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((2, 2048)).astype(np.float32)
    shared = SharedWeights()
    before = _rss()
    session = shared.session(model, session_options(2), CPU)
    grown = _rss() - before
    assert np.allclose(session.run(None, {"x": x})[0], x @ w.T, rtol=1e-4, atol=1e-3)
    assert shared.held_bytes == 0 and shared.packed_bytes >= w.nbytes
    assert grown < 1.5 * w.nbytes, f"the session grew the process by {grown / w.nbytes:.2f}x"


def test_an_int8_weight_the_session_packs_is_held_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A QDQ convolution (static int8, per-channel weights: what ``planner.precision`` makes)
    becomes a QLinearConv whose int8 weight ONNX Runtime packs as the session is made: given
    as the session's own it is freed once packed, not held shared beside its packed copy
    (resnet50 in int8 kept 57 MiB, 33 once so, weights 25). Its answer is the same session's
    on a plain file."""
    _environment()
    import onnx
    from onnx import helper
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)

    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 512, 3, 3)).astype(np.float32)  # int8: 2.25 MiB
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "conv",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 512, 8, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 512, 8, 8])],
        [onnx.numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              tmp_path / "f.onnx")
    x = rng.standard_normal((2, 512, 8, 8)).astype(np.float32)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.left = [{"x": x}]

        def get_next(self):  # type: ignore[no-untyped-def]
            return self.left.pop() if self.left else None

    quantize_static(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), Reader(),
                    quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    model = onnx.load(str(tmp_path / "q.onnx"))
    shared = SharedWeights()
    session = shared.session(model, session_options(2), CPU)
    plain = ort.InferenceSession(str(tmp_path / "q.onnx"), session_options(2), providers=CPU)
    assert np.allclose(session.run(None, {"x": x})[0], plain.run(None, {"x": x})[0])
    assert shared.held_bytes < 0.1 * w.size and shared.packed_bytes >= w.size  # int8: a byte each
