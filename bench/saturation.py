"""Is the model the bottleneck at saturation? `vbs serve` under C clients against the same
batches run offline.

    python bench/saturation.py --model mobilenet_v2 [--clients 8] [--duration 20] [--rounds 2]
                               [--trees DIR,DIR...]

1. `vbs serve` (its own process, tables from ``vbs plan``, ample memory) under ``vbs
   loadtest``'s generator: C clients, one sample per request, for ``--duration`` seconds after
   a warm-up. Every response names the size of the batch it ran in, so the mix of batch sizes
   the service ran is known (a batch of b answers b requests).
2. In this process, on the same tables: the same plans (``Worker.infer`` on b samples, ample
   memory) timed for every batch size of the mix, interleaved in rounds.
3. What the service would do if only the model took time: the mix's samples over the offline
   time of its batches; beside it the service's throughput, and their ratio.
4. Where the machine's CPU went meanwhile, in milliseconds of CPU per request: the load
   generator (this process, during the load), the service's event loop (its main thread) and
   the rest of the service (the model's thread, torch's OpenMP threads, decoding threads), over
   the measured part of the load (from getrusage and /proc/PID/task/TID/stat, read when the
   warm-up ends and when the load has ended).

``--trees`` serves from each of several checkouts in turn within every round (this one is
``.``; another may be a ``git worktree add /tmp/before <commit>``), to compare servers side by
side, interleaved; the offline figure is always this checkout's executor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import threading
import time
from pathlib import Path


from core.loaded import ModelSpec
from planner.pipeline import prepare
from service.settings import Settings
from planner.store import open_store
from loadgen.loadtest import run_loadtest
from served import add_trees_argument, interleaved, stat_cpu, vbs_serve
from workers.memory import MemoryProbe
from workers.worker import Worker


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of process ``pid``'s main thread and of its other threads."""
    main = rest = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            _, spent = stat_cpu(str(task / "stat"))
        except OSError:  # the thread ended meanwhile
            continue
        if int(task.name) == pid:
            main += spent
        else:
            rest += spent
    return main, rest


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-max", type=int, default=16)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--store", default=str(Path.home() / ".cache" / "vbs-serve" / "peers-store"))
    add_trees_argument(ap)
    args = ap.parse_args()
    settings = Settings(cache_dir=args.cache_dir, store=args.store, batch_max=args.batch_max)
    with open_store(settings.store_location) as store:
        prepared = prepare(ModelSpec(args.model), settings, store, progress=False)
    worker = Worker(prepared.capture, prepared.table, MemoryProbe("cpu"))
    print("| round | tree | clients | service (samples/s) | batch sizes run (requests) | the same batches "
          "offline (samples/s) | service / offline | CPU ms a request: load generator, event loop, "
          "rest of the service |")
    print("|---|---|---|---|---|---|---|---|")
    for k, tree in interleaved(args.rounds, args.trees):
        with vbs_serve(["--model", args.model, "--store", args.store, "--batch-max",
                        str(args.batch_max), "--log-level", "warning"],
                       {**os.environ, "VBS_CACHE_DIR": args.cache_dir}, root=tree) as (server, url):
            marks: list[tuple[float, tuple[float, float]]] = []
            warm = threading.Timer(args.warmup, lambda: marks.append(
                (own_cpu_s(), thread_cpu_s(server.pid))))
            warm.start()  # (the load's warm-up starts with it, within a millisecond)
            summary = asyncio.run(run_loadtest(url, args.model, clients=args.clients,
                                               duration_s=args.duration, warmup_s=args.warmup))
            warm.join()
            (cpu0, (loop0, rest0)), (cpu1, (loop1, rest1)) = \
                marks[0], (own_cpu_s(), thread_cpu_s(server.pid))
        mix = {int(b): n / int(b) for b, n in summary["requests_by_batch_size"].items()}
        offline: dict[int, list[float]] = {b: [] for b in mix}
        examples = {b: prepared.capture.model.example(b, seed=b) for b in mix}
        for b in mix:  # warm-up
            worker.infer(examples[b], free=lambda: 1 << 62)
        for _ in range(5):
            for b in mix:
                t0 = time.perf_counter()
                worker.infer(examples[b], free=lambda: 1 << 62)
                offline[b].append(time.perf_counter() - t0)
        samples = sum(b * n for b, n in mix.items())
        seconds = sum(n * statistics.median(offline[b]) for b, n in mix.items())
        expected = samples / seconds
        got = summary["throughput_samples_per_s"]
        sizes = ", ".join(f"{b}: {summary['requests_by_batch_size'][b]}" for b in sorted(mix))
        cpu = ", ".join(f"{1e3 * v / max(summary['requests'], 1):.2f}"
                        for v in (cpu1 - cpu0, loop1 - loop0, rest1 - rest0))
        print(f"| {k} | {tree.name} | {args.clients} | {got:.1f} | {sizes} | {expected:.1f} | "
              f"{got / expected:.2f} | {cpu} |", flush=True)


if __name__ == "__main__":
    main()
