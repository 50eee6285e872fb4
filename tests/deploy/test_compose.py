"""compose.yaml (+ compose.gpu.yaml): redis, a one-shot planner, a worker, in the right order;
the planner on the torch image, the CPU worker on the lean one (the CUDA image for both on a GPU).

Read with PyYAML always; with a Compose v2 CLI (`docker compose` or a standalone v2
`docker-compose`) also resolved by `compose config`, which needs no Docker engine."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from tests.deploy.support import REPO, compose_command, run_python_check

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: pip install -e '.[test]'")

COMPOSE = REPO / "compose.yaml"
COMPOSE_GPU = REPO / "compose.gpu.yaml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose_gpu() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_GPU.read_text())


def command_text(service: dict[str, Any]) -> str:
    command = service.get("command", "")
    return " ".join(command) if isinstance(command, list) else command


def healthcheck_text(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    return " ".join(test) if isinstance(test, list) else test


# ------------------------------------------------------------------------------- compose.yaml
def test_redis_is_pinned_password_protected_persistent_and_checked(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    image = redis["image"]
    assert image.startswith("redis:7.") and "alpine" in image and not image.endswith(":latest"), image
    assert redis["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?"), \
        "redis must refuse to start without REDIS_PASSWORD"
    command = command_text(redis)
    # the password goes to redis-server as a config line on stdin, never on a command line
    assert "--requirepass" not in command and "${REDIS_PASSWORD" not in command
    assert "redis-server - " in command and 'requirepass "$$REDIS_PASSWORD"' in command
    assert redis["user"] == "999:1000", "run as the image's redis user, not root"
    check = healthcheck_text(redis)
    assert "redis-cli" in check and "ping" in check
    assert "REDISCLI_AUTH=" in check and " -a " not in check, "no password on redis-cli's command line"
    volumes = [v.split(":")[0] if isinstance(v, str) else v["source"] for v in redis["volumes"]]
    assert any(v in (compose.get("volumes") or {}) for v in volumes), "redis data is not on a named volume"
    assert "ports" not in redis, "redis is for planner and worker only; publish no host port"


def test_planner_is_one_shot_after_redis_is_healthy(compose: dict[str, Any]) -> None:
    planner = compose["services"]["planner"]
    assert command_text(planner).startswith("vbs plan")
    assert planner["depends_on"]["redis"]["condition"] == "service_healthy"
    assert planner["restart"] == "no"


def test_worker_serves_after_the_planner_succeeded(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    assert command_text(worker).startswith("vbs serve")
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert worker["depends_on"]["planner"]["condition"] == "service_completed_successfully"
    assert worker["ports"] == ["${WORKER_BIND:-127.0.0.1}:${WORKER_PORT:-8000}:8000",
                               "${WORKER_BIND:-127.0.0.1}:${WORKER_GRPC_PORT:-8001}:8001"], \
        "HTTP and gRPC are published on localhost unless WORKER_BIND says otherwise"
    assert worker["environment"]["VBS_GRPC_PORT"] == "8001"
    assert command_text(worker).endswith("--grpc-port 8001")
    assert worker["environment"]["VBS_API_KEY"] == "${VBS_API_KEY:-}"
    assert "/v2/health/live" in healthcheck_text(worker)


def test_worker_healthcheck_passes_on_live_and_fails_otherwise(compose: dict[str, Any],
                                                              health_server) -> None:
    kind, *argv = compose["services"]["worker"]["healthcheck"]["test"]
    assert kind == "CMD"
    server, handler = health_server
    port = server.server_address[1]
    assert run_python_check(argv, port) == 0
    handler.status = 503
    assert run_python_check(argv, port) == 1


# the image each CPU service runs, and the Dockerfile it is built from
CPU_IMAGES = {"planner": ("vbs-serve:0.1.0-cpu", "docker/Dockerfile.cpu"),
              "worker": ("vbs-serve:0.1.0-cpu-worker", "docker/Dockerfile.worker")}


def test_planner_and_worker_share_settings(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("planner", "worker"):
        service = services[name]
        env = service["environment"]
        assert env["VBS_STORE"].startswith("redis://:${REDIS_PASSWORD:?")
        assert env["VBS_STORE"].endswith("@redis:6379/0")
        assert env["VBS_MODELS"] == "${VBS_MODELS:-squeezenet1_0}"
        assert env["VBS_CACHE_DIR"] and env["VBS_DEVICE"] == "cpu"
        assert service.get("read_only") is True and service.get("cap_drop") == ["ALL"]
    # the worker serves what the planner compiled for the same model entries, dtype and
    # runtimes (part of the tables' fingerprint): ONNX Runtime, as the lean worker needs
    for name in ("VBS_STORE", "VBS_MODELS", "VBS_BATCH_MAX", "VBS_DTYPE", "VBS_DEVICE",
                 "VBS_RUNTIME"):
        assert services["planner"]["environment"][name] == services["worker"]["environment"][name]
    assert services["worker"]["environment"]["VBS_RUNTIME"] == "onnxruntime"
    assert "--store" not in command_text(services["planner"]), \
        "the store URL holds the password: pass it in the environment, not on the command line"


def test_the_planner_runs_the_torch_image_the_worker_the_lean_one(compose: dict[str, Any]) -> None:
    """The planner captures and profiles with torch (docker/Dockerfile.cpu); the CPU worker
    serves the compiled model without it (docker/Dockerfile.worker sets VBS_LEAN=on)."""
    services = compose["services"]
    for name, (image, dockerfile) in CPU_IMAGES.items():
        assert services[name]["image"] == image
        assert services[name]["build"] == {"context": ".", "dockerfile": dockerfile}
    assert services["planner"]["image"] != services["worker"]["image"]
    assert "VBS_LEAN" not in services["worker"]["environment"], \
        "the image sets VBS_LEAN=on; compose.gpu.yaml's CUDA worker must not inherit it"


def test_gpu_override_reserves_a_gpu_for_planner_and_worker(compose_gpu: dict[str, Any]) -> None:
    for name in ("planner", "worker"):
        service = compose_gpu["services"][name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
        assert service["environment"]["VBS_DEVICE"] == "cuda"
        assert service["environment"]["VBS_RUNTIME"] == "auto"
        # the worker too: the CUDA image with torch, in place of the lean CPU worker image
        assert service["image"] == "vbs-serve:0.1.0-cuda"
        assert service["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    assert "redis" not in compose_gpu["services"]


# ------------------------------------------------------------------------------- compose config
def compose_config(*files: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = compose_command()
    if command is None:
        pytest.skip("no Compose v2 CLI here (neither the `docker compose` plugin nor a v2 "
                    "docker-compose): only the PyYAML checks ran")
    args = [*command, "--project-directory", str(REPO)]
    for f in files:
        args += ["-f", str(REPO / f)]
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("VBS_", "COMPOSE_", "REDIS_PASSWORD", "WORKER_", "GPU_DEVICE"))}
    return subprocess.run([*args, "config", "--format", "json"], capture_output=True, text=True,
                          timeout=60, env={**clean, **env})


def test_compose_config_resolves_and_needs_a_password() -> None:
    missing = compose_config("compose.yaml", env={})
    assert missing.returncode != 0 and "set REDIS_PASSWORD" in missing.stderr

    done = compose_config("compose.yaml", env={"REDIS_PASSWORD": "0123abcd"})
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    assert set(services) == {"redis", "planner", "worker"}
    assert services["worker"]["environment"]["VBS_STORE"] == "redis://:0123abcd@redis:6379/0"
    assert services["worker"]["environment"]["VBS_MODELS"] == "squeezenet1_0"
    assert "0123abcd" not in " ".join(services["redis"]["command"])  # never on a command line
    assert services["redis"]["environment"]["REDIS_PASSWORD"] == "0123abcd"
    assert services["worker"]["depends_on"]["planner"]["condition"] == "service_completed_successfully"
    assert [(p["host_ip"], p["published"], p["target"]) for p in services["worker"]["ports"]] \
        == [("127.0.0.1", "8000", 8000), ("127.0.0.1", "8001", 8001)]
    assert services["worker"]["environment"]["VBS_API_KEY"] == ""  # empty: no key
    public = compose_config("compose.yaml", env={"REDIS_PASSWORD": "x1", "WORKER_BIND": "0.0.0.0",
                                                 "VBS_API_KEY": "k" * 16})
    worker = json.loads(public.stdout)["services"]["worker"]
    assert {p["host_ip"] for p in worker["ports"]} == {"0.0.0.0"}
    assert worker["environment"]["VBS_API_KEY"] == "k" * 16

    models = compose_config("compose.yaml", env={"REDIS_PASSWORD": "x1", "VBS_MODELS": "resnet18,c3d"})
    assert json.loads(models.stdout)["services"]["planner"]["environment"]["VBS_MODELS"] == "resnet18,c3d"


def test_compose_config_merges_the_gpu_override() -> None:
    done = compose_config("compose.yaml", "compose.gpu.yaml", env={"REDIS_PASSWORD": "0123abcd"})
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    for name in ("planner", "worker"):
        service = services[name]
        assert service["environment"]["VBS_DEVICE"] == "cuda"
        assert service["environment"]["VBS_STORE"].endswith("@redis:6379/0"), "base settings kept"
        assert service["image"] == "vbs-serve:0.1.0-cuda"
        assert service["build"]["dockerfile"] == "docker/Dockerfile.cuda"
        assert service["environment"].get("VBS_LEAN", "off") == "off", "torch serves on CUDA"
        assert service["environment"]["VBS_RUNTIME"] == "auto", "ONNX Runtime runs on the CPU only"
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]


def test_compose_config_merges_the_offline_override_into_build_arguments_only() -> None:
    """compose.offline.yaml substitutes base images and torch's index through build arguments
    and image names; every service runs as compose.yaml says, from the same Dockerfile. The
    worker's image (no torch) takes the base image only."""
    env = {"REDIS_PASSWORD": "0123abcd"}
    base = compose_config("compose.yaml", env=env)
    offline = compose_config("compose.yaml", "compose.offline.yaml", env=env)
    assert offline.returncode == 0, offline.stderr
    plain, changed = (json.loads(done.stdout)["services"] for done in (base, offline))
    for name in ("redis", "planner", "worker"):
        assert changed[name]["image"].startswith("vbs-offline/") or \
            changed[name]["image"].endswith("-offline"), changed[name]["image"]
        keep = {k: v for k, v in plain[name].items() if k not in ("image", "build")}
        assert {k: v for k, v in changed[name].items() if k in keep} == keep, name
        assert changed[name]["build"]["network"] == "host"
    for name, (image, dockerfile) in CPU_IMAGES.items():
        build = changed[name]["build"]
        assert changed[name]["image"] == f"{image}-offline"
        assert build["dockerfile"] == plain[name]["build"]["dockerfile"] == dockerfile
    planner, worker = changed["planner"]["build"], changed["worker"]["build"]
    assert set(planner["args"]) == {"PYTHON_IMAGE", "TORCH_INDEX_URL"}
    assert planner["args"]["TORCH_INDEX_URL"].startswith("http://127.0.0.1:")
    assert worker["args"] == {"PYTHON_IMAGE": planner["args"]["PYTHON_IMAGE"]}
