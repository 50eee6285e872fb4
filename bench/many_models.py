"""Many models in one memory limit: eight models or more whose footprints together are several
times a memory cgroup's limit, a skewed mix of traffic across them, served by vbs-serve (loads
on demand, the least recently used idle model unloaded) and by NVIDIA Triton, every model loaded
at start or driven in explicit mode by a client that loads and unloads.

    .venv-peers/bin/python bench/many_models.py [--models resnet50,mobilenet_v2,...]
        [--shape 3,224,224] [--batch-max 4] [--clients 4] [--duration 60] [--zipf 1.5]
        [--limits vbs,triton] [--headroom 200MiB] [--servers vbs,triton-all,triton-explicit]
        [--json OUT] [--footprints EARLIER_JSON]

Needs root (a memory cgroup, v1 or v2, made per server as ``bench/memory_limit.py`` does) and
the ``peers`` extra in ``.venv-peers`` (``bench/peers.py`` says how: Triton and its client).

1. **Tables.** Every model is planned into a directory store first (``--store``; `vbs plan
   --batch-max B` with this checkout's ``--vbs-python``, skipped where the store has the table),
   outside any limit, as a pod would have its tables made elsewhere (``--profile-repeats`` 2
   and ``--profile-warmup`` 1 by default, to plan eight models in minutes). Weights are random
   (torchvision's init, the same for every server: Triton gets each model exported to ONNX
   from the same seed, ``bench/peers_models.py``).
2. **Footprints.** Each model served alone, in a group with a loose limit, after one
   one-sample request: vbs-serve (a `vbs serve` of that model alone: the group's peak and what
   the service says the model keeps) and Triton (one server in explicit mode, each model
   loaded, asked once and unloaded in turn; the group's peak, reset before each load, and its
   growth over the idle server). ``--limits``: every server runs in each; ``vbs`` is
   vbs-serve's largest peak alone plus ``--headroom``, ``triton`` Triton's (the two servers'
   footprints differ several times over: a limit that makes one unload lets the other keep
   every model); the sums of the footprints alone are printed against each limit.
3. **Traffic**, the same for every server: ``--clients`` closed-loop clients in this process
   (asyncio, HTTP/1.1 keep-alive), each request one sample (OIP v2, the binary tensor
   extension) for a model drawn from a Zipf law over ``--models`` in the order given
   (``--zipf`` s: the first two hot, the rest cold), each client its own seeded draw, for
   ``--duration`` seconds; a request's client timeout is ``--timeout`` (vbs-serve's own
   request timeout the same). Per model: requests, answered, errors by status (``conn``: the
   connection failed, ``timeout``: no answer in time), p50/p99 of the answered.
4. **Servers**, each in a fresh memory cgroup at the limit:

   - ``vbs``: one `vbs serve` of every model with its defaults: models load at start while
     they fit, the rest on demand, the least recently used idle one unloaded for another.
     From ``/metrics``: loads, unloads, the load time (``vbs_model_load_seconds``); from the
     answers, how long requests waited for a load (``load_wait_s``).
   - ``triton-all``: ``tritonserver`` (nvidia-pytriton's, ``bench/peers_triton.py``) with every
     model in its repository and ``--model-control-mode=none``, its default: all loaded at
     start, each in a Python backend stub running ONNX Runtime, dynamic batcher at
     ``max_batch_size`` B. What happens to it is the result.
   - ``triton-explicit``: the same server in ``--model-control-mode=explicit``, nothing loaded
     at start, driven by a client that manages memory as well as a client can: it knows each
     model's footprint in Triton (step 2), loads models in the order given while they fit
     (before the traffic, as vbs-serve does at start) and, when a request's model is not
     loaded, unloads the least recently used model with no request in flight until the model
     fits in the limit less the idle server and ``--client-margin``, waits for the unloads to
     finish (Triton's repository index), loads the model, then sends (the repository API's
     ``POST /v2/repository/models/{m}/load|unload``, what tritonclient's ``load_model`` and
     ``unload_model`` call). One change at a time, under one lock. The time it spends there is
     the client's cost, counted in its requests' latency and apart.

   For each: the group's peak (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``), its OOM
   kills (the kernel's count), whether the server was still alive at the end, and for a server
   that did not start, its exit and the tail of its log.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from core.sizes import parse_bytes  # noqa: E402
from memory_group import MemoryGroup, NoGroup, stop  # noqa: E402
from service.loadtest import request_body  # noqa: E402

MiB = 2**20
MODELS = ("resnet50,mobilenet_v2,resnet18,alexnet,resnet34,convnext_tiny,wide_resnet50_2,"
          "resnet101")
JOIN = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"']  # the group, then the command
LOOSE = 16 * 2**30  # the footprints' group: no limit to speak of


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(name: str, limit: int) -> MemoryGroup:
    try:
        group = MemoryGroup.create(f"vbs-many-{name}-{os.getpid()}-{time.monotonic_ns()}")
    except NoGroup as exc:
        raise SystemExit(f"this bench needs a memory cgroup (root): {exc}") from exc
    group.set_limit(limit)
    group.reset_peak()
    return group


def _tail(log: Path, lines: int = 12) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _wait(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> str | None:
    """None once ``url`` answers 200; else why not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"exited {process.returncode} while starting"
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.3)  # polling a starting process
    return f"not ready within {timeout_s:g} s"


