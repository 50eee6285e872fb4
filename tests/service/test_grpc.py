"""The Open Inference Protocol v2 over gRPC, against a real server (uvicorn and grpc.aio in one
event loop, as `vbs serve` runs them), with Triton's own clients: ``tritonclient.grpc`` gets the
answers ``tritonclient.http`` gets (health, metadata, inference, every refusal, word for word);
typed and raw tensors, through Triton's own protobuf modules where its client sends none; and
``vbs loadtest --protocol grpc``."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from core.errors import UsageError
from service.settings import Settings
from service.cli import serve_settings
from service.commands import build_parser, main
from loadgen.loadtest_grpc import check_target, run_grpc_loadtest
from service.main import create_app
from tests.conftest import free_port
from tests.service.conftest import (TINY_SHAPE, ServerThread, assert_close, reference, run,
                                    running, settings_for, wait_until)

KEY = "grpc-test-key-0123456789"
# the HTTP status tritonclient.http reports, and the gRPC code tritonclient.grpc reports
CODE_OF = {"400": "StatusCode.INVALID_ARGUMENT", "401": "StatusCode.UNAUTHENTICATED",
           "404": "StatusCode.NOT_FOUND", "503": "StatusCode.UNAVAILABLE"}


class Served:
    """One server and a client of each protocol."""

    def __init__(self, server: ServerThread, grpc_port: int) -> None:
        self.server = server
        self.target = f"127.0.0.1:{grpc_port}"
        self.grpc = tgrpc.InferenceServerClient(self.target)
        self.http = thttp.InferenceServerClient(server.url.removeprefix("http://"))

    @property
    def entry(self) -> Any:
        return self.server.app.state.registry.entries["tiny"]

    def stub(self) -> Any:
        """Triton's own generated stub: typed contents, which tritonclient never sends."""
        return service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(self.target))


