"""The Open Inference Protocol v2 over gRPC: KServe's ``GRPCInferenceService`` on the HTTP
service's registry, batchers and API key, answering as the HTTP API does.

Each call is its HTTP twin (``service.routers.v2``) in gRPC's terms: the same metadata, the
same readiness, inference queued on the same batcher and answered with the same parameters
(the plan, the timings). Errors are the HTTP service's, with their messages word for word, as
gRPC status codes (``CODES``): a client's mistake is ``INVALID_ARGUMENT``, ``UNAUTHENTICATED``
or ``NOT_FOUND``, never ``INTERNAL``; a model loading, a full queue or a shutdown is
``UNAVAILABLE`` with the reason and a ``retry-after`` trailer. ``ModelInfer`` needs the API key
(metadata ``authorization: Bearer <key>``) when one is set; health and metadata are open, as
over HTTP.

A call takes and gives back its claims as an HTTP request does (``service.claims``: its
model pinned, loaded first if it is not; under a memory limit a place in the HTTP requests'
line for memory, its message counted as held, since gRPC has read it already). The model
repository's calls (Triton's ``RepositoryIndex``, ``RepositoryModelLoad``,
``RepositoryModelUnload``) are ``POST /v2/repository/...``'s twins (``service.routers.
repository``), with the API key as ``ModelInfer``.

Handlers are coroutines on the event loop uvicorn runs (grpc.aio). A small request is decoded
there (raw bytes are viewed, not read), a large one in a worker thread; the batch runs on the
model's thread, which also encodes each request's output, so the loop only moves futures and
torch never runs on it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from fastapi.security.utils import get_authorization_scheme_param

from core.errors import VbsError
from service.settings import Settings
from service import grpc_codec, serving
from service.claims import Claims
from service.deps import check_api_key
from service.errors import ModelNotFoundError, field_error, status_of
from service.metrics import Metrics
from service.oip import SERVICE, pb, rpc
from service.entry import ModelEntry
from service.registry import Registry
from service.routers import repository
from service.routers.v2 import model_metadata, server_metadata
from service.wire.v2 import V2Request, v2_tensor

log = logging.getLogger("vbs.service.grpc")

# The HTTP status of an error, as a gRPC status code; anything else is INTERNAL (a bug or a
# device failure: never the client's input, which decoding refuses first).
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
         404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
         415: grpc.StatusCode.INVALID_ARGUMENT, 503: grpc.StatusCode.UNAVAILABLE,
         504: grpc.StatusCode.DEADLINE_EXCEEDED}
VERSIONS = ("", "1")  # every model has one version, "1"; empty lets the server choose it
INLINE_TYPED_BYTES = 64 * 1024  # typed values are read one by one: more go to a worker thread
AUTH_WHERE = "metadata authorization"


Handler = Callable[..., Awaitable[Any]]


def _answered(endpoint: str) -> Callable[[Handler], Handler]:
    """A servicer method counted in ``vbs_requests``/``vbs_request_latency_seconds`` under
    ``endpoint`` (status: the HTTP status of the same answer), its errors sent as status codes."""
    def wrap(method: Handler) -> Handler:
        @functools.wraps(method)
        async def handler(self: InferenceService, request: Any, context: Any) -> Any:
            started = time.perf_counter()
            call = Claims(endpoint=endpoint)
            failure: Exception | None = None
            answer = None
            try:
                answer = await method(self, request, context, call)
            except Exception as exc:  # noqa: BLE001 - every error becomes a status code
                failure = exc
            status = 200 if failure is None else status_of(failure)
            self.record(call, status, time.perf_counter() - started)
            if failure is not None:
                await _abort(context, failure, status)
            return answer
        return handler
    return wrap


async def _abort(context: Any, exc: Exception, status: int) -> None:
    """End the call with ``exc`` as the HTTP API would word it, under its gRPC code."""
    code = CODES.get(status, grpc.StatusCode.INTERNAL)
    message = " ".join(str(exc).split()) or type(exc).__name__
    if status >= 500 and not isinstance(exc, VbsError):
        log.error("gRPC call failed", exc_info=exc)
        message = f"internal error ({type(exc).__name__}): see the service log"
    elif status >= 500:
        log.warning("gRPC call: %s", message)
    trailer: tuple[tuple[str, str], ...] = ()
    if status == 503:
        trailer = (("retry-after", str(getattr(exc, "retry_after", 1))),)
    await context.abort(code, message, trailing_metadata=trailer)


class InferenceService(rpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` over one app's registry (see the module doc)."""

    def __init__(self, settings: Settings, registry: Registry, metrics: Metrics) -> None:
        self.settings = settings
        self.registry = registry
        self.metrics = metrics

    # ------------------------------------------------------------------ health and metadata

    @_answered("grpc")
    async def ServerLive(self, request: Any, context: Any, call: Claims) -> Any:  # noqa: N802
        return pb.ServerLiveResponse(live=True)

    @_answered("grpc")
    async def ServerReady(self, request: Any, context: Any, call: Claims) -> Any:  # noqa: N802
        return pb.ServerReadyResponse(ready=self.registry.ready)

    @_answered("grpc")
    async def ModelReady(self, request: Any, context: Any, call: Claims) -> Any:  # noqa: N802
        # an unknown model or version is not ready (tritonclient's HTTP client reads the 404
        # of GET /v2/models/{name}/ready so too), nor is one not loaded now
        entry = self.registry.entries.get(request.name)
        return pb.ModelReadyResponse(ready=entry is not None and entry.ready
                                     and request.version in VERSIONS)

    @_answered("grpc")
    async def ServerMetadata(self, request: Any, context: Any, call: Claims) -> Any:  # noqa: N802
        meta = server_metadata()
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"],
                                         extensions=meta["extensions"])

    @_answered("grpc")
    async def ModelMetadata(self, request: Any, context: Any, call: Claims) -> Any:  # noqa: N802
        entry = self._entry(request.name, request.version, "name", "version")
        entry = self.registry.described_entry(entry.name)
        call.model = entry.name
        meta = model_metadata(entry)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]],
            outputs=[tensor(**t) for t in meta["outputs"]])

    # ------------------------------------------------------------------ inference

    @_answered("grpc_infer")
    async def ModelInfer(self, received: grpc_codec.Received, context: Any,  # noqa: N802
                         call: Claims) -> Any:
        self._authorize(context)
        request, size = received.message, received.wire_bytes
        entry = self._entry(request.model_name, request.model_version, "model_name",
                            "model_version")
        call.model = entry.name
        try:
            await call.pin(self.registry, entry)
            await call.admit(self.registry, entry.name, size, "binary", received=True)
            req, x, decode_s = await self._decode(request, size, entry)
            call.hold(size, None, x, entry.output_shape)  # x never views the message
            outcome = await call.submit(entry, x, decode_s=decode_s,
                                        encode=grpc_codec.encoder(req.binary_output),
                                        field=req.inputs[0].data_where or "inputs[0]")
            return grpc_codec.response(entry.name, req.id, outcome.y, outcome.encoded,
                                       req.binary_output, serving.v2_parameters(outcome))
        finally:
            call.release()

    async def _decode(self, request: Any, size: int, entry: ModelEntry
                      ) -> tuple[V2Request, Any, float]:
        """The request's samples, checked as the HTTP route checks them: on the loop when
        small, else in a worker thread."""
        limit = self.settings.max_samples_per_request

        def decode() -> tuple[V2Request, Any, float]:
            t0 = time.perf_counter()
            req = grpc_codec.read_request(request)
            x = v2_tensor(req, entry.input_shape, limit)
            return req, x, time.perf_counter() - t0

        small = (serving.INLINE_DECODE_BYTES if len(request.raw_input_contents)
                 else INLINE_TYPED_BYTES)
        if size <= small:
            return decode()
        return await asyncio.to_thread(decode)

    # ------------------------------------------------------------------ the model repository

    @_answered("grpc")
    async def RepositoryIndex(self, request: Any, context: Any, call: Claims) -> Any:  # noqa: N802
        self._authorize(context)
        repository.check_repository(request.repository_name, "repository_name")
        index = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(models=[
            index(**m) for m in self.registry.residency.index(ready=request.ready)])

    @_answered("grpc")
    async def RepositoryModelLoad(self, request: Any, context: Any,  # noqa: N802
                                  call: Claims) -> Any:
        await self._change(request, context, call, loading=True)
        return pb.RepositoryModelLoadResponse()

    @_answered("grpc")
    async def RepositoryModelUnload(self, request: Any, context: Any,  # noqa: N802
                                    call: Claims) -> Any:
        await self._change(request, context, call, loading=False)
        return pb.RepositoryModelUnloadResponse()

    async def _change(self, request: Any, context: Any, call: Claims, *, loading: bool) -> None:
        """Load or unload the model a repository call names, its parameters checked."""
        self._authorize(context)
        entry = self._repository_entry(request)
        repository.check_parameters(_parameters(request.parameters), "parameters",
                                    loading=loading)
        call.model = entry.name
        residency = self.registry.residency
        await (residency.load(entry) if loading else residency.unload(entry))

    def _repository_entry(self, request: Any) -> ModelEntry:
        repository.check_repository(request.repository_name, "repository_name")
        if not request.model_name:
            served = ", ".join(self.registry.entries) or "none"
            raise field_error("model_name", f"is empty: name the model (served: {served})")
        return self.registry.get(request.model_name)

    # ------------------------------------------------------------------ shared

    def _authorize(self, context: Any) -> None:
        """UNAUTHENTICATED unless the metadata carries ``authorization: Bearer <api_key>``
        (when a key is set), checked as the HTTP API checks its header."""
        if self.settings.api_key is None:
            return
        value = dict(context.invocation_metadata() or ()).get("authorization")
        scheme, token = get_authorization_scheme_param(value if isinstance(value, str) else None)
        check_api_key(self.settings, token if scheme.lower() == "bearer" and token else None,
                      where=AUTH_WHERE)

    def _entry(self, name: str, version: str, name_field: str, version_field: str
               ) -> ModelEntry:
        """The ready model a call names (NOT_FOUND, or UNAVAILABLE while it loads)."""
        if not name:
            served = ", ".join(self.registry.entries) or "none"
            raise field_error(name_field, f"is empty: name the model (served: {served})")
        entry = self.registry.ready_entry(name)
        if version not in VERSIONS:
            raise ModelNotFoundError(f"{version_field}: {entry.name} has one version, '1': ask "
                                     f"for it or leave {version_field} empty")
        return entry

    def record(self, call: Claims, status: int, elapsed_s: float) -> None:
        """The call in the request metrics (and an inference in the page's live view)."""
        m = self.metrics
        m.requests.labels(call.model, call.endpoint, str(status)).inc()
        m.latency.labels(call.model, call.endpoint).observe(elapsed_s)
        if call.outcome is not None:
            m.live.record(call.model, elapsed_s, call.outcome)


def _parameters(params: Any) -> dict[str, Any]:
    """A repository call's parameters (``ModelRepositoryParameter`` by name) as values."""
    return {name: getattr(value, value.WhichOneof("parameter_choice") or "string_param")
            for name, value in params.items()}


def add_to_server(servicer: InferenceService, server: Any) -> None:
    """``servicer`` on ``server``, as the generated ``add_GRPCInferenceServiceServicer_to_server``
    registers it, but ``ModelInfer`` gets each request with its size on the wire
    (``grpc_codec.Received``)."""
    service = pb.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[-1]]
    handlers = {}
    for method in service.methods:  # all unary in the OIP v2
        request, response = (getattr(pb, t.name) for t in (method.input_type, method.output_type))
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=(grpc_codec.received if method.name == "ModelInfer"
                                  else request.FromString),
            response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


__all__ = ["CODES", "InferenceService", "add_to_server"]
