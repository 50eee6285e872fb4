"""Tables change while serving: a republished table is picked up without a restart (Redis and
a directory store), Redis dies mid-traffic (serving goes on from the last table, nothing is
lost, errors are counted), the store is down at start (not ready, retried), and the memory
budget shrinks mid-traffic (plans step down, nothing fails)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from planner.pipeline import publish
from service.settings import Settings
from planner.solver.tables import build_table
from planner.store import open_store
from core.tree import Layer, Profile
from service.main import create_app
from workers.worker import Worker
from tests.service.conftest import (TINY_SHAPE, assert_close, assert_error, reference, run, running,
                                    wait_until)


def x_(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *TINY_SHAPE)).astype(np.float32)


def republish(location: str, entry: Any, solver: str) -> int:
    """What the planner does: solve the profile again (here with another slot size), publish."""
    profile = entry.prepared.profile
    table = build_table(profile, solver=solver, slot_bytes=entry.table.slot_bytes * 2)
    with open_store(location) as store:
        return publish(store, entry.spec, profile, {solver: table})[solver]


def check_republished_table_is_served(settings: Settings) -> None:
    app = create_app(settings)

    async def main() -> None:
        async with running(app) as client:
            registry = app.state.registry
            entry = registry.entries["tiny"]
            x = x_(3, 0)
            before = (await client.post("/infer", json={"inputs": x.tolist()})).json()
            assert before["table_version"] == 1 and before["plan"]["solver"] == "vbs"
            await wait_until(lambda: registry.store_up is True, what="the store watch")
            old_slot = entry.table.slot_bytes
            version = await asyncio.to_thread(republish, settings.store_location, entry, "vbs")
            assert version == 2
            await registry.wait_table("tiny", 2, timeout_s=30)
            assert entry.table.slot_bytes == 2 * old_slot
            after = (await client.post("/infer", json={"inputs": x.tolist()})).json()
            assert after["table_version"] == 2 and after["plan"]["solver"] == "vbs"
            assert_close(after["outputs"], reference(entry, x))
            (model,) = (await client.get("/models")).json()["models"]
            assert model["table"] == {**model["table"], "version": 2, "solver": "vbs",
                                      "slot_bytes": entry.table.slot_bytes}
            plan = (await client.get("/plan", params={"mem": "1MB"})).json()
            assert plan["table_version"] == 2 and plan["table_solver"] == "vbs"
            assert app.state.metrics.value("vbs_table_reloads_total", {"model": "tiny"}) == 1
            # A table of another solver (another service's VBS_SOLVER) has its own key: it is
            # not served, and the served one is not overwritten; the next vbs table brings the
            # new greedy table along for /plan.
            assert await asyncio.to_thread(republish, settings.store_location, entry, "greedy") == 2
            assert await asyncio.to_thread(republish, settings.store_location, entry, "vbs") == 3
            await registry.wait_table("tiny", 3, timeout_s=30)
            assert entry.table.solver == "vbs" and entry.tables["vbs"] is entry.table
            assert entry.tables["greedy"].slot_bytes == 4 * old_slot  # twice the v2 table's
            assert app.state.metrics.value("vbs_store_errors_total") == 0

    run(main())


def test_a_table_republished_in_redis_is_served_without_restart(
        make_settings: Callable[..., Settings], redis_url: str) -> None:
    check_republished_table_is_served(make_settings(store=redis_url))


def test_a_table_republished_in_a_directory_is_served_without_restart(
        make_settings: Callable[..., Settings]) -> None:
    check_republished_table_is_served(make_settings())


def test_serving_goes_on_when_redis_dies_mid_traffic(make_settings: Callable[..., Settings],
                                                     redis_server_factory: Callable[[], Any]) -> None:
    server = redis_server_factory()
    app = create_app(make_settings(store=server.url))

    async def main() -> None:
        async with running(app) as client:
            registry, metrics = app.state.registry, app.state.metrics
            entry = registry.entries["tiny"]
            await wait_until(lambda: registry.store_up is True, what="the store watch")
            killed = asyncio.Event()
            answers: list[tuple[np.ndarray, httpx.Response]] = []

            async def traffic(seed: int) -> None:
                for i in range(40):
                    x = x_(1 + (seed + i) % 3, seed * 100 + i)
                    answers.append((x, await client.post("/infer", json={"inputs": x.tolist()})))
                    if i == 10:
                        await killed.wait()  # every client goes on only after Redis is gone

            async def kill() -> None:
                await wait_until(lambda: len(answers) >= 15, what="traffic before the kill")
                await asyncio.to_thread(server.stop)
                killed.set()

            await asyncio.gather(kill(), *(traffic(seed) for seed in range(3)))
            await wait_until(lambda: metrics.value("vbs_store_errors_total") >= 1,
                             what="the store error counted")
            assert registry.store_up is False
            extra = x_(2, 999)
            answers.append((extra, await client.post("/infer", json={"inputs": extra.tolist()})))
            assert len(answers) == 121
            for x, r in answers:  # nothing lost, every output right
                assert r.status_code == 200, r.text
                assert_close(r.json()["outputs"], reference(entry, x))
            assert (await client.get("/v2/health/ready")).status_code == 200
            # the watch keeps retrying with backoff: more errors are counted as time goes on
            seen = metrics.value("vbs_store_errors_total")
            await wait_until(lambda: metrics.value("vbs_store_errors_total") > seen,
                             what="a retry")
            text = (await client.get("/metrics")).text
            assert "vbs_store_errors_total" in text and "vbs_store_up 0.0" in text

    run(main())


def test_a_store_down_at_start_is_retried_and_not_ready(make_settings: Callable[..., Settings],
                                                        closed_redis_url: str) -> None:
    app = create_app(make_settings(store=closed_redis_url))

    async def main() -> None:
        async with running(app, wait=False) as client:
            metrics = app.state.metrics
            await wait_until(lambda: metrics.value("vbs_store_errors_total") >= 2,
                             what="retries of the store")
            ready = await client.get("/v2/health/ready")
            message = assert_error(ready, 503, "tiny loading", "plan store unavailable")
            assert "s3cret" not in message
            assert (await client.get("/v2/health/live")).status_code == 200
            assert_error(await client.get("/v2/models/tiny/ready"), 503)
            r = await client.post("/infer", json={"inputs": x_(1, 0).tolist()})
            assert_error(r, 503, "still loading")
            assert r.headers["Retry-After"] == "5"
        # the lifespan ended cleanly while the load was being retried

    run(main())


def regular(profile: Profile) -> Profile:
    """``profile`` with a fixed cost per call (1 ms + 0.1 ms a sample) and no workspaces, on
    torch alone: larger batches are always faster and need more memory, so every budget below
    the top has its own plan (times and workspaces measured on a shared CPU are too noisy to
    promise that)."""
    def redo(node: Any) -> Any:
        if isinstance(node, Layer):
            b = range(1, len(node.time) + 1)
            return dataclasses.replace(node, time=tuple(1e-3 + 1e-4 * k for k in b),
                                       ws=tuple(0 for _ in b), runtimes=(), runtime=(),
                                       unsupported=())
        return dataclasses.replace(node, children=tuple(redo(c) for c in node.children))
    return dataclasses.replace(profile, root=redo(profile.root))


def test_plans_step_down_when_the_memory_budget_shrinks_mid_traffic(
        make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(max_batch_delay_ms=1))

    async def main() -> None:
        async with running(app) as client:
            entry = app.state.registry.entries["tiny"]
            profile = regular(entry.prepared.profile)
            worker = Worker(entry.prepared.capture, build_table(profile, slot_bytes=64),
                            entry.worker.probe)
            entry.worker = entry.batcher.worker = worker
            peaks = worker.table.row(4).peaks.tolist()
            single = int(worker.table.min_peaks[0])
            assert len(peaks) >= 2, "the tiny model's table has several plans of 4 samples"
            limits = [peaks[-1] - 1, peaks[0] - 1, single]  # smaller plans, then splits
            phase = [0]
            answers: list[tuple[int, np.ndarray, httpx.Response]] = []
            shrunk = [asyncio.Event() for _ in limits]

            async def traffic(seed: int) -> None:
                for i in range(24):
                    x = x_(4, seed * 100 + i)
                    sent_in = phase[0]  # the budget in force when the request was sent
                    answers.append((sent_in, x, await client.post("/infer",
                                                                  json={"inputs": x.tolist()})))
                    if i % 6 == 5 and i // 6 < len(limits):
                        await shrunk[i // 6].wait()

            async def shrink() -> None:
                for k, limit in enumerate(limits):
                    await wait_until(lambda k=k: len(answers) >= 8 * (k + 1), what="traffic")
                    worker.probe.limit = limit  # the budget shrinks while requests run
                    phase[0] = k + 1
                    shrunk[k].set()

            await asyncio.gather(shrink(), traffic(0), traffic(1))
            assert len(answers) == 48
            top = entry.table.plans_for(4)[-1][1].plan_id
            seen_phases = set()
            for k, x, r in answers:
                assert r.status_code == 200, r.text
                body = r.json()
                assert_close(body["outputs"], reference(entry, x))
                if k == 0:
                    continue
                # requests sent after the budget shrank ran within it
                for plan in body["plans"]:
                    assert plan["budget_bytes"] <= limits[k - 1], (k, limits, body["plans"])
                    assert plan["peak_bytes"] <= limits[k - 1]
                    assert plan["plan_id"] != top
                seen_phases.add(k)
                if k == 3:  # no plan of 4 samples fits: the batch is split
                    assert body["splits"] >= 1 and all(p["batch"] < 4 for p in body["plans"])
            assert seen_phases == {1, 2, 3}
            gauge = app.state.metrics.value("vbs_free_memory_bytes", {"model": "tiny"})
            assert gauge <= limits[-1]

    run(main())
