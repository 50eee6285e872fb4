"""What a benchmark does to serve a model: this checkout's `vbs serve` in its own process, on a
free loopback port, waited on until it answers ready, and stopped however the benchmark ends.

The benchmark scripts run as ``python bench/NAME.py``, so this module is importable as
``served`` from beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def stat_cpu(path: str) -> tuple[str, float]:
    """The name and user + system CPU seconds in a ``/proc/<pid>/stat`` (the whole process) or
    ``/proc/<pid>/task/<tid>/stat`` (one thread) file."""
    with open(path) as f:
        stat = f.read()
    head, _, rest = stat.rpartition(")")
    fields = rest.split()
    return head[head.index("(") + 1:], (int(fields[11]) + int(fields[12])) / TICK


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def add_trees_argument(ap: argparse.ArgumentParser) -> None:
    """``--trees DIR,DIR...``: checkouts to serve from in turn (this one is ``.``; another may be
    a ``git worktree add /tmp/before <commit>``), compared side by side, interleaved."""
    ap.add_argument("--trees", default=".",
                    help="checkouts to serve from, comma-separated, one after another per round")


def interleaved(rounds: int, trees: str) -> Iterator[tuple[int, Path]]:
    """(round, checkout) for every checkout of ``--trees``, round after round."""
    roots = [Path(t).resolve() for t in trees.split(",")]
    return ((k, root) for k in range(1, rounds + 1) for root in roots)


@contextlib.contextmanager
def vbs_serve(args: Sequence[str], env: Mapping[str, str] | None = None,
              what: str = "vbs serve", root: Path = ROOT
              ) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``vbs serve ARGS`` on 127.0.0.1 (``env`` or this process's environment) of the checkout
    ``root`` (this one, or another such as a ``git worktree`` of an earlier commit): yields the
    process and its base URL once ``/v2/health/ready`` answers 200."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "service.commands", "serve", "--grpc-port", "0", *args, "--host", "127.0.0.1",
         "--port", str(port)],
        env={**(env if env is not None else os.environ), "PYTHONPATH": str(root)}, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{url}/v2/health/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"{what} exited with {server.returncode} before it was ready")
            time.sleep(0.5)  # a process starting (the first start profiles and plans)
        yield server, url
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
