"""The Open Inference Protocol v2 (KServe / Triton): health, metadata and inference.

``POST /v2/models/{name}/infer`` takes JSON tensors or the binary tensor extension
(``Inference-Header-Content-Length``); a single-input model accepts any input name. The
response's ``parameters`` name the plan that ran the batch and the time queued and running.
``GET /v2/models/{name}/config`` answers as Triton's model configuration extension does, so
Triton's own tools (perf_analyzer reads ``max_batch_size`` and the inputs' dims) can drive it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service import serving
from service.fast.route import LeanRoute
from service.deps import NoQuery, RegistryDep, lean_openapi
from service.errors import BAD_REQUEST, NO_MODEL, NOT_READY, error_responses
from service.entry import ModelEntry
from service.routers import health
from service.wire.v2 import OUTPUT_NAME, V2_OF_DTYPE

router = APIRouter(prefix="/v2", tags=["open inference protocol v2"])
SERVER_NAME = "vbs-serve"
EXTENSIONS = ["binary_tensor_data", "model_configuration"]


def server_metadata() -> dict[str, object]:
    """The server's name, release and extensions (HTTP and gRPC answer the same)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("vbs-serve")
    except PackageNotFoundError:
        release = "unknown"
    return {"name": SERVER_NAME, "version": release, "extensions": EXTENSIONS}


def model_metadata(entry: ModelEntry) -> dict[str, object]:
    """A model's OIP metadata, loaded or not (HTTP and gRPC answer the same; gRPC has no
    ``parameters``, where ``state`` says whether it is loaded now)."""
    datatype = V2_OF_DTYPE.get(entry.spec.dtype, "FP32")  # bfloat16 is sent as FP32
    table = entry.table if entry.planned else entry.estimate
    return {"name": entry.name, "versions": ["1"], "platform": "pytorch_vbs",
            "inputs": [{"name": "input", "datatype": datatype, "shape": [-1, *entry.input_shape]}],
            "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32",
                         "shape": [-1, *entry.output_shape]}],
            "parameters": {"model": entry.spec.name, "state": entry.state,
                           "batch_max": table.batch_max if table is not None else None,
                           "fingerprint": entry.fingerprint, "table_version": entry.table_version,
                           "precision": entry.precision.name if entry.precision else None}}


@router.get("", summary="Server metadata")
async def get_server() -> dict[str, object]:
    return server_metadata()


@router.get("/health/live", summary="Liveness")
async def get_live() -> dict[str, bool]:
    return {"live": True}


router.add_api_route("/health/ready", health.get_ready, methods=["GET"],
                     summary="Readiness: every model and its table loaded",
                     responses=error_responses(NOT_READY))


@router.get("/models/{name}", summary="Model metadata",
            responses=error_responses({**BAD_REQUEST, **NO_MODEL, **NOT_READY}))
async def get_model(name: str, registry: RegistryDep) -> dict[str, object]:
    return model_metadata(registry.described_entry(name))


def model_config(entry: ModelEntry, max_delay_s: float) -> dict[str, object]:
    """A ready model's configuration as Triton writes one (``config.pbtxt`` as JSON): the
    largest batch its table plans, its tensors without the batch dimension, its batcher."""
    datatype = "TYPE_" + V2_OF_DTYPE.get(entry.spec.dtype, "FP32")
    kind = "KIND_GPU" if entry.spec.device.startswith("cuda") else "KIND_CPU"
    precision = entry.precision
    return {"name": entry.name, "platform": "pytorch_vbs", "backend": "vbs",
            "max_batch_size": entry.table.batch_max,
            "input": [{"name": "input", "data_type": datatype, "format": "FORMAT_NONE",
                       "dims": list(entry.input_shape)}],
            "output": [{"name": OUTPUT_NAME, "data_type": "TYPE_FP32",
                        "dims": list(entry.output_shape)}],
            "dynamic_batching": {"max_queue_delay_microseconds": int(max_delay_s * 1e6)},
            # what its ONNX Runtime units run at (``core.precision``), as Triton's parameters
            "parameters": {"precision": {"string_value": precision.name if precision else
                                         "float32"}},
            "instance_group": [{"name": f"{entry.name}_0", "kind": kind, "count": 1}]}


@router.get("/models/{name}/config", summary="Model configuration (Triton's extension)",
            responses=error_responses({**BAD_REQUEST, **NO_MODEL, **NOT_READY}))
async def get_model_config(name: str, registry: RegistryDep) -> dict[str, object]:
    return model_config(registry.planned_entry(name), registry.settings.max_batch_delay_ms / 1e3)


@router.get("/models/{name}/ready", summary="Model readiness",
            responses=error_responses({**BAD_REQUEST, **NO_MODEL, **NOT_READY}))
async def get_model_ready(name: str, registry: RegistryDep) -> JSONResponse:
    entry = registry.get(name)
    if entry.ready:
        return JSONResponse({"name": entry.name, "ready": True})
    why = (f"model {entry.name} is {entry.state}" + (f": {entry.error or entry.reason}"
                                                     if entry.error or entry.reason else ""))
    return JSONResponse({"error": why, "name": entry.name, "ready": False,
                         "state": entry.state}, status_code=503, headers={"Retry-After": "5"})


async def post_model_infer(request: Request, name: str) -> Response:
    """A ``LeanRoute``: declares only the request and the path (see
    ``service.routers.inference``)."""
    return await serving.answer(request, "v2_infer", NoQuery, name,
                                lambda body, _: serving.decode_v2(request, name, body),
                                serving.v2_response)


router.add_api_route(
    "/models/{name}/infer", post_model_infer, methods=["POST"], route_class_override=LeanRoute,
    openapi_extra=lean_openapi(NoQuery, {}), summary="Inference (OIP v2)",
    responses=error_responses({
        400: "a bad tensor ({\"error\": ...} names the field)",
        401: "missing or wrong API key", 404: "no such model",
        413: "body or samples over the limit (max_body_bytes, max_json_bytes, "
             "max_samples_per_request), or more than fits under the memory limit",
        503: "loading, queue full, shutting down or no memory now (Retry-After)",
        504: "not answered within request_timeout_s"}))
