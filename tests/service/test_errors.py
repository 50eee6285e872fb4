"""Every bad input gets a 4xx with a JSON body naming the field and the problem; no client
input causes a 5xx; nothing from a request is unpickled."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from service.main import create_app
from tests.service.conftest import TINY, ServerThread, assert_error, settings_for

TINY2 = "tiny2=tests.planner.factories:two_layer@3x8x8"
MAX_BODY = 100_000
MAX_JSON = 20_000  # JSON has its own, smaller limit
MAX_SAMPLES = 8
TRIPPED: list[str] = []


def _tripwire() -> object:
    TRIPPED.append("unpickled")
    return object()


class Canary:
    """Unpickling this calls _tripwire: the test fails if the service ever unpickles."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_tripwire, ())


@pytest.fixture(scope="module")
def server(vbs_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = settings_for(vbs_cache, tmp_path_factory.mktemp("errors") / "store",
                            models=[TINY, TINY2], max_body_bytes=MAX_BODY, max_json_bytes=MAX_JSON,
                            max_samples_per_request=MAX_SAMPLES, max_image_pixels=10_000)
    with ServerThread(create_app(settings)) as started:
        yield started


def x_(n: int = 1, shape: tuple[int, ...] = (3, 8, 8)) -> np.ndarray:
    return np.ones((n, *shape), dtype=np.float32)


def npy(x: np.ndarray, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x, **kwargs)
    return buf.getvalue()


def png(width: int = 10, height: int = 10) -> bytes:
    buf = io.BytesIO()
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def form_without_files() -> dict[str, Any]:
    body = (b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\ntiny\r\n--zz--\r\n')
    return {"content": body, "headers": {"Content-Type": "multipart/form-data; boundary=zz"}}


NPY = {"Content-Type": "application/x-npy"}
RAW = {"Content-Type": "application/octet-stream"}
JSON_CT = {"Content-Type": "application/json"}
INFER = "/infer?model=tiny"
V2 = "/v2/models/tiny/infer"


def v2_input(**change: Any) -> dict[str, Any]:
    item = {"name": "input", "shape": [1, 3, 8, 8], "datatype": "FP32",
            "data": x_().ravel().tolist()}
    item.update(change)
    return {"inputs": [item]}


def binary(head: dict[str, Any], payload: bytes, length: str | None = None) -> dict[str, Any]:
    header = json.dumps(head).encode()
    return {"content": header + payload,
            "headers": {"Inference-Header-Content-Length": length or str(len(header)), **RAW}}


def nested(depth: int) -> bytes:
    return b"{\"inputs\": " + b"[" * depth + b"]" * depth + b"}"


CASES = [
    # /infer JSON
    ("malformed-json", INFER, {"content": b'{"inputs": [1, 2', "headers": JSON_CT}, 400, ["body", "malformed JSON"]),
    ("json-not-object", INFER, {"json": [1, 2]}, 400, ["body", "JSON object"]),
    ("json-not-utf8", INFER, {"content": b'{"inputs": "\xff\xfe"}', "headers": JSON_CT}, 400, ["body", "UTF-8"]),
    ("json-empty-body", INFER, {"content": b"", "headers": JSON_CT}, 400, ["body", "empty"]),
    ("json-too-deep", INFER, {"content": nested(MAX_JSON // 2 - 10), "headers": JSON_CT}, 400, ["body"]),
    ("inputs-missing", INFER, {"json": {}}, 400, ["inputs", "missing"]),
    ("unknown-field", INFER, {"json": {"inputs": [[1]], "input": 1}}, 400, ["input", "unknown field"]),
    ("inputs-not-list", INFER, {"json": {"inputs": "abc"}}, 400, ["inputs", "list"]),
    ("inputs-strings", INFER, {"json": {"inputs": [["a", "b"]]}}, 400, ["inputs", "numbers"]),
    ("inputs-ragged", INFER, {"json": {"inputs": [[1, 2], [1]]}}, 400, ["inputs"]),
    ("inputs-objects", INFER, {"json": {"inputs": [{"a": 1}]}}, 400, ["inputs"]),
    ("inputs-empty", INFER, {"json": {"inputs": []}}, 400, ["inputs"]),
    ("wrong-shape", INFER, {"json": {"inputs": x_(2, (3, 9, 9)).tolist()}}, 400, ["inputs", "[2,3,9,9]", "[N,3,8,8]"]),
    ("wrong-rank", INFER, {"json": {"inputs": x_(1, (3, 8)).tolist()}}, 400, ["inputs", "[N,3,8,8]"]),
    ("bad-dtype", INFER, {"json": {"inputs": x_().tolist(), "dtype": "complex64"}}, 400, ["dtype", "complex64"]),
    ("dtype-not-string", INFER, {"json": {"inputs": x_().tolist(), "dtype": 5}}, 400, ["dtype"]),
    ("int-dtype-fraction", INFER, {"json": {"inputs": (x_() / 2).tolist(), "dtype": "int32"}}, 400, ["inputs", "whole numbers"]),
    ("uint8-overflow", INFER, {"json": {"inputs": (x_() * 300).tolist(), "dtype": "uint8"}}, 400, ["inputs", "uint8"]),
    ("nan", INFER, {"content": json.dumps({"inputs": np.full((1, 3, 8, 8), np.nan).tolist()}).encode(), "headers": JSON_CT}, 400, ["inputs", "NaN"]),
    ("huge-int", INFER, {"json": {"inputs": [[[[10**40] * 8] * 8] * 3]}}, 400, ["inputs"]),
    ("flat-wrong-count", INFER, {"json": {"inputs": [1.0] * 10, "shape": [2, 3, 8, 8]}}, 400, ["inputs", "10 values"]),
    ("shape-not-list", INFER, {"json": {"inputs": [1.0], "shape": "abc"}}, 400, ["shape"]),
    ("model-not-string", "/infer", {"json": {"inputs": x_().tolist(), "model": 5}}, 400, ["model"]),
    ("unknown-model", "/infer?model=nope", {"json": {"inputs": x_().tolist()}}, 404, ["model", "nope", "tiny"]),
    ("model-mismatch", "/infer?model=tiny", {"json": {"inputs": x_().tolist(), "model": "tiny2"}}, 400, ["model", "tiny2"]),
    ("model-missing", "/infer", {"json": {"inputs": x_().tolist()}}, 400, ["model", "?model="]),
    ("too-many-samples", INFER, {"json": {"inputs": x_(MAX_SAMPLES + 1).tolist()}}, 413, ["inputs", "max_samples_per_request"]),
    ("body-too-large", INFER, {"content": b" " * (MAX_BODY + 1), "headers": NPY}, 413, ["body", "max_body_bytes"]),
    ("json-too-large", INFER, {"content": b" " * (MAX_JSON + 1), "headers": JSON_CT}, 413, ["body", f"{MAX_JSON}", "max_json_bytes", "application/x-npy", "OIP v2 binary"]),
    ("json-no-type-too-large", INFER, {"content": b" " * (MAX_JSON + 1)}, 413, ["body", "max_json_bytes"]),
    ("json-streamed-too-large", INFER, {"content": iter([b" " * 15_000] * 2), "headers": JSON_CT}, 413, ["body", "max_json_bytes"]),
    ("v2-json-too-large", "/v2/models/tiny/infer", {"content": b" " * (MAX_JSON + 1), "headers": JSON_CT}, 413, ["body", "max_json_bytes"]),
    ("npy-over-json-limit", INFER, {"content": b"x" * (MAX_JSON + 1), "headers": NPY}, 400, ["body", ".npy"]),
    ("top-k-not-classifier", INFER + "&top_k=3", {"json": {"inputs": x_().tolist()}}, 400, ["top_k", "classifier"]),
    ("top-k-zero", INFER + "&top_k=0", {"json": {"inputs": x_().tolist()}}, 400, ["top_k"]),
    ("top-k-text", INFER + "&top_k=abc", {"json": {"inputs": x_().tolist()}}, 400, ["top_k"]),
    ("top-k-body", INFER, {"json": {"inputs": x_().tolist(), "top_k": "many"}}, 400, ["top_k"]),
    ("content-type", INFER, {"content": b"hello", "headers": {"Content-Type": "text/plain"}}, 415, ["Content-Type", "text/plain"]),
    # .npy
    ("npy-garbage", INFER, {"content": b"not a numpy file at all", "headers": NPY}, 400, ["body", ".npy"]),
    ("npy-pickle", INFER, {"content": npy(np.array([Canary()], dtype=object), allow_pickle=True), "headers": NPY}, 400, ["body", "never unpickled"]),
    ("npz", INFER, {"content": b"PK\x03\x04" + b"\x00" * 100, "headers": NPY}, 400, ["body", ".npy"]),
    ("npy-lying-header", INFER, {"content": npy(x_())[:128] + b"\x00" * 16, "headers": NPY}, 400, ["body", "bytes follow"]),
    ("npy-huge-header", INFER, {"content": npy(x_()).replace(b"(1, 3, 8, 8)", b"(10**9,3,8,8)"), "headers": NPY}, 400, ["body"]),
    ("npy-wrong-shape", INFER, {"content": npy(x_(2, (3, 4, 4))), "headers": NPY}, 400, ["body", "[N,3,8,8]"]),
    ("npy-strings", INFER, {"content": npy(np.array(["abc"])), "headers": NPY}, 400, ["body", "numeric"]),
    ("npy-structured", INFER, {"content": npy(np.zeros(2, dtype=[("a", "f4"), ("b", "i4")])), "headers": NPY}, 400, ["body", "numeric"]),
    ("npy-complex", INFER, {"content": npy(np.zeros((1, 3, 8, 8), dtype=np.complex64)), "headers": NPY}, 400, ["body", "numeric"]),
    ("npy-too-many", INFER, {"content": npy(x_(MAX_SAMPLES + 1)), "headers": NPY}, 413, ["body", "max_samples_per_request"]),
    # raw bytes
    ("raw-length", INFER, {"content": b"\x00" * 10, "headers": RAW}, 400, ["body", "768 bytes each"]),
    ("raw-empty", INFER, {"content": b"", "headers": RAW}, 400, ["body"]),
    ("raw-bad-shape", INFER + "&shape=a,b", {"content": x_().tobytes(), "headers": RAW}, 400, ["shape", "a,b"]),
    ("raw-bad-dtype", INFER + "&dtype=str", {"content": x_().tobytes(), "headers": RAW}, 400, ["dtype", "str"]),
    ("raw-shape-vs-length", INFER + "&shape=2,3,8,8", {"content": x_().tobytes(), "headers": RAW}, 400, ["body", "needs 1536"]),
    ("raw-wrong-shape", INFER + "&shape=1,3,16,4", {"content": x_().tobytes(), "headers": RAW}, 400, ["body", "[N,3,8,8]"]),
    ("raw-inf", INFER, {"content": np.full((1, 3, 8, 8), np.inf, np.float32).tobytes(), "headers": RAW}, 400, ["body", "infinite"]),
    # finite as float64, infinite as the model's float32: checked as the model would see it
    ("npy-float64-overflows", INFER, {"content": npy(np.full((1, 3, 8, 8), 1e39)), "headers": NPY}, 400, ["body", "infinite"]),
    # images
    ("image-not-image", INFER, {"files": {"file": ("notes.txt", b"just text", "text/plain")}}, 400, ["files[0]", "notes.txt", "JPEG or PNG"]),
    ("image-truncated", INFER, {"files": [("a", ("ok.png", png(), "image/png")), ("b", ("bad.png", png(40, 40)[:300], "image/png"))]}, 400, ["files[1]", "bad.png"]),
    ("image-gif", INFER, {"files": {"file": ("x.gif", b"GIF89a" + b"\x00" * 40, "image/gif")}}, 400, ["files[0]"]),
    ("image-none", INFER, form_without_files(), 400, ["files", "no image"]),
    ("image-unknown-field", INFER, {"data": {"color": "red"}, "files": {"file": ("a.png", png(), "image/png")}}, 400, ["form field", "color"]),
    ("image-too-large", INFER, {"files": {"file": ("big.png", png(200, 100), "image/png")}}, 413, ["files[0]", "max_image_pixels"]),
    ("image-empty", INFER, {"files": {"file": ("e.png", b"", "image/png")}}, 400, ["files[0]", "empty"]),
    ("multipart-malformed", INFER, {"content": b"--x\r\nnonsense", "headers": {"Content-Type": "multipart/form-data"}}, 400, ["body", "multipart"]),
    ("form-field-too-long", INFER, {"data": {"model": "m" * 70_000}, "files": {"file": ("a.png", png(), "image/png")}}, 400, ["body", "multipart", "maximum size"]),
    ("image-body-garbage", INFER, {"content": b"\x89PNG garbage", "headers": {"Content-Type": "image/png"}}, 400, ["body", "PNG"]),
    ("image-too-many", INFER, {"files": [("f", (f"{i}.png", png(), "image/png")) for i in range(MAX_SAMPLES + 1)]}, 413, ["max_samples_per_request"]),
    # Open Inference Protocol v2
    ("v2-malformed", V2, {"content": b"{", "headers": JSON_CT}, 400, ["body", "malformed JSON"]),
    ("v2-no-inputs", V2, {"json": {"id": "x"}}, 400, ["inputs", "missing"]),
    ("v2-empty-inputs", V2, {"json": {"inputs": []}}, 400, ["inputs"]),
    ("v2-unknown-key", V2, {"json": {**v2_input(), "extra": 1}}, 400, ["extra", "unknown field"]),
    ("v2-input-not-object", V2, {"json": {"inputs": [5]}}, 400, ["inputs[0]", "object"]),
    ("v2-name-type", V2, {"json": v2_input(name=5)}, 400, ["inputs[0].name"]),
    ("v2-datatype", V2, {"json": v2_input(datatype="FP33")}, 400, ["inputs[0].datatype", "FP33"]),
    ("v2-bytes", V2, {"json": v2_input(datatype="BYTES")}, 400, ["inputs[0].datatype", "BYTES"]),
    ("v2-shape", V2, {"json": v2_input(shape=[1, 3, 9, 9])}, 400, ["inputs[0].shape", "[1,3,9,9]", "[N,3,8,8]"]),
    ("v2-shape-negative", V2, {"json": v2_input(shape=[-1, 3, 8, 8])}, 400, ["inputs[0].shape"]),
    ("v2-data-length", V2, {"json": v2_input(data=[1.0] * 5)}, 400, ["inputs[0].data", "5 values", "192"]),
    ("v2-data-missing", V2, {"json": {"inputs": [{"name": "a", "shape": [1, 3, 8, 8], "datatype": "FP32"}]}}, 400, ["inputs[0].data"]),
    ("v2-data-strings", V2, {"json": v2_input(data=["a"] * 192)}, 400, ["inputs[0].data"]),
    ("v2-bool-for-float", V2, {"json": v2_input(datatype="BOOL")}, 400, ["inputs[0].data", "true/false"]),
    ("v2-two-inputs", V2, {"json": {"inputs": v2_input()["inputs"] * 2}}, 400, ["inputs", "takes one"]),
    ("v2-output-name", V2, {"json": {**v2_input(), "outputs": [{"name": "logits"}]}}, 400, ["outputs[0].name", "logits"]),
    ("v2-output-flag", V2, {"json": {**v2_input(), "outputs": [{"name": "output", "parameters": {"binary_data": "yes"}}]}}, 400, ["outputs[0].parameters.binary_data"]),
    ("v2-binary-output-flag", V2, {"json": {**v2_input(), "parameters": {"binary_data_output": 1}}}, 400, ["parameters.binary_data_output"]),
    ("v2-too-many", V2, {"json": v2_input(shape=[MAX_SAMPLES + 1, 3, 8, 8], data=x_(MAX_SAMPLES + 1).ravel().tolist())}, 413, ["max_samples_per_request"]),
    ("v2-header-length", V2, binary({"inputs": []}, b"", length="abc"), 400, ["Inference-Header-Content-Length"]),
    ("v2-header-too-long", V2, binary({"inputs": []}, b"", length="99999"), 400, ["Inference-Header-Content-Length"]),
    ("v2-binary-size", V2, binary({"inputs": [{"name": "a", "shape": [1, 3, 8, 8], "datatype": "FP32", "parameters": {"binary_data_size": 100}}]}, b"\x00" * 100), 400, ["binary_data_size", "768"]),
    ("v2-binary-short", V2, binary({"inputs": [{"name": "a", "shape": [1, 3, 8, 8], "datatype": "FP32", "parameters": {"binary_data_size": 768}}]}, b"\x00" * 10), 400, ["binary_data_size"]),
    ("v2-binary-extra", V2, binary({"inputs": [{"name": "a", "shape": [1, 3, 8, 8], "datatype": "FP32", "parameters": {"binary_data_size": 768}}]}, b"\x00" * 800), 400, ["body", "32 bytes"]),
    ("v2-binary-no-header", V2, {"json": {"inputs": [{"name": "a", "shape": [1, 3, 8, 8], "datatype": "FP32", "parameters": {"binary_data_size": 768}}]}}, 400, ["binary_data_size", "Inference-Header-Content-Length"]),
    ("v2-unknown-model", "/v2/models/nope/infer", {"json": v2_input()}, 404, ["nope"]),
]


@pytest.mark.parametrize("path,kwargs,status,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_naming_the_field(client: httpx.Client, path: str, kwargs: dict[str, Any],
                                             status: int, words: list[str]) -> None:
    response = client.post(path, **kwargs)
    assert_error(response, status, *words)
    assert not TRIPPED


def test_a_pickled_npy_is_never_unpickled(client: httpx.Client) -> None:
    body = npy(np.array([Canary(), Canary()], dtype=object), allow_pickle=True)
    for path in (INFER, INFER + "&shape=1"):
        assert client.post(path, content=body, headers=NPY).status_code == 400
    assert not TRIPPED


def test_garbage_never_causes_a_5xx(client: httpx.Client) -> None:
    rng = np.random.default_rng(0)
    kinds = ["application/json", "application/x-npy", "application/octet-stream", "image/png",
             "image/jpeg", "multipart/form-data; boundary=zz", "", "application/xml"]
    for i in range(60):
        body = rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes()
        if i % 3 == 0:  # mostly-valid prefixes reach the deeper decoders
            body = [npy(x_())[:100], b'{"inputs": [[[', png()[:80], b"--zz\r\n"][i % 4] + body
        headers = {"Content-Type": kinds[i % len(kinds)]} if kinds[i % len(kinds)] else {}
        for path in (INFER, V2):
            extra = {"Inference-Header-Content-Length": str(i)} if path == V2 and i % 2 else {}
            response = client.post(path, content=body, headers={**headers, **extra})
            assert 400 <= response.status_code < 500, (i, path, response.status_code, response.text)
            assert "error" in response.json()
    assert not TRIPPED
