"""The app: FastAPI, with the inference routes called straight from the server.

Every request passes Starlette's and FastAPI's layers before its handler: the server-error
middleware, ours (the metrics), the exception middleware, FastAPI's exit stack, routing
through every included router (FastAPI matches each router's routes in turn), the route's
request/response wrapper with its telemetry, body-limit and exception layers. That costs the
event loop more per request the later a route is declared, and a one-sample request pays it
while the model has just evicted the interpreter's data from the caches (what the request path
costs: docs/benchmarks.md, section 5).

So the routes built as ``LeanRoute`` (``service.deps``: they take the request and their str
path parameters, no dependencies; here ``POST /infer`` and ``POST /v2/models/{name}/infer``)
are matched first, by their own compiled path pattern, and run in a stack built from the same
parts the app's own stack is built from, in the same order: a guard that answers an unhandled
exception with the app's handler for ``Exception`` (as Starlette's ServerErrorMiddleware, then
re-raising it for the server to log), the app's user middleware (the metrics), and the
endpoint, whose exceptions go to the app's handlers by class (as Starlette's
ExceptionMiddleware looks them up). Every other request, and these routes under a root path
or with Starlette's own body-size limit set, go through FastAPI unchanged; OpenAPI documents
them from the same routes.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.convertors import Convertor
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path

from service.fast.route import LeanRoute

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Handler = Callable[[Request, Exception], Any]


@dataclass(frozen=True)
class _Lean:
    """A lean route as the app serves it: its full path's pattern and parameter converters."""

    pattern: re.Pattern[str]
    convertors: dict[str, Convertor[Any]]
    route: LeanRoute


class FastPathApp(FastAPI):
    """FastAPI whose ``LeanRoute`` POST routes skip the framework's layers (see the module doc).

    The lean routes are those of the routers given to ``include_router`` (their own routes,
    with the prefix given there, and no dependencies added there)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lean: list[_Lean] = []
        self._lean_stack: ASGIApp | None = None

    def add_middleware(self, *args: Any, **kwargs: Any) -> None:
        super().add_middleware(*args, **kwargs)
        self._lean_stack = None  # built again, with it, at the next lean request

    def include_router(self, router: APIRouter, *, prefix: str = "", **kwargs: Any) -> None:
        super().include_router(router, prefix=prefix, **kwargs)
        if kwargs.get("dependencies"):
            return  # they would not run on the fast path: FastAPI serves these routes
        for route in router.routes:
            if isinstance(route, LeanRoute) and "POST" in (route.methods or ()):
                pattern, _, convertors = compile_path(prefix + route.path)
                self._lean.append(_Lean(pattern, convertors, route))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self._lean and scope["type"] == "http" and scope["method"] == "POST"
                and not self.root_path and not scope.get("root_path")
                and getattr(self, "max_body_size", None) is None):  # Starlette's own limit
            path = scope["path"]
            for lean in self._lean:
                match = lean.pattern.match(path)
                if match is not None:
                    if self._lean_stack is None:
                        self._lean_stack = self._build_lean_stack()
                    scope["app"] = self
                    scope["router"] = self.router
                    scope["route"] = lean.route
                    scope["endpoint"] = lean.route.endpoint
                    scope["path_params"] = {name: lean.convertors[name].convert(value)
                                            for name, value in match.groupdict().items()}
                    await self._lean_stack(scope, receive, send)
                    return
        await super().__call__(scope, receive, send)

    def _build_lean_stack(self) -> ASGIApp:
        """The lean routes' stack, from the app as it is at its first such request (as
        Starlette builds its own middleware stack then)."""
        handlers: dict[Any, Handler] = {}
        on_error: Handler | None = None
        for key, value in self.exception_handlers.items():
            if key in (500, Exception):
                on_error = value
            else:
                handlers[key] = value
        app: ASGIApp = _Endpoint(handlers)
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        return _Guard(app, on_error)


async def _call(handler: Handler, request: Request, exc: Exception) -> Response:
    result = handler(request, exc)
    return await result if inspect.isawaitable(result) else result


def _handler_for(handlers: dict[Any, Handler], exc: Exception) -> Handler | None:
    """The app's handler for ``exc``: by status for an HTTPException, else by its classes."""
    if isinstance(exc, HTTPException) and exc.status_code in handlers:
        return handlers[exc.status_code]
    for cls in type(exc).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None


class _Endpoint:
    """The route's endpoint on the request, its exceptions answered by the app's handlers."""

    def __init__(self, handlers: dict[Any, Handler]) -> None:
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await scope["endpoint"](request, **scope["path_params"])
        except Exception as exc:
            handler = _handler_for(self.handlers, exc)
            if handler is None:
                raise
            response = await _call(handler, request, exc)
        await response(scope, receive, send)


class _Guard:
    """An exception nothing handled: answered with the app's handler for ``Exception`` (500)
    when no response has started, then raised for the server to log."""

    def __init__(self, app: ASGIApp, on_error: Handler | None) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if not started:
                request = Request(scope)
                response = (await _call(self.on_error, request, exc) if self.on_error is not None
                            else Response("Internal Server Error", status_code=500,
                                          media_type="text/plain"))
                await response(scope, receive, send)
            raise