@pytest.fixture(scope="module")
def served(vbs_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    settings = settings_for(vbs_cache, tmp_path_factory.mktemp("grpc-store"), grpc_port=port,
                            api_key=KEY)
    with ServerThread(create_app(settings)) as server:
        served = Served(server, port)
        yield served
        served.grpc.close()
        served.http.close()


def inputs(module: Any, x: np.ndarray, datatype: str = "FP32", name: str = "input") -> list[Any]:
    tensor = module.InferInput(name, list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    return [tensor]


def refusals(over_grpc: Callable[[], Any], over_http: Callable[[], Any]
             ) -> tuple[InferenceServerException, InferenceServerException]:
    """The two clients' errors for the same request: the same message under matching codes."""
    with pytest.raises(InferenceServerException) as by_grpc:
        over_grpc()
    with pytest.raises(InferenceServerException) as by_http:
        over_http()
    g, h = by_grpc.value, by_http.value
    assert g.status() == CODE_OF[h.status()], (g.status(), h.status(), h.message())
    return g, h


def same_refusal(over_grpc: Callable[[], Any], over_http: Callable[[], Any], *words: str) -> str:
    g, h = refusals(over_grpc, over_http)
    assert g.message() == h.message()
    for word in words:
        assert word in g.message(), (word, g.message())
    return g.message()


def auth() -> dict[str, str]:
    """The key, as headers (HTTP) or metadata (gRPC): a new dict each call, since
    tritonclient.http adds its own headers to the one it is given."""
    return {"authorization": f"Bearer {KEY}"}


def x_(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *TINY_SHAPE)).astype(np.float32)


# ------------------------------------------------------------------------------- health, metadata
def test_health_is_answered_alike(served: Served) -> None:
    for client in (served.grpc, served.http):
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("tiny") and not client.is_model_ready("nope")
    # gRPC names versions (HTTP's routes have none): the one version, "1", or none
    assert served.grpc.is_model_ready("tiny", "1") and not served.grpc.is_model_ready("tiny", "2")


def test_metadata_is_answered_alike(served: Served) -> None:
    assert served.grpc.get_server_metadata(as_json=True) == served.http.get_server_metadata()
    over_grpc = served.grpc.get_model_metadata("tiny", as_json=True)
    over_http = served.http.get_model_metadata("tiny")
    for tensor in over_grpc["inputs"] + over_grpc["outputs"]:
        tensor["shape"] = [int(d) for d in tensor["shape"]]  # int64 is a string in proto JSON
    assert over_grpc == {k: v for k, v in over_http.items() if k != "parameters"}
    assert over_grpc["inputs"][0]["shape"] == [-1, *TINY_SHAPE]


# ------------------------------------------------------------------------------- inference
def test_infer_gives_both_clients_model_x(served: Served) -> None:
    x = x_(3, 0)
    want = reference(served.entry, x)
    by_grpc = served.grpc.infer("tiny", inputs(tgrpc, x), headers=auth(), request_id="r-7")
    by_http = served.http.infer("tiny", inputs(thttp, x),
                                headers=auth(), request_id="r-7")
    assert_close(by_grpc.as_numpy("output"), want)
    assert_close(by_http.as_numpy("output"), want)
    answer = by_grpc.get_response()
    assert (answer.model_name, answer.model_version, answer.id) == ("tiny", "1", "r-7")
    assert len(answer.raw_output_contents) == 1  # raw in, raw out
    params = {k: getattr(v, v.WhichOneof("parameter_choice"))
              for k, v in answer.parameters.items()}
    assert set(params) == set(by_http.get_response()["parameters"])
    assert params["batch"] >= 3 and params["infer_s"] > 0 and isinstance(params["plan_id"], str)


def test_typed_contents_in_typed_contents_out(served: Served) -> None:
    x = x_(2, 1)
    request = service_pb2.ModelInferRequest(model_name="tiny", id="typed")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    answer = served.stub().ModelInfer(request, metadata=tuple(auth().items()))
    assert not answer.raw_output_contents and answer.id == "typed"
    out = answer.outputs[0]
    assert (out.name, out.datatype, list(out.shape)) == ("output", "FP32", [2, 4, 8, 8])
    assert_close(np.asarray(out.contents.fp32_contents).reshape(out.shape),
                 reference(served.entry, x))
    # another datatype in its own field (whole numbers as INT32), cast as over HTTP
    whole = np.round(x * 3)
    request = service_pb2.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="input", datatype="INT32", shape=list(whole.shape))
    tensor.contents.int_contents.extend(whole.astype(np.int32).reshape(-1).tolist())
    answer = served.stub().ModelInfer(request, metadata=tuple(auth().items()))
    assert_close(np.asarray(answer.outputs[0].contents.fp32_contents).reshape(2, 4, 8, 8),
                 reference(served.entry, whole))


def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize(("build", "code", "field", "words"), [
    (lambda r, t: t.contents.int_contents.extend([1] * 192), "INVALID_ARGUMENT",
     "inputs[0].contents.int_contents", "takes its values in contents.fp32_contents"),
    (lambda r, t: t.contents.fp32_contents.extend([1.0] * 10), "INVALID_ARGUMENT",
     "inputs[0].contents.fp32_contents", "holds 10 values but shape [1,3,8,8] needs 192"),
    (lambda r, t: r.raw_input_contents.append(b"\0" * 12), "INVALID_ARGUMENT",
     "raw_input_contents[0]", "12 bytes, but shape [1,3,8,8] of FP32 needs 768"),
    (lambda r, t: r.raw_input_contents.append(np.full(192, np.nan, np.float32).tobytes()),
     "INVALID_ARGUMENT", "raw_input_contents[0]", "NaN or infinite"),
    (lambda r, t: (t.contents.fp32_contents.extend([1.0] * 192),
                   r.raw_input_contents.append(b"\0" * 768)), "INVALID_ARGUMENT",
     "inputs[0].contents", "must be empty when raw_input_contents is given"),
    (lambda r, t: (setattr(t, "datatype", "FP16"), t.contents.fp32_contents.append(1.0)),
     "INVALID_ARGUMENT", "inputs[0].contents", "FP16 has no typed field"),
    (lambda r, t: r.outputs.add(name="logits"), "INVALID_ARGUMENT", "outputs[0].name",
     "unknown output 'logits'"),
    (lambda r, t: setattr(r, "model_version", "2"), "NOT_FOUND", "model_version",
     "has one version, '1'"),
    (lambda r, t: setattr(r, "model_name", ""), "INVALID_ARGUMENT", "model_name", "is empty"),
])
def test_bad_requests_are_refused_naming_the_grpc_field(served: Served, build: Any, code: str,
                                                         field: str, words: str) -> None:
    request = service_pb2.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, *TINY_SHAPE])
    build(request, tensor)
    error = rpc_error(lambda: served.stub().ModelInfer(request, metadata=tuple(auth().items())))
    assert error.code() == getattr(grpc.StatusCode, code), error.details()
    assert error.details().startswith(f"{field}: ") and words in error.details(), error.details()


