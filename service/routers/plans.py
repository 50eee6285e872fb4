"""``GET /plan?mem=30MB&batch=12``: the table's plan beside every strategy it is compared with.

Without ``mem`` the budget is the model's share of the device's memory now (the memory
arbiter's, ``memory_source: "share (arbiter)"``), and the answer lists every model's share.

The answer is lookups in the stored tables (``service.explain``: bounded work, so it runs on
the event loop rather than paying a thread hop), encoded with orjson, since FastAPI's generic
encoder costs many times the lookups themselves on an answer this size. Only reading the
memory free now goes to a thread.
"""

from __future__ import annotations

from typing import Annotated

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from core.errors import UsageError
from core.sizes import parse_bytes
from service.deps import ApiKey, RegistryDep
from service.errors import BAD_REQUEST, NO_MODEL, NOT_READY, UNAUTHORIZED, error_responses, \
    field_error
from service.explain import explain
from service.claims import of as claims_of

router = APIRouter(tags=["plans"], dependencies=[ApiKey])


@router.get("/plan", summary="The plan for a memory budget and request size",
            responses=error_responses({**BAD_REQUEST, **UNAUTHORIZED, **NO_MODEL, **NOT_READY}))
async def get_plan(
        request: Request, registry: RegistryDep,
        mem: Annotated[str | None, Query(description="budget: bytes or 30MB, 2GiB; default: the "
                                                     "model's share of the memory free now")] = None,
        batch: Annotated[int | None, Query(description="request size; default: the table's largest")] = None,
        model: Annotated[str | None, Query(description="served model name; default: the only one")] = None,
        program: Annotated[bool, Query(description="also list every step of each plan")] = False,
) -> Response:
    claims_of(request.state).endpoint = "plan"
    entry = registry.planned_entry(model)
    claims_of(request.state).model = entry.name
    table = entry.table
    r = table.batch_max if batch is None else batch
    if not 1 <= r <= table.batch_max:
        raise field_error("batch", f"{r} is outside 1..{table.batch_max}, the request sizes of "
                                   f"{entry.name}'s table")
    memory: dict[str, object] = {}
    if mem is None:  # the model's share now (what its next batch may plan for)
        budget = await run_in_threadpool(registry.memory.allowance, entry.name)
        sharing = registry.memory.sharing()  # the device's one owner: the model's share of it
        source = f"share ({sharing['mode']})"
        memory = {"memory_shares": sharing["shares"],
                  "memory_free_for_plans": sharing["budget_bytes"]}
    else:
        try:
            budget, source = parse_bytes(mem), "query"
        except UsageError as exc:
            raise field_error("mem", str(exc)) from exc
    answer = {**explain(entry, r, budget, program=program), "memory_source": source, **memory}
    return Response(orjson.dumps(answer), media_type="application/json")
