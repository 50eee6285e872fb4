"""Does the model run as fast inside `vbs serve` as outside it? Thread settings, measured.

    python bench/threads.py [--model mnasnet0_5] [--requests 60] [--rounds 2]

For each configuration (torch's intra-op threads, OpenMP's wait policy), in rounds so that the
machine's drift hits every configuration alike:

- in process: ``Worker.infer`` on one sample, the same plan table, ``--requests`` times;
- in the service: `vbs serve` started with that configuration (its own process, loopback),
  one client sending ``--requests`` one-sample ``.npy`` requests one after another; the
  ``infer_s`` each response reports (the plan's run, the same call as in process) and the
  client's latency.

Prints medians per configuration and round, and the service's infer time over the in-process
one. The tables are planned once into a directory store that every server reads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from served import npy, vbs_serve

CONFIGS = {  # name -> environment of the service (and of the in-process run)
    "torch default": {},
    "VBS_THREADS=1": {"VBS_THREADS": "1"},
    "VBS_THREADS=2": {"VBS_THREADS": "2"},
    "VBS_THREADS=2, OMP_WAIT_POLICY=PASSIVE": {"VBS_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
}


def in_process(model: str, store: str, cache: str, env: dict[str, str], requests: int) -> float:
    """Median seconds of Worker.infer on one sample, in a fresh process with ``env``."""
    code = f"""
import time, statistics, torch
from core.loaded import ModelSpec
from planner.pipeline import prepare
from service.settings import Settings
from planner.store import open_store
from workers.memory import MemoryProbe
from workers.worker import Worker
s = Settings(cache_dir={cache!r}, store={store!r}, batch_max=8)
with open_store(s.store_location) as st:
    p = prepare(ModelSpec({model!r}), s, st, progress=False)
w = Worker(p.capture, p.table, MemoryProbe("cpu"))
x = p.capture.model.example(1)
for _ in range(5):
    w.infer(x)
ts = []
for _ in range({requests}):
    t0 = time.perf_counter(); w.infer(x); ts.append(time.perf_counter() - t0)
print(statistics.median(ts))
"""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def in_service(model: str, store: str, cache: str, env: dict[str, str], requests: int
               ) -> tuple[float, float]:
    """(median infer_s reported, median client latency) of one-sample requests to `vbs serve`."""
    with vbs_serve(["--model", model, "--store", store, "--batch-max", "8", "--log-level",
                    "warning"], env={**os.environ, "VBS_CACHE_DIR": cache, **env}) as (_, url), \
            httpx.Client(base_url=url, timeout=120) as client:
        shape = client.get(f"/v2/models/{model}").json()["inputs"][0]["shape"][1:]
        body = npy(np.random.default_rng(0).standard_normal((1, *shape)).astype(np.float32))
        infer, latency = [], []
        for k in range(requests + 5):
            t0 = time.perf_counter()
            r = client.post("/infer", content=body, headers={"Content-Type": "application/x-npy"})
            elapsed = time.perf_counter() - t0
            r.raise_for_status()
            if k >= 5:  # warm-up
                infer.append(r.json()["timing"]["infer_s"])
                latency.append(elapsed)
    return statistics.median(infer), statistics.median(latency)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mnasnet0_5")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    args = ap.parse_args()
    store = tempfile.mkdtemp(prefix="vbs-threads-store-")
    print(f"| configuration | round | in process (ms) | service infer_s (ms) | service / in process "
          f"| client latency (ms) |")
    print("|---|---|---|---|---|---|")
    for k in range(1, args.rounds + 1):
        for name, env in CONFIGS.items():
            alone = in_process(args.model, store, args.cache_dir, env, args.requests)
            infer, latency = in_service(args.model, store, args.cache_dir, env, args.requests)
            print(f"| {name} | {k} | {alone * 1e3:.2f} | {infer * 1e3:.2f} | {infer / alone:.2f}x "
                  f"| {latency * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