# -- the tables and the exports ------------------------------------------------------------


def plan(args: argparse.Namespace) -> None:
    """Every model's table into the store (`vbs plan` skips a model whose table is there)."""
    for model in args.models:
        t0 = time.perf_counter()
        subprocess.run([args.vbs_python, "-m", "service.commands", "plan", "--model",
                        f"{model}@{args.shape_arg}", "--batch-max", str(args.batch_max),
                        "--store", args.store, "--quiet"], check=True, cwd=ROOT,
                       env={**_vbs_env(args), "VBS_PROFILE_REPEATS": str(args.profile_repeats),
                            "VBS_PROFILE_WARMUP": str(args.profile_warmup)},
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


def _vbs_env(args: argparse.Namespace) -> dict[str, str]:
    return {**os.environ, "VBS_CACHE_DIR": args.cache_dir, "PYTHONPATH": str(ROOT),
            "VBS_REQUEST_TIMEOUT_S": str(args.timeout)}


# -- the servers -------------------------------------------------------------------------------


def start_vbs(args: argparse.Namespace, group: MemoryGroup, models: list[str], port: int,
              log: Path) -> subprocess.Popen[bytes]:
    cmd = [args.vbs_python, "-m", "service.commands", "serve", "--store", args.store,
           "--batch-max", str(args.batch_max), "--port", str(port), "--grpc-port", "0",
           "--request-timeout", str(args.timeout), "--log-level", "warning"]
    for model in models:
        cmd += ["--model", f"{model}@{args.shape_arg}"]
    return subprocess.Popen([*JOIN, str(group.path), *cmd], env=_vbs_env(args), cwd=ROOT,
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
    cmd = command(work, repo, (port, _port(), _port()))
    if explicit:
        cmd.append("--model-control-mode=explicit")
    return subprocess.Popen([*JOIN, str(group.path), *cmd], env=environment(dict(os.environ)),
                            stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


# -- footprints --------------------------------------------------------------------------------


def _one(url: str, model: str, body: bytes, headers: dict[str, str], timeout: float) -> int:
    return httpx.post(f"{url}/v2/models/{model}/infer", content=body, headers=headers,
                      timeout=timeout).status_code


def footprints_vbs(args: argparse.Namespace, body: bytes, headers: dict[str, str]
                   ) -> dict[str, dict[str, Any]]:
    """Each model in a `vbs serve` of its own: the group's peak through start and one request,
    its idle working set after, and what the service says the model keeps."""
    out = {}
    for model in args.models:
        group = _group(f"fp-vbs-{model}", LOOSE)
        port, log = _port(), Path(args.work) / f"fp-vbs-{model}.log"
        process = start_vbs(args, group, [model], port, log)
        url = f"http://127.0.0.1:{port}"
        try:
            why = _wait(f"{url}/v2/health/ready", process, args.start_timeout)
            if why:
                raise SystemExit(f"vbs serve of {model} alone: {why}\n{_tail(log)}")
            status = _one(url, model, body, headers, args.timeout)
            time.sleep(0.5)
            kept = next(m.get("kept_bytes") for m in httpx.get(f"{url}/models").json()["models"]
                        if m["name"] == model)
            out[model] = {"peak": group.peak(), "working_set": group.working_set(),
                          "kept": kept, "status": status}
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
    group = _group("fp-triton", LOOSE)
    port, log = _port(), Path(args.work) / "fp-triton.log"
    process = start_triton(args, group, repo, port, True, log)
    url = f"http://127.0.0.1:{port}"
    out = {}
    try:
        why = _wait(f"{url}/v2/health/live", process, args.start_timeout)
        if why:
            raise SystemExit(f"tritonserver (explicit, nothing loaded): {why}\n{_tail(log)}")
        time.sleep(1.0)
        base = group.working_set()
        for model in args.models:
            group.reset_peak()
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/v2/repository/models/{model}/load", timeout=args.timeout)
            load_s = time.perf_counter() - t0
            if r.status_code != 200:
                raise SystemExit(f"Triton would not load {model}: {r.text}\n{_tail(log)}")
            status = _one(url, model, body, headers, args.timeout)
            peak = group.peak()
            httpx.post(f"{url}/v2/repository/models/{model}/unload", timeout=args.timeout)
            _await_unloaded(url, [model])
            out[model] = {"peak": peak, "growth": (peak or 0) - base, "load_s": load_s,
                          "status": status}
            print(f"# triton alone {model}: peak {(peak or 0) / MiB:.0f} MiB, load "
                  f"{load_s:.1f} s", file=sys.stderr, flush=True)
    finally:
        stop(process)
        group.remove()
    return base, out


def _await_unloaded(url: str, models: list[str], timeout_s: float = 60.0) -> None:
    """Until Triton's repository index says none of ``models`` is loaded or unloading (an
    unload returns before the model's stub has exited and given its memory back)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        index = httpx.post(f"{url}/v2/repository/index", json={}, timeout=10).json()
        states = {m["name"]: m.get("state", "") for m in index}
        if not any(states.get(m) in ("READY", "UNLOADING", "LOADING") for m in models):
            return
        time.sleep(0.05)


# -- the traffic -------------------------------------------------------------------------------


def zipf(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


class Explicit:
    """Triton's explicit mode driven from the client: LRU over the loaded models, within the
    memory the client knows Triton has for them (the limit less the idle server and a margin),
    from each model's footprint measured alone."""

    def __init__(self, http: httpx.AsyncClient, cost: dict[str, int], capacity: int) -> None:
        self.http, self.cost, self.capacity = http, cost, capacity
        self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.busy: collections.Counter[str] = collections.Counter()
        self.lock = asyncio.Lock()
        self.loads = self.unloads = self.failed_loads = 0
        self.load_s = self.unload_s = 0.0
        self.load_times: list[float] = []
        self.by_model: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])

    def fits(self, model: str) -> bool:
        return sum(self.cost[m] for m in self.loaded) + self.cost[model] <= self.capacity

    async def _unload(self, victim: str) -> None:
        t0 = time.perf_counter()
        await self.http.post(f"/v2/repository/models/{victim}/unload")
        del self.loaded[victim]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until its stub is gone and its memory back
            index = (await self.http.post("/v2/repository/index", json={})).json()
            state = next((m.get("state") for m in index if m["name"] == victim), "")
            if state not in ("READY", "UNLOADING"):
                break
            await asyncio.sleep(0.05)
        self.unloads += 1
        self.by_model[victim][1] += 1
        self.unload_s += time.perf_counter() - t0

    async def _load(self, model: str) -> bool:
        t0 = time.perf_counter()
        try:
            r = await self.http.post(f"/v2/repository/models/{model}/load")
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        spent = time.perf_counter() - t0
        self.load_s += spent
        if ok:
            self.loads += 1
            self.by_model[model][0] += 1
            self.load_times.append(spent)
            self.loaded[model] = None
        else:
            self.failed_loads += 1
        return ok

    async def preload(self, models: list[str]) -> None:
        for model in models:
            if self.fits(model):
                await self._load(model)

    async def acquire(self, model: str) -> float:
        """Make sure ``model`` is loaded and mark it busy; the seconds this client spent."""
        if model in self.loaded:
            self.loaded.move_to_end(model)
            self.busy[model] += 1
            return 0.0
        t0 = time.perf_counter()
        async with self.lock:
            if model not in self.loaded:
                while not self.fits(model):
                    idle = [m for m in self.loaded if not self.busy[m]]
                    if idle:
                        await self._unload(idle[0])
                    elif not self.loaded:
                        break
                    else:
                        await asyncio.sleep(0.005)  # every loaded model busy: wait for one
                await self._load(model)
            if model in self.loaded:
                self.loaded.move_to_end(model)
        self.busy[model] += 1
        return time.perf_counter() - t0

    def release(self, model: str) -> None:
        self.busy[model] -= 1


async def traffic(url: str, args: argparse.Namespace, body: bytes, headers: dict[str, str],
                  explicit: dict[str, int] | None, capacity: int) -> dict[str, Any]:
    """``--clients`` closed-loop clients for ``--duration`` s, each request one sample for a
    Zipf-drawn model; per request (model, status, latency, load wait, client's own cost)."""
    weights = zipf(len(args.models), args.zipf)
    records: list[tuple[str, str, float, float, float]] = []
    limits = httpx.Limits(max_connections=args.clients + 2,
                          max_keepalive_connections=args.clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as http:
        manager = Explicit(http, explicit, capacity) if explicit is not None else None
        preload_s = 0.0
        if manager is not None:
            t0 = time.perf_counter()
            await manager.preload(args.models)
            preload_s = time.perf_counter() - t0
            manager.load_s = 0.0
            manager.load_times.clear()
            manager.loads = 0
            manager.by_model.clear()
        deadline = time.perf_counter() + args.duration

        async def client(c: int) -> None:
            rng = np.random.default_rng(args.seed + c)
            while time.perf_counter() < deadline:
                model = args.models[int(rng.choice(len(args.models), p=weights))]
                t0 = time.perf_counter()
                own = wait = 0.0
                if manager is not None:
                    own = await manager.acquire(model)
                try:
                    r = await http.post(f"/v2/models/{model}/infer", content=body,
                                        headers=headers)
                    status = str(r.status_code)
                    if r.status_code == 200 and explicit is None:
                        wait = _load_wait(r)
                except httpx.TimeoutException:
                    status = "timeout"
                except httpx.HTTPError:
                    status = "conn"
                finally:
                    if manager is not None:
                        manager.release(model)
                records.append((model, status, time.perf_counter() - t0, wait, own))
                if status == "conn":
                    await asyncio.sleep(0.1)  # a dead server: do not spin

        await asyncio.gather(*(client(c) for c in range(args.clients)))
    out: dict[str, Any] = {"records": records}
    if manager is not None:
        out["client"] = {"loads": manager.loads, "unloads": manager.unloads,
                         "failed_loads": manager.failed_loads, "load_s": manager.load_s,
                         "unload_s": manager.unload_s, "load_times": manager.load_times,
                         "preload_s": preload_s, "by_model": dict(manager.by_model)}
    return out


def _load_wait(r: httpx.Response) -> float:
    """vbs-serve's ``load_wait_s`` from an OIP answer's parameters."""
    n = r.headers.get("inference-header-content-length")
    head = r.content[:int(n)] if n else r.content
    try:
        return float(json.loads(head).get("parameters", {}).get("load_wait_s", 0.0))
    except (ValueError, AttributeError):
        return 0.0


# -- one server in the limit -----------------------------------------------------------------


def _metrics(url: str) -> dict[str, Any]:
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


def run_server(server: str, args: argparse.Namespace, limit: int, body: bytes,
               headers: dict[str, str], repo: Path | None, triton_cost: dict[str, int],
               triton_base: int) -> dict[str, Any]:
    group = _group(server, limit)
    port, log = _port(), Path(args.work) / f"{server}.log"
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    if server == "vbs":
        process = start_vbs(args, group, args.models, port, log)
    else:
        assert repo is not None
        process = start_triton(args, group, repo, port, server == "triton-explicit", log)
    row: dict[str, Any] = {"server": server, "limit": limit}
    try:
        ready = "/v2/health/live" if server == "triton-explicit" else "/v2/health/ready"
        why = _wait(f"{url}{ready}", process, args.start_timeout)
        row["start_s"] = time.perf_counter() - t0
        if why:
            time.sleep(1.0)
            row.update(started=False, error=why, oom_kills=group.oom_kills(), peak=group.peak(),
                       log=_tail(log))
            return row
        row["started"] = True
        if server == "vbs":
            row["at_start"] = [m["name"] for m in httpx.get(f"{url}/models").json()["models"]
                               if m.get("state") == "ready"]
            row["metrics_before"] = _metrics(url)
        capacity = limit - triton_base - args.client_margin
        result = asyncio.run(traffic(url, args, body, headers,
                                     triton_cost if server == "triton-explicit" else None,
                                     capacity))
        row.update(result)
        row["capacity"] = capacity if server == "triton-explicit" else None
        row["alive"] = process.poll() is None
        row["exit"] = process.returncode
        if server == "vbs" and row["alive"]:
            row["metrics"] = _metrics(url)
        if server == "triton-all" and row["alive"]:
            row["log"] = _tail(log, 6)
        row.update(oom_kills=group.oom_kills(), peak=group.peak())
        if not row["alive"]:
            row["log"] = _tail(log)
        return row
    finally:
        stop(process)
        group.remove()


def resolve_limits(args: argparse.Namespace, fp_vbs: dict[str, dict[str, Any]],
                   fp_triton: dict[str, dict[str, Any]]) -> list[tuple[str, int]]:
    room = parse_bytes(args.headroom)
    out = []
    for name in args.limits.split(","):
        if name in ("vbs", "triton"):
            fp = fp_vbs if name == "vbs" else fp_triton
            out.append((f"{name}'s largest alone + {args.headroom}",
                        max(f["peak"] or 0 for f in fp.values()) + room))
        else:
            out.append((name, parse_bytes(name)))
    return out


# -- the tables --------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)] if xs else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def per_model(row: dict[str, Any], models: list[str]) -> list[str]:
    out = []
    recs = row.get("records", [])
    total = len(recs) or 1
    metrics = row.get("metrics") or {}
    before = row.get("metrics_before") or {}
    for model in models:
        mine = [r for r in recs if r[0] == model]
        ok = [r for r in mine if r[1] == "200"]
        errors = collections.Counter(r[1] for r in mine if r[1] != "200")
        err = ", ".join(f"{n} x {s}" for s, n in sorted(errors.items())) or "0"
        waited = [max(r[3], r[4]) for r in ok if r[3] > 0 or r[4] > 0]
        if row["server"] == "vbs" and metrics:
            loads = metrics["loads"].get(model, 0) - before.get("loads", {}).get(model, 0)
            unloads = metrics["unloads"].get(model, 0) - before.get("unloads", {}).get(model, 0)
            lc = f"{loads:.0f} / {unloads:.0f}"
        elif row.get("client"):
            lc = "{} / {} (client)".format(*row["client"]["by_model"].get(model, [0, 0]))
        else:
            lc = ""
        out.append(f"| {row['server']} | {row['limit'] / MiB:.0f} | {model} | "
                   f"{100 * len(mine) / total:.1f}% | {len(mine)} | "
                   f"{len(ok)} | {err} | {_ms(_pct([r[2] for r in ok], 0.5))} | "
                   f"{_ms(_pct([r[2] for r in ok], 0.99))} | "
                   f"{len(waited)} ({_ms(_pct(waited, 0.5))}) | {lc} |")
    return out


def summary(row: dict[str, Any]) -> str:
    limit = row["limit"] / MiB
    peak = f"{(row.get('peak') or 0) / MiB:.0f}"
    if not row.get("started"):
        return (f"| {row['server']} | {limit:.0f} | did not start ({row['error']}, after "
                f"{row['start_s']:.0f} s) | - | - | - | - | - | - | - | {peak} | "
                f"{row['oom_kills']} | - |")
    recs = row["records"]
    ok = [r for r in recs if r[1] == "200"]
    lat = [r[2] for r in ok]
    if row["server"] == "vbs" and row.get("metrics"):
        m, b = row["metrics"], row.get("metrics_before") or {}
        loads = sum(m["loads"].values()) - sum(b.get("loads", {}).values())
        unloads = sum(m["unloads"].values()) - sum(b.get("unloads", {}).values())
        load_s = sum(m["load_sum"].values()) - sum(b.get("load_sum", {}).values())
        changes = (f"{loads:.0f} / {unloads:.0f} | {load_s / loads:.2f} s mean"
                   if loads else f"0 / {unloads:.0f} | -")
        changes += " (server)"
    elif row.get("client"):
        c = row["client"]
        t = c["load_times"]
        mean = f"{c['load_s'] / c['loads']:.2f} s mean" if c["loads"] else "-"
        changes = (f"{c['loads']} / {c['unloads']} | {mean} (client: {c['load_s']:.1f} s "
                   f"loading, {c['unload_s']:.1f} s unloading; {c['failed_loads']} failed "
                   f"loads; p50 {_ms(_pct(t, 0.5))} ms)")
    else:
        changes = "- | -"
    alive = "yes" if row["alive"] else f"no (exit {row['exit']})"
    return (f"| {row['server']} | {limit:.0f} | {len(recs)} | {len(ok)} | {len(recs) - len(ok)} | "
            f"{len(ok) / row['duration']:.1f} | {_ms(_pct(lat, 0.5))} | {_ms(_pct(lat, 0.99))} | "
            f"{changes} | {peak} | {row['oom_kills']} | {alive} |")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--models", default=MODELS, help="comma-separated, hottest first")
    ap.add_argument("--shape", default="3,224,224")
    ap.add_argument("--batch-max", type=int, default=4, help="vbs-serve's largest request "
                    "planned and Triton's max_batch_size")
    ap.add_argument("--profile-repeats", type=int, default=2, help="`vbs plan`'s timed runs "
                    "per unit and batch (its default 5: planning eight models takes long)")
    ap.add_argument("--profile-warmup", type=int, default=1)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--zipf", type=float, default=1.5, help="the Zipf law's exponent s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limits", default="vbs,triton", help="the cgroup limits, one run of "
                    "every server in each: sizes, or vbs / triton: that server's largest "
                    "footprint alone plus --headroom")
    ap.add_argument("--headroom", default="200MiB")
    ap.add_argument("--client-margin", default="100MiB",
                    help="what the explicit-mode client leaves free below the limit")
    ap.add_argument("--servers", default="vbs,triton-all,triton-explicit")
    ap.add_argument("--timeout", type=float, default=60.0, help="a request's timeout (s)")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=0, help="Triton's ONNX Runtime threads")
    ap.add_argument("--triton-wait", type=float, default=0.005)
    ap.add_argument("--vbs-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "vbs-serve"))
    ap.add_argument("--store", default=str(Path.home() / ".cache" / "vbs-serve" / "many-store"))
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--footprints", help="an earlier run's --json: take its footprints alone "
                    "instead of measuring them again (the same models, shape and store)")
    args = ap.parse_args()
    args.models = args.models.split(",")
    args.shape_arg = args.shape
    args.shape = tuple(int(d) for d in args.shape.split(","))
    args.threads = args.threads or os.cpu_count() or 1
    args.client_margin = parse_bytes(args.client_margin)
    return args


