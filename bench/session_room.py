"""Why a model gets 503 in a tight memory limit: one `vbs serve` of several models in a memory
cgroup, requests cycling through them one at a time, and what the server's log says of the
sessions it could not make and of what its unloads gave back.

    .venv/bin/python bench/session_room.py --limit 1110MiB [--requests 10]
        [--models resnet34,resnet18,...] [--shape 3,224,224] [--store DIR] [--batch-max 4]

Needs root (a memory cgroup, ``bench/memory_group.py``) and a store the models are planned
into (``bench/many_models.py --store DIR`` plans them). Prints each request's status (and the
error's first words), the group's memory.stat (anonymous memory, page cache), its peak and OOM
kills, then the log's lines about sessions not made, loads and unloads.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

from core.sizes import parse_bytes  # noqa: E402
from loadgen.loadtest import request_body  # noqa: E402
from memory_group import MemoryGroup  # noqa: E402
from served import free_port, stop, wait_ready  # noqa: E402

MODELS = "resnet34,resnet18,mobilenet_v3_large,mnasnet1_0,regnet_y_400mf"
SAID = ("not made ahead", "unloaded", "ready in", "not loaded at start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", required=True)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--shape", default="3,224,224")
    ap.add_argument("--batch-max", type=int, default=4)
    ap.add_argument("--store", default=str(Path.home() / ".cache" / "vbs-serve" / "five-store"))
    args = ap.parse_args()
    models = args.models.split(",")
    group = MemoryGroup.create(f"vbs-session-room-{os.getpid()}")
    group.set_limit(parse_bytes(args.limit))
    port = free_port()
    cmd = [sys.executable, "-m", "service.commands", "serve", "--store", args.store,
           "--batch-max", str(args.batch_max), "--port", str(port), "--grpc-port", "0",
           "--log-level", "info"]
    for model in models:
        cmd += ["--model", f"{model}@{args.shape}"]
    log = Path(tempfile.mkdtemp(prefix="vbs-session-room-")) / "serve.log"
    process = subprocess.Popen(group.command(cmd), cwd=ROOT, stdout=log.open("wb"),
                               stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        url = f"http://127.0.0.1:{port}"
        why = wait_ready(f"{url}/v2/health/ready", process, 300)
        if why:
            raise SystemExit(f"vbs serve did not start: {why}")
        shape = tuple(int(d) for d in args.shape.split(","))
        body, headers, _ = request_body(
            np.random.default_rng(1).standard_normal((1, *shape)).astype(np.float32), "oip")
        for k in range(args.requests):
            model = models[k % len(models)]
            r = httpx.post(f"{url}/v2/models/{model}/infer", content=body, headers=headers,
                           timeout=120)
            print(model, r.status_code, r.text[:160] if r.status_code != 200 else "")
        stat = dict(line.split() for line in (group.path / "memory.stat").read_text().splitlines()
                    if len(line.split()) == 2)
        print({k: int(stat[k]) // 2**20 for k in ("total_rss", "total_cache",
                                                 "total_active_file", "total_inactive_file")
               if k in stat}, "MiB")
        print(f"peak {group.peak() / 2**20:.0f} MiB, OOM kills {group.oom_kills()}")
    finally:
        stop(process)
        group.remove()
    for line in log.read_text().splitlines():
        if any(s in line for s in SAID):
            print(line[:240])


if __name__ == "__main__":
    main()
