"""`vbs loadtest`'s body: the generator its flags ask for, run, and its summary printed.

The flags stay with the ``vbs`` console script (``service/cli.py``), which calls ``run`` only
when the command runs, with the API key it read from the server's settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json


def run(args: argparse.Namespace, api_key: str | None) -> int:
    """Exit code 0 when any request was answered, 1 when none was."""
    from loadgen.loadtest import format_table, run_loadtest

    if any(v is not None for v in (args.processes, args.concurrency, args.rate, args.cpus)):
        from loadgen.processes import configure, run_load
        summary = run_load(configure(
            args.protocol, args.url, args.model, processes=args.processes,
            concurrency=args.concurrency, rate=args.rate, clients=args.clients,
            arrivals=args.arrivals, cpus=args.cpus, fmt=args.format, samples=args.samples,
            duration_s=args.duration, warmup_s=args.warmup, api_key=api_key))
    elif args.protocol == "grpc":
        from loadgen.loadtest_grpc import DEFAULT_TARGET, run_grpc_loadtest
        summary = asyncio.run(run_grpc_loadtest(
            args.url or DEFAULT_TARGET, args.model, clients=args.clients or 4,
            duration_s=args.duration, samples=args.samples, warmup_s=args.warmup,
            api_key=api_key))
    else:
        summary = asyncio.run(run_loadtest(
            args.url or "http://127.0.0.1:8000", args.model, clients=args.clients or 4,
            duration_s=args.duration, samples=args.samples, fmt=args.format or "npy",
            warmup_s=args.warmup, api_key=api_key))
    print(json.dumps(summary, indent=1) if args.json else format_table(summary))
    return 0 if summary["ok"] else 1


__all__ = ["run"]