def print_footprints(args: argparse.Namespace, fp_vbs: dict[str, dict[str, Any]],
                     fp_triton: dict[str, dict[str, Any]], triton_base: int,
                     limits: list[tuple[str, int]]) -> None:
    import torch
    import torchvision

    print("| model | weights (MiB) | vbs-serve alone: group peak (MiB) | vbs-serve: the "
          "model keeps (MiB) | Triton alone: group peak (MiB) | Triton: growth over the "
          "idle server (MiB) | Triton load (s) |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        with torch.device("meta"):
            w = sum(p.numel() * 4 for p in
                    torchvision.models.get_model(model, weights=None).parameters())
        v, t = fp_vbs[model], fp_triton.get(model, {})
        print(f"| {model} | {w / MiB:.0f} | {(v['peak'] or 0) / MiB:.0f} | "
              f"{(v['kept'] or 0) / MiB:.0f} | {(t.get('peak') or 0) / MiB:.0f} | "
              f"{t.get('growth', 0) / MiB:.0f} | {t.get('load_s', 0):.1f} |")
    sum_vbs = sum(f["peak"] or 0 for f in fp_vbs.values())
    sum_triton = sum(f["peak"] or 0 for f in fp_triton.values())
    kept = sum(f["kept"] or 0 for f in fp_vbs.values())
    growth = sum(f["growth"] for f in fp_triton.values())
    print(f"\nfootprints alone together: vbs-serve {sum_vbs / MiB:.0f} MiB, Triton "
          f"{sum_triton / MiB:.0f} MiB; what the models themselves keep together: vbs-serve "
          f"{kept / MiB:.0f} MiB, Triton's stubs {growth / MiB:.0f} MiB over its idle server "
          f"({triton_base / MiB:.0f} MiB)")
    for name, limit in limits:
        print(f"limit {name}: {limit / MiB:.0f} MiB; the footprints alone together are "
              f"{sum_vbs / limit:.1f}x it (vbs-serve's), {sum_triton / limit:.1f}x "
              f"(Triton's)")
    print(f"traffic: Zipf s = {args.zipf}: " + ", ".join(
        f"{m} {100 * p:.1f}%" for m, p in zip(args.models, zipf(len(args.models), args.zipf)))
        + "\n", flush=True)


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print("| server | limit (MiB) | requests | answered | errors | answered/s | p50 (ms) | "
          "p99 (ms) | loads / unloads | load time | group peak (MiB) | OOM kills | alive at "
          "the end |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(summary(row))
    print("\n| server | limit (MiB) | model | share | requests | answered | errors | p50 (ms) "
          "| p99 (ms) | answered after a load wait (its p50 ms) | loads / unloads |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row.get("started"):
            print("\n".join(per_model(row, args.models)))
    for row in rows:
        where = f"{row['server']} in {row['limit'] / MiB:.0f} MiB"
        if row.get("at_start") is not None:
            print(f"\n{where}: loaded at start: {', '.join(row['at_start']) or 'none'}")
        if row.get("log"):
            print(f"\n{where}, the log's last lines:\n" + row["log"])


def main() -> None:
    args = parse_args()
    servers = args.servers.split(",")
    body, headers, _ = request_body(
        np.random.default_rng(1).standard_normal((1, *args.shape)).astype(np.float32), "oip")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vbs-many-") as work:
        args.work = work
        plan(args)
        onnx = export(args) if any(s.startswith("triton") for s in servers) else {}
        repo = triton_repository(args, onnx, "all") if onnx else None
        if args.footprints:  # an earlier run's --json: its footprints, not measured again
            earlier = json.loads(Path(args.footprints).read_text())
            fp_vbs, fp_triton = earlier["footprints_vbs"], earlier["footprints_triton"]
            triton_base = earlier["triton_base"]
        else:
            fp_vbs = footprints_vbs(args, body, headers)
            triton_base, fp_triton = (footprints_triton(args, repo, body, headers) if repo
                                      else (0, {}))
        limits = resolve_limits(args, fp_vbs, fp_triton)
        print_footprints(args, fp_vbs, fp_triton, triton_base, limits)
        rows = []
        for name, limit in limits:
            for server in servers:
                row = run_server(server, args, limit, body, headers, repo,
                                 {m: f["growth"] for m, f in fp_triton.items()}, triton_base)
                row.update(duration=args.duration, limit_name=name)
                rows.append(row)
                print(f"# {server} in {name} ({limit / MiB:.0f} MiB) done", file=sys.stderr,
                      flush=True)
        report(rows, args)
        print(f"\n# whole run {time.perf_counter() - t_start:.0f} s", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"limits": limits, "footprints_vbs": fp_vbs, "footprints_triton": fp_triton,
                 "triton_base": triton_base, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
