"""The dependencies handlers declare, each once, as ``Annotated`` aliases.

``SettingsDep``, ``RegistryDep``, ``MetricsDep`` read what ``create_app`` put in
``app.state`` (tests may replace them with ``app.dependency_overrides``); ``BodyDep`` reads
the request body up to ``max_body_bytes`` (413 beyond); ``require_api_key`` guards inference
and /plan when ``api_key`` is set.
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


async def read_body(request: Request, settings: SettingsDep) -> bytes:
    """The whole body, refusing (413) one longer than ``max_body_bytes`` before reading it all.

    The time it takes is the network's (paced by the client): it is recorded in
    ``request.state.vbs_receive_s`` so the metrics middleware counts it apart from the
    server's own overhead, as Triton's perf_analyzer separates send/receive from overhead.
    """
    started = time.perf_counter()
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise RequestError(f"header Content-Length: {declared!r} is not a number of bytes")
        if int(declared) > limit:
            raise PayloadTooLargeError(f"body: {int(declared)} bytes are more than the "
                                       f"{limit} allowed (max_body_bytes); send fewer samples")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(f"body: more than the {limit} bytes allowed "
                                           "(max_body_bytes); send fewer samples")
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise RequestError("body: the client went away before sending all of it") from exc
    request.state.vbs_receive_s = time.perf_counter() - started
    return b"".join(chunks)


BodyDep = Annotated[bytes, Depends(read_body)]
