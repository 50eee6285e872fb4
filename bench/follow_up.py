"""Does waiting for the last batch's clients pay? `vbs serve` with ``VBS_BATCH_FOLLOW_UP`` set
to each value, under the same closed-loop load, interleaved in rounds.

    python bench/follow_up.py --model mobilenet_v2 [--clients 8] [--values 0,1]
        [--duration 20] [--warmup 5] [--rounds 3] [--store DIR]
        [--setting VBS_MAX_BATCH_DELAY_MS]

``--setting`` names another setting the values are given to (such as
``VBS_MAX_BATCH_DELAY_MS``, a fixed wait). Per value and round: throughput, p50 and p99
latency, errors, and the batch sizes the service ran (requests per batch size, from the
responses). The tables come from ``vbs plan`` at
``--batch-max`` (cached in the default store, or ``--store``, where ``--model
ALIAS=NAME`` serves a model planned under an alias, such as its int8 tables), ample memory;
one server at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from loadgen.loadtest import run_loadtest
from served import vbs_serve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--values", default="0,1", help="the setting's values, interleaved")
    ap.add_argument("--setting", default="VBS_BATCH_FOLLOW_UP", help="the setting they set")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-max", type=int, default=16)
    ap.add_argument("--store", help="the plan store (default: VBS_STORE)")
    args = ap.parse_args()
    name = args.model.partition("=")[0]  # what requests name: the alias where one is given
    store = ["--store", args.store] if args.store else []
    values = args.values.split(",")
    seen: dict[str, list[tuple[float, float]]] = {v: [] for v in values}
    print(f"| {args.setting} | round | throughput (samples/s) | p50 (ms) | p99 (ms) | errors | "
          "batch sizes run (requests) |")
    print("|---|---|---|---|---|---|---|")
    for k in range(1, args.rounds + 1):
        for value in values:
            env = {**os.environ, args.setting: value}
            with vbs_serve(["--model", args.model, "--batch-max", str(args.batch_max), *store,
                            "--log-level", "warning"], env) as (_, url):
                s = asyncio.run(run_loadtest(url, name, clients=args.clients,
                                             duration_s=args.duration, warmup_s=args.warmup))
            mix = ", ".join(f"{b}: {n}" for b, n in sorted(s["requests_by_batch_size"].items(),
                                                          key=lambda kv: int(kv[0])))
            p50, p99 = 1e3 * (s["latency_p50_s"] or 0), 1e3 * (s["latency_p99_s"] or 0)
            seen[value].append((s["throughput_samples_per_s"], p99))
            print(f"| {value} | {k} | {s['throughput_samples_per_s']:.1f} | {p50:.1f} | "
                  f"{p99:.1f} | {s['errors']} | {mix} |", flush=True)
    print()
    for value, runs in seen.items():
        print(f"{args.setting}={value}: throughput median {statistics.median(r[0] for r in runs):.1f} "
              f"(range {min(r[0] for r in runs):.1f}-{max(r[0] for r in runs):.1f}) samples/s, "
              f"p99 median {statistics.median(r[1] for r in runs):.1f} ms")


if __name__ == "__main__":
    main()
