"""``vbs loadtest --protocol grpc``: the load test over the Open Inference Protocol's gRPC.

The same clients, counts and report as over HTTP (``loadgen.loadtest``), each client calling
``ModelInfer`` with K random samples as raw tensor bytes (``raw_input_contents``, as Triton's
perf_analyzer and tritonclient send them) as fast as answers come back, all over one HTTP/2
channel. The breakdown comes from the answer's parameters, as over HTTP; "rest" is gRPC both
ways. Any OIP v2 gRPC server can be loaded (bench/peers.py loads Triton so); an answer without
vbs-serve's timings counts for throughput and latency only. Errors are counted by status code name. Loopback targets only, as over HTTP.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import numpy as np

from core.errors import UsageError
from loadgen.loadtest import Answer, RequestFailed, check_load, closed_loop

DEFAULT_TARGET = "127.0.0.1:8001"


def check_target(target: str) -> str:
    """``HOST:PORT`` (``grpc://`` allowed) on a loopback host; else UsageError."""
    address = target.removeprefix("grpc://").rstrip("/")
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not sep or not port.isdigit() or not loopback:
        raise UsageError(f"--url {target!r}: with --protocol grpc give the gRPC port on this "
                         f"machine, e.g. {DEFAULT_TARGET} (localhost, 127.0.0.0/8 or ::1)")
    return address


async def run_grpc_loadtest(target: str, model: str, *, clients: int, duration_s: float,
                            samples: int = 1, api_key: str | None = None,
                            timeout_s: float = 60.0, seed: int = 0,
                            warmup_s: float = 0.0) -> dict[str, Any]:
    """Run the load test over gRPC and return its summary (``loadgen.loadtest.Result``)."""
    import grpc

    from loadgen.wire import parameters_of
    from service.oip import pb, rpc

    address = check_target(target)
    check_load(clients, duration_s, samples, warmup_s)
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    async with grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    ) as channel:
        stub = rpc.GRPCInferenceServiceStub(channel)
        try:
            meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name=model), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise UsageError(f"model {model!r} at grpc://{address}: {exc.code().name} "
                             f"{exc.details()} (is `vbs serve` listening for gRPC there?)"
                             ) from exc
        shape = [int(d) for d in meta.inputs[0].shape[1:]]
        x = np.random.default_rng(seed).standard_normal((samples, *shape)).astype("<f4")
        request = pb.ModelInferRequest(model_name=model, raw_input_contents=[x.tobytes()])
        request.inputs.add(name=meta.inputs[0].name, datatype="FP32", shape=list(x.shape))

        async def send() -> Answer:
            try:
                answer = await stub.ModelInfer(request, metadata=metadata, timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise RequestFailed(exc.code().name) from exc
            timing = parameters_of(answer.parameters)
            if "batch" not in timing:  # another server's answer (Triton's) has no timings
                return samples, None, None
            return samples, timing, int(timing["batch"])

        result = await closed_loop(send, clients=clients, duration_s=duration_s,
                                   warmup_s=warmup_s)
    return result.summary(url=f"grpc://{address}", model=model, clients=clients,
                          samples=samples)


__all__ = ["DEFAULT_TARGET", "check_target", "run_grpc_loadtest"]
