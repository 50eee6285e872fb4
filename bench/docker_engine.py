"""A Docker engine to build images and run containers on: the one already running, or a private
dockerd started here (its own data root, exec root and socket), stopped by whoever started it.

Why a private engine: this project's machines can install Debian's docker.io but run no engine,
and several jobs share a machine. A dockerd of our own keeps its images, containers and
networks apart from anyone else's, and with ``--bridge none`` it takes no docker0 that another
engine may hold (compose gives every project a network of its own; builds here use the host's
network). `make compose-test` (tests/deploy/test_compose_stack.py) runs on it; so can any
benchmark that wants a container's ``--memory``.

    python -m bench.docker_engine [--state out/compose]   # start one, print DOCKER_HOST; Ctrl-C stops it
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SOCKET = "unix:///var/run/docker.sock"
START_TIMEOUT_S = 90.0  # dockerd and its containerd on a busy 2-core machine; an upper bound
INSTALL_HINT = "apt-get install -y docker.io (Debian's Docker Engine; `make compose-test` does)"


class EngineUnavailable(RuntimeError):
    """No engine runs and none can be started here (no dockerd binary, not root)."""


@dataclass(frozen=True)
class Engine:
    """A Docker engine reachable at ``host``; ``process`` is the dockerd started for the
    caller (None when it was already running: then it is not ours to stop)."""

    host: str
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment with DOCKER_HOST pointing at the engine."""
        return {**os.environ, "DOCKER_HOST": self.host, **(extra or {})}

    def docker(self, *args: str, timeout: float = 120,
               check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the docker CLI against this engine; CalledProcessError (with its stderr) when
        ``check`` and it fails."""
        return subprocess.run(["docker", *args], env=self.env(), capture_output=True, text=True,
                              timeout=timeout, check=check)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the dockerd started here (SIGTERM: it stops its containers first); a no-op for
        an engine that was already running."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def answers(host: str) -> bool:
    """Whether an engine answers at ``host`` (a DOCKER_HOST value)."""
    if shutil.which("docker") is None:
        return False
    try:
        done = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                              env={**os.environ, "DOCKER_HOST": host}, capture_output=True,
                              timeout=15)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def running(state: Path) -> Engine | None:
    """An engine that already answers: $DOCKER_HOST's, the system's, or one an earlier run
    left at ``state``."""
    for host in (os.environ.get("DOCKER_HOST"), DEFAULT_SOCKET, f"unix://{state / 'docker.sock'}"):
        if host and answers(host):
            return Engine(host=host)
    return None


def startable() -> str | None:
    """Why no dockerd can be started here, or None when one can."""
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        return f"no Docker engine runs and dockerd/docker are not installed: {INSTALL_HINT}"
    if os.geteuid() != 0:
        return "no Docker engine runs, and starting dockerd needs root"
    return None


def start(state: Path, timeout_s: float = START_TIMEOUT_S) -> Engine:
    """Start a private dockerd with its files under ``state``; returns once it answers."""
    why = startable()
    if why:
        raise EngineUnavailable(why)
    state.mkdir(parents=True, exist_ok=True)
    socket = state / "docker.sock"
    log = state / "dockerd.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            ["dockerd", "--data-root", str(state / "data"), "--exec-root", str(state / "exec"),
             "--pidfile", str(state / "dockerd.pid"), "-H", f"unix://{socket}", "--bridge", "none"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    engine = Engine(host=f"unix://{socket}", process=process, log=log)
    deadline = time.monotonic() + timeout_s
    while not answers(engine.host):
        if process.poll() is not None:
            raise RuntimeError(f"dockerd exited with {process.returncode}; its log ({log}):\n"
                               + log.read_text(errors="replace")[-3000:])
        if time.monotonic() > deadline:
            engine.stop()
            raise RuntimeError(f"dockerd did not answer on {socket} within {timeout_s:.0f} s; "
                               f"see {log}")
        time.sleep(0.5)  # polling a starting daemon
    return engine


def find_or_start(state: Path) -> Engine:
    """The engine already running, else a private one started under ``state``."""
    return running(state) or start(state)


def wait_for_signal() -> None:
    """Block until SIGINT (Ctrl-C) or SIGTERM, so that a caller can clean up after either."""
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", type=Path, default=Path("out/compose"),
                        help="where a started engine keeps its images, containers and socket")
    args = parser.parse_args()
    engine = find_or_start(args.state.resolve())
    print(f"export DOCKER_HOST={engine.host}", flush=True)
    if engine.process is None:
        print("(an engine was already running there; nothing to stop)")
        return 0
    wait_for_signal()
    engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
