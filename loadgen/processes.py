"""``vbs loadtest --processes P``: a load generator that measures the server, not itself.

P client processes (each its own interpreter, started with ``subprocess``; ``--cpus`` pins
every one of them to those CPUs with ``os.sched_setaffinity``) send requests encoded once
beforehand (``loadgen.wire``: HTTP in the OIP v2 binary tensor extension, or gRPC
``ModelInfer`` with raw tensor bytes) and read of each answer only its status and the timings
the service returns. Two loops:

- **closed** (``--concurrency C``): C requests in flight in all, split across the processes;
  each sends again when answered.
- **open** (``--rate R``): R arrivals a second in all, each process R/P of them, Poisson
  (exponential gaps; the default) or at a fixed interval (the processes' phases interleaved);
  a request is sent at its time whether or not earlier ones were answered (over HTTP on an
  idle connection or a new one, up to ``MAX_CONNECTIONS`` a process). An arrival sent more
  than ``LATE_S`` after its time is *late*: the client could not keep up, for want of CPU or,
  over HTTP, of a free connection when the server holds them all (``connection_waits``).

The processes connect, say they are ready, and all start at one instant of the machine's
monotonic clock; requests in the first ``--warmup`` seconds are not counted. What the window
of ``--duration`` seconds counts: answers received in it (latency from the request's write),
requests sent in it (arrivals scheduled in it, in the open loop), what is still in flight at
its end, and each process's own CPU (``getrusage``: user + system, every thread) over it,
summed. Nothing is drained after the window: each process reports and exits.

Here: the options, checked (``configure``), and the parent (``run_load``: start, synchronize,
gather; ``summary``); a client process's body is ``loadgen.child``, what it sends and
reads ``loadgen.wire``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from core.errors import UsageError
from loadgen.loadtest import Result, check_load, check_loopback

MAX_PROCESSES = 64
MAX_CONCURRENCY = 4096
MAX_RATE = 200_000.0
MAX_CONNECTIONS = 512        # HTTP connections one process of the open loop opens at most
LATE_S = 0.005               # an arrival sent later than this after its time is late
READY_TIMEOUT_S = 60.0       # for every process to start, connect and say so
START_DELAY_S = 0.05         # from "all ready" to the common start
ARRIVALS = ("poisson", "fixed")
ROOT = Path(__file__).resolve().parent.parent
CHILD = "import sys, loadgen.child as c; c.main(int(sys.argv[1]))"  # a client process


@dataclass(frozen=True)
class Load:
    """A load, checked (``configure``): what every client process is told."""

    protocol: str                   # http | grpc
    url: str                        # the base URL, or grpc://HOST:PORT
    host: str
    port: int
    model: str
    input_name: str
    shape: tuple[int, ...]          # one sample's
    samples: int                    # a request's
    processes: int
    concurrency: int | None         # closed loop: in flight in all
    rate_rps: float | None          # open loop: arrivals a second in all
    arrivals: str
    duration_s: float
    warmup_s: float
    cpus: tuple[int, ...] | None
    api_key: str | None = None
    seed: int = 0
    index: int = 0                  # this process's number, in the copy it is given

    @property
    def loop(self) -> str:
        return "open" if self.rate_rps is not None else "closed"

    def share(self) -> tuple[int, float]:
        """This process's requests in flight (closed loop) or arrivals a second (open)."""
        if self.concurrency is not None:
            base, extra = divmod(self.concurrency, self.processes)
            return base + (self.index < extra), 0.0
        return 0, float(self.rate_rps or 0.0) / self.processes


@dataclass(frozen=True)
class ChildReport:
    """What one client process counted in the window."""

    result: Result
    sent: int
    late: int
    lags: list[float]           # open loop: each counted arrival's delay before its write
    in_flight: int              # at the window's end
    cpu_s: float
    connections: int            # HTTP connections opened (gRPC: its one channel)
    connection_waits: int       # HTTP: requests in the window that found every connection busy


def parse_cpus(text: str | None) -> tuple[int, ...] | None:
    """``--cpus 1``, ``2-3`` or ``0,2-3``: CPUs this process may use; else UsageError."""
    if text is None:
        return None
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise UsageError(f"--cpus {text!r}: give CPUs as 1, 2-3 or 0,2-3") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise UsageError(f"--cpus {text!r}: give CPUs among those this process may use "
                         f"({','.join(map(str, sorted(allowed)))})")
    return tuple(sorted(cpus))


