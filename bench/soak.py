"""Soak: N clients on two models for a bounded time while the plan store dies and comes back,
the memory limit changes every few seconds and a table is republished; nothing may be lost.

    python bench/soak.py [--duration 600] [--clients 8] [--json out.json]

On loopback only. A private redis-server (append-only, so a restart keeps the tables) holds
the tables, published by this script as `vbs plan` does; the service (``create_app`` under
uvicorn, in a thread of this process, real HTTP) serves two models from it. Meanwhile:

- clients: ``--clients`` asyncio clients, each with its own keep-alive connection, send 1-4
  samples to a random model (.npy or JSON), one request at a time, and check the output shape;
- the store: every ``--redis-every`` seconds redis-server is killed (SIGKILL) and restarted
  ``--redis-down`` seconds later on the same port;
- memory: every ``--limit-every`` seconds each model's memory limit (``probe.limit``, what
  ``--memory-limit`` sets) is set to a random budget between its table's smallest and largest
  plan (sometimes below one sample's need: then 503 until the next change);
- tables: every ``--republish-every`` seconds one model's table is solved again with another
  slot size and published (skipped while redis is down).

Reported: requests sent and answered, answers by status, lost (sent - answered: must be 0),
wrong output shapes, latency p50/p99/max, the process's memory high-water mark (ru_maxrss:
service and clients together), RSS, open file descriptors and threads (native, OpenMP's
included) after warm-up and after the run, redis kills, limit changes, republishes and the
service's own counters (table reloads, store errors). Exit status 1 when anything was lost,
a 5xx other than 503/504 was answered, or a shape was wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import uvicorn

from core.errors import StoreError
from core.loaded import ModelSpec
from planner.pipeline import prepare, publish
from service.settings import Settings
from planner.solver.tables import build_table
from planner.store import open_store
from service.main import create_app
from served import free_port, npy

MODELS = ("squeezenet1_0@3x64x64", "mobilenet_v2@3x64x64")


def process_stats() -> dict[str, int]:
    status = Path("/proc/self/status").read_text()
    field = {line.split(":")[0]: line.split(":")[1].split() for line in status.splitlines()}
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": int(field["Threads"][0]),
            "python_threads": threading.active_count(),
            "rss_bytes": int(field["VmRSS"][0]) * 1024}


class Redis:
    """A private redis-server on 127.0.0.1 that can be killed and restarted on its port."""

    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            sys.exit("redis-server is not on PATH: apt-get install redis-server")
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.kills = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.workdir), "--save", "", "--appendonly", "yes", "--appendfsync", "always",
             "--loglevel", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)  # a starting process
        sys.exit("redis-server did not start")

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self.kills += 1

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


class Server:
    """uvicorn serving ``app`` on a free loopback port in a thread."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def start(self, timeout_s: float = 600) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                sys.exit("uvicorn did not start")
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=10) as client:
            while client.get("/v2/health/ready").status_code != 200:
                if time.monotonic() > deadline:
                    sys.exit(f"not ready: {self.app.state.registry.not_ready_reason()}")
                time.sleep(0.2)
        return url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=120)


async def client(k: int, url: str, models: dict[str, tuple[int, ...]], outputs: dict[str, list[int]],
                 stop: asyncio.Event, tally: dict[str, Any]) -> None:
    rng = np.random.default_rng(k)
    names = sorted(models)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while not stop.is_set():
            name = names[int(rng.integers(len(names)))]
            n = int(rng.integers(1, 5))
            x = rng.standard_normal((n, *models[name])).astype(np.float32)
            as_json = rng.random() < 0.3
            tally["sent"] += 1
            t0 = time.perf_counter()
            try:
                if as_json:
                    r = await http.post("/infer", params={"model": name},
                                        json={"inputs": x.tolist()})
                else:
                    r = await http.post("/infer", params={"model": name}, content=npy(x),
                                        headers={"Content-Type": "application/x-npy"})
            except httpx.HTTPError as exc:
                tally["transport_errors"][type(exc).__name__] += 1
                continue
            tally["latency"].append(time.perf_counter() - t0)
            tally["answered"] += 1
            tally["status"][r.status_code] += 1
            if r.status_code == 200:
                shape = r.json()["output_shape"]
                if shape != [n, *outputs[name]]:
                    tally["wrong"] += 1
            elif r.status_code == 503:
                await asyncio.sleep(0.05)  # what a client does on Retry-After, shortened


