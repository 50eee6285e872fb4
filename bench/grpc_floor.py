"""What gRPC in Python costs a request apart from the model: `vbs serve`'s gRPC side against
an OIP v2 server that answers at once, both grpcio's asyncio server in Python.

    python bench/grpc_floor.py [--model mobilenet_v2] [--clients 1,8] [--duration 15]
                               [--warmup 3] [--rounds 2] [--runtime auto] [--batch-max 8]
                               [--store DIR]

The echo server (this script again, ``--echo PORT``, its own process) speaks
``GRPCInferenceService`` with the options `vbs serve` uses (``service.grpc_server``): its
``ModelInfer`` views the request's raw bytes and answers the model's output shape in zeros,
raw, running nothing. `vbs serve` (its own process, ``--runtime``, ample memory, the tables of
``vbs plan``) serves the model. Both get the same load (``vbs loadtest --protocol grpc``'s
client: C closed-loop clients, one sample each as raw tensor bytes, a warm-up, then
``--duration`` s), in turn, round after round. Printed per server, client count and round:
samples/s, p50 and p99 latency, and the CPU that the server's event loop thread and gRPC's own
threads (``event_engine``) spent per request (``/proc/<pid>/task``: user + system); for `vbs
serve` also the median of its answers' ``rest`` (latency minus the server's own timings:
gRPC both ways, client included), ``infer`` (its batch's run) and the mean batch a request
ran in. The echo server's latency is the least any grpcio server answers this client in; its
CPU, what grpcio takes from the model's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np

from served import ROOT, free_port, stat_cpu, stop, vbs_serve, wait_until


def front_cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid``'s main thread (the event loop) and gRPC's threads."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name, seconds = stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        except OSError:  # the thread ended meanwhile
            continue
        if tid == str(pid) or name.startswith("event_engine"):
            total += seconds
    return total


def echo(port: int, shape: tuple[int, ...], out: tuple[int, ...]) -> None:
    """Serve ModelMetadata and ModelInfer on ``port``: every answer zeros of ``out``."""
    import grpc

    from service.grpc_server import server_options
    from service.oip import pb, rpc
    from service.settings import Settings

    answer_rows = np.zeros(out, "<f4").tobytes()
    sample = int(np.prod(shape))  # values in one sample

    class Echo(rpc.GRPCInferenceServiceServicer):
        async def ModelMetadata(self, request, context):  # noqa: N802
            tensor = pb.ModelMetadataResponse.TensorMetadata
            return pb.ModelMetadataResponse(
                name=request.name, versions=["1"], platform="echo",
                inputs=[tensor(name="input", datatype="FP32", shape=[-1, *shape])],
                outputs=[tensor(name="output", datatype="FP32", shape=[-1, *out])])

        async def ModelInfer(self, request, context):  # noqa: N802
            n = np.frombuffer(request.raw_input_contents[0], "<f4").size // sample
            answer = pb.ModelInferResponse(model_name=request.model_name, model_version="1")
            answer.outputs.add(name="output", datatype="FP32", shape=[n, *out])
            answer.raw_output_contents.append(answer_rows * n)
            return answer

    async def main() -> None:
        server = grpc.aio.server(options=server_options(Settings().max_body_bytes))
        rpc.add_GRPCInferenceServiceServicer_to_server(Echo(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def wait_listening(port: int, process: subprocess.Popen[bytes]) -> None:
    """Return once something accepts on 127.0.0.1:``port``; SystemExit if ``process`` ends."""
    def accepts() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    why = wait_until(accepts, process, poll_s=0.2)
    if why:
        raise SystemExit(f"the echo server {why}")


def load(pid: int, target: str, model: str, clients: int, args: argparse.Namespace) -> dict:
    """One load test on ``target``, with the front CPU per request of process ``pid``."""
    from loadgen.loadtest_grpc import run_grpc_loadtest

    asyncio.run(run_grpc_loadtest(target, model, clients=clients, duration_s=args.warmup))
    cpu0 = front_cpu_seconds(pid)
    summary = asyncio.run(run_grpc_loadtest(target, model, clients=clients,
                                            duration_s=args.duration))
    summary["front_cpu_s"] = (front_cpu_seconds(pid) - cpu0) / max(1, summary["ok"])
    return summary


def row(server: str, clients: int, k: int, s: dict) -> str:
    """One line of the table: a load test's summary (``load``)."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.2f}"

    sizes = {int(b): n for b, n in s["requests_by_batch_size"].items()}
    batch = (f"{sum(b * n for b, n in sizes.items()) / sum(sizes.values()):.1f}"
             if sizes else "-")  # the mean, per request, of the batch it ran in
    parts = s["breakdown_p50_s"]
    return (f"| {server} | {clients} | {k} | {s['throughput_samples_per_s']:.1f} | "
            f"{ms(s['latency_p50_s'])} | {ms(s['latency_p99_s'])} | {ms(s['front_cpu_s'])} | "
            f"{ms(parts.get('rest'))} | {ms(parts.get('infer'))} | {batch} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--clients", default="1,8", help="client counts, comma-separated")
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runtime", default="auto", help="vbs serve --runtime")
    ap.add_argument("--batch-max", type=int, default=8)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--store", help="vbs serve's plan store (default: grpc-floor-store in "
                                    "--cache-dir; another script's, to skip planning)")
    ap.add_argument("--echo", type=int, help=argparse.SUPPRESS)  # run as the echo server
    ap.add_argument("--shape", help=argparse.SUPPRESS)  # one sample's input, for the echo
    ap.add_argument("--out", help=argparse.SUPPRESS)    # and its output
    args = ap.parse_args()
    if args.echo:
        echo(args.echo, tuple(map(int, args.shape.split(","))),
             tuple(map(int, args.out.split(","))))
        return

    store = args.store or str(Path(args.cache_dir) / "grpc-floor-store")
    env = {**os.environ, "VBS_CACHE_DIR": args.cache_dir}
    counts = [int(c) for c in args.clients.split(",")]
    print(f"| server | clients | round | samples/s | p50 (ms) | p99 (ms) | loop + gRPC threads "
          f"CPU per request (ms) | rest p50 (ms) | infer p50 (ms) | mean batch |\n|{'---|' * 10}")
    grpc_port = free_port()
    with vbs_serve(["--model", args.model, "--runtime", args.runtime, "--batch-max",
                    str(args.batch_max), "--store", store, "--grpc-port",
                    str(grpc_port)], env=env) as (vbs, url):
        meta = httpx.get(f"{url}/v2/models/{args.model}").json()
        shape, out = (",".join(str(d) for d in meta[side][0]["shape"][1:])
                      for side in ("inputs", "outputs"))
        echo_port = free_port()
        with subprocess.Popen([sys.executable, __file__, "--echo", str(echo_port), "--shape",
                               shape, "--out", out],
                              env={**os.environ, "PYTHONPATH": str(ROOT)}) as echo_server:
            try:
                wait_listening(echo_port, echo_server)
                for k in range(1, args.rounds + 1):
                    for name, pid, port in (("echo", echo_server.pid, echo_port),
                                            ("vbs", vbs.pid, grpc_port)):
                        for clients in counts:
                            s = load(pid, f"127.0.0.1:{port}", args.model, clients, args)
                            print(row(name, clients, k, s), flush=True)
            finally:
                stop(echo_server)


if __name__ == "__main__":
    main()
