"""The gRPC side of ``vbs serve``: a grpc.aio server beside uvicorn, in its event loop, and the
order in which the two stop.

``GrpcServer`` listens on ``grpc_port`` (0: no gRPC) of the same host as HTTP, from the app's
lifespan, so it shares the loop, the registry, the batchers and the metrics with the HTTP
routes. Stopping keeps the promise HTTP keeps, that a request accepted is answered: on SIGTERM
(``UvicornServer``, which ``vbs serve`` runs) gRPC stops taking calls at the moment uvicorn
stops taking connections; the lifespan's shutdown then drains the batchers, which answers
every call in flight, and waits for those answers to be sent, for at most the grace period
HTTP gets (``request_timeout_s`` + 5 s).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import uvicorn

from core.errors import UsageError
from service.settings import Settings
from service.metrics import Metrics
from service.registry import Registry

log = logging.getLogger("vbs.service.grpc")

STARTUP_FAILURE = 3  # uvicorn.run's exit code when the app cannot start


def server_options(max_body_bytes: int) -> list[tuple[str, int]]:
    """grpcio's options of the server (bench/grpc_floor.py's echo server takes the same)."""
    # as large as HTTP takes (gRPC's own default is 4 MiB): larger is RESOURCE_EXHAUSTED;
    # Linux's SO_REUSEPORT would let a second server share the port silently
    return [("grpc.max_receive_message_length", max_body_bytes),
            ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)]


class GrpcServer:
    """The app's gRPC server: ``start`` in the lifespan, ``stop_accepting`` on SIGTERM,
    ``stopped`` once the batchers have drained."""

    def __init__(self, settings: Settings, registry: Registry, metrics: Metrics) -> None:
        self.settings = settings
        self.registry = registry
        self.metrics = metrics
        self.grace_s = settings.request_timeout_s + 5
        self.port: int | None = None  # listening, once started
        self._server: Any = None
        self._stopping: asyncio.Future[Any] | None = None

    @property
    def address(self) -> str:
        host = self.settings.host
        return f"[{host}]:{self.settings.grpc_port}" if ":" in host else \
            f"{host}:{self.settings.grpc_port}"

    async def start(self) -> None:
        """Listen on ``grpc_port`` (nothing when it is 0); UsageError when it cannot."""
        if not self.settings.grpc_port:
            return
        import grpc

        from service.grpc_api import InferenceService, add_to_server

        server = grpc.aio.server(options=server_options(self.settings.max_body_bytes))
        add_to_server(InferenceService(self.settings, self.registry, self.metrics), server)
        try:
            port = server.add_insecure_port(self.address)
        except RuntimeError as exc:  # grpcio raises where older releases returned 0
            port, reason = 0, str(exc)
        else:
            reason = "the port is taken or the address is not this machine's"
        if not port:
            raise UsageError(f"grpc_port: cannot listen on {self.address} ({reason}); choose "
                             "another with --grpc-port (VBS_GRPC_PORT), or 0 to serve no gRPC")
        await server.start()
        self._server, self.port = server, port
        log.info("serving the Open Inference Protocol over gRPC on %s", self.address)

    def stop_accepting(self) -> None:
        """Refuse new calls from now on (clients are told to go elsewhere); calls in flight
        go on for up to ``grace_s``."""
        if self._server is not None and self._stopping is None:
            self._stopping = asyncio.ensure_future(self._server.stop(self.grace_s))

    async def stopped(self) -> None:
        """Stop, once every call in flight has been answered (or the grace period is over)."""
        self.stop_accepting()
        if self._stopping is not None:
            await self._stopping


class UvicornServer(uvicorn.Server):
    """uvicorn's server; its shutdown first stops the app's gRPC server accepting calls."""

    async def shutdown(self, sockets: Any = None) -> None:
        grpc_server = getattr(getattr(self.config.app, "state", None), "grpc", None)
        if grpc_server is not None:
            grpc_server.stop_accepting()
        await super().shutdown(sockets)


def run(app: Any, **config: Any) -> None:
    """``uvicorn.run(app, **config)`` with ``UvicornServer``: exits with uvicorn's code 3 when
    the app cannot start (a model that fails, a port that is taken)."""
    server = UvicornServer(uvicorn.Config(app, **config))
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)


__all__ = ["GrpcServer", "UvicornServer", "run", "server_options"]
