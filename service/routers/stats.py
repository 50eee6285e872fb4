"""``GET /models/{name}/stats``: one model's live figures for the page, as JSON.

Memory free now (read as the worker reads it), queue, throughput and p50/p99 latency over
the last seconds, OOM retries, the plan the last batch ran, and the table served with when it
was loaded (``service.live``). The router's lifespan runs the task that stamps table loads.
Needs the API key when one is set, like ``/plan``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.concurrency import run_in_threadpool

from service.deps import ApiKey, MetricsDep, RegistryDep
from service.live import watch_tables
from service.claims import of as claims_of


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    registry, live = app.state.registry, app.state.metrics.live
    task = asyncio.create_task(watch_tables(lambda: registry.entries.values(), live),
                               name="vbs-table-stamps")
    try:
        yield
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task


router = APIRouter(prefix="/models", tags=["models"], dependencies=[ApiKey], lifespan=lifespan)


@router.get("/{name}/stats", summary="Live figures of one model",
            responses={401: {"description": "missing or wrong API key"},
                       404: {"description": "no such model"},
                       503: {"description": "model loading or failed"}})
async def get_stats(name: str, request: Request, registry: RegistryDep,
                    metrics: MetricsDep) -> dict[str, Any]:
    claims_of(request.state).endpoint = "models"
    entry = registry.planned_entry(name)
    claims_of(request.state).model = entry.name
    probe = registry.memory.probe
    free = await run_in_threadpool(probe.free)
    live = metrics.live
    figures = live.figures(entry.name)
    table = entry.table
    stamp = live.note_table(entry.name, table, entry.table_version)
    batcher = entry.batcher
    return {
        "model": entry.name, "window_s": figures.window_s,
        "memory_free_bytes": free, "memory_limit_bytes": probe.limit, "state": entry.state,
        "cgroup_limit": registry.memory.report().to_json(),
        "queue": batcher.waiting if batcher else 0,
        "running": bool(batcher and batcher.running),
        "requests": figures.requests, "samples": figures.samples,
        "samples_per_s": figures.samples_per_s,
        "latency_p50_s": figures.p50_s, "latency_p99_s": figures.p99_s,
        "samples_total": int(metrics.total(metrics.samples, entry.name)),
        "oom_retries_total": int(metrics.total(metrics.oom_retries, entry.name)),
        "batch_splits_total": int(metrics.total(metrics.splits, entry.name)),
        "last_batch": asdict(figures.last) if figures.last is not None else None,
        "table": {"id": entry.table_id, "version": entry.table_version, "solver": table.solver,
                  "kind": "interim" if entry.interim else "planned",
                  "plans": len(table.plans), "loaded_at": stamp.loaded_at,
                  "stored_at": entry.table_meta.get("stored_at")},
    }
