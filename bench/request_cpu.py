"""The CPU time a served request costs, inside a memory limit and without one, side by side.

    python bench/request_cpu.py --model mobilenet_v2 --shape 3,224,224 --store STORE \\
        [--limit 500MB] [--servers limit,limit:VBS_ORT_ARENA=none,free] [--sizes 14,11,9] \\
        [--repeat 3] [--rounds 3] [--before ROOT]

Why: under a cgroup limit a server gives memory back (glibc maps large blocks alone, ONNX
Runtime's arena shrinks), and what it gives back it maps and faults in again; the clients of a
memory-limit bench share the cores with it, so what shows there as fewer samples/s is CPU time
here. Each server is the worker without torch (``VBS_LEAN=on``) serving the store's tables
(`vbs plan --runtime onnxruntime` beforehand), a fresh process: ``limit`` inside a memory
cgroup of ``--limit`` made for it (root), ``free`` without one; settings of its own after a
colon (``limit:VBS_ORT_ARENA=none``); ``--before ROOT`` adds ``limit`` served from another
checkout (a ``git worktree`` of an earlier commit). After a warm-up, in each round every
server in turn gets ``--sizes`` (samples per request, one request after the other from one
client) ``--repeat`` times; the CPU time its process spent meanwhile (``/proc/PID/stat``), and
of it its main thread's (the event loop: HTTP, bodies, answers), over the requests sent.
Printed: per server, ms of CPU per request, median over the rounds (range), and the wall time
a request took.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from core.sizes import parse_bytes  # noqa: E402
from memory_group import MemoryGroup  # noqa: E402
from served import free_port, npy, stat_cpu, stop, wait_until  # noqa: E402


class Server:
    """One `vbs serve` of the store, in a memory group of its own or not."""

    def __init__(self, config: str, args: argparse.Namespace, root: Path = ROOT) -> None:
        self.config = config
        kind, _, own = config.partition(":")
        env = {**os.environ, "VBS_LEAN": "on", "VBS_RUNTIME": "onnxruntime",
               "PYTHONPATH": str(root)}
        env.update(setting.split("=", 1) for setting in own.split(":") if setting)
        self.port = free_port()
        cmd = [args.vbs_python, "-c", "from service.commands import main; main()", "serve",
               "--model", args.model, "--input-shape", args.shape, "--batch-max",
               str(args.batch_max), "--store", args.store, "--port", str(self.port),
               "--grpc-port", "0", "--log-level", "warning"]
        self.group = None
        if kind.startswith("limit"):
            safe = "".join(c if c.isalnum() else "_" for c in config)
            self.group = MemoryGroup.create(f"vbs-cpu-{safe}-{os.getpid()}-{time.monotonic_ns()}")
            self.group.set_limit(args.limit)
            cmd = self.group.command(cmd)
        self.process = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}/infer"

    def ready(self, body: bytes, timeout_s: float = 120) -> None:
        why = wait_until(lambda: httpx.post(self.url, content=body, timeout=60, headers={
            "content-type": "application/x-npy"}).status_code == 200, self.process, timeout_s,
            until="answering")
        if why:
            raise SystemExit(f"{self.config}: {why}")

    def cpu(self) -> tuple[float, float]:
        """(process, main thread) CPU seconds so far. ``vbs serve`` starts itself again in
        the same process (huge pages), so the PID is the one started."""
        pid = self.process.pid
        return stat_cpu(f"/proc/{pid}/stat")[1], stat_cpu(f"/proc/{pid}/task/{pid}/stat")[1]

    def close(self) -> None:
        stop(self.process)
        if self.group is not None:
            self.group.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--shape", default="3,224,224")
    ap.add_argument("--store", required=True)
    ap.add_argument("--batch-max", type=int, default=16)
    ap.add_argument("--limit", default="500MB")
    ap.add_argument("--servers", default="limit,limit:VBS_ORT_ARENA=none,free")
    ap.add_argument("--sizes", default="14,11,9")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", help="a checkout of an earlier commit: its `limit` beside")
    ap.add_argument("--vbs-python", default=sys.executable)
    args = ap.parse_args()
    args.limit = parse_bytes(args.limit)
    shape = tuple(int(d) for d in args.shape.split(","))
    sizes = [int(n) for n in args.sizes.split(",")]
    rng = np.random.default_rng(1)
    sample = rng.standard_normal((max(sizes), *shape)).astype(np.float32)
    bodies = {n: npy(sample[:n]) for n in sizes}
    servers = [Server(c, args) for c in args.servers.split(",")]
    if args.before:
        before = Server("limit", args, Path(args.before))
        before.config = f"limit ({Path(args.before).name})"
        servers.append(before)
    seen: dict[str, list[tuple[float, float, float]]] = {s.config: [] for s in servers}
    try:
        for server in servers:
            server.ready(bodies[min(sizes)])
            with httpx.Client(timeout=120) as client:  # warm-up: every size once
                for n in sizes:
                    client.post(server.url, content=bodies[n],
                                headers={"content-type": "application/x-npy"}).raise_for_status()
        for k in range(1, args.rounds + 1):
            for server in servers:
                count = 0
                process0, loop0 = server.cpu()
                t0 = time.perf_counter()
                with httpx.Client(timeout=120) as client:
                    for _ in range(args.repeat):
                        for n in sizes:
                            client.post(server.url, content=bodies[n], headers={
                                "content-type": "application/x-npy"}).raise_for_status()
                            count += 1
                wall = time.perf_counter() - t0
                process1, loop1 = server.cpu()
                row = (1e3 * (process1 - process0) / count,
                       1e3 * (loop1 - loop0) / count, 1e3 * wall / count)
                seen[server.config].append(row)
                print(f"round {k}, {server.config}: process {row[0]:.1f} ms CPU a request, "
                      f"its event loop {row[1]:.1f}, wall {row[2]:.1f} ms", flush=True)
    finally:
        for server in servers:
            server.close()
    print()
    print(f"{args.model} at {args.shape}, requests of {args.sizes} samples one after the other, "
          f"{args.repeat} times a round, {args.rounds} rounds; limit {args.limit >> 20} MiB; ms a "
          "request, median over the rounds (range)")
    print("| server | process CPU | of it the event loop | wall |")
    print("|---|---|---|---|")
    for config, rows in seen.items():
        cells = []
        for i in range(3):
            values = [r[i] for r in rows]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        print(f"| {config} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
