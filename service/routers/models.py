"""``GET /models``: what is served, each model's state (loaded or not: ``service.residency``),
its input and output shapes, its current table, how the device's memory is shared among the
models (budget, shares, leases, high water), what the loaded models keep and may take
together (``models_memory``), and the memory limit that applies (``memory_limit``: the
cgroup's limit, its working set, what admitted requests hold and what the plans may use;
``workers.device_memory``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service.deps import RegistryDep
from service.claims import of as claims_of

router = APIRouter(tags=["models"])


@router.get("/models", summary="The served models and their tables")
async def get_models(request: Request, registry: RegistryDep) -> dict[str, Any]:
    claims_of(request.state).endpoint = "models"
    return {"models": [e.describe() for e in registry.entries.values()],
            "ready": registry.ready, "store_up": registry.store_up, "memory": registry.arbiters(),
            "memory_limit": registry.memory.report().to_json(),
            "models_memory": {"capacity_bytes": registry.memory.models.capacity(),
                              "kept_bytes": registry.memory.models.kept(),
                              "configured_bytes": registry.memory.total or None}}
