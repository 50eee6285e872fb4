"""The model's time inside `vbs serve` against the whole model in ONNX Runtime, side by side.

    python bench/kernels.py [--model mobilenet_v2] [--samples 1,8] [--requests 20] [--rounds 3]
                            [--runtime auto] [--batch-max 16] [--threads 2] [--ort-spin]

`vbs serve` (its own process, ``--runtime``, ample memory, the tables of ``vbs plan``) gets
requests of n samples one after another from one client; each answer's ``timing.infer_s``
is the plan's run on the batch, the model alone. Beside it, in this process, the same
torchvision model (random weights) exported whole to ONNX (batch axis dynamic) runs in ONNX
Runtime (CPU, ``--threads`` intra-op threads) twice: with its defaults (threads spin) and
with vbs-serve's default (threads sleep when idle; ``--ort-spin`` serves with spinning
threads instead), and eager ``model(x)`` in torch for reference. Blocks of ``--requests``
calls alternate, round after round, so drift hits all alike. Prints per n: milliseconds per
sample (median of each round's median, and the spread over rounds) and vbs-serve's ratios.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
import warnings
from pathlib import Path

import httpx
import numpy as np

from served import vbs_serve


def _npy(x: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, x)
    return buffer.getvalue()


def _onnx_session(model: object, shape: tuple[int, ...], threads: int) -> object:
    import onnxruntime as ort
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, *shape),), buffer, dynamo=False,
                          input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}}, opset_version=17)
    sessions = []
    for spin in ("1", "0"):  # ONNX Runtime's default, then vbs-serve's (threads sleep when idle)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", spin)
        sessions.append(ort.InferenceSession(buffer.getvalue(), options,
                                             providers=["CPUExecutionProvider"]))
    return sessions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--samples", default="1,8", help="samples per request, comma-separated")
    ap.add_argument("--requests", type=int, default=20, help="calls per block")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime", default="auto", help="vbs serve --runtime")
    ap.add_argument("--batch-max", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch and ONNX Runtime threads")
    ap.add_argument("--ort-spin", action="store_true",
                    help="vbs serve with VBS_ORT_SPIN=1 (ONNX Runtime's threads spin)")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    args = ap.parse_args()

    import torch
    import torchvision

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None).eval()
    from planner.models import ModelSpec, load_model

    shape = tuple(load_model(ModelSpec(args.model)).input_shape)
    session, sleeping = _onnx_session(model, shape, args.threads)
    sizes = [int(n) for n in args.samples.split(",")]
    store = Path(args.cache_dir) / f"kernels-store-{args.runtime}"
    serve_args = ["--model", args.model, "--store", str(store), "--batch-max",
                  str(args.batch_max), "--runtime", args.runtime, "--log-level", "warning"]
    env = {"VBS_CACHE_DIR": args.cache_dir, "VBS_THREADS": str(args.threads),
           "VBS_ORT_SPIN": "1" if args.ort_spin else "0"}
    results: dict[tuple[str, int], list[float]] = {}
    with vbs_serve(serve_args, env={**os.environ, **env}) as (_server, url), \
            httpx.Client(base_url=url, timeout=300) as client, torch.inference_mode():
        rng = np.random.default_rng(0)
        inputs = {n: rng.standard_normal((n, *shape), dtype=np.float32) for n in sizes}
        bodies = {n: _npy(x) for n, x in inputs.items()}
        for n in sizes:  # warm-up: the plan's sessions, the model's caches
            for _ in range(3):
                client.post(f"/infer?model={args.model}", content=bodies[n],
                            headers={"content-type": "application/x-npy"}).raise_for_status()
                session.run(None, {"x": inputs[n]})
                sleeping.run(None, {"x": inputs[n]})
                model(torch.from_numpy(inputs[n]))
        for k in range(1, args.rounds + 1):
            for n in sizes:
                served = []
                for _ in range(args.requests):
                    answer = client.post(f"/infer?model={args.model}", content=bodies[n],
                                         headers={"content-type": "application/x-npy"})
                    answer.raise_for_status()
                    served.append(answer.json()["timing"]["infer_s"] / n)
                ort_times, ort_sleeping, eager = [], [], []
                for _ in range(args.requests):
                    t0 = time.perf_counter()
                    session.run(None, {"x": inputs[n]})
                    ort_times.append((time.perf_counter() - t0) / n)
                for _ in range(args.requests):
                    t0 = time.perf_counter()
                    sleeping.run(None, {"x": inputs[n]})
                    ort_sleeping.append((time.perf_counter() - t0) / n)
                for _ in range(max(3, args.requests // 4)):
                    t0 = time.perf_counter()
                    model(torch.from_numpy(inputs[n]))
                    eager.append((time.perf_counter() - t0) / n)
                for name, ts in (("vbs-serve infer_s", served), ("onnxruntime", ort_times),
                                 ("onnxruntime, sleeping", ort_sleeping), ("torch eager", eager)):
                    results.setdefault((name, n), []).append(statistics.median(ts))
                print(f"round {k}, n={n}: vbs {1e3 * statistics.median(served):.2f}, ort "
                      f"{1e3 * statistics.median(ort_times):.2f}, ort sleeping "
                      f"{1e3 * statistics.median(ort_sleeping):.2f}, eager "
                      f"{1e3 * statistics.median(eager):.2f} ms/sample", flush=True)
    print()
    print(f"{args.model}, vbs serve --runtime {args.runtime}, VBS_ORT_SPIN="
          f"{env['VBS_ORT_SPIN']}, {args.threads} threads, {args.rounds} rounds of "
          f"{args.requests} calls")
    print("| samples per request | vbs-serve infer_s (ms/sample) | ONNX Runtime, whole model "
          "(its defaults: threads spin) | the same, threads sleep (vbs-serve's default) | "
          "torch eager | vbs-serve / ONNX Runtime | vbs-serve / ONNX Runtime, threads alike |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        cells = []
        for name in ("vbs-serve infer_s", "onnxruntime", "onnxruntime, sleeping", "torch eager"):
            ts = results[(name, n)]
            cells.append(f"{1e3 * statistics.median(ts):.2f} ({1e3 * min(ts):.2f}-{1e3 * max(ts):.2f})")
        vbs = statistics.median(results[("vbs-serve infer_s", n)])
        alike = "onnxruntime" if args.ort_spin else "onnxruntime, sleeping"
        print(f"| {n} | " + " | ".join(cells) + f" | "
              f"{vbs / statistics.median(results[('onnxruntime', n)]):.2f} | "
              f"{vbs / statistics.median(results[(alike, n)]):.2f} |")


if __name__ == "__main__":
    main()
