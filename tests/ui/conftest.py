"""Fixtures of the page's browser tests: a real ``vbs serve`` and Debian's chromium.

- ``served`` (session): ``vbs serve`` started as a process (the real CLI) on a free loopback
  port, with an API key, three models: ``branchy`` (a parallel block), ``tiny`` (two layers)
  and ``broken`` (cannot be traced: it fails to load, so the page has an error to show). Its
  own profile cache and directory store; profiles of a small grid (batch_max 4, one repeat).
- ``browser`` (session): chromium from the system (``apt-get install chromium``; ``make test``
  installs it), driven by Playwright for Python; Playwright's own browser download is not used.
- ``page``: a fresh browser context on ``/ui`` with the API key entered once.
- ``shot(page, name)``: a screenshot saved under ``artifacts/ui/`` (gitignored); the path is
  printed (``pytest -s``) and recorded in the test report's properties.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "ui"
KEY = "page-test-key-0123456789"
MODELS = ("branchy=tests.ui.models:branchy@3x16x16,tiny=tests.planner.factories:two_layer@3x8x8,"
          "broken=tests.planner.factories:data_dependent@3x8x8")
START_TIMEOUT_S = 180.0
CLI_MODULE = "service.commands"  # the module whose main is the `vbs` command


def vbs_main() -> Callable[[list[str]], int]:
    """The `vbs` command's main, to run it in this process."""
    return importlib.import_module(CLI_MODULE).main  # type: ignore[no-any-return]

VIEWPORT = {"width": 1400, "height": 1000}


@dataclass(frozen=True)
class Served:
    """A running ``vbs serve``: its URL, key, store directory and log."""

    url: str
    key: str
    store: Path
    log: Path

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60,
                            headers={"Authorization": f"Bearer {self.key}"}, **kwargs)


def _log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("vbs-serve-ui")
    port = free_port()
    env = {**os.environ, "VBS_CACHE_DIR": str(work / "cache"), "VBS_STORE": str(work / "store"),
           "VBS_MODELS": MODELS, "VBS_BATCH_MAX": "4", "VBS_PROFILE_REPEATS": "1",
           "VBS_PROFILE_WARMUP": "0", "VBS_SLOT_COUNT": "64", "VBS_API_KEY": KEY,
           "VBS_STORE_POLL_S": "0.2", "VBS_GRPC_PORT": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    log = work / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", CLI_MODULE, "serve", "--host", "127.0.0.1", "--port",
             str(port), "--log-level", "warning"], cwd=ROOT, env=env, stdout=out,
            stderr=subprocess.STDOUT)
    server = Served(f"http://127.0.0.1:{port}", KEY, work / "store", log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(base_url=server.url, timeout=5) as c:
            while True:  # readiness polling of a starting process
                if process.poll() is not None:
                    pytest.fail(f"vbs serve exited ({process.returncode}): {_log_tail(log)}")
                try:
                    states = {m["name"]: m["state"] for m in c.get("/models").json()["models"]}
                except httpx.HTTPError:
                    states = {}
                if states == {"branchy": "ready", "tiny": "ready", "broken": "failed"}:
                    break
                if time.monotonic() > deadline:
                    pytest.fail(f"vbs serve not ready in {START_TIMEOUT_S} s ({states}): "
                                f"{_log_tail(log)}")
                time.sleep(0.1)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed: pip install -e .[test]")
    executable = shutil.which("chromium")
    if executable is None:
        pytest.skip("chromium is not on PATH: install Debian's chromium (apt-get install "
                    "chromium; `make test` does) to run the page's browser tests")
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: the tests may run as root (containers, CI), where chromium's sandbox
        # refuses to start; the page is our own, served on loopback.
        launched = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


def open_page(browser: Any, url: str, key: str | None = None) -> Any:
    """A new context on ``url``; with ``key``, the API key typed into the page's prompt."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.script_errors = errors
    page.goto(url)
    if key is not None:
        page.locator("#key-form").wait_for(state="visible")
        page.fill("#api-key", key)
        page.press("#api-key", "Enter")
        page.locator("#key-form").wait_for(state="hidden")
    return page


@pytest.fixture
def page(browser: Any, served: Served) -> Iterator[Any]:
    opened = open_page(browser, f"{served.url}/ui", served.key)
    try:
        yield opened
        assert not opened.script_errors, f"the page's script failed: {opened.script_errors}"
    finally:
        opened.context.close()


@pytest.fixture
def shot(request: pytest.FixtureRequest) -> Callable[[Any, str], Path]:
    def take(page: Any, name: str, **kwargs: Any) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        page.screenshot(path=str(path), **kwargs)
        request.node.user_properties.append(("screenshot", str(path)))
        print(f"screenshot: {path}")
        return path
    return take
