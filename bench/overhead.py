"""What a request waits for besides the model, at one client: the breakdown, server side.

    python bench/overhead.py [--model squeezenet1_0] [--duration 20] [--rounds 2]

`vbs serve` (its own process, the tables of ``vbs plan``, defaults otherwise) and one client
sending one-sample ``.npy`` requests one after another (``service.loadtest``), as a new user
of `make run` would. Per round: the medians of the breakdown the responses report (queue,
compute input, compute infer, compute output), the server's own mean of the rest
(``vbs_server_overhead_seconds``: HTTP parsing, routing, handing over between threads), the
client's latency, and the server's time outside the model (queue + input + output + the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from service.loadtest import run_loadtest


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="squeezenet1_0")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    args = ap.parse_args()
    print("| round | client latency p50 (ms) | queue | input | infer | output | server rest "
          "(mean) | server time outside the model (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for k in range(1, args.rounds + 1):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        vbs = Path(sys.executable).with_name("vbs")
        server = subprocess.Popen([str(vbs), "serve", "--model", args.model, "--port", str(port),
                                   "--log-level", "warning"],
                                  env={**os.environ, "VBS_CACHE_DIR": args.cache_dir})
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    if httpx.get(f"{url}/v2/health/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if server.poll() is not None:
                    raise SystemExit("vbs serve exited")
                time.sleep(0.5)
            before = httpx.get(f"{url}/metrics").text
            summary = asyncio.run(run_loadtest(url, args.model, clients=1,
                                               duration_s=args.duration, warmup_s=args.warmup))
            after = httpx.get(f"{url}/metrics").text
        finally:
            server.terminate()
            server.wait(timeout=60)
        name = f'vbs_server_overhead_seconds_{{}}{{{{model="{args.model}"}}}}'
        spent = _metric(after, name.format("sum")) - _metric(before, name.format("sum"))
        count = _metric(after, name.format("count")) - _metric(before, name.format("count"))
        rest = spent / count if count else 0.0
        p = summary["breakdown_p50_s"]
        outside = p["queue"] + p["input"] + p["output"] + rest
        ms = [1e3 * v for v in (summary["latency_p50_s"], p["queue"], p["input"], p["infer"],
                                p["output"], rest, outside)]
        print(f"| {k} | " + " | ".join(f"{v:.2f}" for v in ms) + " |", flush=True)


if __name__ == "__main__":
    main()
