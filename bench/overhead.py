"""What a request waits for besides the model, at one client: the breakdown, server side.

    python bench/overhead.py [--model squeezenet1_0] [--duration 20] [--rounds 2]
                             [--trees DIR,DIR...]

`vbs serve` (its own process, the tables of ``vbs plan``, defaults otherwise) and one client
sending one-sample ``.npy`` requests one after another (``loadgen.loadtest``), as a new user
of `make run` would. Per round: the medians of the breakdown the responses report (queue,
compute input, compute infer, compute output), the server's own median and mean of the rest
(``vbs_server_overhead_seconds``: HTTP parsing, routing, handing over between threads), the
client's latency, and the server's time outside the model (queue + input + output + the
rest). Reading the body from the network, paced by the client, is reported apart
(``vbs_receive_seconds``), as perf_analyzer separates it. Histogram medians are
interpolated in the histogram's buckets (as Prometheus' histogram_quantile does); the share of
requests whose rest took at most 1 ms is exact (a bucket bound).

``--protocol http,grpc`` loads the same server over each protocol in turn within every round
(gRPC: ``vbs loadtest --protocol grpc``'s client, OIP v2 ``ModelInfer`` with raw contents);
the server-side histograms are the HTTP path's, so over gRPC only the breakdown the answers
carry and the client's side are printed ("outside the model, client side": each request's
latency less its batch's run, p50).

``--grpc on,off`` serves with the gRPC server on (the default of `vbs serve`) and with it off
(``--grpc-port 0``) in turn within every round, and loads only HTTP: what serving gRPC beside
HTTP costs an HTTP request (the "grpc" column).

``--trees`` serves from each of several checkouts in turn within every round (this one is
``.``; another may be a ``git worktree add /tmp/before <commit>`` of an earlier commit), so
a change is compared side by side, interleaved, through the same noise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import httpx

from loadgen.loadtest import run_loadtest
from loadgen.loadtest_grpc import run_grpc_loadtest
from served import add_trees_argument, free_port, interleaved, vbs_serve


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _buckets(text: str, model: str, metric: str = "vbs_server_overhead_seconds"
             ) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a histogram's buckets for ``model``."""
    out = []
    for line in text.splitlines():
        if line.startswith(f"{metric}_bucket{{") and f'model="{model}"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out.append((float(le), float(line.rsplit(" ", 1)[1])))
    return out


def _quantile(q: float, before: list[tuple[float, float]],
              after: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over the requests between two scrapes (linear within a
    bucket)."""
    earlier = dict(before)
    counts = [(le, cum - earlier.get(le, 0.0)) for le, cum in after]
    total = counts[-1][1] if counts else 0.0
    if not total:
        return 0.0
    rank, lower, below = q * total, 0.0, 0.0
    for le, cum in counts:
        if cum >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(cum - below, 1e-12)
        lower, below = le, cum
    return lower


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="squeezenet1_0")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--log-level", default="info",
                    help="vbs serve's, info as `make run` (with VBS_ACCESS_LOG=1 it prints a line a request)")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--protocol", default="http", help="http, grpc or both (http,grpc)")
    ap.add_argument("--grpc", default="on",
                    help="on, off or both (on,off): serve with the gRPC server on and/or off")
    add_trees_argument(ap)
    args = ap.parse_args()
    protocols = [p.strip() for p in args.protocol.split(",") if p.strip()]
    if not protocols or set(protocols) - {"http", "grpc"}:
        raise SystemExit(f"--protocol {args.protocol!r}: use http, grpc or http,grpc")
    grpc_modes = [g.strip() for g in args.grpc.split(",") if g.strip()]
    if not grpc_modes or set(grpc_modes) - {"on", "off"} or ("off" in grpc_modes
                                                             and "grpc" in protocols):
        raise SystemExit(f"--grpc {args.grpc!r}: use on, off or on,off (off only with "
                         "--protocol http)")
    print("| round | tree | grpc | protocol | client latency p50 (ms) | queue p50 | input p50 | infer p50 | "
          "output p50 | server rest p50 (mean) | rest <= 1 ms | server time outside the model "
          "p50 (ms) | receive p50 | outside the model, client side p50 (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (k, tree), grpc_mode in ((t, g) for t in interleaved(args.rounds, args.trees)
                                 for g in grpc_modes):
        grpc_port = free_port() if grpc_mode == "on" else 0
        with vbs_serve(["--model", args.model, "--log-level", args.log_level, "--grpc-port",
                        str(grpc_port)],
                       {**os.environ, "VBS_CACHE_DIR": args.cache_dir}, root=tree) as (_, url):
            for protocol in protocols:
                before = httpx.get(f"{url}/metrics").text
                if protocol == "grpc":
                    summary = asyncio.run(run_grpc_loadtest(
                        f"127.0.0.1:{grpc_port}", args.model, clients=1,
                        duration_s=args.duration, warmup_s=args.warmup))
                else:
                    summary = asyncio.run(run_loadtest(url, args.model, clients=1,
                                                       duration_s=args.duration,
                                                       warmup_s=args.warmup))
                after = httpx.get(f"{url}/metrics").text
                _row(k, tree, grpc_mode, protocol, args.model, summary, before, after)


def _row(k: int, tree: Path, grpc_mode: str, protocol: str, model: str, summary: dict, before: str,
         after: str) -> None:
    """One Markdown row: the answers' breakdown, and over HTTP the server's own histograms
    (its middleware's; gRPC has none of them)."""
    p = summary["breakdown_p50_s"]
    ms = [1e3 * v for v in (summary["latency_p50_s"], p["queue"], p["input"], p["infer"],
                            p["output"])]
    server = "— | — | — | —"
    if protocol == "http":
        name = f'vbs_server_overhead_seconds_{{}}{{{{model="{model}"}}}}'
        spent = _metric(after, name.format("sum")) - _metric(before, name.format("sum"))
        count = _metric(after, name.format("count")) - _metric(before, name.format("count"))
        mean = spent / count if count else 0.0
        b0, b1 = _buckets(before, model), _buckets(after, model)
        rest = _quantile(0.5, b0, b1)
        under = dict(b1).get(1e-3, 0.0) - dict(b0).get(1e-3, 0.0)
        receive = _quantile(0.5, _buckets(before, model, "vbs_receive_seconds"),
                            _buckets(after, model, "vbs_receive_seconds"))
        outside = p["queue"] + p["input"] + p["output"] + rest
        server = (f"{1e3 * rest:.2f} ({1e3 * mean:.2f}) | {100 * under / max(count, 1):.0f}% | "
                  f"{1e3 * outside:.2f} | {1e3 * receive:.2f}")
    print(f"| {k} | {tree.name} | {grpc_mode} | {protocol} | " + " | ".join(f"{v:.2f}" for v in ms)
          + f" | {server} | {1e3 * summary['overhead_p50_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
