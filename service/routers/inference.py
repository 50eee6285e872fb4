"""``POST /infer``: tensors (JSON, .npy, raw bytes) or images in, outputs or top-k labels out.

A ``LeanRoute``: the handler declares only the request; ``inference_call`` checks the API
key, validates the query (``InferQuery``) and reads the body without FastAPI's per-request
dependency solving (see ``service.deps``); ``lean_openapi`` documents both.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from service import serving
from service.fast.route import LeanRoute
from service.deps import InferQuery, lean_openapi
from service.errors import error_responses
from service.wire import FORMATS

router = APIRouter(tags=["inference"], route_class=LeanRoute)

_BODY = {
    "requestBody": {
        "required": True,
        "description": "samples of the model's planned input shape, as JSON, .npy, raw bytes "
                       "or images",
        "content": {kind: media for f in FORMATS for kind, media in f.openapi.items()},
    },
}

_ERRORS = error_responses({
    400: "a bad field, shape, dtype or encoding ({\"error\": ...} names it)",
    401: "missing or wrong API key",
    404: "no such model",
    413: "body or samples over the limit (max_body_bytes, max_json_bytes, "
         "max_samples_per_request), or more than fits under the memory limit",
    415: "unsupported Content-Type",
    503: "loading, queue full, shutting down or no memory now, before the body is read "
         "(Retry-After)",
    504: "not answered within request_timeout_s",
})


@router.post("/infer", openapi_extra=lean_openapi(InferQuery, _BODY), responses=_ERRORS,
             summary="Run samples through a model with the plan for the memory free now")
async def post_infer(request: Request) -> Response:
    return await serving.answer(request, "infer", InferQuery, None,
                                lambda body, query: serving.decode_infer(request, body, query),
                                serving.infer_response)
