"""The dependencies handlers declare, each once, as ``Annotated`` aliases.

``SettingsDep``, ``RegistryDep``, ``MetricsDep`` read what ``create_app`` put in
``app.state`` (tests may replace them with ``app.dependency_overrides``); ``BodyDep`` reads
the request body up to ``max_body_bytes``, or ``max_json_bytes`` for JSON (413 beyond, before
anything is parsed); ``require_api_key`` guards inference and /plan when ``api_key`` is set.

The two inference routes are the exception: they declare nothing but the request (and a
path's model name) and call ``inference_call``, which does the same three things (API key,
query parameters, body) with the same functions, so that the fast path (``service.fast``)
can call them without FastAPI solving dependencies on every request, the largest part of
what the server does for a one-sample request (docs/benchmarks.md, section 5).
``lean_openapi`` documents what those routes read, from the same declarations (``InferQuery``,
the bearer scheme).
"""

from __future__ import annotations

import functools
import secrets
import time
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import QueryParams

from service.settings import Settings
from service.claims import of as claims_of
from service.errors import AuthError, PayloadTooLargeError, RequestError
from service.fast.body import receive_body
from service.media import is_json_body, media_type
from service.metrics import Metrics
from service.registry import Registry


# async: FastAPI runs a plain ``def`` dependency in a worker thread, a hop per request for an
# attribute read.
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_registry(request: Request) -> Registry:
    return request.app.state.registry


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
RegistryDep = Annotated[Registry, Depends(get_registry)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]

_bearer = HTTPBearer(auto_error=False, description="the service's API key (VBS_API_KEY), when set")


def check_api_key(settings: Settings, token: str | None, *,
                  where: str = "header Authorization") -> None:
    """401 unless ``token`` (the request's bearer token) is the API key, when one is set.
    ``where`` names what carries it (gRPC: ``metadata authorization``)."""
    if settings.api_key is None:
        return
    if not token:
        raise AuthError(f"{where}: missing API key; send '{where.split()[-1]}: Bearer <key>'")
    expected = settings.api_key.get_secret_value().encode()
    if not secrets.compare_digest(token.encode(), expected):
        raise AuthError(f"{where}: the API key is not valid")


