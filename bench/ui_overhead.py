"""What the page costs the service: recording each answer for the live view, and answering the
page's JSON, beside what the service costs anyway.

    .venv/bin/python bench/ui_overhead.py [--model squeezenet1_0] [--input-shape 3,96,96]
        [--batch-max 8] [--rounds 5] [--requests 300] [--baseline DIR] [--json OUT]

1. In process: ``Live.record`` (the metrics middleware calls it once per answered inference)
   and ``Live.figures`` over a full window (what GET /models/{name}/stats reads), on real
   ``Outcome`` objects: nanoseconds per call, median of ``--rounds``, and the spread.
2. `vbs serve` (its own process, real HTTP on 127.0.0.1, tables from ``out/ui-shots``, as
   bench/ui_screenshots.py made them): client-side p50/p99 of GET /models/{name}/stats,
   /models/{name}/curves, /plan?program=true (what the page asks as the slider moves) and
   /v2/health/live (the floor of HTTP and the client), in interleaved rounds.
3. With ``--baseline DIR`` (a checkout without the page, e.g. ``git worktree add /tmp/base
   <commit>``): `vbs serve` from each tree in turn, ``vbs loadtest`` (4 clients, one sample,
   10 s after 3 s of warm-up) on each, interleaved rounds: throughput and p50 with and without
   the live recording.

Prints Markdown tables (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from served import ROOT
from ui_screenshots import serve_page_model


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def in_process(rounds: int, calls: int = 100_000) -> dict[str, list[float]]:
    from planner.solver.synthetic import chain_like
    from planner.solver.tables import build_table
    from service.batch_stage import Outcome, Timing
    from service.live import Live
    from workers.worker import Choice, RunInfo

    table = build_table(chain_like(n_units=8, batch_max=4), slot_count=32)
    choice = Choice(table, int(table.rows[3].plans[-1]), 4, 1 << 30, 1e-6)
    outcome = Outcome(np.zeros((1, 10), np.float32), None, RunInfo((choice,), 0, 0), 4,
                      Timing(0.001, 0.0, 0.002, 0.0, 0.002), 1)
    out: dict[str, list[float]] = {"record_ns": [], "figures_10k_us": []}
    for _ in range(rounds):
        live = Live()
        t0 = time.perf_counter()
        for _ in range(calls):
            live.record("m", 0.003, outcome)
        out["record_ns"].append((time.perf_counter() - t0) / calls * 1e9)
        live = Live()
        for _ in range(10_000):  # 1000 requests/s over the 10 s window
            live.record("m", 0.003, outcome)
        t0 = time.perf_counter()
        for _ in range(100):
            live.figures("m")
        out["figures_10k_us"].append((time.perf_counter() - t0) / 100 * 1e6)
    return out


def endpoints(url: str, model: str, rounds: int, requests: int) -> dict[str, dict[str, list[float]]]:
    rng = np.random.default_rng(0)
    with httpx.Client(base_url=url, timeout=30) as c:
        curves = c.get(f"/models/{model}/curves").json()
        low, high = curves["low_bytes"], curves["high_bytes"]
        paths = {
            "GET /v2/health/live": lambda: "/v2/health/live",
            "GET /models/{name}/stats": lambda: f"/models/{model}/stats",
            "GET /models/{name}/curves": lambda: f"/models/{model}/curves",
            "GET /plan?program=true": lambda: (f"/plan?model={model}&program=true&mem="
                                              f"{int(rng.integers(low, high + 1))}"),
        }
        out: dict[str, dict[str, list[float]]] = {k: {"p50": [], "p99": []} for k in paths}
        for _ in range(rounds):
            for name, path in paths.items():  # interleaved: every endpoint once per round
                times = []
                for _ in range(requests):
                    target = path()
                    t0 = time.perf_counter()
                    r = c.get(target)
                    times.append(time.perf_counter() - t0)
                    r.raise_for_status()
                out[name]["p50"].append(float(np.percentile(times, 50)) * 1e3)
                out[name]["p99"].append(float(np.percentile(times, 99)) * 1e3)
    return out


def load_ab(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    from loadgen.loadtest import run_loadtest

    trees = {"with the page (this tree)": ROOT, "baseline": Path(args.baseline).resolve()}
    out: dict[str, dict[str, list[float]]] = {k: {"rps": [], "p50_ms": []} for k in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            with serve_page_model(args, tree, subprocess.DEVNULL) as (_, url):
                s = asyncio.run(run_loadtest(url, args.model, clients=4, duration_s=10,
                                             warmup_s=3))
            out[name]["rps"].append(s["throughput_rps"])
            out[name]["p50_ms"].append(s["latency_p50_s"] * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="squeezenet1_0")
    parser.add_argument("--input-shape", default="3,96,96")
    parser.add_argument("--batch-max", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--baseline", help="a checkout without the page, for the load A/B")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures: dict[str, Any] = {"in_process": in_process(args.rounds)}
    print(f"in process, median (min-max) of {args.rounds} rounds\n")
    print("| what | per call |\n|---|---|")
    print(f"| Live.record (per answered request) | {spread(figures['in_process']['record_ns'])} ns |")
    print(f"| Live.figures, 10,000 requests in the window | "
          f"{spread(figures['in_process']['figures_10k_us'])} µs |")
    with serve_page_model(args, ROOT, subprocess.DEVNULL) as (_, url):
        figures["endpoints"] = endpoints(url, args.model, args.rounds, args.requests)
    print(f"\n{args.model} {args.input_shape}, client-side ms, median (min-max) of {args.rounds} "
          f"interleaved rounds of {args.requests} requests\n")
    print("| endpoint | p50 ms | p99 ms |\n|---|---|---|")
    for name, v in figures["endpoints"].items():
        print(f"| {name} | {spread(v['p50'])} | {spread(v['p99'])} |")
    if args.baseline:
        figures["load"] = load_ab(args)
        print(f"\nvbs loadtest, 4 clients x 1 sample, 10 s; median (min-max) of {args.rounds} "
              "interleaved rounds\n")
        print("| server | requests/s | p50 ms |\n|---|---|---|")
        for name, v in figures["load"].items():
            print(f"| {name} | {spread(v['rps'])} | {spread(v['p50_ms'])} |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
