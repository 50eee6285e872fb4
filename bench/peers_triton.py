"""NVIDIA Triton Inference Server as a peer of vbs-serve (``bench/peers.py``).

The real ``tritonserver`` binary that the PyPI package ``nvidia-pytriton`` ships, started
directly (not through pytriton's ``Triton`` class, whose models run in the Python process that
binds them, one hop further from the server). The binary ships no framework backends, only
Triton's Python backend: the model runs inside the backend's stub process, which this module's
``TritonPythonModel`` drives with ONNX Runtime or eager torch (``bench/peers_models.py``).
Triton's dynamic batcher forms the batches; the stub concatenates the requests it is handed,
runs them once and splits the answer.

The model repository, the backend directory (the stub built for the running Python) and the
shim ``model.py`` are written to a temporary directory that lives as long as the server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from peers_models import INPUT, OUTPUT, runner

BENCH = Path(__file__).resolve().parent
MODEL_PY = """\
import sys
sys.path.insert(0, {bench!r})
from peers_triton import TritonPythonModel  # noqa: E402,F401
"""


def dist() -> Path:
    """Where nvidia-pytriton keeps the server: bin/tritonserver, backends/, the stubs."""
    import pytriton

    return Path(pytriton.__file__).resolve().parent / "tritonserver"


def backends(work: Path) -> Path:
    """Triton's Python backend with the stub built for this interpreter's Python version (the
    package ships one stub per version; the backend looks for it beside its library)."""
    python = work / "backends" / "python"
    shutil.copytree(dist() / "backends" / "python", python,
                    ignore=shutil.ignore_patterns("__pycache__"))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist() / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise SystemExit(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    shutil.copy2(stub, python / "triton_python_backend_stub")
    return python.parent


def config(name: str, shape: tuple[int, ...], runtime: str, batch: int, wait_s: float,
           threads: int, onnx: str | None, spin: bool) -> str:
    """config.pbtxt: one CPU instance, the dynamic batcher up to ``batch`` samples, waiting at
    most ``wait_s`` for a batch to fill; what the stub runs is passed as parameters."""
    params = {"model": name, "runtime": runtime, "threads": str(threads), "onnx": onnx or "",
              "spin": "1" if spin else ""}
    return "\n".join([
        f'name: "{name}"',
        'backend: "python"',
        f"max_batch_size: {batch}",
        f'input [{{ name: "{INPUT}", data_type: TYPE_FP32, dims: {list(shape)} }}]',
        f'output [{{ name: "{OUTPUT}", data_type: TYPE_FP32, dims: [-1] }}]',
        "instance_group [{ count: 1, kind: KIND_CPU }]",
        f"dynamic_batching {{ max_queue_delay_microseconds: {round(wait_s * 1e6)} }}",
        *(f'parameters {{ key: "{k}", value: {{ string_value: {json.dumps(v)} }} }}'
          for k, v in params.items()),
        "",
    ])


def repository(work: Path, name: str, shape: tuple[int, ...], runtime: str, batch: int,
               wait_s: float, threads: int, onnx: str | None, spin: bool) -> Path:
    """A model repository with the one model; its model.py imports this module's model."""
    model = work / "models" / name
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        config(name, shape, runtime, batch, wait_s, threads, onnx, spin))
    (model / "1" / "model.py").write_text(MODEL_PY.format(bench=str(BENCH)))
    return model.parent


def command(work: Path, repo: Path, ports: tuple[int, int, int]) -> list[str]:
    """tritonserver bound to 127.0.0.1 (HTTP, gRPC and metrics), no GPU, a short exit."""
    http, grpc, metrics = ports
    return [
        str(dist() / "bin" / "tritonserver"), f"--model-repository={repo}",
        f"--backend-directory={backends(work)}",
        "--http-address=127.0.0.1", f"--http-port={http}",
        "--grpc-address=127.0.0.1", f"--grpc-port={grpc}",
        "--metrics-address=127.0.0.1", f"--metrics-port={metrics}",
        "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0",
        "--strict-readiness=true", "--exit-on-error=true", "--exit-timeout-secs=5",
        "--log-info=false",
    ]


def environment(env: dict[str, str]) -> dict[str, str]:
    """The stub links libpython3.x by name: this interpreter's LIBDIR goes first, or it loads
    the system's, another build, and fails in multiprocessing. The stub's embedded Python takes
    its prefix from the first ``python3`` on PATH (it ignores PYTHONPATH): this venv's bin goes
    first, or it imports the base interpreter's packages (a numpy this torch was not built for,
    no onnxruntime)."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    shipped = str(dist().parent.parent / "nvidia_pytriton.libs")  # the copied stub's libraries
    ld = [p for p in (libdir, env.get("LD_LIBRARY_PATH", ""), shipped) if p]
    path = [str(Path(sys.executable).parent), env.get("PATH", "")]
    return {**env, "LD_LIBRARY_PATH": ":".join(ld), "PATH": ":".join(p for p in path if p)}


def serve(name: str, shape: tuple[int, ...], runtime: str, ports: tuple[int, int, int],
          batch: int, wait_s: float, threads: int, onnx: str | None, spin: bool) -> None:
    """Run tritonserver until it exits or this process is told to stop (SIGTERM is passed on
    and waited for, so the temporary directory is removed after the server has gone). Its log
    goes to a file, shown only when it fails: it writes its errors, and a harmless one about
    CUDA on a machine without a GPU, between the bench's rows."""
    with tempfile.TemporaryDirectory(prefix="vbs-peers-triton-") as tmp:
        work = Path(tmp)
        repo = repository(work, name, shape, runtime, batch, wait_s, threads, onnx, spin)
        log = work / "tritonserver.log"
        with log.open("wb") as out:
            server = subprocess.Popen(command(work, repo, ports), stdout=out,
                                      stderr=subprocess.STDOUT, env=environment(dict(os.environ)))
            signal.signal(signal.SIGTERM, lambda *_: server.terminate())
            signal.signal(signal.SIGINT, lambda *_: server.terminate())
            code = server.wait()
        if code:
            tail = log.read_text(errors="replace").splitlines()[-20:]
            sys.stderr.write("\n".join(["tritonserver failed:", *tail, ""]))
    if code:
        raise SystemExit(code)


class TritonPythonModel:
    """The model inside Triton's Python backend stub: the batches Triton forms, run at once."""

    def initialize(self, args: dict[str, Any]) -> None:
        params = {k: v["string_value"] for k, v in
                  json.loads(args["model_config"]).get("parameters", {}).items()}
        self.run = runner(params["model"], params["runtime"], int(params["threads"]),
                          params["onnx"] or None, bool(params["spin"]))

    def execute(self, requests: list[Any]) -> list[Any]:
        import numpy as np
        import triton_python_backend_utils as pb

        xs = [pb.get_input_tensor_by_name(r, INPUT).as_numpy() for r in requests]
        try:
            y = self.run(xs[0] if len(xs) == 1 else np.concatenate(xs))
        except Exception as exc:  # every request of the batch hears why
            return [pb.InferenceResponse(error=pb.TritonError(str(exc))) for _ in requests]
        out, start = [], 0
        for x in xs:
            part = np.ascontiguousarray(y[start:start + len(x)])
            out.append(pb.InferenceResponse(output_tensors=[pb.Tensor(OUTPUT, part)]))
            start += len(x)
        return out