# ------------------------------------------------------------------------------- refusals, alike
def test_a_wrong_shape_is_refused_alike(served: Served) -> None:
    small = np.zeros((1, 3, 4, 4), np.float32)
    same_refusal(lambda: served.grpc.infer("tiny", inputs(tgrpc, small), headers=auth()),
                 lambda: served.http.infer("tiny", inputs(thttp, small), headers=auth()),
                 "inputs[0].shape: [1,3,4,4] does not match the model's input [N,3,8,8]")


def test_a_datatype_the_model_cannot_take_is_refused_alike(served: Served) -> None:
    text = np.full((1, *TINY_SHAPE), b"a", dtype=object)
    same_refusal(lambda: served.grpc.infer("tiny", inputs(tgrpc, text, "BYTES"), headers=auth()),
                 lambda: served.http.infer("tiny", inputs(thttp, text, "BYTES"), headers=auth()),
                 "inputs[0].datatype: BYTES (strings) is not supported")


def test_an_unknown_model_is_refused_alike(served: Served) -> None:
    x = x_(1, 2)
    same_refusal(lambda: served.grpc.infer("nope", inputs(tgrpc, x), headers=auth()),
                 lambda: served.http.infer("nope", inputs(thttp, x), headers=auth()),
                 "model: no model 'nope' is served here; served: tiny")
    same_refusal(lambda: served.grpc.get_model_metadata("nope"),
                 lambda: served.http.get_model_metadata("nope"), "no model 'nope'")


@pytest.mark.parametrize("key", [None, "not-the-key-0123"])
def test_a_missing_or_wrong_api_key_is_refused_alike(served: Served, key: str | None) -> None:
    x = x_(1, 3)
    g, h = refusals(
        lambda: served.grpc.infer("tiny", inputs(tgrpc, x),
                                  headers={"authorization": f"Bearer {key}"} if key else None),
        lambda: served.http.infer("tiny", inputs(thttp, x),
                                  headers={"Authorization": f"Bearer {key}"} if key else None))
    # the same words, each naming where it carries the key: gRPC metadata, an HTTP header
    assert g.message().startswith("metadata authorization: ")
    assert h.message().startswith("header Authorization: ")
    assert g.message().split(": ", 1)[1].lower() == h.message().split(": ", 1)[1].lower()
    assert ("missing API key" if key is None else "the API key is not valid") in g.message()


def test_grpc_calls_are_counted_in_the_metrics(served: Served) -> None:
    metrics = served.server.app.state.metrics

    def answered(model: str, status: str) -> float:
        return metrics.value("vbs_requests_total", {"model": model, "endpoint": "grpc_infer",
                                                    "status": status})

    ok, refused = answered("tiny", "200"), answered("-", "401")
    samples = metrics.value("vbs_samples_total", {"model": "tiny"})
    served.grpc.infer("tiny", inputs(tgrpc, x_(2, 4)), headers=auth())
    with pytest.raises(InferenceServerException):
        served.grpc.infer("tiny", inputs(tgrpc, x_(1, 4)))
    run(wait_until(lambda: metrics.value("vbs_samples_total", {"model": "tiny"}) >= samples + 2,
                   what="the batch counted"))
    assert (answered("tiny", "200"), answered("-", "401")) == (ok + 1, refused + 1)
    assert served.grpc.is_server_live()
    assert metrics.value("vbs_requests_total", {"model": "-", "endpoint": "grpc",
                                                "status": "200"}) > 0


