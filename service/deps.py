"""The dependencies handlers declare, each once, as ``Annotated`` aliases.

``SettingsDep``, ``RegistryDep``, ``MetricsDep`` read what ``create_app`` put in
``app.state`` (tests may replace them with ``app.dependency_overrides``); ``BodyDep`` reads
the request body up to ``max_body_bytes``, or ``max_json_bytes`` for JSON (413 beyond, before
anything is parsed); ``require_api_key`` guards inference and /plan when ``api_key`` is set.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import ClientDisconnect

from planner.settings import Settings
from service.errors import AuthError, PayloadTooLargeError, RequestError
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


async def require_api_key(
        settings: SettingsDep,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """401 unless the request carries ``Authorization: Bearer <api_key>`` (when one is set)."""
    if settings.api_key is None:
        return
    if credentials is None:
        raise AuthError("header Authorization: missing API key; send 'Authorization: Bearer <key>'")
    expected = settings.api_key.get_secret_value().encode()
    if not secrets.compare_digest(credentials.credentials.encode(), expected):
        raise AuthError("header Authorization: the API key is not valid")


ApiKey = Depends(require_api_key)


BINARY_FORMATS = "application/x-npy, application/octet-stream or OIP v2 binary tensors " \
                 "(Inference-Header-Content-Length)"


def is_json(request: Request) -> bool:
    """A JSON body (parsed whole into Python objects), not binary tensors behind a JSON header."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    json_kind = kind in ("", "application/json", "text/json") or kind.endswith("+json")
    return json_kind and "inference-header-content-length" not in request.headers


async def read_body(request: Request, settings: SettingsDep) -> bytes:
    """The whole body, refusing (413) one longer than its limit before reading it all: JSON
    has its own, smaller limit (``max_json_bytes``), since it is parsed into Python objects.

    The time it takes is the network's (paced by the client): it is recorded in
    ``request.state.vbs_receive_s`` so the metrics middleware counts it apart from the
    server's own overhead, as Triton's perf_analyzer separates send/receive from overhead.
    """
    started = time.perf_counter()
    if is_json(request) and settings.max_json_bytes < settings.max_body_bytes:
        limit, name = settings.max_json_bytes, "max_json_bytes"
        advice = f"send large inputs as {BINARY_FORMATS}, up to max_body_bytes"
        what = "bytes of JSON"
    else:
        limit, name, advice, what = settings.max_body_bytes, "max_body_bytes", \
            "send fewer samples", "bytes"
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise RequestError(f"header Content-Length: {declared!r} is not a number of bytes")
        if int(declared) > limit:
            raise PayloadTooLargeError(f"body: {int(declared)} {what} are more than the {limit} "
                                       f"allowed ({name}); {advice}")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(f"body: more than the {limit} {what} allowed "
                                           f"({name}); {advice}")
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise RequestError("body: the client went away before sending all of it") from exc
    body = b"".join(chunks)
    request._body = body  # noqa: SLF001 - Starlette's cache: request.form() reads it from here
    request.state.vbs_receive_s = time.perf_counter() - started
    return body


BodyDep = Annotated[bytes, Depends(read_body)]
