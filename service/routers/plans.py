"""``GET /plan?mem=30MB&batch=12``: the table's plan, FBS and Greedy side by side."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from planner.errors import UsageError
from planner.solver.memory import parse_bytes
from service.deps import ApiKey, RegistryDep
from service.errors import field_error
from service.explain import explain

router = APIRouter(tags=["plans"], dependencies=[ApiKey])


@router.get("/plan", summary="The plan for a memory budget and request size",
            responses={400: {"description": "bad mem or batch"}, 404: {"description": "no such model"}})
async def get_plan(
        request: Request, registry: RegistryDep,
        mem: Annotated[str | None, Query(description="budget: bytes or 30MB, 2GiB; default: free now")] = None,
        batch: Annotated[int | None, Query(description="request size; default: the table's largest")] = None,
        model: Annotated[str | None, Query(description="served model name; default: the only one")] = None,
) -> dict[str, Any]:
    request.state.vbs_endpoint = "plan"
    entry = registry.ready_entry(model)
    request.state.vbs_model = entry.name
    table = entry.table
    r = table.batch_max if batch is None else batch
    if not 1 <= r <= table.batch_max:
        raise field_error("batch", f"{r} is outside 1..{table.batch_max}, the request sizes of "
                                   f"{entry.name}'s table")
    if mem is None:
        budget, source = await run_in_threadpool(entry.worker.probe.free), "free now"
    else:
        try:
            budget, source = parse_bytes(mem), "query"
        except UsageError as exc:
            raise field_error("mem", str(exc)) from exc
    answer = await run_in_threadpool(explain, entry, r, budget)
    return {**answer, "memory_source": source}
