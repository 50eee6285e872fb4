"""Is the load generator the limit? ``vbs loadtest --processes``'s client processes against a
`vbs serve` whose model takes no time, the server on one CPU and the clients on another.

    python bench/loadgen_floor.py [--server-cpu 0] [--client-cpus 1] [--processes N]
                                  [--concurrency 16] [--rates 250,500,1000,2000,4000]
                                  [--protocols http,grpc] [--duration 4] [--warmup 1]

`vbs serve` (its own process, pinned to ``--server-cpu`` with ``sched_setaffinity`` before it
starts, one torch thread, ``--runtime torch``) serves ``tests.planner.factories:two_layer`` at
3x8x8 (two small convolutions: its model time is negligible) with batches up to 8, over HTTP and
gRPC. The load (``loadgen.processes``: ``--processes`` client processes, by default one for each
of ``--client-cpus``, pinned to them; over HTTP the OIP v2 binary tensor extension, over gRPC
raw tensor bytes, both encoded once) runs per protocol: the closed loop at ``--concurrency``
requests in flight (twice the largest batch), then the open loop at each of ``--rates`` (Poisson
arrivals) upward, stopping after the first rate that was not kept (answered or sent below 90% of
the offered rate, or any error). Printed: a markdown table, one row per run: the rate offered,
the rate the clients achieved (requests sent a second), answered a second, latency p50 / p99,
the arrivals sent late (``loadgen.processes.LATE_S``; and how many waited for a free HTTP
connection), errors by status, the clients' CPU (all their processes, ``getrusage``) per
request and in cores, and the server's (``/proc/PID/stat``, user + system) over the same window.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from served import free_port, stat_cpu, vbs_serve
from loadgen.processes import configure, parse_cpus, run_load

MODEL = "tiny=tests.planner.factories:two_layer@3x8x8"
BATCH_MAX = 8


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-cpu", type=int, default=0)
    ap.add_argument("--client-cpus", default="1")
    ap.add_argument("--processes", type=int, help="client processes (default: one a client CPU)")
    ap.add_argument("--concurrency", type=int, default=2 * BATCH_MAX)
    ap.add_argument("--rates", default="250,500,1000,2000,4000")
    ap.add_argument("--protocols", default="http,grpc")
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    return ap.parse_args()


def one_run(args: argparse.Namespace, protocol: str, url: str, pid: int,
            rate: float | None) -> dict[str, Any]:
    """One load: the generator's summary and the server's CPU over its window."""
    read: dict[str, float] = {}
    load = configure(protocol, url, "tiny", processes=args.processes or len(parse_cpus(
                         args.client_cpus) or ()), cpus=args.client_cpus,
                     concurrency=None if rate else args.concurrency, rate=rate,
                     duration_s=args.duration, warmup_s=args.warmup)
    summary = run_load(load, on_window=lambda phase: read.__setitem__(
        phase, stat_cpu(f"/proc/{pid}/stat")[1]))
    summary["server_cpu_s"] = read["end"] - read["start"]
    return summary


def saturated(s: dict[str, Any]) -> bool:
    """The server (answers) or the clients (requests sent) did not keep the offered rate."""
    least = 0.9 * s["rate_rps"]
    return s["throughput_rps"] < least or s["achieved_rate_rps"] < least or bool(s["errors"])


def row(s: dict[str, Any]) -> str:
    answered = s["requests"] or 1
    offered = f"{s['rate_rps']:g}" if s["rate_rps"] else f"{s['concurrency']} in flight"
    cpu = s["client_cpu_ms_per_request"] or 0.0
    errors = ", ".join(f"{n} ({k})" for k, n in s["errors_by_status"].items()) or "0"
    late = f"{s['late_fraction']:.1%}" + (f" ({s['connection_waits']} waited for a connection)"
                                          if s["connection_waits"] else "")
    return (f"| {s['protocol']} | {s['loop']} | {offered} | {s['achieved_rate_rps']:.0f} | "
            f"{s['throughput_rps']:.0f} | {1000 * (s['latency_p50_s'] or 0):.2f} / "
            f"{1000 * (s['latency_p99_s'] or 0):.2f} | {late} | {errors} | "
            f"{cpu:.3f} | {s['client_cores']:.2f} | {1000 * s['server_cpu_s'] / answered:.3f} | "
            f"{s['server_cpu_s'] / s['duration_s']:.2f} |")


@contextlib.contextmanager
def pinned_server(cpu: int, work: Path, grpc_port: int) -> Iterator[tuple[Any, str]]:
    """`vbs serve` on the tiny model, pinned to ``cpu`` (it inherits this process's affinity,
    set for its start and given back once it is ready)."""
    env = {**os.environ, "VBS_CACHE_DIR": str(work / "cache"), "OMP_NUM_THREADS": "1"}
    mine = os.sched_getaffinity(0)
    with contextlib.ExitStack() as stack:
        os.sched_setaffinity(0, {cpu})
        try:
            served = stack.enter_context(vbs_serve(
                ["--model", MODEL, "--batch-max", str(BATCH_MAX), "--runtime", "torch",
                 "--store", str(work / "store"),
                 "--grpc-port", str(grpc_port), "--log-level", "warning"], env=env))
        finally:
            os.sched_setaffinity(0, mine)
        yield served


def main() -> None:
    args = parse()
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="vbs-loadgen-floor-") as work:
        grpc_port = free_port()
        with pinned_server(args.server_cpu, Path(work), grpc_port) as (server, url):
            for protocol in args.protocols.split(","):
                target = url if protocol == "http" else f"127.0.0.1:{grpc_port}"
                for rate in [None, *rates]:
                    s = one_run(args, protocol, target, server.pid, rate)
                    rows.append(row(s))
                    print(rows[-1], flush=True)
                    if rate and saturated(s):
                        break
    print(f"\nserver on CPU {args.server_cpu}, client processes on CPUs "
          f"{args.client_cpus}; {args.duration:g} s a run after {args.warmup:g} s of warm-up\n")
    print("| protocol | loop | offered (req/s) | achieved (sent/s) | answered/s | p50 / p99 (ms) "
          "| late | errors | clients' CPU (ms/req) | clients' cores | server CPU (ms/req) | "
          "server cores |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
