"""The Open Inference Protocol's model repository, as Triton's explicit model control:
``POST /v2/repository/index`` lists every model and its state, ``POST
/v2/repository/models/{name}/load`` loads one (making room for it as a request would: the
least recently used idle models unloaded) and ``.../unload`` unloads one once the requests
it was given are answered; it then stays unloaded until loaded again (a request for it gets
503 saying so). The answers are Triton's, so tritonclient's ``get_model_repository_index``,
``load_model`` and ``unload_model`` work; their gRPC twins are in ``service.grpc_api``. The
API key guards them, as it guards inference.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.deps import ApiKey, RegistryDep
from service.errors import (BAD_REQUEST, NO_MODEL, UNAUTHORIZED, error_responses,
                            field_error)
from service.claims import of as claims_of

router = APIRouter(prefix="/v2/repository", tags=["model repository"], dependencies=[ApiKey])
MAX_BODY = 64 * 1024  # a repository request carries a few parameters


def check_repository(name: str, where: str) -> None:
    """A server has one repository, unnamed (gRPC's ``repository_name``)."""
    if name:
        raise field_error(where, f"{name!r}: this server has one model repository, unnamed; "
                                 "leave it empty")


def check_parameters(params: dict[str, Any], where: str, *, loading: bool) -> None:
    """A load takes no parameters (Triton's ``config`` and ``file:`` overrides are refused),
    an unload only ``unload_dependents`` (true or false: a model here has no dependents)."""
    for name, value in params.items():
        if loading and (name == "config" or name.startswith("file:")):
            raise field_error(f"{where}.{name}", "vbs-serve takes no model configuration or "
                                                 "files on load: a model is what --model "
                                                 "names, its plans what the store holds")
        if not loading and name == "unload_dependents":
            if not isinstance(value, bool):
                raise field_error(f"{where}.{name}", "must be true or false")
            continue
        raise field_error(f"{where}.{name}", "unknown; " + (
            "a load takes no parameters" if loading else "an unload takes unload_dependents"))


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object (an empty body: none), refusing what is not one."""
    data = await request.body()
    if len(data) > MAX_BODY:
        raise field_error("body", f"{len(data)} bytes are more than the {MAX_BODY} a "
                                  "repository request may have")
    if not data.strip():
        return {}
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise field_error("body", f"not JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise field_error("body", "must be a JSON object")
    return body


def _documented(properties: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads an optional JSON object itself."""
    return {"requestBody": {"required": False, "content": {"application/json": {"schema": {
        "type": "object", "properties": properties}}}}}


INDEX_BODY = _documented({"ready": {"type": "boolean", "default": False,
                                    "description": "only the models loaded now"}})
LOAD_BODY = _documented({"parameters": {"type": "object", "description": "none taken (Triton's "
                                        "config and file: overrides are refused)"}})
UNLOAD_BODY = _documented({"parameters": {"type": "object", "properties": {
    "unload_dependents": {"type": "boolean", "description": "accepted: a model here has no "
                                                            "dependents"}}}})


def _parameters(body: dict[str, Any]) -> dict[str, Any]:
    params = body.get("parameters", {})
    if not isinstance(params, dict):
        raise field_error("parameters", "must be a JSON object")
    return params


@router.post("/index", summary="Every model and its state (Triton's repository index)",
             openapi_extra=INDEX_BODY,
             responses=error_responses({**BAD_REQUEST, **UNAUTHORIZED}))
async def post_index(request: Request, registry: RegistryDep) -> JSONResponse:
    claims_of(request.state).endpoint = "models"
    body = await _body(request)
    ready = body.get("ready", False)
    if not isinstance(ready, bool):
        raise field_error("ready", "must be true or false")
    return JSONResponse(registry.residency.index(ready=ready))


@router.post("/models/{name}/load", summary="Load a model, making room for it",
             openapi_extra=LOAD_BODY, responses=error_responses({
                 **BAD_REQUEST, **UNAUTHORIZED, **NO_MODEL,
                 413: "the model could never fit in the memory the models may take",
                 503: "it failed to load, or did not fit beside busy models in time"}))
async def post_load(name: str, request: Request, registry: RegistryDep) -> JSONResponse:
    return await _change(name, request, registry, loading=True)


@router.post("/models/{name}/unload", summary="Unload a model once its requests are answered",
             openapi_extra=UNLOAD_BODY,
             responses=error_responses({**BAD_REQUEST, **UNAUTHORIZED, **NO_MODEL}))
async def post_unload(name: str, request: Request, registry: RegistryDep) -> JSONResponse:
    return await _change(name, request, registry, loading=False)


async def _change(name: str, request: Request, registry: Any, *, loading: bool) -> JSONResponse:
    """Load or unload model ``name``, its body's parameters checked; its index entry after."""
    claims_of(request.state).endpoint = "models"
    entry = registry.get(name)
    claims_of(request.state).model = entry.name
    check_parameters(_parameters(await _body(request)), "parameters", loading=loading)
    residency = registry.residency
    await (residency.load(entry) if loading else residency.unload(entry))
    return JSONResponse(residency.index_of(entry))
