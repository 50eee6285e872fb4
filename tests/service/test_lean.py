"""A CPU worker without torch (``core.compiled``, ``workers.array_backend``): `vbs plan`
compiles the model into a directory store, and `vbs serve` with a ``torch`` on PYTHONPATH that
raises ImportError serves it from the store alone (no weights file): its answers equal
``model(x)`` at every request size, its memory stays small, and a store or a plan it cannot
serve gets an error naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torchvision

from core.errors import UsageError
from core.spec import ModelSpec
from planner.store import open_store
from planner.stored import read_compiled
from tests.conftest import free_port
from workers.array_backend import ArrayModel
from workers.memory import MemoryProbe
from workers.worker import Worker

ROOT = Path(__file__).resolve().parents[2]
MODEL, SHAPE, BATCH_MAX = "mobilenet_v3_small", (3, 64, 64), 4
AT = "@" + ",".join(map(str, SHAPE))
MiB = 2**20


def _vbs(*argv: str, env: dict[str, str] | None = None, timeout: float = 600
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service.commands", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.nn.Module]:
    """A store with the model planned (ONNX Runtime runs) and compiled, from a weights file."""
    here = tmp_path_factory.mktemp("lean")
    torch.manual_seed(3)
    model = torchvision.models.get_model(MODEL, weights=None).eval()
    weights = here / "weights.pt"
    torch.save(model.state_dict(), weights)
    store = here / "store"
    done = _vbs("plan", "--model", f"lean={MODEL}{AT}", "--weights", str(weights), "--store",
                str(store), "--batch-max", str(BATCH_MAX), "--runtime", "onnxruntime", "--quiet",
                env={"VBS_CACHE_DIR": str(here / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert list((store / "compiled").glob("*.zip")), "vbs plan stored no compiled model"
    return here, store, model


def _no_torch(here: Path) -> dict[str, str]:
    """An environment where ``import torch`` raises ImportError (as in the lean image)."""
    fake = here / "no-torch" / "torch"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text('raise ImportError("no torch in this worker (test)")\n')
    return {"PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT)]),
            "VBS_CACHE_DIR": str(here / "serve-cache")}


def _serve(store: Path, port: int, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`vbs serve` of the planned model from ``store``, its output in ``log``."""
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "service.commands", "serve", "--model", f"lean={MODEL}{AT}",
             "--store", str(store), "--port", str(port), "--grpc-port", "0",
             "--batch-max", str(BATCH_MAX)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})


def _infer(client: httpx.Client, x: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.ravel().tolist()}]}
    answer = client.post("/v2/models/lean/infer", json=body)
    assert answer.status_code == 200, answer.text
    out = answer.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def test_serves_from_the_store_without_torch(planned: tuple[Path, Path, torch.nn.Module]) -> None:
    here, store, model = planned
    port = free_port()
    log = here / "serve.log"
    # VBS_PIPELINE=on: its two stages hand torch tensors over, so not for this model
    server = _serve(store, port, log, {**_no_torch(here), "VBS_PIPELINE": "on"})
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            _wait_ready(server, client, log)
            described = client.get("/models").json()["models"][0]
            assert described["state"] == "ready", (described, log.read_text()[-3000:])
            assert described["runs_on"] == "compiled ONNX graphs, without torch"
            rng = np.random.default_rng(0)
            for n in (1, 3, BATCH_MAX, BATCH_MAX + 2):  # the last runs as two pieces
                x = rng.standard_normal((n, *SHAPE), dtype=np.float32)
                got = _infer(client, x)
                with torch.inference_mode():
                    want = model(torch.from_numpy(x)).numpy()
                assert got.shape == want.shape
                assert np.allclose(got, want, rtol=1e-4, atol=1e-4), np.abs(got - want).max()
            rss = int(next(line.split()[1] for line in
                           Path(f"/proc/{server.pid}/status").read_text().splitlines()
                           if line.startswith("VmRSS:"))) * 1024
            maps = Path(f"/proc/{server.pid}/maps").read_text()
    finally:
        server.terminate()
        server.wait(timeout=30)
    text = log.read_text()
    assert "served without torch" in text, text[-2000:]
    assert "libtorch" not in maps  # nothing of torch was loaded, not even by a dependency
    assert rss < 400 * MiB, f"the worker holds {rss / MiB:.0f} MiB after serving"


def _wait_ready(server: subprocess.Popen[bytes], client: httpx.Client, log: Path) -> None:
    deadline = time.monotonic() + 300  # a loaded CI machine: sessions made ahead
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if client.get("/v2/health/ready").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    assert server.poll() is None, log.read_text()[-3000:]


def test_where_torch_is_installed_a_compiled_model_is_served_without_importing_it(
        planned: tuple[Path, Path, torch.nn.Module]) -> None:
    """The default `vbs serve` (``VBS_LEAN`` auto) in this environment, where torch imports:
    the store's compiled model is served without torch, and neither the start's checks nor
    the load import it (the import alone grew a server by ~660 MiB: docs/benchmarks.md
    section 8)."""
    here, store, model = planned
    port = free_port()
    log = here / "serve-auto.log"
    server = _serve(store, port, log, {"PYTHONPATH": str(ROOT), "VBS_LEAN": "auto",
                                       "VBS_CACHE_DIR": str(here / "serve-auto-cache")})
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            _wait_ready(server, client, log)
            x = np.random.default_rng(1).standard_normal((2, *SHAPE), dtype=np.float32)
            got = _infer(client, x)
            maps = Path(f"/proc/{server.pid}/maps").read_text()
    finally:
        server.terminate()
        server.wait(timeout=30)
    with torch.inference_mode():
        assert np.allclose(got, model(torch.from_numpy(x)).numpy(), rtol=1e-4, atol=1e-4)
    assert "served without torch" in log.read_text()
    assert "libtorch" not in maps, "torch was imported by a server of a compiled model"


def test_a_store_without_the_compiled_model_names_vbs_plan(tmp_path: Path) -> None:
    done = _vbs("serve", "--model", f"lean={MODEL}{AT}", "--store", str(tmp_path / "empty"),
                "--port", str(free_port()), "--grpc-port", "0", env=_no_torch(tmp_path),
                timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "no compiled model" in done.stderr and "vbs plan --model lean=" in done.stderr


def test_a_plan_with_torch_steps_is_refused(planned: tuple[Path, Path, torch.nn.Module],
                                            tmp_path: Path) -> None:
    here, _, _ = planned
    store = tmp_path / "store"
    done = _vbs("plan", "--model", f"lean={MODEL}{AT}", "--store", str(store), "--batch-max", "2",
                "--runtime", "torch", "--quiet", env={"VBS_CACHE_DIR": str(here / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    spec = ModelSpec(MODEL, SHAPE)
    with open_store(str(store)) as st:
        stored = read_compiled(st, "lean", spec, "vbs", "time")
    model = ArrayModel(stored.compiled, stored.profile.root, stored.fingerprint)
    with pytest.raises(UsageError, match="VBS_LEAN=off"):
        Worker(model, stored.tables["vbs"], MemoryProbe("cpu"))
