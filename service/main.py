"""The service's app: ``create_app(settings)`` assembles routers, errors, metrics, the gRPC
server and the lifespan.

Nothing else happens here. The app is a ``FastPathApp`` (``service.fast``: FastAPI, with the
inference routes called without its layers), or plain FastAPI with ``fast_path`` off. The lifespan starts the registry (models load in the background;
``/v2/health/ready`` says when they are ready) and the gRPC server beside HTTP
(``service.grpc_server``) and, on shutdown, stops gRPC taking calls, drains every batcher so each
accepted request is answered, and lets gRPC send its last answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service.settings import Settings
from service import errors
from service.fast.app import FastPathApp
from service.fast.route import plain
from service.grpc_server import GrpcServer
from service.metrics import Metrics, RequestMetricsMiddleware
from service.registry import Registry
from service.routers import (charts, health, inference, metrics, models, plans, repository,
                             stats, ui, v2)

DESCRIPTION = """CNN inference where every layer runs at its own batch size, with the plan
for the memory free at the moment each batch runs. Errors are `{"error": "..."}` naming the
field and the problem."""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings if settings is not None else Settings()
    registry_metrics = Metrics()
    registry = Registry(settings, registry_metrics)
    grpc = GrpcServer(settings, registry, registry_metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await registry.start()
        try:
            await grpc.start()
            yield
        finally:
            grpc.stop_accepting()
            await registry.close()
            await grpc.stopped()

    app_class = FastPathApp if settings.fast_path else FastAPI
    app = app_class(title="vbs-serve", description=DESCRIPTION, version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = registry_metrics
    app.state.registry = registry
    app.state.grpc = grpc
    errors.install(app)
    app.add_middleware(RequestMetricsMiddleware, metrics=registry_metrics)
    for router in (inference.router, v2.router, repository.router, plans.router, models.router,
                   health.router, metrics.router, charts.router, stats.router, ui.router):
        app.include_router(router if settings.fast_path else plain(router))
    return app
