"""Issue 47's done-when, with a real cgroup: one `vbs serve` given five models inside a memory
cgroup that holds the largest of them alone plus 200 MiB, but not all five, answers every
request of traffic that cycles through all five; nothing is killed, nothing lost; the metrics
show the loads and unloads.

The five (``tests.service.heavy``: 40 to 120 MB of weights each, 400 MB together) are planned
into a store first, as `vbs plan` would; the limit is measured: a `vbs serve` of the largest
alone, warmed, its group's working set idle, plus 200 MiB. Needs root and a writable memory
cgroup, as ``test_memory_limit.py``; skipped with the reason elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from bench.memory_group import MemoryGroup, NoGroup
from core.loaded import ModelSpec
from planner.pipeline import prepare
from planner.store import open_store
from service.settings import Settings
from tests.conftest import free_port
from tests.workers.cgroups import serve_in_group, stop_server, wait_ready
from tests.service.heavy import INPUT

MiB = 2**20
HEADROOM = 200 * MiB
SIZES = (40, 60, 80, 100, 120)  # MB of weights
MODELS = [f"m{mb}=tests.service.heavy:heavy_{mb}@3x8x8" for mb in SIZES]
LARGEST = MODELS[-1]
ROUNDS, CLIENTS = 2, 2
READY_S = 120.0
ENV = {"VBS_PROFILE_REPEATS": "1", "VBS_PROFILE_WARMUP": "0", "VBS_SLOT_COUNT": "64",
       "VBS_RUNTIME": "torch", "VBS_BATCH_MAX": "4", "VBS_GRPC_PORT": "0"}


@pytest.fixture
def group() -> Iterator[MemoryGroup]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a memory cgroup (run the suite as root, or in a "
                    "container with cgroup write access)")
    try:
        made = MemoryGroup.create(f"vbs-many-{os.getpid()}-{time.monotonic_ns()}")
    except NoGroup as exc:
        pytest.skip(str(exc))
    try:
        yield made
    finally:
        made.remove()


def _env(tmp: Path) -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, **ENV, "VBS_CACHE_DIR": str(tmp / "cache"),
            "VBS_STORE": str(tmp / "store"),
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def _plan(tmp: Path) -> None:
    """The five models' tables in the store, as `vbs plan` puts them (the server only reads)."""
    settings = Settings(cache_dir=tmp / "cache", store=str(tmp / "store"), profile_repeats=1,
                        profile_warmup=0, slot_count=64, runtime="torch", batch_max=4)
    with open_store(settings.store_location) as store:
        for model in MODELS:
            name = model.split("=")[1].split("@")[0]
            prepare(ModelSpec(name, input_shape=INPUT), settings, store, batch_max=4,
                    progress=False)


def _serve(group: MemoryGroup, tmp: Path, port: int, models: list[str], log: str
           ) -> subprocess.Popen[bytes]:
    serve = [sys.executable, "-c", "from service.commands import main; main()", "serve",
             "--port", str(port), "--log-level", "info", "--request-timeout", "60"]
    for model in models:
        serve += ["--model", model]
    return serve_in_group(group.path, serve, _env(tmp), tmp / log)


def _v2(x: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.ravel().tolist()}]}


def _largest_alone(group: MemoryGroup, tmp: Path) -> int:
    """The working set of a warmed `vbs serve` of the largest model alone, idle."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(group, tmp, port, [LARGEST], "alone.log")
    try:
        wait_ready(url, proc, tmp / "alone.log", READY_S)
        x = np.zeros((4, *INPUT), np.float32)
        r = httpx.post(url + "/v2/models/m120/infer", json=_v2(x), timeout=60)
        assert r.status_code == 200, r.text
        time.sleep(0.6)  # idle: what stays
        return group.working_set()
    finally:
        stop_server(proc)


async def _traffic(url: str) -> list[tuple[str, int, str]]:
    """CLIENTS clients, each cycling through every model ROUNDS times, one request at a time."""
    names = [m.split("=")[0] for m in MODELS]

    async def client(http: httpx.AsyncClient, c: int) -> list[tuple[str, int, str]]:
        out = []
        for k in range(ROUNDS * len(names)):
            name = names[(c + k) % len(names)]
            x = np.random.default_rng(k).standard_normal((1 + k % 2, *INPUT)).astype(np.float32)
            r = await http.post(f"{url}/v2/models/{name}/infer", json=_v2(x))
            out.append((name, r.status_code, r.text[:300] if r.status_code != 200 else ""))
        return out

    async with httpx.AsyncClient(timeout=120) as http:
        found = await asyncio.gather(*(client(http, c) for c in range(CLIENTS)))
    return [one for got in found for one in got]


def test_five_models_in_a_cgroup_that_holds_the_largest_plus_200_mib(
        group: MemoryGroup, tmp_path: Path) -> None:
    _plan(tmp_path)
    group.set_limit(4096 * MiB)  # loose while the largest alone is measured
    limit = _largest_alone(group, tmp_path) + HEADROOM
    assert sum(SIZES) * 10**6 > HEADROOM + SIZES[-1] * 10**6  # all five do not fit
    group.set_limit(limit)
    group.reset_peak()
    kills = group.oom_kills()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(group, tmp_path, port, MODELS, "serve.log")
    try:
        wait_ready(url, proc, tmp_path / "serve.log", READY_S)
        models = httpx.get(url + "/models", timeout=10).json()
        assert models["memory_limit"]["limit_bytes"] == limit
        loaded = [m["name"] for m in models["models"] if m["state"] == "ready"]
        assert 0 < len(loaded) < len(MODELS), models["models"]  # not all five at start

        out = asyncio.run(asyncio.wait_for(_traffic(url), 240))

        assert proc.poll() is None, "vbs serve was killed"
        assert group.oom_kills() == kills
        failed = [o for o in out if o[1] != 200]
        if failed:
            print(httpx.get(url + "/models", timeout=10).json()["memory_limit"],
                  httpx.get(url + "/models", timeout=10).json()["models_memory"])
            print((tmp_path / "serve.log").read_text()[-6000:])
        assert failed == []  # every request answered
        assert len(out) == CLIENTS * ROUNDS * len(MODELS)
        peak = group.peak()
        assert peak is None or group.version == 2 or peak < limit, (peak, limit)
        text = httpx.get(url + "/metrics", timeout=10).text
        counts = {kind: sum(float(line.split()[-1]) for line in text.splitlines()
                            if line.startswith(f"vbs_model_{kind}_total{{"))
                  for kind in ("loads", "unloads")}
        assert counts["unloads"] >= 1 and counts["loads"] >= len(MODELS), counts
        print(f"limit {limit >> 20} MiB, peak {(peak or 0) >> 20} MiB, {counts}")
    finally:
        stop_server(proc)
