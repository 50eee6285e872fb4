"""The plan's own session of the whole model against the model exported whole, same threads.

    python bench/composed.py [--model mobilenet_v3_large] [--samples 1,6,8] [--calls 40]
                             [--spin-after] [--pieces 6,2]

The session a plan of one call runs (``OrtUnits``: the units' graphs composed, vbs-serve's
session options: threads spin within a call and stop when it returns) and the torchvision
model exported whole to ONNX, in ONNX Runtime with the same intra-op threads and the same
stop (``--spin-after``: the export with ONNX Runtime's default instead, its threads spinning
on after each call, into whatever runs next), called in shuffled order ``--calls`` times per
request size, in one process; with ``--pieces``, for the request size they add up to, the plan's
session called once per piece too (a plan of several calls, such as the table's 6 + 2 for 8
samples). Prints milliseconds per sample (p50, p25). The model's table
comes from ``--store`` (planned there if absent), as `vbs serve` reads it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _exported(name: str, shape: tuple[int, ...], threads: int, spin_after: bool) -> Any:
    """The model as the peers export it (``peers_models.export_onnx``) in an ONNX Runtime
    session with ``threads`` intra-op threads, stopped after each call unless ``spin_after``."""
    import onnxruntime as ort

    from core.runtimes.onnxrt import STOP
    from peers_models import export_onnx

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if not spin_after:
        options.add_session_config_entry(STOP, "1")
    with tempfile.TemporaryDirectory(prefix="vbs-composed-") as directory:
        path = export_onnx(name, shape, Path(directory) / "model.onnx")
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default="mobilenet_v3_large")
    ap.add_argument("--samples", default="1,6,8", help="request sizes, comma-separated")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spin-after", action="store_true",
                    help="the export with ONNX Runtime's default: threads spin after a call")
    ap.add_argument("--pieces", default="",
                    help="sizes whose sum is one of --samples, comma-separated: that request "
                         "also as one call per piece")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--store", default=str(Path.home() / ".cache" / "vbs-serve"
                                           / "kernels-store-auto"))
    args = ap.parse_args()

    import torch

    from core.loaded import ModelSpec
    from core.runtimes.onnxrt import OrtUnits
    from planner.pipeline import prepare
    from planner.store import open_store
    from service.settings import Settings

    torch.set_num_threads(args.threads)
    settings = Settings(cache_dir=args.cache_dir, store=args.store, batch_max=8)
    with open_store(settings.store_location) as store:
        prepared = prepare(ModelSpec(args.model), settings, store, progress=False)
    capture = prepared.capture
    units = OrtUnits(capture, threads=args.threads)
    children = capture.tree.children
    first, last = children[0].name, children[-1].name

    export = _exported(args.model, capture.input_shape, args.threads, args.spin_after)

    rng = random.Random(0)
    pieces = [int(v) for v in args.pieces.split(",") if v]
    print(f"{args.model}, {args.threads} threads, export's threads "
          f"{'spinning after each call' if args.spin_after else 'stopped after each call'}; "
          "ms per sample, p50 (p25)")
    for n in (int(v) for v in args.samples.split(",")):
        x = capture.model.example(n)
        out = units.output(children[-1], x, n)
        feed = {"x": x.numpy()}
        jobs = {"the plan's session (composed)": lambda: units.run(first, last, x, out),
                "the model exported whole": lambda: export.run(None, feed)}
        if pieces and sum(pieces) == n:
            parts, start = [], 0
            for size in pieces:
                part = x[start:start + size]
                parts.append((part, units.output(children[-1], part, size)))
                start += size
            jobs[f"the plan's session, {'+'.join(map(str, pieces))}"] = lambda: [
                units.run(first, last, part, into) for part, into in parts]
        for job in jobs.values():
            for _ in range(5):
                job()
        times: dict[str, list[float]] = {k: [] for k in jobs}
        keys = list(jobs)
        for _ in range(args.calls):
            rng.shuffle(keys)
            for k in keys:
                t0 = time.perf_counter()
                jobs[k]()
                times[k].append((time.perf_counter() - t0) / n)
        for k, ts in times.items():
            ts.sort()
            print(f"  n={n}  {k:32s} {1e3 * statistics.median(ts):7.3f} "
                  f"({1e3 * ts[len(ts) // 4]:.3f})")


if __name__ == "__main__":
    main()
