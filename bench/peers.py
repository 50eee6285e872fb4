"""vbs-serve against the servers people would otherwise pick: Ray Serve, LitServe and NVIDIA
Triton, eager and with ONNX Runtime, one at a time.

    .venv-peers/bin/python bench/peers.py --model mobilenet_v2 [--clients 1,8] [--duration 20]
        [--warmup 5] [--rounds 2] [--batch-sizes 1,8,16] [--only vbs,triton-ort-8]
        [--protocol http|grpc] [--json OUT] [--int8 MODEL-int8.onnx] [--bf16 CALIBRATION] [--f16 CALIBRATION]

Needs the optional extra, in a venv of its own (nvidia-pytriton pins numpy<2, which pip then
picks): ``python3 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.14.1
torchvision==0.29.1 -e '.[peers]'`` (ray[serve], litserve, nvidia-pytriton with its
tritonserver binary, onnx, onnxruntime). Every server runs the same torchvision model with
random weights (the same seed), with the same intra-op threads (``--threads``, default one per
core), in its own processes on this machine, bound to 127.0.0.1, one server at a time; the ONNX
peers run the same weights exported once per run (TorchScript exporter, opset 17, a dynamic
batch dimension) on ONNX Runtime's CPU provider, its idle threads not spinning (they would take
the cores from the server's own processes; ``--ort-spin`` for ONNX Runtime's default). Every
configuration is loaded by the same load generator (``loadgen.loadtest``: C concurrent clients,
one sample per request, the same sample values, a warm-up, then a fixed duration). B is the
peer's largest batch, tried for each of ``--batch-sizes`` (the tuning):

- ``vbs``: `vbs serve` with its defaults (no batch delay; gathers while the model is busy)
  and the tables of ``vbs plan`` (``--batch-max``, ample memory); the .npy as the body.
- ``ray-B``: Ray Serve, eager torch, one replica with ``@serve.batch(max_batch_size=B,
  batch_wait_timeout_s=--ray-wait)``; the .npy as the body (a Starlette request).
- ``lit-B``: LitServe, eager torch, ``max_batch_size=B, batch_timeout=--lit-wait``; the .npy
  as a multipart file (LitServe hands a JSON or form payload to its worker process; JSON would
  parse 150,528 floats).
- ``lit-ort-B``: the same LitServe, its worker running the ONNX export on ONNX Runtime.
- ``triton-ort-B``: NVIDIA Triton Inference Server, the ``tritonserver`` binary that
  nvidia-pytriton ships, its dynamic batcher (``max_batch_size`` B, ``max_queue_delay``
  ``--triton-wait``) feeding one model instance in Triton's Python backend, which runs the
  ONNX export on ONNX Runtime (the shipped binary has no ONNX Runtime backend of its own); the
  request in the Open Inference Protocol v2 with the binary tensor extension (a JSON header,
  then the sample's raw bytes), the answer in JSON. See ``bench/peers_triton.py``.
- ``triton-torch-B``: the same Triton, its Python backend running eager torch.
- ``lit-ort-spin-B``, ``triton-ort-spin-B``: ``lit-ort-B`` and ``triton-ort-B`` with ONNX
  Runtime in its defaults, as users run it: its intra-op threads spin while idle.
- ``vbs-int8`` (with ``--int8``): `vbs serve` of the model's int8 tables and compiled units,
  planned beforehand under the alias ``MODEL-int8`` (`vbs plan --model MODEL-int8=MODEL
  --precision auto --calibration DIR`, the store given here).
- ``triton-ort-int8-B`` (with ``--int8``): ``triton-ort-B`` on the same int8 model as one ONNX
  file (``bench/int8_export.py`` composes it from those compiled units): a user who quantized
  the model alone and serves it tuned.
- ``vbs-bf16`` (with ``--bf16 DIR``): `vbs serve` of the model in bfloat16 on torch
  (``VBS_PRECISION=bfloat16``, ``VBS_CALIBRATION=DIR``), its tables planned beforehand under
  the alias ``MODEL-bf16`` (`vbs plan --model MODEL-bf16=MODEL --precision bfloat16
  --calibration DIR`).
- ``vbs-f16`` (with ``--f16 DIR``): the same in float16 (``MODEL-f16``, ``--precision
  float16``).

With ``--protocol grpc`` the same clients call the Open Inference Protocol's ``ModelInfer``
over gRPC instead (``loadgen.loadtest_grpc``: the sample as raw tensor bytes, as Triton's
perf_analyzer sends it), on the servers that speak it: vbs-serve and Triton; Ray Serve and
LitServe have no OIP gRPC endpoint and are left out.

Rounds are interleaved (every configuration once per round) so the machine's drift shows.
Prints a Markdown table (throughput, p50, p99, errors) per configuration, client count and
round, then per client count the best batch size of each peer and vbs-serve against the best
tuned peer.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from peers_models import export_onnx, runner, torch_model  # noqa: E402 (bench/, this one's)
from served import free_port, stop, wait_ready, wait_until  # noqa: E402

# a configuration's name without its batch size -> the server and what runs the model
FAMILIES = {"ray": ("ray", "torch"), "lit": ("lit", "torch"), "lit-ort": ("lit", "ort"),
            "lit-ort-spin": ("lit", "ort-spin"), "triton-ort": ("triton", "ort"),
            "triton-ort-spin": ("triton", "ort-spin"), "triton-torch": ("triton", "torch"),
            "triton-ort-int8": ("triton", "ort-int8")}
INT8 = ("vbs-int8", "triton-ort-int8")  # configurations of the int8 model (``--int8``)
BF16 = "vbs-bf16"  # the model in bfloat16 (``--bf16``)
F16 = "vbs-f16"  # the model in float16 (``--f16``)
HALVES = {BF16: "bfloat16", F16: "float16"}  # configuration -> the dtype it serves
GRPC = {"vbs", "triton"}  # the servers that speak OIP v2 over gRPC


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
            self.model = torch_model(model, threads)

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
        """The model behind LitServe: the .npy of a multipart file in, outputs out; eager
        torch or the ONNX export on ONNX Runtime, both from numpy to numpy."""

        def __init__(self, model: str, threads: int, runtime: str = "torch",
                     onnx: str | None = None, spin: bool = False, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.model_name, self.threads, self.runtime = model, threads, runtime
            self.onnx, self.spin = onnx, spin

        def setup(self, device: str) -> None:
            self.run = runner(self.model_name, self.runtime, self.threads, self.onnx, self.spin)

        def decode_request(self, request: Any) -> Any:
            import numpy as np

            return np.load(io.BytesIO(request["input"].file.read()), allow_pickle=False)

        def batch(self, xs: list[Any]) -> Any:
            import numpy as np

            return np.concatenate(xs)

        def predict(self, x: Any) -> Any:  # max_batch_size=1: batch() is not called, same array
            return self.run(x)

        def unbatch(self, y: Any) -> list[Any]:
            return list(y)

        def encode_response(self, y: Any) -> Any:
            return {"outputs": y.reshape(-1, y.shape[-1]).tolist()}

    # LitServe reads the annotation to hand over the request: a Starlette Request gets its form
    # parsed (this module's annotations are strings, which it would take for a query parameter)
    from starlette.requests import Request as _Request
    LitModel.decode_request.__annotations__["request"] = _Request


def serve_lit(model: str, port: int, batch: int, wait_s: float, threads: int, runtime: str,
              onnx: str | None, spin: bool) -> None:
    api = LitModel(model, threads, runtime, onnx, spin, max_batch_size=batch,
                   batch_timeout=wait_s)
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1)
    server.run(host="127.0.0.1", port=port, num_api_servers=1, log_level="warning",
               generate_client_file=False)


def serve_triton(model: str, ports: tuple[int, int], batch: int, wait_s: float, threads: int,
                 runtime: str, onnx: str | None, spin: bool, shape: tuple[int, ...]) -> None:
    """Triton on ``ports`` (HTTP, gRPC), its metrics on a free port, all on 127.0.0.1."""
    from peers_triton import serve

    serve(model, shape, runtime, (*ports, free_port(*ports)), batch, wait_s, threads, onnx, spin)


# -- the orchestration ---------------------------------------------------------------------


def _wait_answering(url: str, fmt: str, model: str, process: subprocess.Popen[bytes],
                    timeout_s: float = 300) -> str | None:
    """Until a peer answers one inference (its health check says little about its model), with
    a request in the format the load test will send; else why not."""
    import numpy as np

    from loadgen.loadtest import request_body

    body, headers, files = request_body(np.zeros((1, *_model_shape(model)), np.float32), fmt)
    with httpx.Client(timeout=60) as client:
        return wait_until(lambda: (client.post(url, content=body, headers=headers)
                                   if files is None else client.post(url, files=files)
                                   ).status_code == 200, process, timeout_s)


def start(kind: str, args: argparse.Namespace, port: int, grpc_port: int
          ) -> tuple[subprocess.Popen[bytes], str, str]:
    """Start one server, its gRPC on ``grpc_port`` where it has one (0: off); (process, path to
    POST to, request format)."""
    env = {**os.environ, "VBS_CACHE_DIR": args.cache_dir}
    if kind in ("vbs", "vbs-int8", *HALVES):
        vbs = Path(sys.executable).with_name("vbs")
        entry = args.model if kind == "vbs" else f"{served_name(kind, args.model)}={args.model}"
        if kind in HALVES:
            env.update(VBS_PRECISION=HALVES[kind],
                       VBS_CALIBRATION=args.bf16 if kind == BF16 else args.f16)
        process = subprocess.Popen(
            [str(vbs), "serve", "--grpc-port", str(grpc_port), "--model", entry, "--store",
             args.store, "--batch-max", str(args.batch_max), "--port", str(port),
             "--log-level", "warning"], env=env)
        # the first start plans the model: minutes on a busy machine
        why = wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", process, args.start_timeout)
        if why:
            stop(process)  # not left running behind the bench
            raise SystemExit(f"vbs serve {why}")
        return process, "/infer", "npy"
    peer, runtime, batch = parse_config(kind)
    spin = args.ort_spin or runtime.endswith("-spin")  # ONNX Runtime as users run it
    runtime = runtime.removesuffix("-spin")
    wait = {"ray": args.ray_wait, "lit": args.lit_wait, "triton": args.triton_wait}[peer]
    onnx = ""
    if runtime == "ort":
        onnx = str(onnx_path(args))
    elif runtime == "ort-int8":  # the int8 model's one file, as a user who quantized it has
        onnx, runtime = args.int8, "ort"
    process = subprocess.Popen(
        [sys.executable, __file__, f"serve-{peer}", "--model", args.model, "--port", str(port),
         "--grpc-port", str(grpc_port or free_port(port)), "--batch", str(batch), "--wait", str(wait), "--threads", str(args.threads),
         "--runtime", runtime, "--onnx", onnx, "--shape", ",".join(map(str, args.shape)),
         *(["--spin"] if spin else [])],
        env=env, start_new_session=True)
    path, fmt = {"ray": ("/predict", "npy"), "lit": ("/predict", "npy-form"),
                 "triton": (f"/v2/models/{args.model}/infer", "oip")}[peer]
    why = _wait_answering(f"http://127.0.0.1:{port}{path}", fmt, args.model, process,
                          args.start_timeout)
    if why:
        stop(process)
        raise SystemExit(f"{kind} {why}")
    return process, path, fmt


def parse_config(kind: str) -> tuple[str, str, int]:
    """``lit-8`` -> (lit, torch, 8), ``triton-ort-8`` -> (triton, ort, 8)."""
    family, batch = kind.rsplit("-", 1)
    return (*FAMILIES[family], int(batch))


def configs(sizes: list[int], protocol: str = "http", int8: bool = False,
            bf16: bool = False, f16: bool = False) -> list[str]:
    """Every configuration that speaks ``protocol``: vbs, then each peer and runtime at each
    batch size (those of the int8 model with ``int8``, vbs in bfloat16 with ``bf16``, in
    float16 with ``f16``)."""
    every = ["vbs", "vbs-int8", BF16, F16,
             *[f"{family}-{b}" for family, (peer, _) in FAMILIES.items() for b in sizes
               if protocol == "http" or peer in GRPC]]
    return [c for c in every if (int8 or not c.startswith(INT8)) and (bf16 or c != BF16)
            and (f16 or c != F16)]


def served_name(config: str, model: str) -> str:
    """The model name a configuration's requests carry (vbs-int8, vbs-bf16 and vbs-f16
    serve an alias)."""
    return {"vbs-int8": f"{model}-int8", BF16: f"{model}-bf16", F16: f"{model}-f16"
            }.get(config, model)


def onnx_path(args: argparse.Namespace) -> Path:
    """The ONNX export of the model, made once per run (the same weights as the eager peers)."""
    path = Path(args.work) / f"{args.model}.onnx"
    if not path.exists():
        export_onnx(args.model, args.shape, path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="command")
    for peer in ("ray", "lit", "triton"):
        p = sub.add_parser(f"serve-{peer}")
        p.add_argument("--model", required=True)
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--grpc-port", type=int, default=0, help="Triton's gRPC port")
        p.add_argument("--batch", type=int, required=True)
        p.add_argument("--wait", type=float, required=True)
        p.add_argument("--threads", type=int, default=0)
        p.add_argument("--runtime", choices=["torch", "ort"], default="torch")
        p.add_argument("--onnx", default="", help="the ONNX export (runtime ort)")
        p.add_argument("--spin", action="store_true", help="ONNX Runtime's threads spin")
        p.add_argument("--shape", required=True, help="one sample's input shape, e.g. 3,224,224")
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,8,16", help="the peers' max batch sizes tried")
    ap.add_argument("--batch-max", type=int, default=16, help="vbs-serve's largest request size")
    ap.add_argument("--ray-wait", type=float, default=0.005, help="Ray's batch_wait_timeout_s")
    ap.add_argument("--lit-wait", type=float, default=0.005, help="LitServe's batch_timeout")
    ap.add_argument("--triton-wait", type=float, default=0.005,
                    help="Triton's max_queue_delay, in seconds")
    ap.add_argument("--ort-spin", action="store_true",
                    help="let ONNX Runtime's threads spin while idle (its default; off here)")
    ap.add_argument("--threads", type=int, default=0,
                    help="peers' intra-op threads, torch and ONNX Runtime (0: one per core)")
    ap.add_argument("--start-timeout", type=float, default=300,
                    help="seconds a server may take to answer its first request")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--store", default=str(Path.home() / ".cache" / "vbs-serve" / "peers-store"))
    ap.add_argument("--only", help="comma-separated configurations (vbs, ray-8, lit-16, "
                                   "lit-ort-8, triton-ort-8, triton-torch-8, ...)")
    ap.add_argument("--protocol", choices=["http", "grpc"], default="http",
                    help="the load's protocol: HTTP, or OIP v2 gRPC (vbs and Triton only)")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--int8", metavar="FILE",
                    help="the int8 model as one ONNX file (bench/int8_export.py): adds vbs-int8 "
                         "(its tables planned in --store as MODEL-int8) and triton-ort-int8-B")
    ap.add_argument("--bf16", metavar="DIR",
                    help="calibration samples the bfloat16 model was planned with: adds "
                         "vbs-bf16 (its tables planned in --store as MODEL-bf16)")
    ap.add_argument("--f16", metavar="DIR",
                    help="calibration samples the float16 model was planned with: adds "
                         "vbs-f16 (its tables planned in --store as MODEL-f16)")
    args = ap.parse_args()
    args.threads = args.threads or os.cpu_count() or 1
    if args.command == "serve-ray":
        serve_ray(args.model, args.port, args.batch, args.wait, args.threads)
        return
    if args.command == "serve-lit":
        serve_lit(args.model, args.port, args.batch, args.wait, args.threads, args.runtime,
                  args.onnx or None, args.spin)
        return
    if args.command == "serve-triton":
        serve_triton(args.model, (args.port, args.grpc_port), args.batch, args.wait,
                     args.threads, args.runtime, args.onnx or None, args.spin,
                     tuple(int(d) for d in args.shape.split(",")))
        return
    with tempfile.TemporaryDirectory(prefix="vbs-peers-") as work:
        args.work = work
        bench(args)


def bench(args: argparse.Namespace) -> None:
    """Every configuration, every round, every client count; the table and the summary."""
    from loadgen.loadtest import run_loadtest
    from loadgen.loadtest_grpc import run_grpc_loadtest

    clients = [int(c) for c in args.clients.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    chosen = configs(sizes, args.protocol, bool(args.int8), bool(args.bf16),
                     bool(args.f16))
    if args.only:
        unknown = set(args.only.split(",")) - set(chosen)
        if unknown:
            raise SystemExit(f"--only: {', '.join(sorted(unknown))} not among {', '.join(chosen)}"
                             f" (over {args.protocol})")
        chosen = [c for c in chosen if c in args.only.split(",")]
    shape = args.shape = tuple(int(d) for d in _model_shape(args.model))
    results: list[dict[str, Any]] = []
    print("| server | clients | round | throughput (samples/s) | p50 (ms) | p99 (ms) | errors |")
    print("|---|---|---|---|---|---|---|")
    for k in range(1, args.rounds + 1):
        for config in chosen:
            port = free_port()
            grpc_port = free_port(port) if args.protocol == "grpc" else 0
            try:
                process, path, fmt = start(config, args, port, grpc_port)
            except SystemExit as exc:  # one server that will not start does not end the bench
                print(f"| {config} | - | {k} | did not start: {exc} | | | |", flush=True)
                continue
            try:
                for c in clients:
                    name = served_name(config, args.model)
                    summary = asyncio.run(run_grpc_loadtest(
                        f"127.0.0.1:{grpc_port}", name, clients=c,
                        duration_s=args.duration, warmup_s=args.warmup)
                        if grpc_port else run_loadtest(
                        f"http://127.0.0.1:{port}", name, clients=c,
                        duration_s=args.duration, warmup_s=args.warmup, fmt=fmt,
                        peer=None if config.startswith("vbs") else (path, shape)))
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
        summarize(results, c)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def summarize(results: list[dict[str, Any]], clients: int) -> None:
    """For one client count: each peer at its best batch size (a configuration counts by its
    worse round, the machine being noisy), and vbs-serve against the best of them."""
    by_config: dict[str, list[float]] = {}
    for row in results:
        if row["clients"] == clients:
            by_config.setdefault(row["server"], []).append(row["throughput_samples_per_s"])
    worse = {cfg: min(v) for cfg, v in by_config.items()}
    tuned: dict[str, str] = {}  # peer (and runtime) -> its best configuration
    for cfg, value in worse.items():
        if not cfg.startswith("vbs"):
            family = cfg.rsplit("-", 1)[0]
            if family not in tuned or value > worse[tuned[family]]:
                tuned[family] = cfg
    if tuned:
        print(f"{clients} clients, each peer tuned: " + ", ".join(
            f"{cfg} {worse[cfg]:.1f}" for cfg in sorted(tuned.values(), key=worse.get,
                                                         reverse=True)) + " samples/s")
    if tuned and "vbs" in worse:
        top = max(tuned.values(), key=worse.get)  # type: ignore[arg-type]
        print(f"{clients} clients: vbs {worse['vbs']:.1f} samples/s (worse round) against the "
              f"best tuned peer {top} {worse[top]:.1f}: {worse['vbs'] / worse[top]:.2f}x")
    for mine in ("vbs-int8", *HALVES):
        if mine not in worse:
            continue
        rivals = [cfg for cfg in ("vbs", "vbs-int8", tuned.get("triton-ort"),
                                  tuned.get("triton-ort-spin"), tuned.get("triton-ort-int8"))
                  if cfg in worse and cfg != mine]
        print(f"{clients} clients: {mine} {worse[mine]:.1f} samples/s (worse round): " +
              ", ".join(f"{worse[mine] / worse[cfg]:.2f}x {cfg}" for cfg in rivals))


def _model_shape(name: str) -> tuple[int, ...]:
    from core.loaded import ModelSpec
    from planner.models import load_model

    return tuple(load_model(ModelSpec(name)).input_shape)


if __name__ == "__main__":
    main()
