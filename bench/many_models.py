"""Many models in one memory limit: eight models or more whose footprints together are several
times a memory cgroup's limit, a skewed mix of traffic across them, served by vbs-serve (loads
on demand, the least recently used idle model unloaded) and by NVIDIA Triton, every model loaded
at start or driven in explicit mode by a client that loads and unloads.

    .venv-peers/bin/python bench/many_models.py [--models resnet50,mobilenet_v2,...]
        [--shape 3,224,224] [--batch-max 4] [--clients 4] [--duration 60] [--zipf 1.5]
        [--limits vbs,triton] [--headroom 200MiB] [--servers vbs,triton-all,triton-explicit]
        [--json OUT] [--footprints EARLIER_JSON]

Needs root (a memory cgroup, v1 or v2, made per server as ``bench/memory_limit.py`` does) and
the ``peers`` extra in ``.venv-peers`` (``bench/peers.py`` says how: Triton and its client).

1. **Tables.** Every model is planned into a directory store first (``--store``; `vbs plan
   --batch-max B` with this checkout's ``--vbs-python``, skipped where the store has the table),
   outside any limit, as a pod would have its tables made elsewhere (``--profile-repeats`` 2
   and ``--profile-warmup`` 1 by default, to plan eight models in minutes). Weights are random
   (torchvision's init, the same for every server: Triton gets each model exported to ONNX
   from the same seed, ``bench/peers_models.py``).
2. **Footprints.** Each model served alone, in a group with a loose limit, after one
   one-sample request: vbs-serve (a `vbs serve` of that model alone: the group's peak and what
   the service says the model keeps) and Triton (one server in explicit mode, each model
   loaded, asked once and unloaded in turn; the group's peak, reset before each load, and its
   growth over the idle server). ``--limits``: every server runs in each; ``vbs`` is
   vbs-serve's largest peak alone plus ``--headroom``, ``triton`` Triton's (the two servers'
   footprints differ several times over: a limit that makes one unload lets the other keep
   every model); the sums of the footprints alone are printed against each limit.
3. **Traffic**, the same for every server: ``--clients`` closed-loop clients in this process
   (asyncio, HTTP/1.1 keep-alive), each request one sample (OIP v2, the binary tensor
   extension) for a model drawn from a Zipf law over ``--models`` in the order given
   (``--zipf`` s: the first two hot, the rest cold), each client its own seeded draw, for
   ``--duration`` seconds; a request's client timeout is ``--timeout`` (vbs-serve's own
   request timeout the same). Per model: requests, answered, errors by status (``conn``: the
   connection failed, ``timeout``: no answer in time), p50/p99 of the answered.
4. **Servers**, each in a fresh memory cgroup at the limit:

   - ``vbs``: one `vbs serve` of every model with its defaults: models load at start while
     they fit, the rest on demand, the least recently used idle one unloaded for another.
     From ``/metrics``: loads, unloads, the load time (``vbs_model_load_seconds``); from the
     answers, how long requests waited for a load (``load_wait_s``).
   - ``triton-all``: ``tritonserver`` (nvidia-pytriton's, ``bench/peers_triton.py``) with every
     model in its repository and ``--model-control-mode=none``, its default: all loaded at
     start, each in a Python backend stub running ONNX Runtime, dynamic batcher at
     ``max_batch_size`` B. What happens to it is the result.
   - ``triton-explicit``: the same server in ``--model-control-mode=explicit``, nothing loaded
     at start, driven by a client that manages memory as well as a client can: it knows each
     model's footprint in Triton (step 2), loads models in the order given while they fit
     (before the traffic, as vbs-serve does at start) and, when a request's model is not
     loaded, unloads the least recently used model with no request in flight until the model
     fits in the limit less the idle server and ``--client-margin``, waits for the unloads to
     finish (Triton's repository index), loads the model, then sends (the repository API's
     ``POST /v2/repository/models/{m}/load|unload``, what tritonclient's ``load_model`` and
     ``unload_model`` call). One change at a time, under one lock. The time it spends there is
     the client's cost, counted in its requests' latency and apart.

   For each: the group's peak (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``), its OOM
   kills (the kernel's count), whether the server was still alive at the end, and for a server
   that did not start, its exit and the tail of its log.

Beside this script: the servers and their footprints (``many_models_servers.py``), the traffic
(``many_models_traffic.py``), the tables printed (``many_models_report.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from many_models_report import print_footprints, report  # noqa: E402
from many_models_servers import (MiB, export, footprints_triton, footprints_vbs,  # noqa: E402
                                 new_group, plan, start_triton, start_vbs, tail,
                                 triton_repository, vbs_metrics)
from many_models_traffic import traffic  # noqa: E402
from served import free_port, stop, wait_ready  # noqa: E402

MODELS = ("resnet50,mobilenet_v2,resnet18,alexnet,resnet34,convnext_tiny,wide_resnet50_2,"
          "resnet101")


def run_server(server: str, args: argparse.Namespace, limit: int, body: bytes,
               headers: dict[str, str], repo: Path | None, triton_cost: dict[str, int],
               triton_base: int) -> dict[str, Any]:
    group = new_group(server, limit)
    port, log = free_port(), Path(args.work) / f"{server}.log"
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    if server == "vbs":
        process = start_vbs(args, group, args.models, port, log)
    else:
        assert repo is not None
        process = start_triton(args, group, repo, port, server == "triton-explicit", log)
    row: dict[str, Any] = {"server": server, "limit": limit}
    try:
        ready = "/v2/health/live" if server == "triton-explicit" else "/v2/health/ready"
        why = wait_ready(f"{url}{ready}", process, args.start_timeout)
        row["start_s"] = time.perf_counter() - t0
        if why:
            time.sleep(1.0)
            row.update(started=False, error=why, oom_kills=group.oom_kills(), peak=group.peak(),
                       log=tail(log))
            return row
        row["started"] = True
        if server == "vbs":
            row["at_start"] = [m["name"] for m in httpx.get(f"{url}/models").json()["models"]
                               if m.get("state") == "ready"]
            row["metrics_before"] = vbs_metrics(url)
        capacity = limit - triton_base - args.client_margin
        result = asyncio.run(traffic(url, args, body, headers,
                                     triton_cost if server == "triton-explicit" else None,
                                     capacity))
        row.update(result)
        row["capacity"] = capacity if server == "triton-explicit" else None
        row["alive"] = process.poll() is None
        row["exit"] = process.returncode
        if server == "vbs" and row["alive"]:
            row["metrics"] = vbs_metrics(url)
        if server == "triton-all" and row["alive"]:
            row["log"] = tail(log, 6)
        row.update(oom_kills=group.oom_kills(), peak=group.peak())
        if not row["alive"]:
            row["log"] = tail(log)
        return row
    finally:
        stop(process)
        group.remove()


def resolve_limits(args: argparse.Namespace, fp_vbs: dict[str, dict[str, Any]],
                   fp_triton: dict[str, dict[str, Any]]) -> list[tuple[str, int]]:
    room = parse_bytes(args.headroom)
    out = []
    for name in args.limits.split(","):
        if name in ("vbs", "triton"):
            fp = fp_vbs if name == "vbs" else fp_triton
            out.append((f"{name}'s largest alone + {args.headroom}",
                        max(f["peak"] or 0 for f in fp.values()) + room))
        else:
            out.append((name, parse_bytes(name)))
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--models", default=MODELS, help="comma-separated, hottest first")
    ap.add_argument("--shape", default="3,224,224")
    ap.add_argument("--batch-max", type=int, default=4, help="vbs-serve's largest request "
                    "planned and Triton's max_batch_size")
    ap.add_argument("--profile-repeats", type=int, default=2, help="`vbs plan`'s timed runs "
                    "per unit and batch (its default 5: planning eight models takes long)")
    ap.add_argument("--profile-warmup", type=int, default=1)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--zipf", type=float, default=1.5, help="the Zipf law's exponent s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limits", default="vbs,triton", help="the cgroup limits, one run of "
                    "every server in each: sizes, or vbs / triton: that server's largest "
                    "footprint alone plus --headroom")
    ap.add_argument("--headroom", default="200MiB")
    ap.add_argument("--client-margin", default="100MiB",
                    help="what the explicit-mode client leaves free below the limit")
    ap.add_argument("--servers", default="vbs,triton-all,triton-explicit")
    ap.add_argument("--timeout", type=float, default=60.0, help="a request's timeout (s)")
    ap.add_argument("--vbs-log-level", default="warning", help="vbs serve's --log-level (its "
                    "log's tail is printed where it fails; info: every load and unload)")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=0, help="Triton's ONNX Runtime threads")
    ap.add_argument("--triton-wait", type=float, default=0.005)
    ap.add_argument("--vbs-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--store", default=str(Path.home() / ".cache" / "vbs-serve" / "many-store"))
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--footprints", help="an earlier run's --json: take its footprints alone "
                    "instead of measuring them again (the same models, shape and store)")
    args = ap.parse_args()
    args.models = args.models.split(",")
    args.shape_arg = args.shape
    args.shape = tuple(int(d) for d in args.shape.split(","))
    args.threads = args.threads or os.cpu_count() or 1
    args.client_margin = parse_bytes(args.client_margin)
    return args


def main() -> None:
    args = parse_args()
    servers = args.servers.split(",")
    body, headers, _ = request_body(
        np.random.default_rng(1).standard_normal((1, *args.shape)).astype(np.float32), "oip")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vbs-many-") as work:
        args.work = work
        plan(args)
        onnx = export(args) if any(s.startswith("triton") for s in servers) else {}
        repo = triton_repository(args, onnx, "all") if onnx else None
        if args.footprints:  # an earlier run's --json: its footprints, not measured again
            earlier = json.loads(Path(args.footprints).read_text())
            fp_vbs, fp_triton = earlier["footprints_vbs"], earlier["footprints_triton"]
            triton_base = earlier["triton_base"]
        else:
            fp_vbs = footprints_vbs(args, body, headers)
            triton_base, fp_triton = (footprints_triton(args, repo, body, headers) if repo
                                      else (0, {}))
        limits = resolve_limits(args, fp_vbs, fp_triton)
        print_footprints(args, fp_vbs, fp_triton, triton_base, limits)
        rows = []
        for name, limit in limits:
            for server in servers:
                row = run_server(server, args, limit, body, headers, repo,
                                 {m: f["growth"] for m, f in fp_triton.items()}, triton_base)
                row.update(duration=args.duration, limit_name=name)
                rows.append(row)
                print(f"# {server} in {name} ({limit / MiB:.0f} MiB) done", file=sys.stderr,
                      flush=True)
        report(rows, args)
        print(f"\n# whole run {time.perf_counter() - t_start:.0f} s", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"limits": limits, "footprints_vbs": fp_vbs, "footprints_triton": fp_triton,
                 "triton_base": triton_base, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
