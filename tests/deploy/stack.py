"""The compose stack under test (tests/deploy/test_compose_stack.py): one compose project on a
Docker engine, with the CLI calls, waits and readings its tests share.

The project is compose.yaml + compose.offline.yaml (what this machine substitutes for the
registries it cannot reach) + an override the test writes (the weights it checks answers
against, given to the planner, which compiles them into the store the worker serves from),
under a project name of its own, so it never touches another stack on the engine.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.docker_engine import Engine
from tests.deploy.support import REPO

PROJECT = "vbs-compose-test"
FILES = ("compose.yaml", "compose.offline.yaml")


@dataclass(frozen=True)
class Stack:
    """A compose project on ``engine``: ``env`` holds its settings (the password among them),
    ``answered`` counts the 200 answers the tests got, by the service's endpoint label."""

    engine: Engine
    command: list[str]  # the Compose v2 CLI
    override: Path
    env: dict[str, str]
    http_port: int
    grpc_port: int
    transcript: dict[str, Any] = field(default_factory=dict)
    answered: Counter[str] = field(default_factory=Counter)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def password(self) -> str:
        return self.env["REDIS_PASSWORD"]

    def compose(self, *args: str, timeout: float = 600, check: bool = True,
                log: Path | None = None) -> subprocess.CompletedProcess[str]:
        """`docker compose -p PROJECT -f ... ARGS` against the engine; with ``log``, its output
        goes there (builds print thousands of lines) and a failure quotes the log's end."""
        argv = [*self.command, "-p", PROJECT, "--project-directory", str(REPO)]
        for name in (*FILES, str(self.override)):
            argv += ["-f", str(REPO / name)]
        env = {k: v for k, v in self.engine.env().items()  # only the test's settings
               if not k.startswith(("VBS_", "COMPOSE_", "WORKER_", "REDIS_PASSWORD"))}
        env.update(self.env)
        if log is None:
            done = subprocess.run([*argv, *args], env=env, capture_output=True, text=True,
                                  timeout=timeout)
            detail = done.stderr[-3000:]
        else:
            with open(log, "w") as out:
                done = subprocess.run([*argv, *args], env=env, stdout=out,
                                      stderr=subprocess.STDOUT, text=True, timeout=timeout)
            detail = f"{log}:\n" + log.read_text(errors="replace")[-3000:]
        if check and done.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} failed ({done.returncode}): "
                                 f"{detail}")
        return done

    def config(self) -> dict[str, Any]:
        """The project as compose resolves it (images, environment, ports)."""
        return json.loads(self.compose("config", "--format", "json").stdout)

    def container(self, service: str) -> dict[str, Any]:
        """`docker inspect` of the service's container (running or exited)."""
        ids = self.compose("ps", "-a", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return json.loads(self.engine.docker("inspect", ids[0]).stdout)[0]

    def redis_cli(self, *args: str) -> str:
        """redis-cli in the redis container, the password from its environment (REDISCLI_AUTH),
        never on a command line."""
        quoted = " ".join(f"'{a}'" for a in args)
        script = f'REDISCLI_AUTH="$REDIS_PASSWORD" exec redis-cli --no-auth-warning {quoted}'
        return self.compose("exec", "-T", "redis", "sh", "-c", script, timeout=60).stdout.strip()


def get(url: str, timeout: float = 30) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_until_ready(stack: Stack, timeout_s: float) -> float:
    """Poll the worker's readiness until it answers 200; the monotonic time it did. Fails with
    the worker's log when its container exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if get(f"{stack.base}/v2/health/ready", timeout=5)[0] == 200:
                return time.monotonic()
        except OSError:
            pass  # the port is published before the server listens
        state = stack.container("worker")["State"]
        if state["Status"] == "exited" or time.monotonic() > deadline:
            logs = stack.compose("logs", "--no-color", "--tail", "60", check=False).stdout
            raise AssertionError(f"worker not ready ({state['Status']}) within {timeout_s:.0f} "
                                 f"s:\n{logs}")
        time.sleep(0.5)  # readiness polling of containers starting, not test synchronisation


def wait_until_healthy(stack: Stack, service: str, timeout_s: float) -> None:
    """Poll the engine until the service's container reports its health check healthy."""
    deadline = time.monotonic() + timeout_s
    while (health := stack.container(service)["State"].get("Health", {})).get("Status") != "healthy":
        if time.monotonic() > deadline:
            raise AssertionError(f"{service} not healthy within {timeout_s:.0f} s: {health}")
        time.sleep(1)  # the engine runs the check every few seconds


def metric_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a /metrics page: (name, labels) -> value, read by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)
