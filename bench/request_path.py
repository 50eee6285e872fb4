"""Where a request's model time goes around ONNX Runtime's call, in one process and served.

    python bench/request_path.py [--model mnasnet0_5] [--samples 1] [--calls 2000]
                                 [--pause-ms 0] [--trees .,/tmp/before] [--serve-rounds 0]
                                 [--requests 30]

In process (a child process per checkout of ``--trees``, in turn): the model's table as
`vbs plan` stores it (``--store``, ``--cache-dir``; planned here if absent), a ``Worker`` with
an arbiter as `vbs serve` builds it, and four ways to run ``--samples`` samples, called in
shuffled order ``--calls`` times each so that drift and cache churn hit all alike: the whole
torchvision model exported to ONNX and run by ONNX Runtime with its defaults, the plan's own
session (``run_with_iobinding``), ``OrtUnits.run`` and ``Worker.infer``; with ``--pause-ms``,
the four again in blocks of 50 calls (no call right after another way's, whose threads may
spin on), each call after a sleep of that long (the cores idle between calls, as between a
server's requests, where back to back they never are). Then ``Worker.infer``
alone with its parts timed around their calls (the lease, the executor's call, the session's
call). Prints p50 and p25 in milliseconds, and ``Worker.infer`` minus ``OrtUnits.run``.

Served (``--serve-rounds`` > 0): `vbs serve` of each checkout in turn, ``--requests``
requests of ``--samples`` samples per round, the median ``timing.infer_s`` per sample.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np

from served import add_trees_argument, interleaved, npy, vbs_serve

CHILD = r"""
import collections, io, json, random, sys, time, warnings
import numpy as np, onnxruntime as ort, torch, torchvision
from core.loaded import ModelSpec
from core.runtimes.base import RuntimeOptions
from core.runs import TreeIndex
from planner.pipeline import prepare
from planner.store import open_store
from service.settings import Settings
from workers.arbiter import Arbiter
from workers.memory import MemoryProbe
from workers.worker import Worker

model, n, calls, cache, store = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
pause = float(sys.argv[6]) / 1e3
s = Settings(cache_dir=cache, store=store, batch_max=max(8, n))
with open_store(s.store_location) as st:
    p = prepare(ModelSpec(model), s, st, progress=False)
probe = MemoryProbe("cpu")
arbiter = Arbiter("cpu", probe.free)
arbiter.register(model, lambda: p.table, lambda: 1)
worker = Worker(p.capture, p.table, probe, name=model, memory=arbiter,
                runtime_options=RuntimeOptions(spin=s.ort_spin))
