"""Every way to send tensors to the tiny model, through uvicorn on a real socket; every output
equals ``model(x)`` computed directly with torch."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from service.main import create_app
from tests.service.conftest import (TINY_SHAPE, ServerThread, assert_close, assert_error,
                                    reference, settings_for)


@pytest.fixture(scope="module")
def server(vbs_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = settings_for(vbs_cache, tmp_path_factory.mktemp("formats") / "store")
    with ServerThread(create_app(settings)) as started:
        yield started


@pytest.fixture
def entry(server: ServerThread):  # type: ignore[no-untyped-def]
    return server.app.state.registry.entries["tiny"]


def samples(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *TINY_SHAPE)).astype(np.float32)


def npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x)
    return buf.getvalue()


def check_run(body: dict, n: int) -> None:
    """The response names the plan and the time queued and running."""
    assert body["model"] == "tiny" and body["samples"] == n
    plan = body["plan"]
    assert set(plan) >= {"batch", "budget_bytes", "plan_id", "predicted_time_s", "peak_bytes"}
    assert 1 <= plan["batch"] <= 4 and plan["peak_bytes"] <= plan["budget_bytes"]
    assert len(plan["plan_id"]) == 16 and plan["predicted_time_s"] > 0
    assert body["batch"] >= n and body["table_version"] == 1
    timing = body["timing"]  # perf_analyzer's breakdown: queue, compute input/infer/output
    assert set(timing) == {"queue_s", "input_s", "infer_s", "output_s", "run_s",
                           "load_wait_s"}  # waiting for its model to load: 0, loaded
    assert all(v >= 0 for v in timing.values()) and timing["run_s"] > 0
    assert 0 < timing["infer_s"] <= timing["run_s"]


def test_json_nested_samples(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    x = samples(3)
    r = client.post("/infer", json={"inputs": x.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    check_run(body, 3)
    assert body["output_shape"] == [3, 4, 8, 8]
    assert_close(body["outputs"], reference(entry, x))


def test_json_one_sample_without_batch_dim_and_named_model(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    x = samples(1, seed=1)
    r = client.post("/infer", json={"inputs": x[0].tolist(), "model": "tiny"})
    assert r.status_code == 200, r.text
    assert_close(r.json()["outputs"], reference(entry, x))
    r = client.post("/infer?model=tiny", json={"inputs": x.tolist()})
    assert_close(r.json()["outputs"], reference(entry, x))


@pytest.mark.parametrize("shape", [[2, 3, 8, 8], [3, 8, 8], [-1, 3, 8, 8]])
def test_json_flat_with_shape(client: httpx.Client, entry, shape: list[int]) -> None:  # type: ignore[no-untyped-def]
    x = samples(2, seed=2)
    r = client.post("/infer", json={"inputs": x.ravel().tolist(), "shape": shape})
    assert r.status_code == 200, r.text
    assert_close(r.json()["outputs"], reference(entry, x))


@pytest.mark.parametrize("dtype", ["float64", "float16", "uint8", "int32"])
def test_json_dtypes(client: httpx.Client, entry, dtype: str) -> None:  # type: ignore[no-untyped-def]
    x = (samples(2, seed=3) * 10).astype(dtype)
    r = client.post("/infer", json={"inputs": x.tolist(), "dtype": dtype})
    assert r.status_code == 200, r.text
    assert_close(r.json()["outputs"], reference(entry, x.astype(np.float32)))


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f8", "|u1"])
def test_npy(client: httpx.Client, entry, dtype: str) -> None:  # type: ignore[no-untyped-def]
    x = (samples(3, seed=4) * 5).astype(dtype)
    r = client.post("/infer", content=npy(x), headers={"Content-Type": "application/x-npy"})
    assert r.status_code == 200, r.text
    check_run(r.json(), 3)
    assert_close(r.json()["outputs"], reference(entry, x.astype(np.float32)))


def test_npy_one_sample(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    x = samples(1, seed=5)
    r = client.post("/infer", content=npy(x[0]), headers={"Content-Type": "application/x-npy"})
    assert_close(r.json()["outputs"], reference(entry, x))


def test_octet_stream_with_query_header_or_no_shape(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    x = samples(2, seed=6)
    want = reference(entry, x)
    raw = {"Content-Type": "application/octet-stream"}
    r = client.post("/infer?shape=2,3,8,8&dtype=float32", content=x.tobytes(), headers=raw)
    assert r.status_code == 200, r.text
    assert_close(r.json()["outputs"], want)
    r = client.post("/infer", content=x.astype("<f8").tobytes(),
                    headers={**raw, "X-Tensor-Shape": "2x3x8x8", "X-Tensor-Dtype": "float64"})
    assert r.status_code == 200, r.text
    assert_close(r.json()["outputs"], want)
    r = client.post("/infer", content=x.tobytes(), headers=raw)  # samples counted from the length
    assert r.status_code == 200, r.text
    assert r.json()["samples"] == 2
    assert_close(r.json()["outputs"], want)


def test_more_samples_than_batch_max_are_split(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    x = samples(7, seed=7)
    r = client.post("/infer", json={"inputs": x.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["splits"] >= 1 and sum(p["batch"] for p in body["plans"]) == 7
    assert all(p["batch"] <= 4 for p in body["plans"])
    assert_close(body["outputs"], reference(entry, x))


def test_image_for_a_model_without_weights_is_resized(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    pixels = np.random.default_rng(8).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    r = client.post("/infer", content=buf.getvalue(), headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text
    assert r.json()["output_shape"] == [1, 4, 8, 8]
    # the same image as a 3x8x8 tensor in [0, 1]: resized (bilinear, antialiased: Pillow's, as
    # torchvision resizes a Pillow image), then / 255
    from torchvision.transforms import functional as F
    resized = np.asarray(F.resize(Image.fromarray(pixels), [8, 8]), dtype=np.float32)
    x = (resized / 255).transpose(2, 0, 1)[None]
    assert_close(r.json()["outputs"], reference(entry, x))


# -- Open Inference Protocol v2 -------------------------------------------------------------


def test_v2_json_any_input_name(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    x = samples(2, seed=9)
    request = {"id": "r-1", "inputs": [{"name": "whatever", "shape": [2, 3, 8, 8],
                                        "datatype": "FP32", "data": x.ravel().tolist()}]}
    r = client.post("/v2/models/tiny/infer", json=request)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == "tiny" and body["id"] == "r-1"
    (out,) = body["outputs"]
    assert out["name"] == "output" and out["datatype"] == "FP32" and out["shape"] == [2, 4, 8, 8]
    assert_close(np.reshape(out["data"], out["shape"]), reference(entry, x))
    params = body["parameters"]
    assert set(params) >= {"plan_id", "budget_bytes", "predicted_time_s", "queue_s", "run_s",
                           "batch", "table_version"}
    # nested data and an integer datatype are read too
    request["inputs"][0].update(data=(x * 10).astype(np.int64).tolist(), datatype="INT64")
    r = client.post("/v2/models/tiny/infer", json=request)
    assert r.status_code == 200, r.text
    want = reference(entry, (x * 10).astype(np.int64).astype(np.float32))
    assert_close(np.reshape(r.json()["outputs"][0]["data"], (2, 4, 8, 8)), want)


def binary_request(x: np.ndarray, datatype: str = "FP32", binary_out: bool = True) -> tuple[bytes, dict]:
    head = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": datatype,
                        "parameters": {"binary_data_size": x.nbytes}}],
            "outputs": [{"name": "output", "parameters": {"binary_data": binary_out}}]}
    header = json.dumps(head).encode()
    return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header)),
                                  "Content-Type": "application/octet-stream"}


def parse_binary_response(r: httpx.Response) -> tuple[dict, np.ndarray]:
    n = int(r.headers["Inference-Header-Content-Length"])
    head = json.loads(r.content[:n])
    (out,) = head["outputs"]
    assert out["datatype"] == "FP32"
    assert out["parameters"]["binary_data_size"] == len(r.content) - n
    return head, np.frombuffer(r.content[n:], dtype="<f4").reshape(out["shape"])


def test_v2_binary_tensors_in_and_out(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    x = samples(3, seed=10)
    body, headers = binary_request(x)
    r = client.post("/v2/models/tiny/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    head, y = parse_binary_response(r)
    assert head["model_name"] == "tiny"
    assert_close(y, reference(entry, x))
    # FP16 in, JSON out
    half = x.astype("<f2")
    body, headers = binary_request(half, "FP16", binary_out=False)
    r = client.post("/v2/models/tiny/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert_close(np.reshape(r.json()["outputs"][0]["data"], (3, 4, 8, 8)),
                 reference(entry, half.astype(np.float32)))


def test_v2_json_in_binary_out(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    x = samples(1, seed=11)
    r = client.post("/v2/models/tiny/infer", json={
        "inputs": [{"name": "input", "shape": [1, 3, 8, 8], "datatype": "FP32",
                    "data": x.ravel().tolist()}],
        "parameters": {"binary_data_output": True}})
    assert r.status_code == 200, r.text
    _, y = parse_binary_response(r)
    assert_close(y, reference(entry, x))


def test_v2_metadata_health_and_server(client: httpx.Client) -> None:
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").status_code == 200
    assert client.get("/health/live").status_code == 200
    assert client.get("/health/ready").json()["models"] == {"tiny": "ready"}
    server = client.get("/v2").json()
    assert server["name"] == "vbs-serve" and "binary_tensor_data" in server["extensions"]
    meta = client.get("/v2/models/tiny").json()
    assert meta["name"] == "tiny"
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 8, 8]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 4, 8, 8]}]
    assert client.get("/v2/models/tiny/ready").json() == {"name": "tiny", "ready": True}
    assert_error(client.get("/v2/models/nope/ready"), 404, "nope")
    assert_error(client.get("/v2/models/nope"), 404, "nope")


def test_v2_model_config_as_triton_writes_it(client: httpx.Client) -> None:
    """What Triton's tools read of a model (perf_analyzer: the largest batch, the inputs'
    dims without the batch dimension and their data type), in Triton's field names."""
    assert "model_configuration" in client.get("/v2").json()["extensions"]
    config = client.get("/v2/models/tiny/config").json()
    assert config["name"] == "tiny" and config["max_batch_size"] == 4
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32",
                                "format": "FORMAT_NONE", "dims": [3, 8, 8]}]
    assert config["output"] == [{"name": "output", "data_type": "TYPE_FP32", "dims": [4, 8, 8]}]
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] >= 0
    assert_error(client.get("/v2/models/nope/config"), 404, "nope")


