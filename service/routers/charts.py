"""``GET /models/{name}/curves`` and ``GET /models/{name}/tree``: what the page draws plans with.

Curves: every strategy's time per sample against memory for one request size (the paper's
Fig. 7), one point per plan of the table's row, read from the stored tables; the page's
memory slider spans them. Tree: the model's division tree (units in order, branches under
their block), so the page groups a plan's units as the model is built. Both are lookups,
cached per table; they need the API key when one is set, as ``/plan`` does.
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from planner.view.data import curves, tree
from service.deps import ApiKey, RegistryDep
from service.errors import field_error
from service.claims import of as claims_of

router = APIRouter(prefix="/models", tags=["models"], dependencies=[ApiKey])

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "bad batch"}, 401: {"description": "missing or wrong API key"},
    404: {"description": "no such model"}, 503: {"description": "model loading or failed"}}


@router.get("/{name}/curves", summary="Time per sample against memory, every strategy",
            responses=_ERRORS)
async def get_curves(
        name: str, request: Request, registry: RegistryDep,
        batch: Annotated[int | None, Query(description="request size; default: the table's largest")] = None,
) -> Response:
    claims_of(request.state).endpoint = "models"
    entry = registry.planned_entry(name)
    claims_of(request.state).model = entry.name
    table, tables = entry.table, entry.tables
    r = table.batch_max if batch is None else batch
    if not 1 <= r <= table.batch_max:
        raise field_error("batch", f"{r} is outside 1..{table.batch_max}, the request sizes of "
                                   f"{entry.name}'s table")
    answer = entry.cached(("curves", id(table), r), lambda: orjson.dumps({
        "model": entry.name, "table_id": entry.table_id, "table_version": entry.table_version,
        **curves(tables, table.solver, r)}))
    return Response(answer, media_type="application/json")


@router.get("/{name}/tree", summary="The model's division tree (no measurements)",
            responses=_ERRORS)
async def get_tree(name: str, request: Request, registry: RegistryDep) -> Response:
    claims_of(request.state).endpoint = "models"
    entry = registry.planned_entry(name)
    claims_of(request.state).model = entry.name
    profile = entry.profile
    answer = entry.cached(("tree", entry.fingerprint), lambda: orjson.dumps({
        "model": entry.name, "fingerprint": entry.fingerprint, "root": tree(profile)}))
    return Response(answer, media_type="application/json")
