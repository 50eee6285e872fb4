"""The model's time inside `vbs serve` against the whole model alone in ONNX Runtime, side by side.

    python bench/kernels.py [--model mobilenet_v2,resnet50,mnasnet0_5,mobilenet_v3_large]
                            [--samples 1,8] [--requests 20] [--rounds 3] [--runtime auto]
                            [--batch-max 8] [--threads 2] [--ort-sleep]
                            [--lean [--store STORE]]

For each model, `vbs serve` (its own process, ``--runtime``, ample memory, the tables of
``vbs plan``) gets requests of n samples one after another from one client; each answer's
``timing.infer_s`` is the plan's run on the batch, the model alone. Beside it, in this
process, the same torchvision model (random weights) exported whole to ONNX (batch axis
dynamic) runs in ONNX Runtime (CPU, ``--threads`` intra-op threads) with its defaults
(threads spin), in a loop of calls back to back and paced as the served requests came (each
call after a pause as long as the median time a served request spent outside the model, as
its client saw it: the cores idle between calls, as they are in a server), with threads that
sleep between operators (what ``--ort-sleep``, i.e. `VBS_ORT_SPIN=0`, serves with), and
eager ``model(x)`` in torch for reference. Blocks of ``--requests`` calls alternate, round
after round, so drift hits all alike. Prints per model and n: milliseconds per sample (median
of each round's median, and the spread over rounds) and vbs-serve's ratio to ONNX Runtime's
defaults, back to back and paced. ``--lean`` serves the worker without torch (`VBS_LEAN=on`,
runtime onnxruntime) from ``--store``, where `vbs plan --runtime onnxruntime` put the tables
and the compiled model (without ``--store``, this bench runs that `vbs plan` first, into a
store of its own).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import numpy as np

from served import ROOT, npy, vbs_serve

MODELS = "mobilenet_v2,resnet50,mnasnet0_5,mobilenet_v3_large"
COLUMNS = ("vbs-serve infer_s", "onnxruntime", "onnxruntime, calls paced as served",
           "onnxruntime, sleeping", "torch eager")


def _onnx_sessions(model: object, shape: tuple[int, ...], threads: int) -> list[object]:
    """The whole model in ONNX Runtime: with its defaults (threads spin), and with threads
    that sleep between operators."""
    import onnxruntime as ort
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, *shape),), buffer, dynamo=False,
                          input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}}, opset_version=17)
    sessions = []
    for spin in ("1", "0"):  # "1" is ONNX Runtime's default
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", spin)
        sessions.append(ort.InferenceSession(buffer.getvalue(), options,
                                             providers=["CPUExecutionProvider"]))
    return sessions


def _timed(call: object, n: int, times: int, pause: float = 0.0) -> list[float]:
    out = []
    for _ in range(times):
        if pause:
            time.sleep(pause)
        t0 = time.perf_counter()
        call()  # type: ignore[operator]
        out.append((time.perf_counter() - t0) / n)
    return out


def bench_model(name: str, args: argparse.Namespace) -> dict[tuple[str, int], list[float]]:
    """Each column's per-round medians (seconds per sample) by (column, samples)."""
    import torch
    import torchvision

    from core.loaded import ModelSpec

    from planner.models import load_model

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).eval()
    shape = tuple(load_model(ModelSpec(name)).input_shape)
    spinning, sleeping = _onnx_sessions(model, shape, args.threads)
    sizes = [int(n) for n in args.samples.split(",")]
    runtime = "onnxruntime" if args.lean else args.runtime
    own = f"kernels-store-{runtime}" + ("-lean" if args.lean else "")
    store = Path(args.store) if args.store else Path(args.cache_dir) / own
    serve_args = ["--model", name, "--input-shape", ",".join(map(str, shape)), "--store",
                  str(store), "--batch-max", str(args.batch_max), "--runtime", runtime,
                  "--log-level", "warning"]
    env = {"VBS_CACHE_DIR": args.cache_dir, "VBS_THREADS": str(args.threads),
           "VBS_ORT_SPIN": "0" if args.ort_sleep else "1"}
    if args.lean:
        env["VBS_LEAN"] = "on"
        if not args.store:  # the planner compiles (with torch), the worker only runs
            subprocess.run([sys.executable, "-m", "service.commands", "plan", "--model",
                            f"{name}@{','.join(map(str, shape))}",
                            "--batch-max", str(args.batch_max), "--runtime", runtime,
                            "--store", str(store)], check=True, cwd=ROOT,
                           env={**os.environ, **env, "VBS_LEAN": "off",
                                "PYTHONPATH": str(ROOT)})
    results: dict[tuple[str, int], list[float]] = {}
    with vbs_serve(serve_args, env={**os.environ, **env}) as (_server, url), \
            httpx.Client(base_url=url, timeout=300) as client, torch.inference_mode():
        rng = np.random.default_rng(0)
        inputs = {n: rng.standard_normal((n, *shape), dtype=np.float32) for n in sizes}
        bodies = {n: npy(x) for n, x in inputs.items()}

        pauses: list[float] = []  # each request's time outside the model, as its client saw it

        def served(n: int) -> float:
            t0 = time.perf_counter()
            answer = client.post(f"/infer?model={name}", content=bodies[n],
                                 headers={"content-type": "application/x-npy"})
            answer.raise_for_status()
            infer_s = answer.json()["timing"]["infer_s"]
            pauses.append(max(0.0, time.perf_counter() - t0 - infer_s))
            return infer_s / n

        for n in sizes:  # warm-up: the plan's sessions, the model's caches
            for _ in range(3):
                served(n)
                spinning.run(None, {"x": inputs[n]})
                sleeping.run(None, {"x": inputs[n]})
                model(torch.from_numpy(inputs[n]))
        for k in range(1, args.rounds + 1):
            for n in sizes:
                x = inputs[n]
                pauses.clear()
                columns = {
                    "vbs-serve infer_s": [served(n) for _ in range(args.requests)],
                    "onnxruntime": _timed(lambda: spinning.run(None, {"x": x}), n, args.requests),
                    "onnxruntime, calls paced as served": _timed(
                        lambda: spinning.run(None, {"x": x}), n, args.requests,
                        pause=statistics.median(pauses)),
                    "onnxruntime, sleeping": _timed(lambda: sleeping.run(None, {"x": x}), n,
                                                    args.requests),
                    "torch eager": _timed(lambda: model(torch.from_numpy(x)), n,
                                          max(3, args.requests // 4)),
                }
                for column, ts in columns.items():
                    results.setdefault((column, n), []).append(statistics.median(ts))
                print(f"{name}, round {k}, n={n}: " + ", ".join(
                    f"{c} {1e3 * statistics.median(ts):.2f}" for c, ts in columns.items())
                      + " ms/sample", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default=MODELS, help="models, comma-separated")
    ap.add_argument("--samples", default="1,8", help="samples per request, comma-separated")
    ap.add_argument("--requests", type=int, default=20, help="calls per block")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime", default="auto", help="vbs serve --runtime")
    ap.add_argument("--batch-max", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="torch and ONNX Runtime threads")
    ap.add_argument("--ort-sleep", action="store_true",
                    help="vbs serve with VBS_ORT_SPIN=0 (ONNX Runtime's threads sleep between "
                         "operators)")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--lean", action="store_true",
                    help="serve the worker without torch (VBS_LEAN=on, runtime onnxruntime)")
    ap.add_argument("--store", help="with --lean: a store `vbs plan --runtime onnxruntime` "
                                    "filled (default: plan into one of this bench's own)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    sizes = [int(n) for n in args.samples.split(",")]
    rows = []
    for name in args.model.split(","):
        results = bench_model(name, args)
        for n in sizes:
            cells = []
            for column in COLUMNS:
                ts = results[(column, n)]
                cells.append(f"{1e3 * statistics.median(ts):.2f} "
                             f"({1e3 * min(ts):.2f}-{1e3 * max(ts):.2f})")
            vbs = statistics.median(results[("vbs-serve infer_s", n)])
            ratios = (vbs / statistics.median(results[(column, n)])
                      for column in ("onnxruntime", "onnxruntime, calls paced as served"))
            rows.append(f"| {name} | {n} | " + " | ".join(cells) + " | "
                        + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    print()
    print(f"vbs serve --runtime {'onnxruntime' if args.lean else args.runtime}"
          f"{', without torch (VBS_LEAN=on)' if args.lean else ''}, "
          f"VBS_ORT_SPIN={0 if args.ort_sleep else 1}, "
          f"{args.threads} threads, {args.rounds} rounds of {args.requests} calls; ms/sample, "
          "median of the rounds' medians (range)")
    print("| model | samples per request | vbs-serve infer_s | ONNX Runtime, whole model, "
          "its defaults | the same, calls paced as served | the same, threads sleeping | "
          "torch eager | vbs-serve / ONNX Runtime | vbs-serve / ONNX Runtime paced |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