# ------------------------------------------------------------------------------- not ready, ports
def test_a_loading_model_is_unavailable_with_the_reason(make_settings: Callable[..., Settings],
                                                        closed_redis_url: str) -> None:
    port = free_port()
    app = create_app(make_settings(store=closed_redis_url, grpc_port=port))
    target = f"127.0.0.1:{port}"

    def over_grpc() -> tuple[bool, bool, grpc.RpcError, grpc.RpcError]:
        client = tgrpc.InferenceServerClient(target)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(target))
        request = service_pb2.ModelInferRequest(model_name="tiny")
        request.inputs.add(name="input", datatype="FP32", shape=[1, *TINY_SHAPE])
        request.raw_input_contents.append(x_(1, 5).tobytes())
        return (client.is_server_ready(), client.is_model_ready("tiny"),
                rpc_error(lambda: stub.ModelInfer(request)),
                rpc_error(lambda: stub.ModelMetadata(service_pb2.ModelMetadataRequest(
                    name="tiny"))))

    async def main() -> None:
        async with running(app, wait=False) as client:
            metrics = app.state.metrics
            await wait_until(lambda: metrics.value("vbs_store_errors_total") >= 1,
                             what="a failed try of the store")
            ready, model_ready, infer, meta = await asyncio.to_thread(over_grpc)
            assert not ready and not model_ready
            http = (await client.post("/v2/models/tiny/infer", json={"inputs": [
                {"name": "input", "shape": [1, *TINY_SHAPE], "datatype": "FP32",
                 "data": [0.0] * 192}]})).json()["error"]
            for error in (infer, meta):
                assert error.code() == grpc.StatusCode.UNAVAILABLE
                assert error.details() == http and "still loading" in http
                assert dict(error.trailing_metadata())["retry-after"] == "5"

    run(main())


def test_a_taken_grpc_port_stops_the_start_naming_it(make_settings: Callable[..., Settings]
                                                     ) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        app = create_app(make_settings(grpc_port=port))

        async def main() -> None:
            with pytest.raises(UsageError, match=rf"grpc_port: cannot listen on 127.0.0.1:{port}"):
                async with running(app, wait=False):
                    pass

        run(main())


