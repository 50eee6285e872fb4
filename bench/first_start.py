"""`make run` on a cold cache: seconds to its first /infer answer, and to the planned table.

Starts `make run` (``FIRST_START=interim`` unless told otherwise) with an empty
``VBS_CACHE_DIR`` (profile cache and directory store), posts a one-sample request every 0.2 s
until one is answered, then one a second (and reads ``GET /models``) until the planned table
serves; prints both times, the tables and what was answered meanwhile, and the service's log
lines about them (docs/benchmarks.md, section 12).

    python bench/first_start.py [--port 18123] [--model squeezenet1_0] [--first-start wait]
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

from served import ROOT, npy, stop, wait_until

KEPT = ("ready in", "interim", "planned in", "swapped in", "beside", "Error", "error")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--port", type=int, default=18123)
    ap.add_argument("--model", default="squeezenet1_0")
    ap.add_argument("--first-start", default="interim", choices=["interim", "wait"])
    ap.add_argument("--shape", default="3,224,224", help="the model's input, per sample")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="vbs-first-start-")
    log_path = Path(f"{cache}.log")
    env = {**os.environ, "VBS_CACHE_DIR": cache, "VBS_GRPC_PORT": "0"}
    cmd = ["make", "-C", str(ROOT), "run", f"PORT={args.port}", f"MODEL={args.model}",
           f"FIRST_START={args.first_start}"]
    shape = tuple(int(d) for d in args.shape.split(","))
    body = npy(np.random.default_rng(0).standard_normal((1, *shape)).astype(np.float32))
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    client = httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=120)

    def infer() -> httpx.Response:
        return client.post("/infer", content=body, headers={"content-type": "application/x-npy"})

    answers: list[httpx.Response] = []

    def is_answered() -> bool:
        answers.append(infer())
        return answers[-1].status_code == 200

    try:
        why = wait_until(is_answered, proc, poll_s=0.2)
        if why:
            sys.exit(f"the server {why}: see {log_path}")
        first, answer = time.monotonic() - started, answers[-1]
        model = client.get("/models").json()["models"][0]
        print(f"first /infer answered {first:.1f} s after `make run` started: table "
              f"v{answer.json()['table_version']} ({model['table']['kind']}, "
              f"{model['table']['plans']} plans)", flush=True)
        answered = failed = 0
        while model["table"]["kind"] != "planned":
            time.sleep(1.0)
            ok = infer().status_code == 200
            answered, failed = answered + ok, failed + (not ok)
            model = client.get("/models").json()["models"][0]
        planned = time.monotonic() - started
        print(f"planned table serving {planned:.1f} s after the start (v{model['table']['version']}"
              f", {model['table']['solver']}, {model['table']['plans']} plans); {answered} "
              f"requests answered meanwhile, {failed} not", flush=True)
    finally:
        stop(proc)
    for line in log_path.read_text(errors="replace").splitlines():
        if any(k in line for k in KEPT):
            print("  " + line[:300])


if __name__ == "__main__":
    main()
