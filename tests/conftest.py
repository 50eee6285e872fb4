"""Shared test fixtures: a real redis-server for the whole session, flushed before each test.

The server is started from the ``redis-server`` binary on a free port on 127.0.0.1 (never
the machine's 6379 one) and on a unix socket, without persistence (``--save ""
--appendonly no``), in a temporary directory. Without the binary, every test that asks
for it is skipped with the reason; the rest of the suite runs.

Fixtures:
    redis_server          session: the running server (``.url``, ``.unix_url``, ``.port``)
    redis_url             that server's redis://127.0.0.1:<port>/0 URL, flushed for this test
    redis_unix_url        the same server's unix:// URL, flushed for this test
    redis_server_factory  call it to start a private server this test may stop (``.stop()``)
    closed_redis_url      a redis:// URL with a password on a port where nothing listens
    no_planning           fails the test if the DP, the simulator or a memory walk runs

Hook: a test marked ``gpu`` that skips without CUDA must skip at its CUDA call (a reason with
``CUDA only:`` or ``needs CUDA``); any other skip fails it, so a GPU path that stopped running
on the CPU shows in `make test` itself (the GPU run's rehearsal only collects them).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT_S = 10.0
START_TRIES = 5


@dataclass(frozen=True)
class RedisServer:
    """A redis-server process started for tests."""

    port: int
    socket_path: Path
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket_path}?db=0"

    def flush(self) -> None:
        import redis
        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5) as client:
            client.flushall()

    def stop(self) -> None:
        """Terminate the server (kill it if it lingers) and reap it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not on PATH: install Redis (e.g. apt-get install "
                    "redis-server) to run the tests that need a real Redis")
    pytest.importorskip("redis", reason="redis-py is not installed: pip install -e .[test]")
    return binary


def _wait_ready(process: subprocess.Popen[bytes], port: int) -> bool:
    """Poll until the server answers PING (True) or exits or times out (False)."""
    import redis
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1,
                             socket_connect_timeout=1, retry=None) as client:
                if client.ping():
                    return True
        except redis.RedisError:
            time.sleep(0.02)  # readiness polling of a starting process, not test synchronisation
    return False


def start_redis_server(workdir: Path) -> RedisServer:
    """Start redis-server on a free port and a unix socket in ``workdir``; wait until it answers."""
    binary = _redis_binary()
    socket_path = workdir / "redis.sock"
    log_tail = ""
    for _ in range(START_TRIES):  # another process may take the free port before redis binds it
        port = free_port()
        log = workdir / f"redis-{port}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(workdir), "--unixsocket", str(socket_path),
                 "--unixsocketperm", "700", "--daemonize", "no", "--loglevel", "warning"],
                stdout=out, stderr=subprocess.STDOUT)
        server = RedisServer(port=port, socket_path=socket_path, process=process)
        if _wait_ready(process, port):
            return server
        server.stop()
        log_tail = log.read_text(errors="replace")[-500:]
    pytest.fail(f"redis-server did not start in {START_TRIES} tries; its log ends: {log_tail}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis_server(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis_server.flush()
    return redis_server.url


@pytest.fixture
def redis_unix_url(redis_server: RedisServer) -> str:
    redis_server.flush()
    return redis_server.unix_url


@pytest.fixture
def redis_server_factory(tmp_path_factory: pytest.TempPathFactory
                         ) -> Iterator[Callable[[], RedisServer]]:
    started: list[RedisServer] = []

    def start() -> RedisServer:
        server = start_redis_server(tmp_path_factory.mktemp("redis-private"))
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def closed_redis_url() -> str:
    return f"redis://:s3cret@127.0.0.1:{free_port()}/0"


@pytest.fixture
def no_planning(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """While a test runs: building the DP's tables, replaying a program in the simulator, or
    walking a program on byte counts raises, and the test fails at teardown if any was tried
    (even where the error was caught), so a request path that does more than look up is found."""
    from planner.solver.dp import ChainTables
    from core.walk import MemoryAccount
    from planner.solver.simulate import _Frame

    tried: list[str] = []

    def forbid(what: str) -> Callable[..., None]:
        def init(self: object, *args: object, **kwargs: object) -> None:
            tried.append(what)
            raise AssertionError(f"{what} ran where only table lookups may")
        return init

    for cls, what in ((ChainTables, "the DP"), (MemoryAccount, "a memory walk"),
                      (_Frame, "the simulator")):
        monkeypatch.setattr(cls, "__init__", forbid(what))
    yield tried
    assert not tried, f"planning work on the request path: {tried}"


CUDA_SKIPS = ("CUDA only:", "needs CUDA")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or item.get_closest_marker("gpu") is None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(mark in reason for mark in CUDA_SKIPS):
        report.outcome = "failed"
        report.longrepr = (f"a test marked gpu skipped before its CUDA call: {reason} "
                           "(skip with tests/gpu/conftest.py's cuda_only at the call that "
                           "needs CUDA)")
