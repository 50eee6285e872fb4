"""``GET /metrics``: Prometheus text format (open: no API key)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.deps import MetricsDep
from service.claims import of as claims_of

router = APIRouter(tags=["metrics"])


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def get_metrics(request: Request, metrics: MetricsDep) -> Response:
    claims_of(request.state).endpoint = "metrics"
    content, media_type = metrics.render()
    return Response(content, media_type=media_type)
