"""What reading the free memory costs a worker: right after a model's call, and warm.

    python bench/probe.py [--model mnasnet0_5] [--rounds 20] [--reads 50]

A worker reads the memory free (``workers.memory.cpu_free``: the cgroup limits on its path,
the working set where one is set, the host's MemAvailable) before each batch's plan, right
after the model's previous work, when the caches the reading needs are cold. This times that
reading right after a one-sample call of the model in ONNX Runtime (2 threads) and in a warm
loop, ``--rounds`` rounds of ``--reads`` each, and prints the medians (range over rounds).
Run it in a checkout of an earlier commit (``PYTHONPATH=<worktree>``) to compare.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
import warnings

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mnasnet0_5")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--reads", type=int, default=50)
    args = ap.parse_args()
    import onnxruntime as ort
    import torch
    import torchvision

    from workers.memory import cpu_free

    model = torchvision.models.get_model(args.model, weights=None).eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(1, 3, 224, 224),), buffer, dynamo=False,
                          input_names=["x"], output_names=["y"], opset_version=17)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(buffer.getvalue(), options)
    x = {"x": np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)}
    after: list[float] = []
    warm: list[float] = []
    for _ in range(args.rounds):
        cold_times, warm_times = [], []
        for _ in range(args.reads):
            session.run(None, x)
            t0 = time.perf_counter()
            cpu_free()
            cold_times.append(time.perf_counter() - t0)
        for _ in range(args.reads):
            t0 = time.perf_counter()
            cpu_free()
            warm_times.append(time.perf_counter() - t0)
        after.append(statistics.median(cold_times))
        warm.append(statistics.median(warm_times))
    for label, times in (("right after a call", after), ("warm", warm)):
        print(f"cpu_free() {label}: {statistics.median(times) * 1e6:.0f} us "
              f"({min(times) * 1e6:.0f}-{max(times) * 1e6:.0f} over {args.rounds} rounds)")


if __name__ == "__main__":
    main()