units = worker.runtimes["onnxruntime"]
x = p.capture.model.example(n)
choice = worker.choose(p.table, n, p.table.top_bytes)
steps = choice.program.steps
assert choice.runs == {0: len(steps) - 1}, f"the plan at {n} is not one call: {choice.runs}"
nodes = TreeIndex.of(p.capture.tree).run_nodes(steps, 0, len(steps) - 1)
out = units.output(nodes[-1], x, n)
session = units._run(nodes[0].name, nodes[-1].name).session
binding = session.io_binding()
binding.bind_input("x", "cpu", 0, units._dtype, x.shape, x.data_ptr())
binding.bind_output("y", "cpu", 0, units._dtype, out.shape, out.data_ptr())
whole = torchvision.models.get_model(model, weights=None).eval()
buffer = io.BytesIO()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.onnx.export(whole, (torch.randn(1, *x.shape[1:]),), buffer, dynamo=False,
                      input_names=["x"], output_names=["y"], opset_version=17,
                      dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
options = ort.SessionOptions()
options.intra_op_num_threads = torch.get_num_threads()
defaults = ort.InferenceSession(buffer.getvalue(), options)
feed = {"x": x.numpy()}
jobs = {
    "ONNX Runtime, whole model, its defaults": lambda: defaults.run(None, feed),
    "the plan's session, run_with_iobinding": lambda: session.run_with_iobinding(binding),
    "OrtUnits.run": lambda: units.run(nodes[0].name, nodes[-1].name, x, out),
    "Worker.infer": lambda: worker.infer(x),
}
for job in jobs.values():
    for _ in range(20):
        job()
times = {k: [] for k in jobs}
keys = list(jobs)
rng = random.Random(0)
for _ in range(calls):
    rng.shuffle(keys)
    for k in keys:
        t0 = time.perf_counter(); jobs[k](); times[k].append(time.perf_counter() - t0)
paced = {f"{k}, after a pause": [] for k in jobs} if pause else {}
for _ in range(-(-calls // 50) if pause else 0):  # blocks of 50: no call follows another way's
    rng.shuffle(keys)
    for k in keys:
        for _call in range(50):
            time.sleep(pause)
            t0 = time.perf_counter(); jobs[k]()
            paced[f"{k}, after a pause"].append(time.perf_counter() - t0)

parts = collections.defaultdict(list)
def timed(name, f):
    def g(*a, **kw):
        t0 = time.perf_counter(); r = f(*a, **kw); parts[name].append(time.perf_counter() - t0)
        return r
    return g
import core.runtimes.onnxrt as onnxrt
import workers.executor as executor
import workers.worker as worker_module
worker._lease = timed("the lease (memory reading, lookup, arbiter)", worker._lease)
if hasattr(executor, "Prepared"):
    executor.Prepared.__call__ = timed("the executor's call", executor.Prepared.__call__)
else:  # a checkout from before the executor's Prepared
    worker_module.execute = timed("the executor's call", worker_module.execute)
onnxrt.OrtUnits.run = timed("the session's call (OrtUnits.run)", onnxrt.OrtUnits.run)
for _ in range(50):
    worker.infer(x)
parts.clear()
for _ in range(calls):
    t0 = time.perf_counter(); worker.infer(x); parts["Worker.infer, parts timed"].append(time.perf_counter() - t0)
print(json.dumps({"shuffled": times, "paced": paced, "parts": parts}))
"""


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] * 1e3


def in_process(root: Path, args: argparse.Namespace) -> None:
    ran = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.samples),
                          str(args.calls), args.cache_dir, args.store, str(args.pause_ms)],
                         env={**os.environ, "PYTHONPATH": str(root)}, cwd=root, check=True,
                         capture_output=True, text=True)
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    print(f"\n{root}: {args.model}, {args.samples} samples, {args.calls} calls each "
          "(ms per call: p50, p25)")
    for section in ("shuffled", "paced", "parts"):
        for name, values in result[section].items():
            print(f"  {name:44s} {_q(values, 0.5):8.3f} {_q(values, 0.25):8.3f}")
    shuffled = result["shuffled"]
    print("  Worker.infer - OrtUnits.run (p50)".ljust(46),
          f"{_q(shuffled['Worker.infer'], 0.5) - _q(shuffled['OrtUnits.run'], 0.5):8.3f}")


def served(args: argparse.Namespace) -> None:
    x = np.random.default_rng(0).standard_normal((args.samples, 3, 224, 224), dtype=np.float32)
    body = npy(x)
    serve_args = ["--model", args.model, "--store", args.store, "--batch-max",
                  str(max(8, args.samples)), "--log-level", "warning"]
    env = {**os.environ, "VBS_CACHE_DIR": args.cache_dir}
    medians: dict[Path, list[float]] = {}
    for k, root in interleaved(args.serve_rounds, args.trees):
        with vbs_serve(serve_args, env=env, root=root) as (_server, url), \
                httpx.Client(base_url=url, timeout=300) as client:
            def one() -> float:
                answer = client.post(f"/infer?model={args.model}", content=body,
                                     headers={"content-type": "application/x-npy"})
                answer.raise_for_status()
                return answer.json()["timing"]["infer_s"] / args.samples * 1e3
            for _ in range(5):
                one()
            median = statistics.median(one() for _ in range(args.requests))
            medians.setdefault(root, []).append(median)
            print(f"served, round {k}, {root}: infer_s {median:.2f} ms per sample", flush=True)
    for root, values in medians.items():
        print(f"served {root}: median {statistics.median(values):.2f} "
              f"({min(values):.2f}-{max(values):.2f}) ms per sample")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mnasnet0_5")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--pause-ms", type=float, default=0.0,
                    help="also each way again, in blocks of 50 calls, after a sleep of this "
                         "long before each call (the cores idle, as between a server's requests)")
    ap.add_argument("--serve-rounds", type=int, default=0)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--store", default=str(Path.home() / ".cache" / "vbs-serve" / "kernels-store-auto"))
    add_trees_argument(ap)
    args = ap.parse_args()
    for _k, root in interleaved(1, args.trees):
        in_process(root, args)
    if args.serve_rounds:
        served(args)


if __name__ == "__main__":
    main()