def bearer_token(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``, parsed as ``HTTPBearer`` parses it."""
    scheme, token = get_authorization_scheme_param(request.headers.get("authorization"))
    return token if scheme.lower() == "bearer" and token else None


async def require_api_key(
        settings: SettingsDep,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """401 unless the request carries ``Authorization: Bearer <api_key>`` (when one is set)."""
    check_api_key(settings, credentials.credentials if credentials is not None else None)


ApiKey = Depends(require_api_key)


BINARY_FORMATS = "application/x-npy, application/octet-stream or OIP v2 binary tensors " \
                 "(Inference-Header-Content-Length)"


async def read_body(request: Request, settings: SettingsDep) -> bytes:
    """The whole body, refusing (413) one longer than its limit before reading it all: JSON
    has its own, smaller limit (``max_json_bytes``), since it is parsed into Python objects.

    The time it takes is the network's (paced by the client): it is recorded in
    the request's claims (``service.claims``) so the metrics middleware counts it apart from the
    server's own overhead, as Triton's perf_analyzer separates send/receive from overhead.
    """
    started = time.perf_counter()
    if is_json_body(request.headers) and settings.max_json_bytes < settings.max_body_bytes:
        limit, name = settings.max_json_bytes, "max_json_bytes"
        advice = f"send large inputs as {BINARY_FORMATS}, up to max_body_bytes"
        what = "bytes of JSON"
    else:
        limit, name, advice, what = settings.max_body_bytes, "max_body_bytes", \
            "send fewer samples", "bytes"
    def over(size: int | None = None) -> PayloadTooLargeError:
        if size is None:
            return PayloadTooLargeError(f"body: more than the {limit} {what} allowed "
                                        f"({name}); {advice}")
        return PayloadTooLargeError(f"body: {size} {what} are more than the {limit} "
                                    f"allowed ({name}); {advice}")

    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise RequestError(f"header Content-Length: {declared!r} is not a number of bytes")
        if int(declared) > limit:
            raise over(int(declared))
    if settings.fast_path:
        body = await receive_body(request, limit, over)
    else:
        body = await request.body()  # Starlette's own: whole, then measured
        if len(body) > limit:
            raise over()
    claims_of(request.state).receive_s = time.perf_counter() - started
    return body


BodyDep = Annotated[bytes, Depends(read_body)]


# -- the inference routes (see the module doc) ----------------------------------------------


class InferQuery(BaseModel):
    """``POST /infer``'s query parameters."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str | None = Field(None, description="served model name; default: the only one")
    top_k: int | None = Field(None, ge=1, description="return the k best labels")
    shape: str | None = Field(None, description="octet-stream: the tensor's shape")
    dtype: str | None = Field(None, description="octet-stream: the values' dtype")


class NoQuery(BaseModel):
    """A route that reads no query parameters."""

    model_config = ConfigDict(extra="ignore", frozen=True)


Q = TypeVar("Q", bound=BaseModel)


async def inference_call(request: Request, query: type[Q],
                         model: str | None = None) -> tuple[Q, bytes]:
    """What an inference route's dependencies would give it: the API key checked, the query
    parameters validated (400 naming the parameter, as FastAPI's own) and the body read.

    The request's claims (``service.claims``, ``request.state.vbs``) are taken first: the
    model it names (in the path or the query) pinned, loaded if it is not (a wait, 503 or
    413), then under a memory limit a place before its body is read (503 + Retry-After or
    413 instead). The route gives them back (``Claims.release``) once it has answered."""
    settings: Settings = request.app.state.settings
    if settings.api_key is not None:
        check_api_key(settings, bearer_token(request))
    query_string = request.scope.get("query_string", b"")
    parse = _parameters if len(query_string) <= CACHED_QUERY_BYTES else _parameters.__wrapped__
    parsed = parse(query, query_string)
    registry = getattr(request.app.state, "registry", None)
    if registry is not None:  # its model loaded first (service.residency), its body unread
        claims = claims_of(request.state)
        name = model if model is not None else getattr(parsed, "model", None)
        entry = registry.entry_of(name)
        if entry is not None:
            await claims.pin(registry, entry)
        declared = request.headers.get("content-length")
        size = int(declared) if declared is not None and declared.strip().isdigit() else 0
        await claims.admit(registry, name, size, body_kind(request))
    return parsed, await read_body(request, settings)


def body_kind(request: Request) -> str:
    """binary, json or image: how much a body of its type holds once decoded."""
    if is_json_body(request.headers):
        return "json"
    kind = media_type(request.headers)
    return "image" if kind.startswith("image/") or kind == "multipart/form-data" else "binary"


CACHED_QUERY_BYTES = 1024  # longer query strings are parsed every time (the cache stays small)


@functools.lru_cache(maxsize=256)
def _parameters(query: type[Q], query_string: bytes) -> Q:
    """A route's query parameters, parsed and validated once per query string (clients send
    the same few again and again; frozen: one instance serves all; a refused one raises, and is
    not cached)."""
    params = QueryParams(query_string)
    try:
        return query.model_validate({k: params[k] for k in query.model_fields if k in params})
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("query", *e["loc"])}
                                      for e in exc.errors(include_url=False)]) from exc


def lean_openapi(query: type[BaseModel], extra: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` for a route that calls ``inference_call``: its query parameters (from
    ``query``), the bearer scheme ``require_api_key`` documents, and ``extra``."""
    schema = query.model_json_schema()
    parameters = [{"name": name, "in": "query", "required": False,
                   "description": prop.get("description", ""),
                   "schema": {k: v for k, v in prop.items() if k != "description"}}
                  for name, prop in schema.get("properties", {}).items()]
    return {**extra, "parameters": parameters, "security": [{_bearer.scheme_name: []}]}
