"""Several models on one device: the same mixed load with the memory arbiter, with equal
static shares, and with every model planning for all the free memory (the old behaviour).

    python bench/multi_model.py [--models resnet50,mobilenet_v2,squeezenet1_0]
        [--clients 4,2,2] [--duration 30] [--warmup 5] [--rounds 2] [--batch-max 8]
        [--limit auto] [--input-shape 3x224x224] [--threads 1]

1. The models are planned once into a directory store (``planner.pipeline.prepare``, as
   `vbs plan` does); every server reads its tables from there.
2. Per round, per configuration (the order rotates between rounds, so the machine's drift
   hits every configuration alike): `vbs serve` with all the models under one memory limit
   (its own process, loopback), and closed-loop clients on every model at once (``vbs
   loadtest``'s generator: one sample per request, ``--clients`` per model) for
   ``--duration`` seconds after ``--warmup``.
3. Per run: the aggregate throughput, each model's p99 latency, the arbiter's record from
   ``GET /models`` (the most bytes leased at once against the budget, and overcommits: grants
   that took the live leases past the budget), OOM retries from ``/metrics``, and the server's
   peak resident memory (VmHWM).

Configurations: ``shared``: the defaults on the CPU (one torch thread runs every model's
batches one at a time, so leases never overlap and each batch gets the whole budget);
``none``, ``static``, ``arbiter``: one torch thread per model (``--cpu-model-threads
per_model``, batches of different models run at once) with that ``--memory-sharing``.
``--threads`` sets ``VBS_THREADS`` for planning and every server (0: torch's default, one per
core); 1 keeps OpenMP teams out of the comparison on a machine shared with other work, where
a team of two spins on a core another process holds. ``--limit auto`` is the sum of the
models' smallest plans plus an eighth of what their largest plans at ``--batch-max`` add to
that: all can run at once, but when they do, not all of them their fastest plans.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from core.loaded import ModelSpec
from planner.pipeline import prepare
from planner.settings import split_model_entry
from service.settings import Settings
from core.sizes import format_bytes, parse_bytes
from planner.store import open_store
from loadgen.loadtest import run_loadtest
from served import vbs_serve
from workers.shares import Want, demand_level, divide, time_per_sample

CONFIGS = {  # name -> vbs serve flags
    "shared": ["--cpu-model-threads", "shared", "--memory-sharing", "arbiter"],
    "none": ["--cpu-model-threads", "per_model", "--memory-sharing", "none"],
    "static": ["--cpu-model-threads", "per_model", "--memory-sharing", "static"],
    "arbiter": ["--cpu-model-threads", "per_model", "--memory-sharing", "arbiter"],
}


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _metric(text: str, name: str, model: str) -> float:
    want = f'{name}{{model="{model}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want))


def plan(models: list[str], settings: Settings) -> dict[str, Any]:
    """Every model's tables into the store; returns the served tables."""
    tables = {}
    with open_store(settings.store_location) as store:
        for entry in models:
            served, name, shape = split_model_entry(entry)
            t0 = time.perf_counter()
            prepared = prepare(ModelSpec(name, input_shape=shape), settings, store,
                               progress=False)
            tables[served] = prepared.table
            print(f"planned {served} in {time.perf_counter() - t0:.0f} s: {len(prepared.table.plans)} "
                  f"plans, smallest {format_bytes(int(prepared.table.min_peaks[0]))}, largest "
                  f"{format_bytes(prepared.table.top_bytes)}", file=sys.stderr, flush=True)
    return tables


async def load(url: str, models: list[str], clients: list[int], duration: float,
               warmup: float) -> dict[str, dict[str, Any]]:
    busy = [(m, c) for m, c in zip(models, clients) if c > 0]  # 0 clients: served, idle
    runs = [run_loadtest(url, m, clients=c, duration_s=duration, warmup_s=warmup) for m, c in busy]
    return dict(zip([m for m, _ in busy], await asyncio.gather(*runs)))


def one_run(config: str, args: argparse.Namespace, served: list[str], limit: int,
            env: dict[str, str]) -> dict[str, Any]:
    cmd = [*[a for m in args.model_entries for a in ("--model", m)], "--store", args.store,
           "--batch-max", str(args.batch_max), "--memory-limit", str(limit), "--log-level",
           "warning", *CONFIGS[config]]
    with vbs_serve(cmd, env, what=f"vbs serve ({config})") as (server, url):
        summaries = asyncio.run(load(url, served, args.client_counts, args.duration, args.warmup))
        memory = httpx.get(f"{url}/models").json()["memory"][0]
        metrics = httpx.get(f"{url}/metrics").text
        rss = _peak_rss(server.pid)
    return {"config": config, "summaries": summaries, "memory": memory, "rss": rss,
            "oom": {m: _metric(metrics, "vbs_oom_retries_total", m) for m in served},
            "waits": {m: _metric(metrics, "vbs_memory_lease_waits_total", m) for m in served},
            "step_downs": {m: _metric(metrics, "vbs_memory_step_downs_total", m) for m in served}}


