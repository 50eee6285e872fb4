"""What ONNX Runtime's prepacking of Gemm/MatMul weights costs and gives on one whole model:
its sessions made on the shared weights (``core.runtimes.ort_weights``) with and without
``session.disable_prepacking``, the process's growth making each (VmRSS), then interleaved timed
calls at 1 and 4 samples (median and 10th-90th percentiles, ms a sample).

    .venv/bin/python bench/ort_prepack_probe.py --model alexnet [--rounds 30]

Needs torch once, to export the model (random weights) to ONNX in a temporary folder.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from core.runtimes.ort_memory import status_bytes  # noqa: E402
from core.runtimes.ort_sessions import session_options, start  # noqa: E402
from core.runtimes.ort_weights import SharedWeights  # noqa: E402

MiB = 2**20


def export(name: str, folder: str) -> onnx.ModelProto:
    import torch
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    path = f"{folder}/{name}.onnx"
    torch.onnx.export(model, torch.randn(1, 3, 224, 224), path, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "n"}, "y": {0: "n"}},
                      opset_version=17, dynamo=False)
    return onnx.load(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="alexnet")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = export(args.model, folder)
    start()
    sessions = {}
    for mode in ("prepack", "noprepack"):
        options = session_options(2)
        if mode == "noprepack":
            options.add_session_config_entry("session.disable_prepacking", "1")
        before = status_bytes("VmRSS")
        sessions[mode] = SharedWeights().session(model, options)
        print(f"{args.model} {mode}: the process grew {(status_bytes('VmRSS') - before) / MiB:.0f}"
              f" MiB making it")
    xs = {b: np.random.default_rng(b).random((b, 3, 224, 224), dtype=np.float32) for b in (1, 4)}
    times: dict[tuple[str, int], list[float]] = {(m, b): [] for m in sessions for b in xs}
    for (m, b) in times:
        sessions[m].run(None, {"x": xs[b]})
    for _ in range(args.rounds):
        keys = list(times)
        random.shuffle(keys)
        for m, b in keys:
            t = time.perf_counter()
            sessions[m].run(None, {"x": xs[b]})
            times[(m, b)].append((time.perf_counter() - t) / b * 1e3)
    for (m, b), v in times.items():
        v.sort()
        print(f"{args.model} {m} at {b}: median {statistics.median(v):.2f} ms a sample "
              f"(p10 {v[len(v) // 10]:.2f}, p90 {v[9 * len(v) // 10]:.2f})")


if __name__ == "__main__":
    main()
