"""The Redis start and health commands of deploy/ and compose.yaml, run for real against a local
redis-server: the password is required, the placeholder is refused, the checks tell up from down.

The commands run unchanged; small shims named redis-server and redis-cli, first on PATH, add
`--port/--dir` (redis takes the last of a repeated option; a `--dir` given is pointed at a
temporary directory too, since redis checks it as it reads it) and `-p`, so nothing touches port
6379 or /data on this machine."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port
from tests.deploy.support import DEPLOY, REPO, load_yaml_documents, render_kustomization

PASSWORD = "0123456789abcdef"


@pytest.fixture
def shims(tmp_path: Path) -> tuple[dict[str, str], int]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.skip("redis-server/redis-cli are not on PATH: install Redis (apt-get install "
                    "redis-server) to run the Redis command checks")
    port = free_port()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    data = tmp_path / "data"
    data.mkdir()
    for name, body in (
            # the value after --dir becomes the test's data directory (/data is not here)
            ("redis-server", 'skip=0\nfor a in "$@"; do shift\n'
                             f'  if [ $skip = 1 ]; then set -- "$@" {data}; skip=0; continue; fi\n'
                             '  [ "$a" = --dir ] && skip=1\n  set -- "$@" "$a"\ndone\n'
                             f'exec {server} "$@" --port {port} --bind 127.0.0.1 --dir {data}\n'),
            ("redis-cli", f'exec {cli} -p {port} "$@"\n')):
        shim = bin_dir / name
        shim.write_text("#!/bin/sh\n" + body)
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS", "VBS_"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env, port


@pytest.fixture
def start() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def _start(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        started.append(process)
        return process

    yield _start
    for process in started:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


def ask(port: int, *commands: str) -> list[str]:
    """Send inline commands to redis on 127.0.0.1:port; its one-line replies, in order."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        conn.sendall("".join(f"{c}\r\n" for c in commands).encode())
        replies = b""
        while replies.count(b"\r\n") < len(commands):
            chunk = conn.recv(4096)
            if not chunk:
                break
            replies += chunk
    return replies.decode().splitlines()


def wait_for_auth(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"redis exited {process.returncode}: {process.stdout.read().decode()[-500:]}")
        try:
            if ask(port, f"AUTH {PASSWORD}", "PING") == ["+OK", "+PONG"]:
                return
        except OSError:
            time.sleep(0.02)  # readiness polling of a starting process
    pytest.fail("redis did not answer in 10 s")


def assert_password_required(port: int) -> None:
    assert ask(port, "PING")[0].startswith("-NOAUTH")
    assert ask(port, "AUTH wrong", "PING")[0].startswith("-WRONGPASS")


def sh(command: list[str], env: dict[str, str]) -> int:
    return subprocess.run(command, env=env, capture_output=True, timeout=20).returncode


# ------------------------------------------------------------------------------- Kubernetes
@pytest.fixture(scope="module")
def redis_container() -> dict[str, Any]:
    objects = render_kustomization(DEPLOY / "base" / "common")
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    return sts["spec"]["template"]["spec"]["containers"][0]


def test_kubernetes_redis_refuses_the_placeholder_password(redis_container, shims) -> None:
    env, _ = shims
    argv = redis_container["command"] + redis_container["args"]
    for placeholder in ("CHANGE-ME", ""):
        done = subprocess.run(argv, env={**env, "REDIS_PASSWORD": placeholder},
                              capture_output=True, text=True, timeout=20)
        assert done.returncode == 1
        assert "placeholder" in done.stderr and "deploy/README.md" in done.stderr


def test_kubernetes_redis_requires_the_password_and_its_probe_knows(redis_container, shims,
                                                                    start) -> None:
    env, port = shims
    env = {**env, "REDIS_PASSWORD": PASSWORD}
    process = start(redis_container["command"] + redis_container["args"], env)
    wait_for_auth(port, process)
    assert_password_required(port)
    probe = redis_container["readinessProbe"]["exec"]["command"]
    assert sh(probe, env) == 0
    assert sh(probe, {**env, "REDIS_PASSWORD": "wrong"}) != 0
    process.terminate()
    process.wait(timeout=10)
    assert sh(probe, env) != 0, "the probe must fail when redis is down"


# ------------------------------------------------------------------------------- compose
def interpolate(value: str, variables: dict[str, str]) -> str:
    """The part of Compose interpolation compose.yaml's redis uses: ${VAR:?msg}, $$."""
    import re
    value = re.sub(r"\$\{(\w+)(:\?[^}]*)?\}", lambda m: variables[m.group(1)], value)
    return value.replace("$$", "$")


def test_compose_redis_requires_the_password_and_its_healthcheck_knows(shims, start) -> None:
    env, port = shims
    (compose,) = load_yaml_documents((REPO / "compose.yaml").read_text())
    redis = compose["services"]["redis"]
    variables = {"REDIS_PASSWORD": PASSWORD}
    argv = [interpolate(a, variables) for a in redis["command"]]
    container_env = {**env, **{k: interpolate(v, variables) for k, v in redis["environment"].items()}}
    process = start(argv, container_env)
    wait_for_auth(port, process)
    assert_password_required(port)
    kind, *check = [interpolate(a, variables) for a in redis["healthcheck"]["test"]]
    assert kind == "CMD-SHELL"
    assert sh(["sh", "-c", *check], container_env) == 0
    assert sh(["sh", "-c", *check], {**container_env, "REDIS_PASSWORD": "wrong"}) != 0