def predicted(tables: dict[str, Any], limit: int, clients: list[int]) -> None:
    """What the tables say each mode's shares buy at the load's steady demand (closed-loop
    clients keep about one request each in flight): per model its share and the time per
    sample of its plan there, and the knapsack's objective (the queued work's time)."""
    names = list(tables)
    demand = [demand_level(c) for c in clients]
    modes = {
        "none": {n: limit for n in names},
        "static": {n: limit // len(names) for n in names},
        "arbiter": divide(limit, [Want(n, tables[n], d) for n, d in zip(names, demand)]),
    }
    print(f"| mode | share MiB ({' / '.join(names)}) | predicted ms per sample | predicted "
          "time of the queued work (s) | sum of shares (x limit) |")
    print("|---|---|---|---|---|")
    for mode, shares in modes.items():
        tps = [float(time_per_sample(tables[n], max(d, 1), np.array([shares[n]]))[0]) if d else 0.0
               for n, d in zip(names, demand)]
        work = sum(d * t for d, t in zip(demand, tps))
        print(f"| {mode} | {' / '.join(f'{shares[n] / 2**20:.1f}' for n in names)} | "
              f"{' / '.join(f'{1000 * t:.1f}' if d else 'idle' for t, d in zip(tps, demand))} | "
              f"{work:.3f} | {sum(shares.values()) / limit:.2f} |")
    print(flush=True)


def row(k: int, run: dict[str, Any], served: list[str], limit: int) -> str:
    s = run["summaries"]
    total = sum(x["throughput_samples_per_s"] for x in s.values())
    errors = sum(x["errors"] for x in s.values())
    p99 = " / ".join(f"{1000 * (s[m]['latency_p99_s'] or 0):.0f}" if m in s else "idle"
                     for m in served)
    per = " / ".join(f"{s[m]['throughput_samples_per_s']:.1f}" if m in s else "idle"
                     for m in served)
    mem = run["memory"]
    waits = sum(run["waits"].values())
    steps = sum(run["step_downs"].values())
    return (f"| {run['config']} | {k} | {total:.1f} | {per} | {p99} | {errors} | "
            f"{format_bytes(mem['high_water_bytes'])} ({mem['high_water_bytes'] / limit:.2f}x) | "
            f"{mem['overcommits']} of {mem['grants']} | {int(sum(run['oom'].values()))} | "
            f"{waits} / {steps} | {run['rss'] / 1e6:.0f} MB |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,mobilenet_v2,squeezenet1_0")
    ap.add_argument("--clients", default="4,2,2",
                    help="closed-loop clients per model (0: served but idle)")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-max", type=int, default=8)
    ap.add_argument("--limit", default="auto", help="memory limit (bytes, 64MB) or auto")
    ap.add_argument("--input-shape", default=None, help="e.g. 3x112x112 (default: each model's)")
    ap.add_argument("--threads", type=int, default=1, help="VBS_THREADS (0: torch's default)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--predict-only", action="store_true",
                    help="print what the tables predict for each mode, run no load")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--store", default=str(Path.home() / ".cache" / "vbs-serve" / "multi-store"))
    args = ap.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    args.model_entries = [f"{m}@{args.input_shape}" if args.input_shape else m for m in names]
    args.client_counts = [max(0, int(c)) for c in args.clients.split(",")]
    if len(args.client_counts) == 1:
        args.client_counts *= len(names)
    if len(args.client_counts) != len(names):
        raise SystemExit("--clients: one count, or one per model")
    configs = [c.strip() for c in args.configs.split(",")]
    settings = Settings(cache_dir=args.cache_dir, store=args.store, batch_max=args.batch_max,
                        profile_grid=True, threads=args.threads)
    tables = plan(args.model_entries, settings)
    served = list(tables)
    least = sum(int(t.min_peaks[0]) for t in tables.values())
    limit = (least + (sum(t.top_bytes for t in tables.values()) - least) // 8
             if args.limit == "auto" else parse_bytes(args.limit))
    env = {**os.environ, "VBS_CACHE_DIR": args.cache_dir, "VBS_PROFILE_GRID": "1",
           "VBS_THREADS": str(args.threads)}
    print(f"models {', '.join(served)} (clients {args.clients}), batch_max {args.batch_max}, "
          f"VBS_THREADS={args.threads}, memory limit {format_bytes(limit)}; {args.rounds} rounds "
          f"of {args.duration:.0f} s after {args.warmup:.0f} s warm-up", flush=True)
    predicted(tables, limit, args.client_counts)
    if args.predict_only:
        return
    print(f"| config | round | samples/s (all) | samples/s ({' / '.join(served)}) | p99 ms "
          f"({' / '.join(served)}) | errors | most leased at once (x limit) | overcommits of "
          "grants | OOM retries | lease waits / step-downs | server peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    results: dict[str, list[float]] = {c: [] for c in configs}
    for k in range(1, args.rounds + 1):
        order = configs[(k - 1) % len(configs):] + configs[:(k - 1) % len(configs)]
        for config in order:
            run = one_run(config, args, served, limit, env)
            results[config].append(sum(x["throughput_samples_per_s"]
                                       for x in run["summaries"].values()))
            print(row(k, run, served, limit), flush=True)
    print()
    for config, values in results.items():
        spread = (max(values) - min(values)) / statistics.median(values) if values else 0
        print(f"{config}: median {statistics.median(values):.1f} samples/s over {len(values)} "
              f"rounds (spread {100 * spread:.0f}%)")


if __name__ == "__main__":
    main()
