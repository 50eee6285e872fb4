"""The model every peer serves, eager or through ONNX Runtime (``bench/peers.py``).

Kept apart from the servers so that each server's worker (a Ray actor, a LitServe worker, a
Triton Python backend stub) builds the same model the same way: the torchvision model with
random weights from the same seed, and the same number of intra-op threads whatever runs it.
Nothing here imports torch or onnxruntime at module level: Triton's ONNX Runtime stub never
loads torch, so it pays for neither its import nor its threads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

RUNTIMES = ("torch", "ort")
INPUT, OUTPUT = "x", "y"  # the tensor names of the ONNX export and of Triton's model config


def torch_model(name: str, threads: int) -> Any:
    """The torchvision model, random weights (seed 0), eval mode; ``threads`` 0: torch's default."""
    import torch
    import torchvision

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None).eval()


def export_onnx(name: str, shape: tuple[int, ...], path: Path) -> Path:
    """The same model (same seed, same weights) as ONNX with a dynamic batch dimension.

    The TorchScript exporter (``dynamo=False``) at opset 17: what ONNX Runtime's CPU kernels
    cover for every torchvision classifier, without the dynamo exporter's extra dependencies.
    """
    import torch

    model = torch_model(name, 0)
    x = torch.zeros((1, *shape), dtype=torch.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        torch.onnx.export(model, (x,), str(path), dynamo=False, input_names=[INPUT],
                          output_names=[OUTPUT], dynamic_axes={INPUT: {0: "N"}, OUTPUT: {0: "N"}},
                          opset_version=17)
    return path


def ort_session(path: str | Path, threads: int, spin: bool = False) -> Any:
    """An ONNX Runtime CPU session with ``threads`` intra-op threads, run sequentially (one
    operator at a time, as torch runs them), so it uses the cores torch would and no more.

    ``spin``: whether its threads spin between operators and between runs (ONNX Runtime's
    default). Spinning threads keep the cores from the server's own processes (HTTP, the
    batcher) that share them, which costs a server on few cores more than it saves."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return ort.InferenceSession(str(path), sess_options=options,
                                providers=["CPUExecutionProvider"])


def runner(name: str, runtime: str, threads: int, onnx: str | None,
           spin: bool = False) -> Callable[[Any], Any]:
    """A function from a float32 batch (numpy) to the model's outputs (numpy), for a server
    that batches numpy arrays itself (LitServe, Triton's Python backend); ``onnx`` and
    ``spin`` are for the ort runtime (see ``ort_session``)."""
    if runtime == "ort":
        if not onnx:
            raise ValueError("the ort runtime needs the path of the ONNX export")
        session = ort_session(onnx, threads, spin)
        return lambda x: session.run([OUTPUT], {INPUT: x})[0]
    if runtime != "torch":
        raise ValueError(f"runtime {runtime!r}: use one of {', '.join(RUNTIMES)}")
    import torch

    model = torch_model(name, threads)

    def run(x: Any) -> Any:
        with torch.inference_mode():
            return model(torch.from_numpy(x)).numpy()

    return run
