"""The traffic bench/many_models.py sends every server alike: closed-loop clients, each
request one sample for a model drawn from a Zipf law, and the client that drives Triton's
explicit mode (loads and unloads as well as a client can)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from typing import Any

import httpx
import numpy as np


def zipf(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


class Explicit:
    """Triton's explicit mode driven from the client: LRU over the loaded models, within the
    memory the client knows Triton has for them (the limit less the idle server and a margin),
    from each model's footprint measured alone."""

    def __init__(self, http: httpx.AsyncClient, cost: dict[str, int], capacity: int) -> None:
        self.http, self.cost, self.capacity = http, cost, capacity
        self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.busy: collections.Counter[str] = collections.Counter()
        self.lock = asyncio.Lock()
        self.loads = self.unloads = self.failed_loads = 0
        self.load_s = self.unload_s = 0.0
        self.load_times: list[float] = []
        self.by_model: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])

    def fits(self, model: str) -> bool:
        return sum(self.cost[m] for m in self.loaded) + self.cost[model] <= self.capacity

    async def _unload(self, victim: str) -> None:
        t0 = time.perf_counter()
        await self.http.post(f"/v2/repository/models/{victim}/unload")
        del self.loaded[victim]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until its stub is gone and its memory back
            index = (await self.http.post("/v2/repository/index", json={})).json()
            state = next((m.get("state") for m in index if m["name"] == victim), "")
            if state not in ("READY", "UNLOADING"):
                break
            await asyncio.sleep(0.05)
        self.unloads += 1
        self.by_model[victim][1] += 1
        self.unload_s += time.perf_counter() - t0

    async def _load(self, model: str) -> bool:
        t0 = time.perf_counter()
        try:
            r = await self.http.post(f"/v2/repository/models/{model}/load")
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        spent = time.perf_counter() - t0
        self.load_s += spent
        if ok:
            self.loads += 1
            self.by_model[model][0] += 1
            self.load_times.append(spent)
            self.loaded[model] = None
        else:
            self.failed_loads += 1
        return ok

    async def preload(self, models: list[str]) -> None:
        for model in models:
            if self.fits(model):
                await self._load(model)

    async def acquire(self, model: str) -> float:
        """Make sure ``model`` is loaded and mark it busy; the seconds this client spent."""
        if model in self.loaded:
            self.loaded.move_to_end(model)
            self.busy[model] += 1
            return 0.0
        t0 = time.perf_counter()
        async with self.lock:
            if model not in self.loaded:
                while not self.fits(model):
                    idle = [m for m in self.loaded if not self.busy[m]]
                    if idle:
                        await self._unload(idle[0])
                    elif not self.loaded:
                        break
                    else:
                        await asyncio.sleep(0.005)  # every loaded model busy: wait for one
                await self._load(model)
            if model in self.loaded:
                self.loaded.move_to_end(model)
        self.busy[model] += 1
        return time.perf_counter() - t0

    def release(self, model: str) -> None:
        self.busy[model] -= 1


async def traffic(url: str, args: argparse.Namespace, body: bytes, headers: dict[str, str],
                  explicit: dict[str, int] | None, capacity: int) -> dict[str, Any]:
    """``--clients`` closed-loop clients for ``--duration`` s, each request one sample for a
    Zipf-drawn model; per request (model, status, latency, load wait, client's own cost)."""
    weights = zipf(len(args.models), args.zipf)
    records: list[tuple[str, str, float, float, float]] = []
    limits = httpx.Limits(max_connections=args.clients + 2,
                          max_keepalive_connections=args.clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as http:
        manager = Explicit(http, explicit, capacity) if explicit is not None else None
        preload_s = 0.0
        if manager is not None:
            t0 = time.perf_counter()
            await manager.preload(args.models)
            preload_s = time.perf_counter() - t0
            manager.load_s = 0.0
            manager.load_times.clear()
            manager.loads = 0
            manager.by_model.clear()
        deadline = time.perf_counter() + args.duration

        async def client(c: int) -> None:
            rng = np.random.default_rng(args.seed + c)
            while time.perf_counter() < deadline:
                model = args.models[int(rng.choice(len(args.models), p=weights))]
                t0 = time.perf_counter()
                own = wait = 0.0
                if manager is not None:
                    own = await manager.acquire(model)
                try:
                    r = await http.post(f"/v2/models/{model}/infer", content=body,
                                        headers=headers)
                    status = str(r.status_code)
                    if r.status_code == 200 and explicit is None:
                        wait = load_wait(r)
                except httpx.TimeoutException:
                    status = "timeout"
                except httpx.HTTPError:
                    status = "conn"
                finally:
                    if manager is not None:
                        manager.release(model)
                records.append((model, status, time.perf_counter() - t0, wait, own))
                if status == "conn":
                    await asyncio.sleep(0.1)  # a dead server: do not spin

        await asyncio.gather(*(client(c) for c in range(args.clients)))
    out: dict[str, Any] = {"records": records}
    if manager is not None:
        out["client"] = {"loads": manager.loads, "unloads": manager.unloads,
                         "failed_loads": manager.failed_loads, "load_s": manager.load_s,
                         "unload_s": manager.unload_s, "load_times": manager.load_times,
                         "preload_s": preload_s, "by_model": dict(manager.by_model)}
    return out


def load_wait(r: httpx.Response) -> float:
    """vbs-serve's ``load_wait_s`` from an OIP answer's parameters."""
    n = r.headers.get("inference-header-content-length")
    head = r.content[:int(n)] if n else r.content
    try:
        return float(json.loads(head).get("parameters", {}).get("load_wait_s", 0.0))
    except (ValueError, AttributeError):
        return 0.0
