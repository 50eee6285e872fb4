"""Fixtures of the HTTP service tests: real models, real tables, real HTTP.

- ``vbs_cache``: one profile cache for the session, so each model is profiled once.
- ``make_settings(**overrides)``: Settings for the tiny model (``two_layer`` at 3x8x8,
  batch_max 4, one profile repeat) with this test's own directory store.
- ``running(app)``: the app's lifespan run, its models ready, and an httpx client over
  ``httpx.ASGITransport`` (async tests, driven with ``asyncio.run`` like the rest of the suite).
- ``ServerThread(app)``: uvicorn on a free port in a thread (module-scoped servers for the
  many request/response tests, through real sockets).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from fastapi import FastAPI

from service.settings import Settings
from service.grpc_server import UvicornServer
from service.fast.protocol import http_protocol
from service.entry import ModelEntry

TINY = "tiny=tests.planner.factories:two_layer@3x8x8"
TINY_SHAPE = (3, 8, 8)
READY_TIMEOUT_S = 120.0
T = TypeVar("T")


def settings_for(cache: Path, store: Path | str, **overrides: Any) -> Settings:
    base: dict[str, Any] = dict(
        cache_dir=cache, store=str(store), batch_max=4, profile_repeats=1, profile_warmup=0,
        slot_count=64, models=[TINY], max_batch_delay_ms=2, store_poll_s=0.05,
        store_retry_base_s=0.02, store_retry_cap_s=0.2, request_timeout_s=30,
        grpc_port=0)  # gRPC off unless a test asks for it (test_grpc.py: on a free port)
    base.update(overrides)
    return Settings(**base)


@pytest.fixture(scope="session")
def vbs_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vbs-cache")


@pytest.fixture
def make_settings(vbs_cache: Path, tmp_path: Path) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        overrides.setdefault("store", tmp_path / "store")
        return settings_for(vbs_cache, **overrides)
    return make


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
    """Run an async test body with an overall bound."""
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)
    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def running(app: FastAPI, *, wait: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """The app started (lifespan), its models ready, and a client that talks to it over ASGI."""
    async with app.router.lifespan_context(app):
        if wait:
            await app.state.registry.wait_ready(READY_TIMEOUT_S)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://vbs.test",
                                     timeout=60) as client:
            yield client


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) in a thread, until the block ends."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.server = UvicornServer(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                   log_level="warning", lifespan="on",
                                                   http=http_protocol(  # as `vbs serve`
                                                       app.state.settings.fast_path)))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = ""

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.server.started:  # readiness polling of a starting server
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while client.get("/v2/health/ready").status_code != 200:
                registry = self.app.state.registry
                if any(e.state == "failed" for e in registry.entries.values()):
                    raise RuntimeError(registry.not_ready_reason())
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not ready in time: {registry.not_ready_reason()}")
                time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)


def reference(entry: ModelEntry, x: np.ndarray) -> np.ndarray:
    """``model(x)`` computed directly with the torch model."""
    module = entry.prepared.capture.model.module
    with torch.inference_mode():
        return module(torch.from_numpy(np.asarray(x, dtype=np.float32))).numpy()


def assert_close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)


def assert_error(response: httpx.Response, status: int, *words: str) -> str:
    """A JSON error body ``{"error": ...}`` with ``status`` that mentions every word."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) >= {"error"} and isinstance(body["error"], str), body
    for word in words:
        assert word in body["error"], (word, body["error"])
    return body["error"]


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0,
                     what: str = "condition") -> None:
    """Poll ``predicate`` on the event loop (yielding between looks) until true, or fail."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Gate:
    """Holds a model's batches on the worker thread until opened (wraps ``worker.infer``).

    ``entered`` (an asyncio.Event) is set, from the worker thread, when a batch has reached
    the gate; ``open()`` lets every batch through.
    """

    def __init__(self, entry: ModelEntry) -> None:
        self.loop = asyncio.get_running_loop()
        self.entered = asyncio.Event()
        self.batches = 0
        self._open = threading.Event()
        self._real = entry.worker.infer
        self._entry = entry
        entry.worker.infer = self._infer

    def _infer(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.batches += 1
        self.loop.call_soon_threadsafe(self.entered.set)
        if not self._open.wait(timeout=60):
            raise RuntimeError("gate never opened")
        return self._real(x, *args, **kwargs)

    def open(self) -> None:
        self._open.set()

    def remove(self) -> None:
        self.open()
        self._entry.worker.infer = self._real


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[httpx.Client]:
    """An HTTP client of the ``server`` fixture of the module that asks for it."""
    with server.client() as c:
        yield c
