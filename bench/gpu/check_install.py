"""After the install (bench/gpu/install.py): is everything the GPU run needs there?

Run by the Python the project was installed into; prints one JSON object. Every requirement of
vbs-serve must be installed (a release outside a floor is reported, not fatal: the image's own
release is what there is); every module the steps import must import (the service, the gRPC
modules the build generated, the tests' plugins); and the device is described: torch, CUDA,
cuDNN, the GPU, NVML. ``ok`` is false when a requirement or a module is missing.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import platform
import sys

MODULES = ("planner.cli", "planner.profiling.energy", "workers.worker", "workers.plans_measured",
           "service.commands", "service.main", "service.grpc_server", "service.oip",
           "loadgen.processes",
           "pytest", "pytest_timeout", "hypothesis", "yaml", "httpx", "matplotlib")


def requirements() -> tuple[list[str], list[str]]:
    """(missing, outside their specifier) among vbs-serve's requirements (no extras)."""
    from packaging.requirements import Requirement

    missing, outside = [], []
    for line in md.requires("vbs-serve") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            missing.append(str(req))
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            outside.append(f"{req.name} {version} (wants {req.specifier})")
    return missing, outside


def device() -> dict[str, object]:
    import torch

    out: dict[str, object] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                              "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=torch.cuda.get_device_name(0), gpu_memory_bytes=props.total_memory,
                   cudnn=torch.backends.cudnn.version(), devices=torch.cuda.device_count())
        try:
            import pynvml

            pynvml.nvmlInit()
            out["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
            out["nvml"] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported, the energy step says what it lacks
            out["nvml"] = f"unavailable: {exc}"
    return out


def main() -> int:
    missing, outside = requirements()
    failed = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every import failure is reported
            failed[name] = f"{type(exc).__name__}: {exc}"
    versions = {}
    for name in ("vbs-serve", "torch", "torchvision", "numpy", "onnxruntime", "fastapi",
                 "pydantic", "grpcio", "protobuf", "uvicorn"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    report = {"ok": not missing and not failed, "python_version": platform.python_version(),
              "executable": sys.executable, "missing": missing, "outside_floor": outside,
              "import_errors": failed, "versions": versions, "device_info": device()}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