def configure(protocol: str, url: str | None, model: str, *, processes: int | None = None,
              concurrency: int | None = None, rate: float | None = None,
              clients: int | None = None, arrivals: str = "poisson", cpus: str | None = None,
              fmt: str | None = None, samples: int = 1, duration_s: float = 10.0,
              warmup_s: float = 0.0, api_key: str | None = None, seed: int = 0) -> Load:
    """The load the options ask for, checked, with the model's input from the service's
    metadata; UsageError naming the option and the fix otherwise. ``clients`` (``--clients``)
    stands for ``concurrency`` where that is not given; ``url`` None is the default port."""
    processes = 1 if processes is None else processes
    if fmt not in (None, "oip"):
        raise UsageError(f"--format {fmt}: the client processes send OIP v2 with binary "
                         "tensors; leave --format out")
    if protocol == "grpc":
        from loadgen.loadtest_grpc import DEFAULT_TARGET, check_target
        address = check_target(url or DEFAULT_TARGET)
        base, (host, _, port) = f"grpc://{address}", address.rpartition(":")
    else:
        url = url or "http://127.0.0.1:8000"
        base = check_loopback(url)
        parts = urlsplit(base)
        if parts.scheme != "http":
            raise UsageError(f"--url {url!r}: the client processes speak plain HTTP; give "
                             "http://127.0.0.1:PORT")
        host, port = str(parts.hostname), str(parts.port or 80)
    if not 1 <= processes <= MAX_PROCESSES:
        raise UsageError(f"--processes {processes}: give 1..{MAX_PROCESSES} client processes")
    if rate is not None and (concurrency is not None or clients is not None):
        raise UsageError(f"--rate with --{'concurrency' if concurrency is not None else 'clients'}"
                         ": give --rate R for an open loop or --concurrency C for a closed one")
    if concurrency is not None and clients is not None and clients != concurrency:
        raise UsageError("--clients with --concurrency: give --concurrency alone")
    if rate is None:
        concurrency = concurrency if concurrency is not None else (clients or 4)
        if not processes <= concurrency <= MAX_CONCURRENCY:
            raise UsageError(f"--concurrency {concurrency}: give {processes}..{MAX_CONCURRENCY} "
                             f"(at least one request in flight for each of --processes "
                             f"{processes}; to fill the largest batch, twice its size)")
    elif not 0 < rate <= MAX_RATE or math.isnan(rate):
        raise UsageError(f"--rate {rate}: give requests a second, 0..{MAX_RATE:g}")
    if arrivals not in ARRIVALS:
        raise UsageError(f"--arrivals {arrivals!r}: give {' or '.join(ARRIVALS)}")
    check_load(1, duration_s, samples, warmup_s)
    pinned = parse_cpus(cpus)
    name, shape = _describe(protocol, base, model, api_key)
    return Load(protocol=protocol, url=base, host=host.strip("[]"), port=int(port), model=model,
                input_name=name, shape=shape, samples=samples, processes=processes,
                concurrency=concurrency, rate_rps=rate, arrivals=arrivals,
                duration_s=duration_s, warmup_s=warmup_s, cpus=pinned,
                api_key=api_key, seed=seed)


def _describe(protocol: str, base: str, model: str, api_key: str | None
              ) -> tuple[str, tuple[int, ...]]:
    """The model's input name and per-sample shape, from the service's OIP v2 metadata."""
    auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    if protocol == "grpc":
        import grpc

        from service.oip import pb, rpc
        with grpc.insecure_channel(base.removeprefix("grpc://")) as channel:
            try:
                meta = rpc.GRPCInferenceServiceStub(channel).ModelMetadata(
                    pb.ModelMetadataRequest(name=model), metadata=auth, timeout=10)
            except grpc.RpcError as exc:
                raise UsageError(f"model {model!r} at {base}: {exc.code().name} (is `vbs "
                                 "serve` listening for gRPC there?)") from exc
        return meta.inputs[0].name, tuple(int(d) for d in meta.inputs[0].shape[1:])
    import httpx

    try:
        answer = httpx.get(f"{base}/v2/models/{model}", headers=dict(auth), timeout=10)
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach the service at {base} ({exc}): is `vbs serve` "
                         "running there?") from exc
    if answer.status_code != 200:
        raise UsageError(f"model {model!r} at {base}: {answer.status_code} {answer.text[:200]}")
    first = answer.json()["inputs"][0]
    return str(first["name"]), tuple(int(d) for d in first["shape"][1:])


