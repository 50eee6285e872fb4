"""The servers bench/many_models.py drives, each in a memory cgroup of its own: the tables and
the ONNX exports they serve, `vbs serve` and Triton started in a group, each model's footprint
alone, and what vbs-serve's /metrics says of loads and unloads."""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from memory_group import MemoryGroup, NoGroup
from served import ROOT, free_port, stop, wait_ready

MiB = 2**20
LOOSE = 16 * 2**30  # the footprints' group: no limit to speak of


def new_group(name: str, limit: int) -> MemoryGroup:
    try:
        group = MemoryGroup.create(f"vbs-many-{name}-{os.getpid()}-{time.monotonic_ns()}")
    except NoGroup as exc:
        raise SystemExit(f"this bench needs a memory cgroup (root): {exc}") from exc
    group.set_limit(limit)
    group.reset_peak()
    return group


def tail(log: Path, lines: int = 12) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# -- the tables and the exports ------------------------------------------------------------


def plan(args: argparse.Namespace) -> None:
    """Every model's table into the store (`vbs plan` skips a model whose table is there)."""
    for model in args.models:
        t0 = time.perf_counter()
        subprocess.run([args.vbs_python, "-m", "service.commands", "plan", "--model",
                        f"{model}@{args.shape_arg}", "--batch-max", str(args.batch_max),
                        "--store", args.store, "--quiet"], check=True, cwd=ROOT,
                       env=vbs_env(args),
                       stdout=subprocess.DEVNULL)
        print(f"# planned {model} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)


def export(args: argparse.Namespace) -> dict[str, Path]:
    from peers_models import export_onnx

    out = {}
    for model in args.models:
        out[model] = Path(args.work) / "onnx" / f"{model}.onnx"
        export_onnx(model, args.shape, out[model])
    return out


def vbs_env(args: argparse.Namespace) -> dict[str, str]:
    """`vbs plan`'s and `vbs serve`'s settings, the same for both: the profile's settings are
    part of its fingerprint, so a torch worker with others finds no table and profiles the
    model as it loads (a 28 s load of resnet34, once)."""
    return {**os.environ, "VBS_CACHE_DIR": args.cache_dir, "PYTHONPATH": str(ROOT),
            "VBS_REQUEST_TIMEOUT_S": str(args.timeout),
            "VBS_PROFILE_REPEATS": str(args.profile_repeats),
            "VBS_PROFILE_WARMUP": str(args.profile_warmup)}


# -- the servers -------------------------------------------------------------------------------


def start_vbs(args: argparse.Namespace, group: MemoryGroup, models: list[str], port: int,
              log: Path) -> subprocess.Popen[bytes]:
    cmd = [args.vbs_python, "-m", "service.commands", "serve", "--store", args.store,
           "--batch-max", str(args.batch_max), "--port", str(port), "--grpc-port", "0",
           "--request-timeout", str(args.timeout), "--log-level", args.vbs_log_level]
    for model in models:
        cmd += ["--model", f"{model}@{args.shape_arg}"]
    return subprocess.Popen(group.command(cmd), env=vbs_env(args), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"),
                            start_new_session=True)


def triton_repository(args: argparse.Namespace, onnx: dict[str, Path], name: str) -> Path:
    """A model repository with every model: config.pbtxt (ONNX Runtime in the Python backend,
    the dynamic batcher at B, as ``bench/peers_triton.py``) and the shim model.py."""
    from peers_triton import MODEL_PY, config

    repo = Path(args.work) / f"repo-{name}"
    for model in args.models:
        (repo / model / "1").mkdir(parents=True)
        (repo / model / "config.pbtxt").write_text(
            config(model, args.shape, "ort", args.batch_max, args.triton_wait, args.threads,
                   str(onnx[model]), False))
        (repo / model / "1" / "model.py").write_text(
            MODEL_PY.format(bench=str(ROOT / "bench")))
    return repo


def start_triton(args: argparse.Namespace, group: MemoryGroup, repo: Path, port: int,
                 explicit: bool, log: Path) -> subprocess.Popen[bytes]:
    from peers_triton import command, environment

    work = Path(tempfile.mkdtemp(prefix="triton-", dir=args.work))
    cmd = command(work, repo, (port, free_port(), free_port()))
    if explicit:
        cmd.append("--model-control-mode=explicit")
    return subprocess.Popen(group.command(cmd), env=environment(dict(os.environ)),
                            stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


# -- footprints --------------------------------------------------------------------------------


def infer_once(url: str, model: str, body: bytes, headers: dict[str, str], timeout: float) -> int:
    return httpx.post(f"{url}/v2/models/{model}/infer", content=body, headers=headers,
                      timeout=timeout).status_code


def footprints_vbs(args: argparse.Namespace, body: bytes, headers: dict[str, str]
                   ) -> dict[str, dict[str, Any]]:
    """Each model in a `vbs serve` of its own: the group's peak through start and one request,
    its idle working set after, and what the service says the model keeps."""
    out = {}
    for model in args.models:
        group = new_group(f"fp-vbs-{model}", LOOSE)
        port, log = free_port(), Path(args.work) / f"fp-vbs-{model}.log"
        process = start_vbs(args, group, [model], port, log)
        url = f"http://127.0.0.1:{port}"
        try:
            why = wait_ready(f"{url}/v2/health/ready", process, args.start_timeout)
            if why:
                raise SystemExit(f"vbs serve of {model} alone: {why}\n{tail(log)}")
            status = infer_once(url, model, body, headers, args.timeout)
            time.sleep(0.5)
            described = next(m for m in httpx.get(f"{url}/models").json()["models"]
                             if m["name"] == model)
            kept = described.get("kept_bytes")
            out[model] = {"peak": group.peak(), "working_set": group.working_set(),
                          "kept": kept, "status": status, "load_s": described.get("load_s"),
                          "runs_on": described.get("runs_on")}
        finally:
            stop(process)
            group.remove()
        print(f"# vbs alone {model}: peak {out[model]['peak'] / MiB:.0f} MiB, kept "
              f"{(kept or 0) / MiB:.0f} MiB", file=sys.stderr, flush=True)
    return out


def footprints_triton(args: argparse.Namespace, repo: Path, body: bytes,
                      headers: dict[str, str]) -> tuple[int, dict[str, dict[str, Any]]]:
    """One Triton in explicit mode: its idle working set, then each model loaded, asked once,
    unloaded: the group's peak meanwhile (reset before) and its growth over the idle server."""
    group = new_group("fp-triton", LOOSE)
    port, log = free_port(), Path(args.work) / "fp-triton.log"
    process = start_triton(args, group, repo, port, True, log)
    url = f"http://127.0.0.1:{port}"
    out = {}
    try:
        why = wait_ready(f"{url}/v2/health/live", process, args.start_timeout)
        if why:
            raise SystemExit(f"tritonserver (explicit, nothing loaded): {why}\n{tail(log)}")
        time.sleep(1.0)
        base = group.working_set()
        for model in args.models:
            group.reset_peak()
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/v2/repository/models/{model}/load", timeout=args.timeout)
            load_s = time.perf_counter() - t0
            if r.status_code != 200:
                raise SystemExit(f"Triton would not load {model}: {r.text}\n{tail(log)}")
            status = infer_once(url, model, body, headers, args.timeout)
            peak = group.peak()
            httpx.post(f"{url}/v2/repository/models/{model}/unload", timeout=args.timeout)
            await_unloaded(url, [model])
            out[model] = {"peak": peak, "growth": (peak or 0) - base, "load_s": load_s,
                          "status": status}
            print(f"# triton alone {model}: peak {(peak or 0) / MiB:.0f} MiB, load "
                  f"{load_s:.1f} s", file=sys.stderr, flush=True)
    finally:
        stop(process)
        group.remove()
    return base, out


def await_unloaded(url: str, models: list[str], timeout_s: float = 60.0) -> None:
    """Until Triton's repository index says none of ``models`` is loaded or unloading (an
    unload returns before the model's stub has exited and given its memory back)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        index = httpx.post(f"{url}/v2/repository/index", json={}, timeout=10).json()
        states = {m["name"]: m.get("state", "") for m in index}
        if not any(states.get(m) in ("READY", "UNLOADING", "LOADING") for m in models):
            return
        time.sleep(0.05)


def vbs_metrics(url: str) -> dict[str, Any]:
    """vbs-serve's loads, unloads and load-time histogram, by model."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    loads: dict[str, float] = collections.Counter()
    unloads: dict[str, float] = collections.Counter()
    load_sum: dict[str, float] = collections.Counter()
    buckets: dict[str, float] = collections.Counter()  # le -> count, every model
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        labels = dict(kv.split("=", 1) for kv in rest.rsplit("}", 1)[0].split(",") if "=" in kv)
        labels = {k: v.strip('"') for k, v in labels.items()}
        value = float(line.rsplit(" ", 1)[1])
        model = labels.get("model", "-")
        if name == "vbs_model_loads_total":
            loads[model] += value
        elif name == "vbs_model_unloads_total":
            unloads[model] += value
        elif name == "vbs_model_load_seconds_sum":
            load_sum[model] += value
        elif name == "vbs_model_load_seconds_bucket":
            buckets[labels["le"]] += value
    return {"loads": dict(loads), "unloads": dict(unloads), "load_sum": dict(load_sum),
            "buckets": dict(buckets)}
