"""Several models, one device: three real torchvision models in one service under one memory
limit, each on its own torch thread (so their batches run at once), with concurrent clients
on all three over real HTTP (uvicorn on 127.0.0.1).

What must hold: every request is answered with model(x); the memory arbiter checked the sum
of live leases against the budget at every grant and never found it over; no OOM retry; every
model ran (none starved); an idle model's share goes to the busy ones and comes back when it
gets busy; ``/metrics``, ``/models`` and ``/plan`` show budget, shares and leases.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from core.loaded import ModelSpec
from planner.pipeline import prepare
from service.settings import Settings
from planner.store import open_store
from service.main import create_app
from tests.service.conftest import Gate, ServerThread, assert_close, reference, run, wait_until

SHAPE = (3, 32, 32)
MODELS = ("squeezenet1_0", "mobilenet_v2", "resnet18")


def npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x)
    return buf.getvalue()


def metric(text: str, name: str, **labels: str) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{want} not in /metrics")


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory, vbs_cache: Path) -> Settings:
    """Three models planned into a store (as `vbs plan` does), served under a memory limit
    that lets each run its fastest plan alone but not the three at once."""
    store = tmp_path_factory.mktemp("memory-store")
    base: dict[str, Any] = dict(
        cache_dir=vbs_cache, store=str(store), batch_max=4, profile_repeats=1, profile_warmup=0,
        slot_count=64, models=[f"{m}@3x32x32" for m in MODELS], cpu_model_threads="per_model",
        max_batch_delay_ms=2, request_timeout_s=60, store_poll_s=0.05,
        grpc_port=0)  # no gRPC: the default port may be another server's
    plan = Settings(**base)
    tables = {}
    with open_store(plan.store_location) as st:
        for name in MODELS:
            tables[name] = prepare(ModelSpec(name, input_shape=SHAPE), plan, st,
                                   batch_max=4, progress=False).table
    tops = [t.top_bytes for t in tables.values()]
    limit = max(tops) // 2 + sum(int(t.min_peaks[3]) for t in tables.values())
    assert sum(tops) > limit > max(int(t.min_peaks[3]) for t in tables.values())
    return Settings(**base, memory_limit_bytes=limit)


def test_three_models_at_once_share_the_memory_without_overrun(settings: Settings) -> None:
    app = create_app(settings)
    limit = settings.memory_limit_bytes

    async def client(http: httpx.AsyncClient, model: str, seed: int, rounds: int) -> list[str]:
        problems = []
        entry = app.state.registry.entries[model]
        for k in range(rounds):
            x = np.random.default_rng(seed * 100 + k).standard_normal(
                (1 + k % 2, *SHAPE)).astype(np.float32)
            r = await http.post("/infer", params={"model": model}, content=npy(x),
                                headers={"content-type": "application/x-npy"})
            if r.status_code != 200:
                problems.append(f"{model}: {r.status_code} {r.text}")
                continue
            body = r.json()
            assert_close(body["outputs"], reference(entry, x))
            for plan in body["plans"]:
                assert plan["peak_bytes"] <= plan["budget_bytes"] <= limit
        return problems

    async def main() -> None:
        with ServerThread(app) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                text = (await http.get("/metrics")).text  # before any batch: known already
                assert metric(text, "vbs_memory_budget_bytes", device="cpu") == limit
                # Phase 1: three clients on each model, all at once.
                jobs = [client(http, m, 10 * i + c, 6) for i, m in enumerate(MODELS)
                        for c in range(3)]
                problems = [p for got in await asyncio.gather(*jobs) for p in got]
                assert not problems, problems  # none lost, none refused: nothing starved
                memory = (await http.get("/models")).json()["memory"]
                assert len(memory) == 1
                state = memory[0]
                assert state["mode"] == "arbiter" and not state["serial"]
                assert state["budget_bytes"] == limit
                assert state["grants"] >= 3 * 3 * 6 // 4  # batches gather up to 4 samples
                assert state["overcommits"] == 0 and state["min_headroom_bytes"] >= 0
                assert 0 < state["high_water_bytes"] <= limit and state["leased_bytes"] == 0
                text = (await http.get("/metrics")).text
                assert metric(text, "vbs_memory_budget_bytes", device="cpu") == limit
                for m in MODELS:
                    assert metric(text, "vbs_samples_total", model=m) == 3 * (1 + 2 + 1 + 2 + 1 + 2)
                    assert metric(text, "vbs_memory_lease_bytes", model=m) == 0
                    assert metric(text, "vbs_oom_retries_total", model=m) == 0
                    metric(text, "vbs_memory_lease_waits_total", model=m)
                    metric(text, "vbs_memory_step_downs_total", model=m)
                assert metric(text, "vbs_memory_overcommits_total", device="cpu") == 0

                # Phase 2: one model busy, the others idle: the busy one gets all the memory;
                # an idle one, once busy, gets a share back.
                registry = app.state.registry
                busy, idle = registry.entries[MODELS[2]], registry.entries[MODELS[0]]
                gates = {e.name: Gate(e) for e in (busy, idle)}
                x = np.zeros((2, *SHAPE), np.float32)
                first = asyncio.create_task(http.post(
                    "/infer", params={"model": busy.name}, content=npy(x),
                    headers={"content-type": "application/x-npy"}))
                await asyncio.wait_for(gates[busy.name].entered.wait(), 30)
                shares = (await http.get("/models")).json()["memory"][0]["shares"]
                assert shares[busy.name] == limit and shares[idle.name] == 0
                plan = (await http.get("/plan", params={"model": idle.name})).json()
                assert plan["memory_source"] == "share (arbiter)"
                assert plan["memory_shares"] == shares and plan["memory_budget"] == 0
                second = asyncio.create_task(http.post(
                    "/infer", params={"model": idle.name}, content=npy(x),
                    headers={"content-type": "application/x-npy"}))
                await asyncio.wait_for(gates[idle.name].entered.wait(), 30)
                shares = (await http.get("/models")).json()["memory"][0]["shares"]
                need = int(idle.table.min_peaks[0])
                assert shares[idle.name] >= need and shares[busy.name] < limit
                text = (await http.get("/metrics")).text
                assert metric(text, "vbs_memory_share_bytes", model=idle.name) == shares[idle.name]
                for gate in gates.values():
                    gate.remove()
                for task in (first, second):
                    r = await task
                    assert r.status_code == 200, r.text
                await wait_until(lambda: registry.memory.sharing()["leased_bytes"] == 0, what="leases back")

    run(main(), timeout_s=300)


def test_settings_name_served_models_and_the_modes(settings: Settings,
                                                   make_settings: Callable[..., Settings]) -> None:
    with pytest.raises(ValueError, match="memory_weights: 'nope' is not a served model"):
        make_settings(memory_weights="nope=2")
    with pytest.raises(ValueError, match="memory_sharing"):
        make_settings(memory_sharing="fair")
    s = make_settings(memory_weights="tiny=2", memory_minimums="tiny=1MB", memory_sharing="static")
    assert s.memory_weights == {"tiny": 2.0} and s.memory_minimums == {"tiny": 1_000_000}