# ------------------------------------------------------------------------------- vbs loadtest
def test_loadtest_over_grpc(served: Served, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    summary = asyncio.run(run_grpc_loadtest(served.target, "tiny", clients=2, duration_s=0.5,
                                            samples=2, api_key=KEY))
    assert summary["ok"] > 0 and summary["errors"] == 0 and summary["url"].startswith("grpc://")
    assert summary["throughput_samples_per_s"] == pytest.approx(2 * summary["throughput_rps"])
    parts = summary["breakdown_p50_s"]
    assert set(parts) == {"queue", "input", "infer", "output", "rest"} and parts["infer"] > 0
    monkeypatch.setenv("VBS_API_KEY", KEY)
    assert main(["loadtest", "--protocol", "grpc", "--url", served.target, "--model", "tiny",
                 "--clients", "1", "--duration", "0.3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] > 0
    monkeypatch.setenv("VBS_API_KEY", "not-the-key-0123")
    assert main(["loadtest", "--protocol", "grpc", "--url", served.target, "--model", "tiny",
                 "--clients", "1", "--duration", "0.2", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["errors_by_status"].keys() == {"UNAUTHENTICATED"}
    assert main(["loadtest", "--protocol", "grpc", "--url", served.target, "--model", "nope",
                 "--duration", "0.2"]) == 2
    for target in ("10.0.0.1:8001", "example.com:8001", "127.0.0.1", "http://127.0.0.1:8001"):
        with pytest.raises(UsageError, match="--protocol grpc"):
            check_target(target)
    assert check_target("grpc://[::1]:8001") == "[::1]:8001"


class _PlainPeer(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """Another OIP v2 server, as Triton answers: metadata, and outputs without timings."""

    def __init__(self, calls: list[int]) -> None:
        self.calls = calls

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        answer = service_pb2.ModelMetadataResponse(name=request.name, platform="peer")
        answer.inputs.add(name="x", datatype="FP32", shape=[-1, 3, 4])
        return answer

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        samples = int(request.inputs[0].shape[0])
        assert len(request.raw_input_contents[0]) == samples * 3 * 4 * 4
        self.calls.append(samples)
        answer = service_pb2.ModelInferResponse(model_name=request.model_name)
        answer.outputs.add(name="y", datatype="FP32", shape=[samples, 2])
        answer.raw_output_contents.append(bytes(samples * 2 * 4))
        return answer


def test_loadtest_over_grpc_loads_another_servers_oip() -> None:
    """bench/peers.py loads Triton so: answers without vbs-serve's timings count for throughput
    and latency, with no breakdown and no error."""
    calls: list[int] = []

    async def main() -> dict[str, Any]:
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_PlainPeer(calls), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await run_grpc_loadtest(f"127.0.0.1:{port}", "peer", clients=2,
                                           duration_s=0.3, samples=3)
        finally:
            await server.stop(None)

    summary = asyncio.run(main())
    assert summary["ok"] > 0 and summary["errors"] == 0 and set(calls) == {3}
    assert summary["latency_p50_s"] > 0 and summary["requests_by_batch_size"] == {}
    assert all(v is None for v in summary["breakdown_p50_s"].values())


class _Recording:
    """Every method of the service, recording what it was given."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        async def method(request: Any, context: Any) -> Any:
            self.seen[name] = request
            return getattr(service_pb2, f"{name}Response")()
        return method


def test_model_infer_gets_each_request_with_its_size_on_the_wire() -> None:
    """The servicer is registered for every method of the service, and ModelInfer's requests
    come with the bytes they took on the wire (what ByteSize would compute), the others as
    the generated code gives them."""
    from service.grpc_api import add_to_server
    from service.grpc_codec import Received
    from service.oip import pb

    servicer = _Recording()
    request = service_pb2.ModelInferRequest(model_name="tiny", raw_input_contents=[bytes(4000)])
    request.inputs.add(name="x", datatype="FP32", shape=[1, 1000])

    async def main() -> None:
        server = grpc.aio.server()
        add_to_server(servicer, server)  # type: ignore[arg-type]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                await stub.ModelInfer(request)
                await stub.ServerLive(service_pb2.ServerLiveRequest())
                await stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="tiny"))
        finally:
            await server.stop(None)

    asyncio.run(main())
    got = servicer.seen["ModelInfer"]
    assert isinstance(got, Received)
    assert got.wire_bytes == len(request.SerializeToString()) == got.message.ByteSize() > 4000
    assert got.message.SerializeToString() == request.SerializeToString()
    assert isinstance(servicer.seen["ServerLive"], pb.ServerLiveRequest)
    assert servicer.seen["ModelMetadata"].name == "tiny"


# ------------------------------------------------------------------------------- settings, CLI
def test_the_grpc_port_is_a_setting_and_a_documented_flag(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    assert Settings().grpc_port == 8001 and Settings(grpc_port=0).grpc_port == 0
    with pytest.raises(ValueError):
        Settings(grpc_port=70000)
    args = build_parser().parse_args(["serve", "--model", "tiny", "--grpc-port", "9001"])
    assert serve_settings(args).grpc_port == 9001
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--grpc-port GRPC_PORT" in text and "default 8001" in text and "0 serves no gRPC" in text
