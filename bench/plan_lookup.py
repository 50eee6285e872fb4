"""How long choosing a plan and answering /plan take once the tables are built: lookups only.

    python bench/plan_lookup.py --model resnet50 --batch-max 32 [--grid] [--samples 5000]
                                [--requests 500] [--json OUT]

1. ``vbs plan`` for the model into a fresh directory store (profile cached under
   --cache-dir); the table build (every strategy's table, the executor walked for every
   candidate plan) is the offline price of making the request path a lookup.
2. The worker's choice (``Worker.choose``: the largest request that fits, then the plan, by
   binary search) for r = batch_max at random free memory from below the smallest plan to
   above the largest, on a table freshly read from the store's bytes, the very first call
   included: p50, p99, max.
3. ``vbs serve`` (its own process, real HTTP on 127.0.0.1, reading those tables) answering
   GET /plan for random budgets and request sizes, every strategy side by side: client-side
   p50, p99 and max, and the server's own ``vbs_request_latency_seconds`` mean; beside it the
   same client's GET /v2/health/live, the floor that HTTP and the client cost by themselves.

Prints a Markdown table (docs/benchmarks.md) and, with --json, writes the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import tempfile
import time
from typing import Any
from pathlib import Path

import httpx

from core.loaded import ModelSpec
from planner.pipeline import prepare
from service.settings import Settings
from core.table import PlanTable
from planner.store import open_store
from workers.memory import MemoryProbe
from workers.worker import Worker
from served import vbs_serve


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def serve(args: argparse.Namespace, store: str
          ) -> contextlib.AbstractContextManager[tuple[subprocess.Popen[bytes], str]]:
    """``vbs serve`` of the tables in ``store``, in its own process (``served.vbs_serve``)."""
    env = {**os.environ, "VBS_CACHE_DIR": args.cache_dir, "VBS_PROFILE_GRID": str(args.grid),
           "VBS_SLOT_COUNT": str(args.slot_count)}
    return vbs_serve(["--model", args.model, "--store", store, "--batch-max",
                      str(args.batch_max), "--log-level", "warning"], env=env)


def time_choices(args: argparse.Namespace, prepared: Any, blob: bytes, rng: random.Random,
                 figures: dict[str, Any]) -> tuple[PlanTable, int, int]:
    """The worker's choice, on a table read from its bytes, first call included; returns the
    table and the range of free memory drawn from."""
    r = args.batch_max
    t0 = time.perf_counter()
    table = PlanTable.from_bytes(blob)
    figures["table_load_s"] = round(time.perf_counter() - t0, 3)
    worker = Worker(prepared.capture, table, MemoryProbe("cpu"))
    low, high = int(table.min_peaks[0]) // 2, table.top_bytes * 2
    choice_us = []
    for _ in range(args.samples):
        free = rng.randint(low, high)
        t0 = time.perf_counter()
        try:
            worker.choose(table, r, free)
        except Exception:  # noqa: BLE001 - below one sample: the error is the answer
            pass
        choice_us.append((time.perf_counter() - t0) * 1e6)
    figures["choice_us"] = {"first": round(choice_us[0], 1), "p50": round(pct(choice_us, .5), 1),
                            "p99": round(pct(choice_us, .99), 1), "max": round(max(choice_us), 1)}

    return table, low, high


def time_plan_requests(args: argparse.Namespace, store_location: str, low: int, high: int,
                       rng: random.Random, figures: dict[str, Any]) -> None:
    """/plan over real HTTP, interleaved with /v2/health/live, and the server's own histogram."""
    r = args.batch_max
    with serve(args, store_location) as (_, url):
        plan_ms, live_ms = [], []
        with httpx.Client(base_url=url, timeout=60) as client:
            client.get("/plan", params={"mem": str(high)})  # connection set up
            for _ in range(args.requests):  # interleaved, so noise hits both alike
                params = {"mem": str(rng.randint(low, high)), "batch": rng.randint(1, r)}
                t0 = time.perf_counter()
                response = client.get("/plan", params=params)
                t1 = time.perf_counter()
                client.get("/v2/health/live")
                live_ms.append((time.perf_counter() - t1) * 1e3)
                plan_ms.append((t1 - t0) * 1e3)
                assert response.status_code == 200, response.text
            metrics = client.get("/metrics").text
        total = count = 0.0
        within: dict[str, float] = {}
        for line in metrics.splitlines():
            if line.startswith('vbs_request_latency_seconds_sum{endpoint="plan"'):
                total = float(line.rsplit(" ", 1)[1])
            if line.startswith('vbs_request_latency_seconds_count{endpoint="plan"'):
                count = float(line.rsplit(" ", 1)[1])
            for le in ("0.0025", "0.005"):
                if line.startswith(f'vbs_request_latency_seconds_bucket{{endpoint="plan",le="{le}"'):
                    within[le] = float(line.rsplit(" ", 1)[1])
        figures["plan_ms"] = {"p50": round(pct(plan_ms, .5), 2), "p99": round(pct(plan_ms, .99), 2),
                              "max": round(max(plan_ms), 2),
                              "server_mean": round(1e3 * total / count, 2) if count else None,
                              # the server's own histogram: the share answered within 2.5 / 5 ms
                              "server_within_2_5ms": round(within.get("0.0025", 0) / count, 4),
                              "server_within_5ms": round(within.get("0.005", 0) / count, 4)}
        figures["live_ms"] = {"p50": round(pct(live_ms, .5), 2), "p99": round(pct(live_ms, .99), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch-max", type=int, default=32)
    ap.add_argument("--slot-count", type=int, default=512)
    ap.add_argument("--grid", action="store_true", help="profile a grid of batch sizes")
    ap.add_argument("--samples", type=int, default=5000, help="choices timed")
    ap.add_argument("--requests", type=int, default=500, help="/plan requests timed")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    store_dir = Path(tempfile.mkdtemp(prefix="vbs-lookup-store-"))
    settings = Settings(cache_dir=args.cache_dir, store=str(store_dir), batch_max=args.batch_max,
                        slot_count=args.slot_count, models=[args.model], profile_grid=args.grid)
    spec = ModelSpec(name=args.model)
    with open_store(settings.store_location) as store:
        prepared = prepare(spec, settings, store, progress=False)
        stored = store.get_table(prepared.table_id)
    blob = stored.blob
    r = args.batch_max
    figures: dict[str, object] = {
        "model": args.model, "batch_max": r, "slot_count": args.slot_count,
        "tables_build_s": stored.meta["solve_s"],
        "plans": {s: len(t.plans) for s, t in prepared.tables.items()},
        "table_bytes": len(blob)}

    rng = random.Random(0)
    table, low, high = time_choices(args, prepared, blob, rng, figures)
    time_plan_requests(args, settings.store_location, low, high, rng, figures)

    c, p, h = figures["choice_us"], figures["plan_ms"], figures["live_ms"]
    print(f"| {args.model} | {r} | {args.slot_count} | {figures['tables_build_s']} | "  # type: ignore[index]
          f"{figures['plans']['vbs']} | {figures['table_load_s']} | {c['first']} | {c['p50']} | "  # type: ignore[index]
          f"{c['p99']} | {c['max']} | {p['p50']} / {p['p99']} | {h['p50']} / {h['p99']} | "  # type: ignore[index]
          f"{p['server_mean']} | {100 * p['server_within_5ms']:.1f}% |")  # type: ignore[index]
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
