"""The compose services' commands, run as local processes against a real redis-server:
`vbs plan` publishes a plan table and exits 0, `vbs serve` loads it, turns ready and answers
inference requests with model(x), over HTTP and over gRPC.

A broken install fails here instead of skipping: the `vbs` console script must be installed
beside this Python and list every subcommand (a module that failed to import is a failure of
`vbs` itself, not a missing subcommand).

Request format: both POST /v2/models/{name}/infer and POST /infer take an Open Inference
Protocol v2 body {"inputs": [{"name", "shape", "datatype": "FP32", "data"}]} (/infer also with
"model": name) and answer {"outputs": [{"shape", "data", ...}]}.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port
from tests.deploy.support import REPO

MODEL = "tests.planner.factories:two_layer"
INPUT_SHAPE = (3, 8, 8)
BATCH_MAX = 4
START_TIMEOUT_S = 120.0  # torch import + model load on a busy 2-core machine; an upper bound


SUBCOMMANDS = ("graph", "profile", "solve", "show", "plan", "bench", "serve", "loadtest")


def vbs_executable() -> str:
    beside = Path(sys.executable).with_name("vbs")
    found = str(beside) if beside.exists() else shutil.which("vbs")
    if found is None:
        pytest.fail(f"the vbs console script is not installed beside {sys.executable}: "
                    "run `pip install -e .` (make setup)")
    return found


def help_of(vbs: str, *sub: str) -> str:
    done = subprocess.run([vbs, *sub, "--help"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, f"vbs {' '.join(sub)} --help failed:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def vbs() -> str:
    return vbs_executable()


def test_vbs_lists_every_subcommand_and_each_has_help(vbs: str) -> None:
    listed = help_of(vbs)
    for sub in SUBCOMMANDS:
        assert sub in listed, f"`vbs --help` does not list {sub}:\n{listed}"
        assert f"usage: vbs {sub}" in help_of(vbs, sub)


def model_flags(weights: Path) -> list[str]:
    return ["--input-shape", ",".join(map(str, INPUT_SHAPE)), "--weights", str(weights)]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The compose services' environment, minus Docker: settings only from the flags below."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VBS_")}
    clean.update(VBS_CACHE_DIR=str(tmp_path / "cache"), VBS_DEVICE="cpu",
                 NUMBA_CACHE_DIR=str(tmp_path / "numba"), MPLCONFIGDIR=str(tmp_path / "mpl"),
                 PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return clean


@pytest.fixture
def model_and_weights(tmp_path: Path) -> tuple[Any, Path]:
    torch = pytest.importorskip("torch")
    from tests.planner.factories import two_layer
    torch.manual_seed(0)
    model = two_layer().eval()
    weights = tmp_path / "two_layer.pt"
    torch.save(model.state_dict(), weights)
    return model, weights


@pytest.fixture
def server() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post_json(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def oip_request(x: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.flatten().tolist()}]}


def check_outputs(answer: Any, expected: Any) -> None:
    """Shape always; values too where both commands load the test's weights (--weights)."""
    torch = pytest.importorskip("torch")
    assert isinstance(answer, dict) and answer.get("outputs"), answer
    out = answer["outputs"][0]
    assert list(out["shape"]) == list(expected.shape)
    got = torch.tensor(out["data"], dtype=torch.float32).reshape(expected.shape)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_plan_then_serve_then_infer(vbs: str, redis_url: str, env: dict[str, str], model_and_weights,
                                    server: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    model, weights = model_and_weights

    # planner service: one-shot, exits 0 after publishing the table
    plan = subprocess.run(
        [vbs, "plan", "--model", MODEL, *model_flags(weights),
         "--batch-max", str(BATCH_MAX), "--store", redis_url],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, f"vbs plan failed:\n{plan.stdout}\n{plan.stderr}"

    # worker service
    port, grpc_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server.append(subprocess.Popen(
            [vbs, "serve", "--model", MODEL, *model_flags(weights),
             "--store", redis_url, "--host", "127.0.0.1", "--port", str(port),
             "--grpc-port", str(grpc_port)],
            env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT))
    process = server[0]
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"vbs serve exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if get(f"{base}/v2/health/ready")[0] == 200:
                break
        except OSError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            pytest.fail(f"vbs serve not ready in {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)  # readiness polling of a starting process

    assert get(f"{base}/v2/health/live")[0] == 200
    status, metrics = get(f"{base}/metrics")
    assert status == 200 and b"# TYPE" in metrics

    torch.manual_seed(1)
    x = torch.randn(BATCH_MAX - 1, *INPUT_SHAPE)
    with torch.no_grad():
        expected = model(x)

    name = urllib.parse.quote(MODEL, safe="")
    status, answer = post_json(f"{base}/v2/models/{name}/infer", oip_request(x))
    assert status == 200, answer
    check_outputs(answer, expected)

    status, answer = post_json(f"{base}/infer", {"model": MODEL, **oip_request(x)})
    assert status == 200, answer
    check_outputs(answer, expected)

    status, _ = get(f"{base}/plan?mem=30MB&batch={BATCH_MAX}")
    assert status == 200, "GET /plan failed"

    # the same model over gRPC, with Triton's client
    tgrpc = pytest.importorskip("tritonclient.grpc")
    with tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
        assert client.is_server_ready() and client.is_model_ready(MODEL)
        tensor = tgrpc.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x.numpy())
        got = torch.from_numpy(client.infer(MODEL, [tensor]).as_numpy("output").copy())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
