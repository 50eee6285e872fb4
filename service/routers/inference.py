"""``POST /infer``: tensors (JSON, .npy, raw bytes) or images in, outputs or top-k labels out."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from service import serving
from service.deps import ApiKey, BodyDep, RegistryDep, SettingsDep
from service.errors import error_responses

router = APIRouter(tags=["inference"], dependencies=[ApiKey])

_BODY = {
    "requestBody": {
        "required": True,
        "description": "samples of the model's planned input shape, as JSON, .npy, raw bytes "
                       "or images",
        "content": {
            "application/json": {"schema": {
                "type": "object", "required": ["inputs"],
                "properties": {
                    "inputs": {"type": "array", "description": "samples, nested lists "
                               "[N, *input_shape] (or flat with 'shape')", "items": {}},
                    "shape": {"type": "array", "items": {"type": "integer"}},
                    "dtype": {"type": "string", "default": "float32"},
                    "model": {"type": "string"}, "top_k": {"type": "integer", "minimum": 1}}}},
            "application/x-npy": {"schema": {"type": "string", "format": "binary"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {"schema": {
                "type": "object", "properties": {"files": {
                    "type": "array", "items": {"type": "string", "format": "binary"}}}}},
            "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
            "image/png": {"schema": {"type": "string", "format": "binary"}},
        },
    },
}

_ERRORS = error_responses({
    400: "a bad field, shape, dtype or encoding ({\"error\": ...} names it)",
    401: "missing or wrong API key",
    404: "no such model",
    413: "body or samples over the limit (max_body_bytes, max_json_bytes, max_samples_per_request)",
    415: "unsupported Content-Type",
    503: "loading, queue full, shutting down or no memory now (Retry-After)",
    504: "not answered within request_timeout_s",
})


@router.post("/infer", openapi_extra=_BODY, responses=_ERRORS,
             summary="Run samples through a model with the plan for the memory free now")
async def post_infer(
        request: Request, registry: RegistryDep, settings: SettingsDep, body: BodyDep,
        model: Annotated[str | None, Query(description="served model name; default: the only one")] = None,
        top_k: Annotated[int | None, Query(ge=1, description="return the k best labels")] = None,
        shape: Annotated[str | None, Query(description="octet-stream: the tensor's shape")] = None,
        dtype: Annotated[str | None, Query(description="octet-stream: the values' dtype")] = None,
) -> Response:
    request.state.vbs_endpoint = "infer"
    decoded = await serving.decode_infer(request, body, registry, settings,
                                         model=model, top_k=top_k, shape=shape, dtype=dtype)
    outcome = await serving.run(decoded, settings, request.state)
    return serving.infer_response(decoded, outcome)
