"""What an idle `vbs serve` costs in CPU: three models served, each having answered, then
nobody asking.

    python bench/idle.py [--model mobilenet_v2,mnasnet0_5,mobilenet_v3_large] [--seconds 30]
                         [--requests 20] [--runtime auto] [--batch-max 8] [--threads 2]

`vbs serve` (its own process, ``--runtime``, ample memory) serves the models; each gets
``--requests`` requests of 1 and of ``--batch-max`` samples, so every session its plans use
is built and has run. Then, after a second for anything that winds down, the server's CPU
time (user + system, every thread of it: ``/proc/<pid>/stat``) is read over ``--seconds``
with no request; printed as a share of one core. The same reading over the requests before
it is printed beside, for scale.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import httpx
import numpy as np

from served import npy, stat_cpu, vbs_serve


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads."""
    return stat_cpu(f"/proc/{pid}/stat")[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default="mobilenet_v2,mnasnet0_5,mobilenet_v3_large",
                    help="models, comma-separated")
    ap.add_argument("--seconds", type=float, default=30.0, help="the idle window")
    ap.add_argument("--requests", type=int, default=20, help="requests per model and size")
    ap.add_argument("--runtime", default="auto", help="vbs serve --runtime")
    ap.add_argument("--batch-max", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="torch and ONNX Runtime threads")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    args = ap.parse_args()

    from core.loaded import ModelSpec

    from planner.models import load_model

    names = args.model.split(",")
    serve_args = ["--store", str(Path(args.cache_dir) / f"kernels-store-{args.runtime}"),
                  "--batch-max", str(args.batch_max), "--runtime", args.runtime,
                  "--log-level", "warning"]
    for name in names:
        serve_args += ["--model", name]
    env = {**os.environ, "VBS_CACHE_DIR": args.cache_dir, "VBS_THREADS": str(args.threads)}
    rng = np.random.default_rng(0)
    bodies = {(name, n): npy(rng.standard_normal((n, *load_model(ModelSpec(name)).input_shape),
                                                 dtype=np.float32))
              for name in names for n in sorted({1, args.batch_max})}
    with vbs_serve(serve_args, env=env) as (server, url), \
            httpx.Client(base_url=url, timeout=300) as client:
        c0, t0 = cpu_seconds(server.pid), time.perf_counter()
        for (name, _n), body in bodies.items():
            for _ in range(args.requests):
                client.post(f"/infer?model={name}", content=body,
                            headers={"content-type": "application/x-npy"}).raise_for_status()
        busy = (cpu_seconds(server.pid) - c0) / (time.perf_counter() - t0)
        time.sleep(1.0)
        c1, t1 = cpu_seconds(server.pid), time.perf_counter()
        time.sleep(args.seconds)
        idle_cpu = cpu_seconds(server.pid) - c1
        idle = idle_cpu / (time.perf_counter() - t1)
        threads = len(os.listdir(f"/proc/{server.pid}/task"))
    print(f"vbs serve --runtime {args.runtime} with {', '.join(names)} ({args.threads} threads, "
          f"VBS_ORT_SPIN={os.environ.get('VBS_ORT_SPIN', 'default')}): {threads} threads; "
          f"{100 * busy:.0f}% of a core answering requests one at a time, "
          f"{100 * idle:.2f}% of a core idle ({idle_cpu:.2f} CPU s over {args.seconds:g} s)")


if __name__ == "__main__":
    main()