# -- the parent: start the processes, start them together, gather what they counted ----------
def run_load(load: Load, on_window: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``load`` in its client processes and return the summary (``summary``).
    ``on_window("start")`` and ``on_window("end")`` are called in this process at the window's
    two ends (a bench reads the server's CPU there)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    children: list[tuple[subprocess.Popen[bytes], Connection]] = []
    try:
        for index in range(load.processes):
            mine, theirs = Pipe()
            proc = subprocess.Popen([sys.executable, "-c", CHILD, str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),), env=env)
            theirs.close()
            mine.send(replace(load, index=index))
            children.append((proc, mine))
        for _, conn in children:
            _expect(conn, "ready", READY_TIMEOUT_S)
        start = time.monotonic() + START_DELAY_S
        for _, conn in children:
            conn.send(start)
        window = (start + load.warmup_s, start + load.warmup_s + load.duration_s)
        if on_window is not None:
            for phase, at in zip(("start", "end"), window):
                time.sleep(max(0.0, at - time.monotonic()))
                on_window(phase)
        left = window[1] - time.monotonic() + READY_TIMEOUT_S
        reports = [_expect(conn, "report", left) for _, conn in children]
    finally:
        for proc, conn in children:
            conn.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return summary(load, reports)


def _expect(conn: Connection, kind: str, timeout_s: float) -> Any:
    """The next message of a client process, which must be ``kind``; else UsageError."""
    if not conn.poll(max(0.0, timeout_s)):
        raise UsageError(f"a client process sent no {kind} in {timeout_s:.0f} s")
    try:
        got, value = conn.recv()
    except EOFError:
        raise UsageError(f"a client process ended before its {kind}") from None
    if got != kind:
        raise UsageError(f"a client process failed: {value}")
    return value


def summary(load: Load, reports: list[ChildReport]) -> dict[str, Any]:
    """``loadgen.loadtest.Result.summary``'s keys (over the processes' answers together) and
    the generator's own: the loop, what was sent, late and in flight, the clients' CPU."""
    merged = Result(duration_s=load.duration_s)
    for r in reports:
        merged.latencies += r.result.latencies
        merged.overheads += r.result.overheads
        for key, values in r.result.parts.items():
            merged.parts[key] += values
        for size, n in r.result.batches.items():
            merged.batches[size] = merged.batches.get(size, 0) + n
        for label, n in r.result.errors.items():
            merged.errors[label] = merged.errors.get(label, 0) + n
        merged.samples += r.result.samples
    clients = load.concurrency if load.concurrency is not None else load.processes
    out = merged.summary(url=load.url, model=load.model, clients=clients, samples=load.samples)
    sent = sum(r.sent for r in reports)
    late = sum(r.late for r in reports)
    cpu_s = sum(r.cpu_s for r in reports)
    lags = [lag for r in reports for lag in r.lags]
    answered = out["requests"]
    out.update({
        "protocol": load.protocol, "format": "oip-binary" if load.protocol == "http" else "raw",
        "loop": load.loop, "processes": load.processes,
        "cpus": list(load.cpus) if load.cpus else None, "concurrency": load.concurrency,
        "rate_rps": load.rate_rps, "arrivals": load.arrivals if load.rate_rps else None,
        "latency_p90_s": float(np.percentile(merged.latencies, 90)) if merged.latencies else None,
        "sent": sent, "achieved_rate_rps": sent / load.duration_s,
        "late": late, "late_fraction": late / sent if sent else 0.0,
        "send_lag_p99_s": float(np.percentile(lags, 99)) if lags else None,
        "in_flight_at_end": sum(r.in_flight for r in reports),
        "connections": sum(r.connections for r in reports),
        "connection_waits": sum(r.connection_waits for r in reports),
        "client_cpu_s": cpu_s,
        "client_cpu_ms_per_request": 1000 * cpu_s / answered if answered else None,
        "client_cores": cpu_s / load.duration_s,
    })
    return out


__all__ = ["ARRIVALS", "ChildReport", "LATE_S", "Load", "configure", "parse_cpus", "run_load",
           "summary"]
