"""Fixtures for the packaging and deployment checks; helpers are in support.py."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.deploy.support import DEPLOY, HealthHandler, render_kustomization


@pytest.fixture(scope="session")
def render() -> Callable[[str], list[dict[str, Any]]]:
    """render(overlay) -> the rendered objects of deploy/overlays/<overlay>, cached per session."""
    cache: dict[str, list[dict[str, Any]]] = {}

    def _render(overlay: str) -> list[dict[str, Any]]:
        if overlay not in cache:
            cache[overlay] = render_kustomization(DEPLOY / "overlays" / overlay)
        return cache[overlay]

    return _render


@pytest.fixture
def health_server() -> Iterator[tuple[http.server.HTTPServer, type[HealthHandler]]]:
    """A local HTTP server on a free port standing in for a worker's /v2/health/live."""
    handler = type("Handler", (HealthHandler,), {})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
