"""Liveness and readiness (open: no API key)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.deps import RegistryDep
from service.errors import NOT_READY, error_responses
from service.registry import Registry
from service.claims import of as claims_of

router = APIRouter(prefix="/health", tags=["health"])


def readiness(registry: Registry) -> JSONResponse:
    models = {e.name: e.state for e in registry.entries.values()}
    if registry.ready:
        return JSONResponse({"ready": True, "models": models, "store_up": registry.store_up})
    return JSONResponse({"error": registry.not_ready_reason(), "ready": False, "models": models},
                        status_code=503, headers={"Retry-After": "5"})


@router.get("/live", summary="Liveness: the process answers")
async def get_live(request: Request) -> dict[str, bool]:
    claims_of(request.state).endpoint = "health"
    return {"live": True}


@router.get("/ready", summary="Readiness: every model and its table loaded",
            responses=error_responses(NOT_READY))
async def get_ready(request: Request, registry: RegistryDep) -> JSONResponse:
    claims_of(request.state).endpoint = "health"
    return readiness(registry)
