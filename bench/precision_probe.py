"""What precision is worth on this CPU (issue 59's ground work): one model, whole, at float32
and int8 on ONNX Runtime (static QDQ, per-channel weights, calibrated on the model's own
random examples), and at float32 and bfloat16 on torch, timed side by side in interleaved
rounds at each batch size, with the int8 and bfloat16 outputs' top-1 agreement with
float32's on held-out random inputs (random weights: agreement only, not accuracy).

    .venv/bin/python bench/precision_probe.py --model resnet50 --batches 1,8 [--rounds 7]

Why a probe: it says whether a per-unit precision choice can pay here before the planner
grows one; figures go in the issue's note and docs/benchmarks.md when that lands.
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                      quantize_static)
from onnxruntime.quantization.shape_inference import quant_pre_process

from core.spec import ModelSpec
from planner.models import load_model


class _Reader(CalibrationDataReader):
    def __init__(self, samples: list[np.ndarray]) -> None:
        self._it = iter([{"x": s} for s in samples])

    def get_next(self):  # type: ignore[no-untyped-def]
        return next(self._it, None)


def _session(path: Path, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calibration", type=int, default=16, help="calibration samples")
    p.add_argument("--held-out", type=int, default=64, help="samples for top-1 agreement")
    args = p.parse_args()
    threads = torch.get_num_threads()
    model = load_model(ModelSpec(name=args.model))
    module = model.module.eval()
    shape = tuple(model.example(1, seed=0).shape[1:])
    work = Path(tempfile.mkdtemp(prefix="vbs-precision-"))
    fp32, pre, int8 = work / "fp32.onnx", work / "pre.onnx", work / "int8.onnx"
    t0 = time.perf_counter()
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.zeros(1, *shape),), buffer, dynamo=False, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}},
                      opset_version=17)
    fp32.write_bytes(buffer.getvalue())
    quant_pre_process(str(fp32), str(pre))
    calib = [model.example(1, seed=100 + i).numpy() for i in range(args.calibration)]
    quantize_static(str(pre), str(int8), _Reader(calib), quant_format=QuantFormat.QDQ,
                    per_channel=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8)
    made = time.perf_counter() - t0
    s32, s8 = _session(fp32, threads), _session(int8, threads)
    bf16 = __import__("copy").deepcopy(module).to(torch.bfloat16)

    held = torch.cat([model.example(1, seed=1000 + i) for i in range(args.held_out)])
    with torch.inference_mode():
        want = module(held).argmax(1)
        agree_bf16 = float((bf16(held.to(torch.bfloat16)).float().argmax(1) == want).float().mean())
    got8 = np.concatenate([s8.run(None, {"x": held[i:i + 8].numpy()})[0]
                           for i in range(0, len(held), 8)])
    agree8 = float((torch.from_numpy(got8).argmax(1) == want).float().mean())

    jobs = {}
    for b in (int(v) for v in args.batches.split(",")):
        x = model.example(b, seed=7)
        xn, xb = x.numpy(), x.to(torch.bfloat16)
        jobs[f"ort fp32 b={b}"] = (b, lambda s=s32, xn=xn: s.run(None, {"x": xn}))
        jobs[f"ort int8 b={b}"] = (b, lambda s=s8, xn=xn: s.run(None, {"x": xn}))
        jobs[f"torch fp32 b={b}"] = (b, lambda x=x: module(x))
        jobs[f"torch bf16 b={b}"] = (b, lambda xb=xb: bf16(xb))
    seconds: dict[str, list[float]] = {k: [] for k in jobs}
    order = list(jobs)
    with torch.inference_mode():
        for k in order:
            jobs[k][1]()
        for i in range(args.rounds):
            random.Random(i).shuffle(order)
            for k in order:
                t = time.perf_counter()
                jobs[k][1]()
                seconds[k].append(time.perf_counter() - t)
    print(f"{args.model} {shape}, {threads} threads, {args.rounds} interleaved rounds; "
          f"int8 made in {made:.1f} s from {args.calibration} calibration samples")
    print(f"top-1 agreement with float32 on {args.held_out} held-out random inputs: "
          f"int8 {100 * agree8:.1f}%, bfloat16 {100 * agree_bf16:.1f}%")
    print(f"{'what':<18} {'ms/sample':>10} {'spread':>7} {'vs ort fp32':>12}")
    for k in jobs:
        b = jobs[k][0]
        med = statistics.median(seconds[k]) / b
        base = statistics.median(seconds[k.replace(k.split(' b=')[0], 'ort fp32')]) / b
        spread = (max(seconds[k]) - min(seconds[k])) / statistics.median(seconds[k])
        print(f"{k:<18} {1e3 * med:>10.2f} {100 * spread:>6.0f}% {base / med:>11.2f}x")
    print(f"weights: fp32 {fp32.stat().st_size / 2**20:.1f} MiB, int8 "
          f"{int8.stat().st_size / 2**20:.1f} MiB (files)")


if __name__ == "__main__":
    main()
