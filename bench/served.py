"""The one set of helpers the benchmark scripts share: what a benchmark does to serve a model
(this checkout's `vbs serve`, or any server, in its own process on a free loopback port,
waited on until it answers, and stopped however the benchmark ends), a request's .npy body,
a process's CPU seconds.

The benchmark scripts run as ``python bench/NAME.py``, so this module is importable as
``served`` from beside them. bench/gpu/ keeps its own copies: on the GPU machine only its own
files and the package are importable.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import httpx
import numpy as np

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


def free_port(*taken: int) -> int:
    """A port free on 127.0.0.1 now, none of ``taken`` (ports chosen for the same server but
    not bound yet, which the kernel may hand out again)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in taken:
            return port


def npy(x: np.ndarray) -> bytes:
    """``x`` as the body of an ``application/x-npy`` request."""
    buffer = io.BytesIO()
    np.save(buffer, x)
    return buffer.getvalue()


def wait_until(ask: Callable[[], bool], process: subprocess.Popen[bytes] | None,
               timeout_s: float = math.inf, poll_s: float = 0.5, until: str = "ready"
               ) -> str | None:
    """None once ``ask()`` is true (an HTTP error counts as not yet: a server still starting);
    else why not: ``process`` (the server's, if it has one) exited, or ``timeout_s`` passed
    ("not {until} within ...")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            return f"exited {process.returncode} while starting"
        try:
            if ask():
                return None
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    return f"not {until} within {timeout_s:g} s"


def wait_ready(url: str, process: subprocess.Popen[bytes] | None, timeout_s: float = math.inf,
               poll_s: float = 0.5) -> str | None:
    """``wait_until`` a GET of ``url`` (a health endpoint) answers 200."""
    return wait_until(lambda: httpx.get(url, timeout=5).status_code == 200, process,
                      timeout_s, poll_s)


def stop(process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """SIGTERM, to the process's group where it leads one (``start_new_session``: a server
    that starts helpers of its own, or one inside a memory group's shell), SIGKILL after
    ``timeout_s``."""
    def send(sig: int) -> None:
        try:
            if os.getpgid(process.pid) == process.pid:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    send(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        process.wait(timeout=30)


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
              what: str = "vbs serve", root: Path = ROOT, timeout_s: float = math.inf,
              log: IO[bytes] | int | None = None
              ) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``vbs serve ARGS`` on 127.0.0.1 (``env`` or this process's environment) of the checkout
    ``root`` (this one, or another such as a ``git worktree`` of an earlier commit): yields the
    process and its base URL once ``/v2/health/ready`` answers 200; its output to ``log``
    (a file, or ``subprocess.DEVNULL``) where given."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "service.commands", "serve", "--grpc-port", "0", *args, "--host", "127.0.0.1",
         "--port", str(port)],
        env={**(env if env is not None else os.environ), "PYTHONPATH": str(root)}, cwd=root,
        stdout=log, stderr=None if log is None else subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:  # a process starting (the first start profiles and plans)
        why = wait_ready(f"{url}/v2/health/ready", server, timeout_s)
        if why:
            raise SystemExit(f"{what}: {why}")
        yield server, url
    finally:
        stop(server)