def test_models_docs_and_openapi(client: httpx.Client) -> None:
    (model,) = client.get("/models").json()["models"]
    assert model["name"] == "tiny" and model["state"] == "ready"
    assert model["input_shape"] == [3, 8, 8] and model["batch_max"] == 4
    assert model["table"]["version"] == 1 and model["table"]["solver"] == "vbs"
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/infer", "/v2/models/{name}/infer", "/plan", "/models", "/metrics",
                 "/v2/health/ready", "/v2/models/{name}"):
        assert path in paths
    assert client.get("/docs").status_code == 200
    assert_error(client.get("/no/such/endpoint"), 404, "/no/such/endpoint")
    # the inference routes declare only the request: what they read is documented all the same
    infer = paths["/infer"]["post"]
    params = {p["name"]: p for p in infer["parameters"]}
    assert set(params) == {"model", "top_k", "shape", "dtype"}
    assert all(p["in"] == "query" and not p["required"] for p in params.values())
    assert {"type": "integer", "minimum": 1} in params["top_k"]["schema"]["anyOf"]
    v2 = paths["/v2/models/{name}/infer"]["post"]
    assert [(p["name"], p["in"]) for p in v2["parameters"]] == [("name", "path")]
    for operation in (infer, v2, paths["/plan"]["get"]):
        assert operation["security"] == [{"HTTPBearer": []}]


