"""The worker without torch beside the torch worker: start from the store to ready, and memory.

    python bench/lean_worker.py [--models mobilenet_v2,resnet50] [--shape 3,224,224]
                                [--batch-max 8] [--rounds 2] [--store DIR] [--requests 12]

Each model is planned once into a directory store (``vbs plan --runtime onnxruntime``, which
also compiles it: ``planner.compile``). Then, in turn for ``--rounds`` rounds, `vbs serve` of
that store as the lean worker (``VBS_LEAN=on``: torch never imported, the compiled graphs run on
numpy arrays) and as the torch worker (``VBS_LEAN=off``: the model captured from torchvision),
each a fresh process: the seconds from its start to its first answer (/infer of one sample,
polled), then ``--requests`` requests of 1..batch_max samples one after the other, and its
resident memory (VmRSS and, of it, anonymous) after them, its ONNX Runtime sessions and the
bytes it says it keeps (/models). Printed: a markdown table, one row per server and round.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.loadtest import request_body  # noqa: E402
from served import free_port, stop, wait_until  # noqa: E402

MiB = 2**20


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _post(client: httpx.Client, x: np.ndarray) -> httpx.Response:
    body, headers, _ = request_body(x, "npy")
    return client.post("/infer", content=body, headers=headers)


def plan(model: str, shape: str, batch_max: int, store: Path, cache: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "service.commands", "plan", "--model",
                    f"{model}@{shape}", "--store", str(store), "--batch-max", str(batch_max),
                    "--runtime", "onnxruntime", "--quiet"], cwd=ROOT, check=True,
                   env={**os.environ, "VBS_CACHE_DIR": str(cache)})
    return time.perf_counter() - t0


def serve_once(model: str, shape: str, batch_max: int, store: Path, cache: Path, lean: bool,
               requests: int) -> dict[str, object]:
    port = free_port()
    env = {**os.environ, "VBS_CACHE_DIR": str(cache), "VBS_LEAN": "on" if lean else "off",
           "PYTHONPATH": str(ROOT)}
    dims = tuple(int(d) for d in shape.split(","))
    t0 = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, "-m", "service.commands", "serve", "--model", f"{model}@{shape}",
         "--store", str(store), "--port", str(port), "--grpc-port", "0", "--batch-max",
         str(batch_max), "--log-level", "warning"], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rng = np.random.default_rng(0)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            why = wait_until(lambda: _post(client, rng.standard_normal(
                (1, *dims), dtype=np.float32)).status_code == 200, server, poll_s=0.1)
            if why:
                raise RuntimeError(f"{model}: the server {why}: "
                                   f"{server.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            first = time.perf_counter() - t0
            for i in range(requests):
                n = 1 + i % batch_max
                answer = _post(client, rng.standard_normal((n, *dims), dtype=np.float32))
                answer.raise_for_status()
            described = client.get("/models").json()["models"][0]
            rss, anon = _status(server.pid, "VmRSS"), _status(server.pid, "RssAnon")
    finally:
        stop(server)
    return {"model": model, "worker": "lean (no torch)" if lean else "torch", "ready_s": first,
            "rss": rss, "anon": anon, "kept": described.get("kept_bytes") or 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mobilenet_v2,resnet50")
    ap.add_argument("--shape", default="3,224,224")
    ap.add_argument("--batch-max", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--store", type=Path, help="a store planned before (default: a new one)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vbs-lean-"))
    store, cache = args.store or work / "store", work / "cache"
    rows = []
    for model in args.models.split(","):
        took = plan(model, args.shape, args.batch_max, store, cache)
        print(f"{model}: planned and compiled in {took:.0f} s", file=sys.stderr)
        for _ in range(args.rounds):
            for lean in (True, False):
                rows.append(serve_once(model, args.shape, args.batch_max, store, cache, lean,
                                       args.requests))
                print(rows[-1], file=sys.stderr)
    print("| model | worker | start to first answer (s) | RSS after serving (MiB) | "
          "of it anonymous (MiB) | kept, as it says (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['worker']} | {r['ready_s']:.1f} | {r['rss'] / MiB:.0f} | "
              f"{r['anon'] / MiB:.0f} | {int(r['kept']) / MiB:.0f} |")


if __name__ == "__main__":
    main()
