"""vbs-serve and NVIDIA Triton (ONNX Runtime) inside the same memory limit, under bursts.

    .venv-peers/bin/python bench/memory_limit.py --model resnet18 --shape 3,448,448 \\
        --limits 1300MB,1700MB,2500MB [--servers vbs,triton-ort-1,...,triton-ort-16] \\
        [--clients 1,8,32] [--requests 3] [--batch-max 16] [--rounds 1] [--json OUT]

Every server runs in a memory cgroup of its own that this bench creates (v1 or v2, whichever
the machine has; root needed), its limit set before it starts, as a pod's is: the server and
every process it starts (Triton's Python backend stub) are inside it. ``vbs`` is `vbs serve`
with the tables of a `vbs plan` run beforehand outside the limit (``--store``: planning
profiles every layer, which a pod does once, elsewhere); ``vbs-lean`` the same store served
without torch (``VBS_LEAN=on``: the compiled model `vbs plan` stored); ``triton-ort-B`` is the
``tritonserver`` binary of nvidia-pytriton with its dynamic batcher at ``max_batch_size`` B
feeding ONNX Runtime in its Python backend, with its defaults (``bench/peers_triton.py``), the
same weights exported once; ``lit-ort-B`` is LitServe (``bench/peers.py serve-lit``) at
``max_batch_size`` B, ONNX Runtime with its defaults (threads spinning) on the same export,
each request a multipart .npy, whole (its batch gathers whole requests). vbs-serve's own
request timeout is the clients' (``--timeout``):
Triton has none, and a 504 after vbs-serve's default 30 s would count as lost while the client
still waits. A server may carry settings of its own after a colon, ``vbs-lean:VBS_ORT_ARENA=shared``
(the environment it starts with), so that two settings of one server take turns in one run;
``--rounds`` runs every server that many times at each limit, in turn, for the spread.

The load, the same for every server: bursts of C concurrent clients (``--clients``), each
sending ``--requests`` requests one after the other, each of 1 to 16 samples (drawn with a fixed
seed: the same sizes for every server); vbs-serve gets the samples as .npy, Triton as OIP v2
binary tensors. Triton refuses a request larger than its ``max_batch_size``, so its clients
send such a request as pieces of at most B samples, at once (what a user of it would do). A
503 (vbs-serve's answer when memory is short; it carries Retry-After) counts as refused, not
lost; anything else that is not a 200 (a connection dropped by a killed server, a 5xx) is
failed/lost. For each server and limit: the group's OOM kills (the kernel's count), requests
answered / refused / failed, samples/s answered over the bursts' wall time, p50/p99 of the
answered requests, and the group's peak usage (v1 ``memory.max_usage_in_bytes``, v2
``memory.peak``); for vbs-serve also what its answers say ran them: the pieces the batches
ran in (and how many of one sample), the median memory their plans were chosen for, and the
table's time per sample of those plans. A server that dies is not restarted within its limit:
its later requests fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from core.sizes import parse_bytes  # noqa: E402
from loadgen.loadtest import request_body  # noqa: E402
from memory_group import MemoryGroup, NoGroup  # noqa: E402
from served import free_port, stop, wait_until  # noqa: E402

MiB = 2**20


def start(config: str, args: argparse.Namespace, group: MemoryGroup, port: int,
          log: Path) -> tuple[subprocess.Popen[bytes], str, str, int]:
    """One server inside ``group``: (process, path, format, largest request it takes)."""
    env = {**os.environ, "VBS_CACHE_DIR": args.cache_dir, "PYTHONPATH": str(ROOT),
           "VBS_REQUEST_TIMEOUT_S": str(args.timeout)}  # as long as its clients wait
    config, _, own = config.partition(":")
    env.update(setting.split("=", 1) for setting in own.split(":") if setting)
    shape = ",".join(map(str, args.shape))
    if config in ("vbs", "vbs-lean"):
        # vbs-lean: the worker without torch (VBS_LEAN=on), serving the compiled model of the
        # same store; the tables must then be all ONNX Runtime runs (VBS_RUNTIME=onnxruntime
        # for the plan and for both servers)
        env["VBS_LEAN"] = "on" if config == "vbs-lean" else "off"
        cmd = [args.vbs_python, "-c", "from service.commands import main; main()", "serve",
               "--model", args.model, "--input-shape", shape, "--batch-max", str(args.batch_max),
               "--store", args.store, "--port", str(port), "--grpc-port", "0",
               "--log-level", "warning"]
        path, fmt, most = "/infer", "npy", 16
    elif config.startswith("lit-ort-"):  # LitServe, ONNX Runtime in its defaults (spinning)
        batch = int(config.rsplit("-", 1)[1])
        cmd = [sys.executable, str(ROOT / "bench" / "peers.py"), "serve-lit", "--model",
               args.model, "--port", str(port), "--batch", str(batch), "--wait",
               str(args.triton_wait), "--threads", str(args.threads), "--runtime", "ort",
               "--onnx", str(args.onnx), "--shape", shape, "--spin"]
        path, fmt, most = "/predict", "npy-form", 16  # its batch gathers requests whole
    else:
        batch = int(config.rsplit("-", 1)[1])
        cmd = [sys.executable, str(ROOT / "bench" / "peers.py"), "serve-triton", "--model",
               args.model, "--port", str(port), "--grpc-port", str(free_port()), "--batch",
               str(batch), "--wait", str(args.triton_wait), "--threads", str(args.threads),
               "--runtime", "ort", "--onnx", str(args.onnx), "--shape", shape]
        path, fmt, most = f"/v2/models/{args.model}/infer", "oip", batch
    process = subprocess.Popen(group.command(cmd), env=env, stdout=subprocess.DEVNULL,
                               stderr=log.open("wb"), start_new_session=True)
    return process, path, fmt, most


def wait_answering(url: str, fmt: str, shape: tuple[int, ...], process: subprocess.Popen[bytes],
                   timeout_s: float) -> str | None:
    """None once the server answers a one-sample request; else why not."""
    body, headers, files = request_body(np.zeros((1, *shape), np.float32), fmt)
    with httpx.Client(timeout=60) as client:
        return wait_until(lambda: client.post(url, content=body or None, headers=headers,
                                              files=files).status_code == 200,
                          process, timeout_s, until="answering")


def plan_sizes(args: argparse.Namespace) -> list[list[list[int]]]:
    """For each burst, for each client, the sizes of its requests (the same for every server)."""
    rng = np.random.default_rng(args.seed)
    return [[[int(s) for s in rng.integers(1, 17, args.requests)] for _ in range(c)]
            for c in args.clients]


async def burst(url: str, fmt: str, most: int, sizes: list[list[int]], shape: tuple[int, ...],
                timeout_s: float) -> dict[str, Any]:
    """One burst: every client at once, its requests one after the other."""
    rng = np.random.default_rng(1)
    sample = rng.standard_normal((16, *shape)).astype(np.float32)
    bodies: dict[int, tuple[bytes, dict[str, str], Any]] = {}

    def body(n: int) -> tuple[bytes, dict[str, str], Any]:
        if n not in bodies:
            bodies[n] = request_body(sample[:n], fmt)  # (body, headers, multipart files)
        return bodies[n]

    answered = refused = failed = samples = 0
    latencies: list[float] = []
    plans: list[tuple[int, int, float]] = []  # vbs-serve's: (samples, budget, predicted s/sample)

    async def one(http: httpx.AsyncClient, n: int) -> str:
        b, h, files = body(n)
        try:
            r = await http.post(url, content=b or None, headers=h, files=files)
        except httpx.HTTPError:
            return "failed"
        if r.status_code == 200:
            if fmt == "npy":  # vbs-serve says which plans ran each piece of the request
                plans.extend((p["batch"], p["budget_bytes"], p["predicted_time_per_sample_s"])
                             for p in r.json()["plans"])
            return "ok"
        if r.status_code == 503 and r.headers.get("retry-after"):
            return "refused"
        return "failed"

    async def client(http: httpx.AsyncClient, mine: list[int]) -> None:
        nonlocal answered, refused, failed, samples
        for n in mine:
            t0 = time.perf_counter()
            pieces = [min(most, n - k) for k in range(0, n, most)]
            outcomes = await asyncio.gather(*(one(http, p) for p in pieces))
            if all(o == "ok" for o in outcomes):
                answered += 1
                samples += n
                latencies.append(time.perf_counter() - t0)
            elif "failed" in outcomes:
                failed += 1
            else:
                refused += 1

    clients = len(sizes)
    limits = httpx.Limits(max_connections=clients * 16, max_keepalive_connections=clients * 16)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        await asyncio.gather(*(client(http, mine) for mine in sizes))
    wall = time.perf_counter() - t0
    return {"clients": clients, "answered": answered, "refused": refused, "failed": failed,
            "samples": samples, "wall_s": wall, "latencies": latencies, "plans": plans}


def run_config(config: str, limit: int, args: argparse.Namespace,
               sizes: list[list[list[int]]]) -> dict[str, Any]:
    try:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in config)
        group = MemoryGroup.create(f"vbs-bench-{safe}-{os.getpid()}-{time.monotonic_ns()}")
    except NoGroup as exc:
        raise SystemExit(f"this bench needs a memory cgroup (root): {exc}") from exc
    group.set_limit(limit)
    port = free_port()
    log = Path(args.work) / f"{group.path.name}.log"
    process, path, fmt, most = start(config, args, group, port, log)
    row: dict[str, Any] = {"server": config, "limit_bytes": limit, "cgroup": group.version}
    try:
        why = wait_answering(f"http://127.0.0.1:{port}{path}", fmt, args.shape, process,
                             args.start_timeout)
        row["started"] = why is None
        if why is not None:
            row.update(error=why, oom_kills=group.oom_kills(), peak_bytes=group.peak())
            return row
        kills = group.oom_kills()
        group.reset_peak()
        bursts = [asyncio.run(burst(f"http://127.0.0.1:{port}{path}", fmt, most, s, args.shape,
                                    args.timeout)) for s in sizes]
        lat = sorted(x for b in bursts for x in b.pop("latencies"))
        plans = [p for b in bursts for p in b["plans"]]
        wall = sum(b["wall_s"] for b in bursts)
        row.update(
            oom_kills=group.oom_kills() - kills, alive=process.poll() is None,
            answered=sum(b["answered"] for b in bursts),
            refused=sum(b["refused"] for b in bursts),
            failed=sum(b["failed"] for b in bursts),
            samples=sum(b["samples"] for b in bursts), wall_s=wall,
            samples_per_s=sum(b["samples"] for b in bursts) / wall if wall else 0.0,
            p50_s=lat[len(lat) // 2] if lat else None,
            p99_s=lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)] if lat else None,
            peak_bytes=group.peak(), bursts=bursts,
            pieces=len(plans), one_sample_pieces=sum(1 for n, _, _ in plans if n == 1),
            budget_p50=_median([m for _, m, _ in plans]),
            predicted_per_sample_s=(sum(n * t for n, _, t in plans) / sum(n for n, _, _ in plans)
                                    if plans else None))
        return row
    finally:
        stop(process)
        group.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--shape", default="3,448,448")
    ap.add_argument("--limits", default="1300MB,1700MB,2500MB")
    ap.add_argument("--servers", default="vbs,triton-ort-1,triton-ort-2,triton-ort-4,"
                                         "triton-ort-8,triton-ort-16")
    ap.add_argument("--clients", default="1,8,32", help="clients of each burst")
    ap.add_argument("--requests", type=int, default=3, help="requests per client per burst")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-max", type=int, default=16, help="vbs-serve's largest request size")
    ap.add_argument("--triton-wait", type=float, default=0.005)
    ap.add_argument("--threads", type=int, default=0, help="Triton's ONNX Runtime threads")
    ap.add_argument("--timeout", type=float, default=120.0, help="a request's client timeout")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--vbs-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--store", default=str(Path.home() / ".cache" / "vbs-serve" / "mem-store"),
                    help="where `vbs plan` put the tables (planned beforehand, no limit)")
    ap.add_argument("--rounds", type=int, default=1, help="every server this often at each limit")
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args()
    args.shape = tuple(int(d) for d in args.shape.split(","))
    args.clients = [int(c) for c in args.clients.split(",")]
    args.threads = args.threads or os.cpu_count() or 1
    limits = [parse_bytes(x) for x in args.limits.split(",")]
    sizes = plan_sizes(args)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vbs-memlimit-") as work:
        args.work = work
        if any(not s.startswith("vbs") for s in args.servers.split(",")):
            from peers_models import export_onnx

            args.onnx = export_onnx(args.model, args.shape, Path(work) / f"{args.model}.onnx")
        print("| server | limit (MiB) | OOM kills | answered | refused (503) | failed/lost | "
              "samples/s | p50 (ms) | p99 (ms) | group peak (MiB) | vbs pieces (one sample) | "
              "vbs plan budget p50 (MiB) | vbs predicted ms/sample |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for limit in limits:
            for _ in range(args.rounds):
                for config in args.servers.split(","):
                    row = run_config(config, limit, args, sizes)
                    rows.append(row)
                    print(table_row(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))


def _median(values: list[int]) -> int | None:
    return sorted(values)[len(values) // 2] if values else None


def table_row(row: dict[str, Any]) -> str:
    mib = row["limit_bytes"] / MiB
    if not row.get("started"):
        return (f"| {row['server']} | {mib:.0f} | {row.get('oom_kills', 0)} | did not start: "
                f"{row.get('error')} | | | | | | {row.get('peak_bytes', 0) / MiB:.0f} | | | |")
    ms = (lambda s: f"{1e3 * s:.0f}" if s is not None else "-")
    dead = "" if row["alive"] else " (dead)"
    plans = (f"{row['pieces']} ({row['one_sample_pieces']}) | {row['budget_p50'] / MiB:.1f} | "
             f"{1e3 * row['predicted_per_sample_s']:.0f}" if row["pieces"] else "— | — | —")
    return (f"| {row['server']} | {mib:.0f} | {row['oom_kills']}{dead} | {row['answered']} | "
            f"{row['refused']} | {row['failed']} | {row['samples_per_s']:.1f} | "
            f"{ms(row['p50_s'])} | {ms(row['p99_s'])} | {row['peak_bytes'] / MiB:.0f} | {plans} |")


if __name__ == "__main__":
    main()