def test_metrics_count_requests_batches_and_memory(client: httpx.Client) -> None:
    x = samples(2, seed=12)
    assert client.post("/infer", json={"inputs": x.tolist()}).status_code == 200
    assert client.post("/infer", json={"inputs": []}).status_code == 400
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text

    def value(line_start: str) -> float:
        found = [ln for ln in text.splitlines() if ln.startswith(line_start)]
        assert found, line_start
        return float(found[0].rsplit(" ", 1)[1])

    assert value('vbs_requests_total{endpoint="infer",model="tiny",status="200"}') >= 1
    assert value('vbs_requests_total{endpoint="infer",model="tiny",status="400"}') >= 1
    assert value('vbs_request_latency_seconds_count{endpoint="infer",model="tiny"}') >= 2
    assert value('vbs_queue_time_seconds_count{model="tiny"}') >= 1
    assert value('vbs_batch_size_count{model="tiny"}') >= 1
    assert value('vbs_free_memory_bytes{model="tiny"}') > 0
    assert value('vbs_plan_peak_bytes{model="tiny"}') > 0
    assert value('vbs_plan_choice_seconds_count{model="tiny"}') >= 1
    requests = value('vbs_queue_time_seconds_count{model="tiny"}')
    for part in ("receive", "compute_input", "compute_infer", "compute_output", "server_overhead"):
        assert value(f'vbs_{part}_seconds_count{{model="tiny"}}') == requests, part
    assert value('vbs_receive_seconds_sum{model="tiny"}') > 0  # the bodies were read and timed
    assert value('vbs_model_ready{model="tiny"}') == 1
    assert value("vbs_store_errors_total") == 0
    for name in ("vbs_oom_retries_total", "vbs_table_reloads_total"):
        assert f"# TYPE {name} counter" in text


def test_an_oip_body_on_infer_is_answered_in_kind(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    x = samples(2, seed=13)
    request = {"model": "tiny", "inputs": [{"name": "input", "shape": [2, 3, 8, 8],
                                            "datatype": "FP32", "data": x.ravel().tolist()}]}
    r = client.post("/infer", json=request)
    assert r.status_code == 200, r.text
    (out,) = r.json()["outputs"]
    assert out["shape"] == [2, 4, 8, 8]
    assert_close(np.reshape(out["data"], out["shape"]), reference(entry, x))
    assert "plan_id" in r.json()["parameters"]


def test_served_weights_are_loaded(make_settings, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import torch

    from tests.planner.factories import two_layer
    from tests.service.conftest import run, running

    torch.manual_seed(123)
    model = two_layer().eval()
    weights = tmp_path / "two_layer.pt"
    torch.save(model.state_dict(), weights)
    app = create_app(make_settings(weights=weights))

    async def main() -> None:
        async with running(app) as c:
            x = samples(3, seed=14)
            r = await c.post("/infer", json={"inputs": x.tolist()})
            assert r.status_code == 200, r.text
            with torch.no_grad():
                want = model(torch.from_numpy(x)).numpy()
            assert_close(r.json()["outputs"], want)

    run(main())
