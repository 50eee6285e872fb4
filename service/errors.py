"""HTTP errors: the service's own branches of the one exception tree, and their status codes.

Every error the service answers with is a JSON body ``{"error": "..."}`` that says what was
wrong (naming the field: ``inputs[0].shape``, ``body``, ``top_k``) and what to do. The
service's errors are subclasses of ``core.errors`` classes, so the tree stays one tree::

    UsageError (400)
    ├── RequestError            400  the request body, a field or a parameter is not valid
    │   ├── PayloadTooLargeError    413  body or samples over the limit
    │   └── UnsupportedMediaError   415  a Content-Type the endpoint does not read
    ├── ModelNotFoundError      404  no model served under that name
    ├── ModelTooLargeError      413  a model that could never fit in the memory the models may take
    ├── AssetNotFoundError      404  no such file of the page (/ui/...)
    └── AuthError               401  missing or wrong API key
    VbsError
    ├── UnavailableError        503  not ready yet, queue full, shutting down (Retry-After)
    └── RequestTimeoutError     504  queued and run longer than request_timeout_s

Errors from the planner and the workers keep their meaning: RequestTooLargeError (a request
that no memory limit's ledger could ever hold) is 413; InfeasibleError (no plan fits
in the memory free now) and OutOfMemoryError are 503 with Retry-After (memory is the
server's condition, not the client's input), StoreError 503, other ExecutionErrors and
anything unexpected 500. No client input reaches a 5xx: decoding turns every bad input into
a RequestError first.
"""

from __future__ import annotations

import logging

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import (ExecutionError, InfeasibleError, OutOfMemoryError, PlanError,
                            RequestTooLargeError, StoreError, UsageError, VbsError)

log = logging.getLogger("vbs.service")


class RequestError(UsageError):
    """A request body, field or parameter is not valid (400)."""


class PayloadTooLargeError(RequestError):
    """The body or the number of samples is over the configured limit (413)."""


class UnsupportedMediaError(RequestError):
    """The endpoint does not read this Content-Type (415)."""


class ModelNotFoundError(UsageError):
    """No model is served under the name asked for (404)."""


class ModelTooLargeError(UsageError):
    """A model could never be loaded, even alone, in the memory the models may take (413:
    the message names the limit and what the model needs)."""


class AssetNotFoundError(UsageError):
    """The page has no file of that name (404)."""


class AuthError(UsageError):
    """The API key is missing or wrong (401)."""


class UnavailableError(VbsError):
    """The service cannot take the request now; retry after ``retry_after`` seconds (503)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeoutError(VbsError):
    """The request was queued and run for longer than the configured timeout (504)."""


class ErrorBody(BaseModel):
    """The body of every error answer (the OpenAPI schema of every 4xx and 5xx)."""

    error: str = Field(description="what was wrong, naming the field, and what to do")


def error_responses(codes: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error statuses an endpoint answers, each an ErrorBody."""
    return {code: {"model": ErrorBody, "description": text} for code, text in codes.items()}


BAD_REQUEST = {400: "a query or path parameter is not valid ({\"error\": ...} names it)"}
NOT_READY = {503: "a model is not ready (still loading, or failed to load), Retry-After"}
NO_MODEL = {404: "no model is served under that name"}
UNAUTHORIZED = {401: "missing or wrong API key (when VBS_API_KEY is set)"}


def field_error(field: str, problem: str, cls: type[RequestError] = RequestError) -> RequestError:
    """The one wording of a bad field: ``<field>: <problem>``."""
    return cls(f"{field}: {problem}")


# The one translation of the exception tree into HTTP statuses (the tree in the module doc):
# an exception is answered with the status of the first of its classes found here.
STATUS: dict[type[BaseException], int] = {
    PayloadTooLargeError: 413, RequestTooLargeError: 413, ModelTooLargeError: 413,
    UnsupportedMediaError: 415,
    RequestError: 400,
    ModelNotFoundError: 404, AssetNotFoundError: 404, AuthError: 401,
    UnavailableError: 503, RequestTimeoutError: 504,
    InfeasibleError: 503, OutOfMemoryError: 503, StoreError: 503,
    UsageError: 400, PlanError: 400,
}


def status_of(exc: BaseException) -> int:
    """The HTTP status an exception is answered with (``STATUS``; anything else is 500)."""
    return next((STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS), 500)


def error_response(exc: BaseException) -> JSONResponse:
    status = status_of(exc)
    headers: dict[str, str] = {}
    if status == 503:
        headers["Retry-After"] = str(getattr(exc, "retry_after", 1))
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    message = " ".join(str(exc).split()) or type(exc).__name__
    if status >= 500 and not isinstance(exc, VbsError):
        message = f"internal error ({type(exc).__name__}): see the service log"
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _vbs_error(request: Request, exc: Exception) -> JSONResponse:
    if status_of(exc) >= 500:
        log.warning("%s %s: %s", request.method, request.url.path, exc)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no endpoint {request.method} {request.url.path}: see /docs for the API"
    return JSONResponse({"error": detail}, status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


def _where(loc: tuple[object, ...]) -> str:
    kinds = {"query": "query parameter", "path": "path parameter", "header": "header",
             "body": "body"}
    if loc and loc[0] in kinds:
        rest = ".".join(str(p) for p in loc[1:])
        return f"{kinds[str(loc[0])]} {rest}".strip()
    return ".".join(str(p) for p in loc) or "request"


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [f"{_where(tuple(e.get('loc', ())))}: {e.get('msg', 'invalid')}"
                for e in exc.errors()]
    return JSONResponse({"error": "; ".join(problems) or "invalid request"}, status_code=400)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(exc)


def install(app: FastAPI) -> None:
    """Answer every error with ``{"error": ...}`` and its status."""
    app.add_exception_handler(VbsError, _vbs_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)


__all__ = ["AssetNotFoundError", "AuthError", "ErrorBody", "ExecutionError", "ModelNotFoundError",
           "ModelTooLargeError", "PayloadTooLargeError",
           "RequestError", "RequestTimeoutError", "UnavailableError", "UnsupportedMediaError",
           "error_response", "error_responses", "field_error", "install", "status_of"]