async def stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds``, or less if ``stop`` is set meanwhile; True when it was."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        return False
    return True


async def chaos_memory(app: Any, every: float, stop: asyncio.Event, rng: random.Random,
                       tally: dict[str, Any]) -> None:
    registry = app.state.registry
    while not stop.is_set():
        await stopped_within(stop, every)
        # one limit for the device (its models share its one memory owner), drawn from
        # the models' tables: mostly a budget some plan fits; now and then none of one
        # model's (503) or no limit at all
        tables = [entry.table for entry in registry.entries.values()]
        low = max(int(t.min_peaks[0]) for t in tables)
        high = max(int(t.top_bytes) for t in tables)
        limit = rng.choice([0, int(low * 0.9)] + [rng.randint(low, max(low, high))] * 4)
        registry.memory.probe.limit = limit  # 0 = what is free
        tally["limit_changes"] += 1


async def chaos_redis(redis: Redis, every: float, down: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        if await stopped_within(stop, every):
            return
        await asyncio.to_thread(redis.kill)
        await stopped_within(stop, down)
        await asyncio.to_thread(redis.start)


def republish(redis: Redis, entry: Any, slot_factor: int) -> int:
    profile = entry.prepared.profile
    base = entry.prepared.table.slot_bytes  # the slot size first planned, not the last one
    table = build_table(profile, solver="vbs", slot_bytes=max(1, base * slot_factor // 4))
    with open_store(redis.url) as store:
        return publish(store, entry.spec, profile, {"vbs": table})["vbs"]


async def chaos_tables(app: Any, redis: Redis, every: float, stop: asyncio.Event,
                       rng: random.Random, tally: dict[str, Any]) -> None:
    entries = list(app.state.registry.entries.values())
    k = 0
    while not stop.is_set():
        if await stopped_within(stop, every):
            return
        entry = entries[k % len(entries)]
        k += 1
        try:
            await asyncio.to_thread(republish, redis, entry, rng.choice([2, 3, 5, 6]))
            tally["republished"] += 1
        except StoreError:
            tally["republish_skipped"] += 1  # redis down right now


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (<= 3600)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--model", action="append", help=f"served models (default {', '.join(MODELS)})")
    ap.add_argument("--batch-max", type=int, default=8)
    ap.add_argument("--redis-every", type=float, default=60.0)
    ap.add_argument("--redis-down", type=float, default=5.0)
    ap.add_argument("--limit-every", type=float, default=3.0)
    ap.add_argument("--republish-every", type=float, default=45.0)
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the "
                                                                "'before' figures are taken")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()
    if not 0 < args.duration <= 3600 or not 1 <= args.clients <= 256:
        sys.exit("--duration must be in (0, 3600] s and --clients in 1..256")
    return args


def planned_settings(args: argparse.Namespace, models: list[str], redis: Redis) -> Settings:
    """The service's settings, every model planned into the store first (as `vbs plan`)."""
    settings = Settings(cache_dir=args.cache_dir, store=redis.url, models=models,
                        batch_max=args.batch_max, store_retry_base_s=0.2, store_retry_cap_s=2.0,
                        request_timeout_s=30)
    t0 = time.monotonic()
    with open_store(redis.url) as store:
        for _, name, shape in settings.served_models:
            prepare(ModelSpec(name, input_shape=shape), settings, store,
                    batch_max=args.batch_max, progress=False)
    print(f"planned {len(models)} models in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return settings


async def load_with_chaos(args: argparse.Namespace, app: Any, url: str, redis: Redis,
                          rng: random.Random, tally: dict[str, Any]) -> dict[str, Any]:
    """Clients for ``--duration`` s with memory limits, Redis and table chaos after the
    warm-up; returns the process figures taken when warm."""
    registry = app.state.registry
    shapes = {e.name: tuple(e.input_shape) for e in registry.entries.values()}
    outputs = {e.name: list(e.output_shape) for e in registry.entries.values()}
    stop = asyncio.Event()
    clients = [asyncio.create_task(client(k, url, shapes, outputs, stop, tally))
               for k in range(args.clients)]
    await asyncio.sleep(args.warmup)
    gc.collect()
    before = process_stats()
    print(f"warm: {before}", file=sys.stderr)
    chaos = [asyncio.create_task(chaos_memory(app, args.limit_every, stop, rng, tally)),
             asyncio.create_task(chaos_redis(redis, args.redis_every, args.redis_down, stop)),
             asyncio.create_task(chaos_tables(app, redis, args.republish_every, stop, rng,
                                              tally))]
    started = time.monotonic()
    while time.monotonic() - started < args.duration:
        await asyncio.sleep(min(30.0, args.duration - (time.monotonic() - started)))
        now = process_stats()
        tally["samples"].append(now)
        print(f"{time.monotonic() - started:.0f} s: sent {tally['sent']}, answered "
              f"{tally['answered']}, status {dict(tally['status'])}, {now}", file=sys.stderr)
    stop.set()
    await asyncio.gather(*clients, *chaos)
    if redis.process is None or redis.process.poll() is not None:
        await asyncio.to_thread(redis.start)
    for entry in registry.entries.values():
        entry.worker.probe.limit = 0
    return before


def report_of(args: argparse.Namespace, models: list[str], tally: dict[str, Any],
              before: dict[str, Any], after: dict[str, Any], redis: Redis,
              reloads: dict[str, Any], store_errors: Any) -> dict[str, Any]:
    lat = tally["latency"]
    statuses = {str(k): v for k, v in sorted(tally["status"].items())}
    return {
        "duration_s": args.duration, "clients": args.clients, "models": models,
        "sent": tally["sent"], "answered": tally["answered"],
        "lost": tally["sent"] - tally["answered"], "by_status": statuses,
        "transport_errors": dict(tally["transport_errors"]), "wrong_shapes": tally["wrong"],
        "requests_per_s": round(tally["answered"] / args.duration, 1),
        "latency_p50_ms": round(statistics.median(lat) * 1e3, 1) if lat else None,
        "latency_p99_ms": round(percentile(lat, 0.99) * 1e3, 1),
        "latency_max_ms": round(max(lat) * 1e3, 1) if lat else None,
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "before": before, "after": after,
        # every 30 s under load: a leak grows from sample to sample, a pool levels off
        "under_load": {key: [s[key] for s in tally["samples"]]
                       for key in ("fds", "threads", "rss_bytes")},
        "redis_kills": redis.kills, "limit_changes": tally["limit_changes"],
        "republished": tally["republished"], "republish_skipped": tally["republish_skipped"],
        "table_reloads": reloads, "store_errors": store_errors,
    }


def main() -> int:
    args = arguments()
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("vbs").setLevel(logging.ERROR)  # 503s under a tight limit are expected
    models = args.model or list(MODELS)
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="vbs-soak-"))
    redis = Redis(workdir)
    redis.start()
    app = create_app(planned_settings(args, models, redis))
    server = Server(app)
    url = server.start()
    tally: dict[str, Any] = {"sent": 0, "answered": 0, "status": Counter(), "latency": [],
                             "wrong": 0, "transport_errors": Counter(), "limit_changes": 0,
                             "republished": 0, "republish_skipped": 0, "samples": []}
    before = asyncio.run(load_with_chaos(args, app, url, redis, rng, tally))
    gc.collect()
    after = process_stats()
    metrics = app.state.metrics
    reloads = {name: metrics.value("vbs_table_reloads_total", {"model": name})
               for name in app.state.registry.entries}
    store_errors = metrics.value("vbs_store_errors_total")
    server.stop()
    redis.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    report = report_of(args, models, tally, before, after, redis, reloads, store_errors)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    bad_5xx = sum(v for k, v in tally["status"].items() if k >= 500 and k not in (503, 504))
    return 1 if report["lost"] or bad_5xx or tally["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
