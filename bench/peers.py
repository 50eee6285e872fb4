"""vbs-serve against the servers people would otherwise pick: Ray Serve and LitServe, one at a time.

    .venv-peers/bin/python bench/peers.py --model mobilenet_v2 [--clients 1,8] [--duration 20]
        [--warmup 5] [--rounds 2] [--batch-sizes 1,8,16] [--json OUT]

Needs the optional extra: ``python -m venv .venv-peers && .venv-peers/bin/pip install
torch==2.14.1 torchvision==0.29.1 -e '.[peers]'`` (ray[serve], litserve). Every server runs
the same torchvision model with random weights (the same seed, the same torch threads), in
its own processes on this machine, bound to 127.0.0.1, one server at a time; every
configuration is loaded by the same load generator (``service.loadtest``: C concurrent
clients, one sample per request, the same .npy bytes, a warm-up, then a fixed duration):

- ``vbs``: `vbs serve` with its defaults (no batch delay; gathers while the model is busy)
  and the tables of ``vbs plan`` (``--batch-max``, ample memory); the .npy as the body.
- ``ray-B``: Ray Serve, one replica with ``@serve.batch(max_batch_size=B,
  batch_wait_timeout_s=--ray-wait)``; the .npy as the body (a Starlette request).
- ``lit-B``: LitServe, ``max_batch_size=B, batch_timeout=--lit-wait``; the .npy as a
  multipart file (LitServe hands a JSON or form payload to its worker process; JSON would
  parse 150,528 floats).

Rounds are interleaved (every configuration once per round) so the machine's drift shows.
Prints a Markdown table (throughput, p50, p99, errors) per configuration, client count and
round, and the best tuned peer per client count.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _model(name: str, threads: int) -> Any:
    import torch
    import torchvision

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None).eval()


def _rows(y: Any) -> list[bytes]:
    import orjson

    return [orjson.dumps({"outputs": row}, option=orjson.OPT_SERIALIZE_NUMPY) for row in y]


# -- the peers, each in its own process --------------------------------------------------------


def serve_ray(model: str, port: int, batch: int, wait_s: float, threads: int) -> None:
    import numpy as np
    import ray
    import torch
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=os.cpu_count(),
             configure_logging=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})

    @serve.deployment(ray_actor_options={"num_cpus": os.cpu_count()}, max_ongoing_requests=256)
    class Model:
        def __init__(self) -> None:
            self.model = _model(model, threads)

        @serve.batch(max_batch_size=batch, batch_wait_timeout_s=wait_s)
        async def run(self, xs: list[np.ndarray]) -> list[bytes]:
            with torch.inference_mode():
                y = self.model(torch.from_numpy(np.concatenate(xs))).numpy()
            return _rows(y)

        async def __call__(self, request: Request) -> Response:
            x = np.load(io.BytesIO(await request.body()), allow_pickle=False)
            return Response(await self.run(x), media_type="application/json")

    serve.run(Model.bind(), route_prefix="/predict", blocking=False)
    while True:
        time.sleep(3600)


try:  # LitServe pickles its API into worker processes: the class must live at module level
    import litserve as ls
except ImportError:  # only the peers' environment has it
    ls = None

if ls is not None:
    class LitModel(ls.LitAPI):  # type: ignore[misc]
        """The model behind LitServe: the .npy of a multipart file in, outputs out."""

        def __init__(self, model: str, threads: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.model_name, self.threads = model, threads

        def setup(self, device: str) -> None:
            self.model = _model(self.model_name, self.threads)

        def decode_request(self, request: Any) -> Any:
            import numpy as np

            return np.load(io.BytesIO(request["input"].file.read()), allow_pickle=False)

        def batch(self, xs: list[Any]) -> Any:
            import numpy as np
            import torch

            return torch.from_numpy(np.concatenate(xs))

        def predict(self, x: Any) -> Any:
            import torch

            if not isinstance(x, torch.Tensor):  # max_batch_size=1: batch() is not called
                x = torch.from_numpy(x)
            with torch.inference_mode():
                return self.model(x).numpy()

        def unbatch(self, y: Any) -> list[Any]:
            return list(y)

        def encode_response(self, y: Any) -> Any:
            return {"outputs": y.reshape(-1, y.shape[-1]).tolist()}

    # LitServe reads the annotation to hand over the request: a Starlette Request gets its form
    # parsed (this module's annotations are strings, which it would take for a query parameter)
    from starlette.requests import Request as _Request
    LitModel.decode_request.__annotations__["request"] = _Request


def serve_lit(model: str, port: int, batch: int, wait_s: float, threads: int) -> None:
    api = LitModel(model, threads, max_batch_size=batch, batch_timeout=wait_s)
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1)
    server.run(host="127.0.0.1", port=port, num_api_servers=1, log_level="warning",
               generate_client_file=False)


# -- the orchestration ---------------------------------------------------------------------


def _wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"a server exited with {process.returncode} before it was ready")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    raise SystemExit(f"{url} not ready within {timeout_s} s")


def _wait_answering(url: str, fmt: str, model: str, process: subprocess.Popen[bytes],
                    timeout_s: float = 300) -> None:
    """Until a peer answers one inference (its health check says little about its model)."""
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.zeros((1, *_model_shape(model)), dtype=np.float32))
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"a server exited with {process.returncode} before it was ready")
            try:
                if fmt == "npy":
                    r = client.post(url, content=buf.getvalue(),
                                    headers={"Content-Type": "application/x-npy"})
                else:
                    r = client.post(url, files={"input": ("x.npy", buf.getvalue(),
                                                          "application/x-npy")})
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {timeout_s} s")


def start(kind: str, args: argparse.Namespace, port: int) -> tuple[subprocess.Popen[bytes], str, str]:
    """Start one server; (process, path to POST to, request format)."""
    env = {**os.environ, "VBS_CACHE_DIR": args.cache_dir}
    if kind == "vbs":
        vbs = Path(sys.executable).with_name("vbs")
        process = subprocess.Popen(
            [str(vbs), "serve", "--model", args.model, "--store", args.store, "--batch-max",
             str(args.batch_max), "--port", str(port), "--log-level", "warning"], env=env)
        _wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", process)
        return process, "/infer", "npy"
    peer, batch = kind.split("-")
    wait = args.ray_wait if peer == "ray" else args.lit_wait
    process = subprocess.Popen(
        [sys.executable, __file__, f"serve-{peer}", "--model", args.model, "--port", str(port),
         "--batch", batch, "--wait", str(wait), "--threads", str(args.threads)], env=env,
        start_new_session=True)
    fmt = "npy" if peer == "ray" else "npy-form"
    try:
        _wait_answering(f"http://127.0.0.1:{port}/predict", fmt, args.model, process)
    except SystemExit:
        stop(process)
        raise
    return process, "/predict", fmt


def stop(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, 15)  # the peers start helper processes of their own
    except (ProcessLookupError, PermissionError):
        process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="command")
    for peer in ("ray", "lit"):
        p = sub.add_parser(f"serve-{peer}")
        p.add_argument("--model", required=True)
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--batch", type=int, required=True)
        p.add_argument("--wait", type=float, required=True)
        p.add_argument("--threads", type=int, default=0)
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,8,16", help="the peers' max batch sizes tried")
    ap.add_argument("--batch-max", type=int, default=16, help="vbs-serve's largest request size")
    ap.add_argument("--ray-wait", type=float, default=0.005, help="Ray's batch_wait_timeout_s")
    ap.add_argument("--lit-wait", type=float, default=0.005, help="LitServe's batch_timeout")
    ap.add_argument("--threads", type=int, default=0, help="peers' torch threads (0: default)")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--store", default=str(Path.home() / ".cache" / "vbs-serve" / "peers-store"))
    ap.add_argument("--only", help="comma-separated configurations (vbs, ray-8, lit-16, ...)")
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args()
    if args.command == "serve-ray":
        serve_ray(args.model, args.port, args.batch, args.wait, args.threads)
        return
    if args.command == "serve-lit":
        serve_lit(args.model, args.port, args.batch, args.wait, args.threads)
        return

    from service.loadtest import run_loadtest

    clients = [int(c) for c in args.clients.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    configs = ["vbs", *[f"ray-{b}" for b in sizes], *[f"lit-{b}" for b in sizes]]
    if args.only:
        configs = [c for c in configs if c in args.only.split(",")]
    shape = tuple(int(d) for d in _model_shape(args.model))
    results: list[dict[str, Any]] = []
    print("| server | clients | round | throughput (samples/s) | p50 (ms) | p99 (ms) | errors |")
    print("|---|---|---|---|---|---|---|")
    for k in range(1, args.rounds + 1):
        for config in configs:
            port = _port()
            try:
                process, path, fmt = start(config, args, port)
            except SystemExit as exc:  # one server that will not start does not end the bench
                print(f"| {config} | - | {k} | did not start: {exc} | | | |", flush=True)
                continue
            try:
                for c in clients:
                    summary = asyncio.run(run_loadtest(
                        f"http://127.0.0.1:{port}", args.model, clients=c,
                        duration_s=args.duration, warmup_s=args.warmup, fmt=fmt,
                        peer=None if config == "vbs" else (path, shape)))
                    row = {"server": config, "clients": c, "round": k, **summary}
                    results.append(row)
                    print(f"| {config} | {c} | {k} | {summary['throughput_samples_per_s']:.1f} | "
                          f"{1e3 * (summary['latency_p50_s'] or 0):.1f} | "
                          f"{1e3 * (summary['latency_p99_s'] or 0):.1f} | {summary['errors']} |",
                          flush=True)
            finally:
                stop(process)
    print()
    for c in clients:
        by_config: dict[str, list[float]] = {}
        for row in results:
            if row["clients"] == c:
                by_config.setdefault(row["server"], []).append(row["throughput_samples_per_s"])
        best = {cfg: min(v) for cfg, v in by_config.items()}  # a configuration's worse round
        peers = {cfg: t for cfg, t in best.items() if cfg != "vbs"}
        if peers and "vbs" in best:
            top = max(peers, key=peers.get)  # type: ignore[arg-type]
            print(f"{c} clients: vbs {best['vbs']:.1f} samples/s (worse round) against the best "
                  f"tuned peer {top} {peers[top]:.1f}: {best['vbs'] / peers[top]:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _model_shape(name: str) -> tuple[int, ...]:
    from planner.models import ModelSpec, load_model

    return tuple(load_model(ModelSpec(name)).input_shape)


if __name__ == "__main__":
    main()
