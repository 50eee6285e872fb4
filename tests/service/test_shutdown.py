"""Graceful shutdown of a real `vbs serve` process: SIGTERM while clients are sending, over
HTTP and gRPC.

The model's batches are held by a gate file (``tests.planner.factories:gated_two_layer``) so
that requests are provably inside the server (one running, the rest queued, read from
/metrics) when SIGTERM arrives. Then: new requests are turned away (HTTP: 503, or the
connection refused once the listener is closed; gRPC: UNAVAILABLE), every request accepted
before the signal is answered with model(x) (HTTP 200, gRPC OK), and the process shuts down
cleanly within its grace period (request timeout + 5 s). Twice: each batch whole on the
model's thread (the CPU's default), and pipelined (``VBS_PIPELINE=on``: issued there, finished
on the finisher's thread), whose two stages both drain.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from tests.conftest import free_port
from tests.planner.factories import GATE_FILE_ENV, gated_two_layer

MODEL = "tests.planner.factories:gated_two_layer"
SHAPE = (3, 8, 8)
CLIENTS = 6       # over HTTP
GRPC_CLIENTS = 3  # over gRPC
REQUEST_TIMEOUT_S = 20
GRACE_S = REQUEST_TIMEOUT_S + 5  # what `vbs serve` gives uvicorn (service/cli.py)
START_TIMEOUT_S = 180.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["auto", "on"], ids=["whole", "pipelined"])
def server(tmp_path: Path, request: pytest.FixtureRequest
           ) -> Iterator[tuple[subprocess.Popen[bytes], str, Path, Path, str]]:
    torch.manual_seed(0)
    weights = tmp_path / "weights.pt"
    torch.save(gated_two_layer().state_dict(), weights)
    gate = tmp_path / "gate"
    port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VBS_")}
    # torch runs the units: the gate is a Python side effect, which an ONNX export drops
    env.update({GATE_FILE_ENV: str(gate), "VBS_CACHE_DIR": str(tmp_path / "cache"),
                "VBS_RUNTIME": "torch", "VBS_PIPELINE": request.param,
                "VBS_PROFILE_REPEATS": "1", "VBS_PROFILE_WARMUP": "0", "VBS_SLOT_COUNT": "64",
                "NUMBA_CACHE_DIR": str(tmp_path / "numba"),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))})
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "service.commands", "serve", "--model", MODEL,
             "--input-shape", ",".join(map(str, SHAPE)), "--weights", str(weights),
             "--batch-max", "4", "--store", str(tmp_path / "store"), "--host", "127.0.0.1",
             "--port", str(port), "--grpc-port", str(grpc_port),
             "--request-timeout", str(REQUEST_TIMEOUT_S),
             "--max-batch-delay-ms", "0"],
            env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process, f"http://127.0.0.1:{port}", gate, log, f"127.0.0.1:{grpc_port}"
    finally:
        gate.unlink(missing_ok=True)
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def wait_ready(process: subprocess.Popen[bytes], base: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with httpx.Client(base_url=base, timeout=5) as client:
        while True:
            if process.poll() is not None:
                pytest.fail(f"vbs serve exited {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if client.get("/v2/health/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                pytest.fail(f"not ready in {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)  # readiness polling of a starting process


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_sigterm_answers_accepted_requests_refuses_new_ones_and_exits_in_time(server) -> None:
    process, base, gate, log, target = server
    wait_ready(process, base, log)
    gate.touch()  # from now on batches wait in the model
    inputs = [np.random.default_rng(i).standard_normal((1, *SHAPE)).astype(np.float32)
              for i in range(CLIENTS + GRPC_CLIENTS)]
    answers: dict[int, Any] = {}

    def client(i: int) -> None:
        with httpx.Client(base_url=base, timeout=GRACE_S + 30) as c:
            try:
                answers[i] = c.post("/infer", json={"inputs": inputs[i].tolist()})
            except httpx.HTTPError as exc:
                answers[i] = exc

    def grpc_client(i: int) -> None:
        tensor = tgrpc.InferInput("input", list(inputs[i].shape), "FP32")
        tensor.set_data_from_numpy(inputs[i])
        with tgrpc.InferenceServerClient(target) as c:
            try:
                answers[i] = c.infer(MODEL, [tensor], client_timeout=GRACE_S + 30)
            except InferenceServerException as exc:
                answers[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    threads += [threading.Thread(target=grpc_client, args=(i,))
                for i in range(CLIENTS, CLIENTS + GRPC_CLIENTS)]
    # every request inside the server: the first batch held in the model, the rest queued
    threads[0].start()
    held = Path(f"{gate}.held")
    deadline = time.monotonic() + 60
    while not held.exists():
        assert time.monotonic() < deadline and process.poll() is None, "no batch was held"
        time.sleep(0.01)  # polling another process's state
    for t in threads[1:]:
        t.start()
    with httpx.Client(base_url=base, timeout=5) as probe:
        while metric(probe.get("/metrics").text, "vbs_queue_depth") < len(threads) - 1:
            assert time.monotonic() < deadline, "requests did not all reach the server"
            time.sleep(0.02)  # polling another process's state
    process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    # a new request is turned away: 503, or refused once the listener has closed; never run
    late: list[object] = []
    deadline = time.monotonic() + 30
    while True:
        try:
            with httpx.Client(base_url=base, timeout=10) as c:
                r = c.post("/infer", json={"inputs": inputs[0].tolist()})
        except httpx.TransportError as exc:
            late.append(exc)
            break
        late.append(r.status_code)
        assert r.status_code == 503 and "error" in r.json(), r.text
        assert time.monotonic() < deadline
    # and a new gRPC call: UNAVAILABLE (one that came before gRPC stopped taking calls would be
    # queued behind the gate: its client gives up, and it is tried again)
    while True:
        tensor = tgrpc.InferInput("input", list(inputs[0].shape), "FP32")
        tensor.set_data_from_numpy(inputs[0])
        with tgrpc.InferenceServerClient(target) as c:
            with pytest.raises(InferenceServerException) as refused:
                c.infer(MODEL, [tensor], client_timeout=5)
        if refused.value.status() == "StatusCode.UNAVAILABLE":
            break
        assert refused.value.status() == "StatusCode.DEADLINE_EXCEEDED", refused.value
        assert time.monotonic() < deadline
    gate.unlink()  # let the accepted requests through
    for t in threads:
        t.join(timeout=GRACE_S + 30)
    with torch.inference_mode():
        model = gated_two_layer()
        model.load_state_dict(torch.load(Path(log).parent / "weights.pt", weights_only=True))
        for i in range(CLIENTS + GRPC_CLIENTS):
            r = answers[i]
            want = model(torch.from_numpy(inputs[i])).numpy()
            if i >= CLIENTS:
                assert isinstance(r, tgrpc.InferResult), f"accepted gRPC call {i} lost: {r!r}"
                np.testing.assert_allclose(r.as_numpy("output"), want, rtol=1e-4, atol=1e-5)
                continue
            assert isinstance(r, httpx.Response), f"accepted request {i} lost: {r!r}"
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(np.asarray(r.json()["outputs"]), want, rtol=1e-4, atol=1e-5)
    try:
        code = process.wait(timeout=GRACE_S - (time.monotonic() - signalled) + 5)
    except subprocess.TimeoutExpired:
        pytest.fail(f"vbs serve still running {GRACE_S} s after SIGTERM:\n{log.read_text()[-3000:]}")
    # uvicorn (>= 0.29) re-raises the signal once it has shut down cleanly: -SIGTERM, or 0
    assert code in (0, -signal.SIGTERM), log.read_text()[-3000:]
    assert "Application shutdown complete" in log.read_text()
