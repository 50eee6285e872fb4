"""``LeanRoute``: an inference route that FastAPI documents as any route but calls directly.

FastAPI solves a route's dependencies anew on every request; an inference route that declares
only the request (and a path's str parameters) and calls ``service.deps.inference_call`` does
the same checks (API key, query, body) with the same functions, without that. When the fast
path is off (``VBS_FAST_PATH=false``), ``plain`` declares the same endpoints as FastAPI's own
routes.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from starlette.responses import Response


class LeanRoute(APIRoute):
    """A route whose endpoint takes the request and its path parameters (strings) and nothing
    else: FastAPI documents it from its signature and ``openapi_extra`` as any route, and each
    request calls it directly (FastAPI's customisation point ``get_route_handler``), without
    solving dependencies or reading the body for it. A route given dependencies or other
    parameters is refused when it is built: they would silently not run."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        d = self.dependant
        other = [f.name for f in (*d.query_params, *d.header_params, *d.cookie_params,
                                  *d.body_params)]
        other += [f.name for f in d.path_params if f.field_info.annotation is not str]
        if d.dependencies or other or d.request_param_name is None:
            raise TypeError(f"LeanRoute {path}: the endpoint {endpoint.__name__} may take only "
                            "the request and str path parameters, and no dependencies "
                            f"(found {other or 'dependencies'}); use a plain APIRoute")

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint

        async def handle(request: Request) -> Response:
            return await endpoint(request, **request.path_params)

        return handle


def plain(router: APIRouter) -> APIRouter:
    """``router`` with its ``LeanRoute``s declared again as FastAPI's own ``APIRoute``s (the
    same endpoint, path, methods and documentation): FastAPI calls them with the request and
    the path parameters, as it calls any route."""
    out = APIRouter(tags=list(router.tags or ()))
    for route in router.routes:
        if isinstance(route, LeanRoute):
            out.add_api_route(route.path, route.endpoint, methods=sorted(route.methods or ()),
                              route_class_override=APIRoute, summary=route.summary,
                              description=route.description, responses=route.responses,
                              openapi_extra=route.openapi_extra, name=route.name,
                              tags=list(route.tags or ()),
                              include_in_schema=route.include_in_schema)
        else:
            out.routes.append(route)
    return out
