"""Many models in one memory: loaded at start while they fit, then each on demand, the least
recently used idle one unloaded for another; a model that can never fit refused with 413
naming the limit; the model repository API over HTTP, and Triton's own clients' model
control over HTTP and gRPC; traffic cycling through more models than fit, every request
answered.

Real parts: models whose weights outweigh their activations (``tests.service.heavy``, one
weights file for all, so every load of a model computes the same), their tables in a
directory store, a ``models_memory_bytes`` that holds one or two of them (the device's memory
owner and its arbiter keep it: no cgroup needed).
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.utils import InferenceServerException

from service.cli import serve_settings
from service.commands import build_parser
from service.main import create_app
from service.oip import pb
from service.settings import Settings
from tests.conftest import free_port
from tests.service.conftest import Gate, ServerThread, assert_close, assert_error, run, \
    running, settings_for, wait_until
from tests.service.heavy import INPUT, heavier, heavy

HEAVY = "tests.service.heavy:heavy@3x8x8"      # keeps 4214208 bytes loaded (weights, buffer)
HEAVIER = "tests.service.heavy:heavier@3x8x8"
ONE = 6_000_000    # models_memory_bytes that holds one HEAVY model and its plans
TWO = 10_000_000   # ... two of them, not three
KEY = "repository-test-key"


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One state_dict for every HEAVY alias: each load of a model computes the same."""
    path = tmp_path_factory.mktemp("heavy") / "heavy.pt"
    torch.manual_seed(0)
    torch.save(heavy().state_dict(), path)
    return path


@pytest.fixture
def make(vbs_cache: Path, tmp_path: Path, weights: Path) -> Callable[..., Settings]:
    def settings(names: str = "abc", **overrides: Any) -> Settings:
        base: dict[str, Any] = dict(models=[f"{n}={HEAVY}" for n in names], runtime="torch",
                                    weights=weights)
        base.update(overrides)
        return settings_for(vbs_cache, tmp_path / "store", **base)
    return settings


def x_(n: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *INPUT)).astype(np.float32)


def expected(weights: Path, x: np.ndarray) -> np.ndarray:
    model = heavy()
    model.load_state_dict(torch.load(weights, weights_only=True))
    with torch.inference_mode():
        return model(torch.from_numpy(x)).numpy()


def v2(x: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.ravel().tolist()}]}


def states(app: Any) -> dict[str, str]:
    return {e.name: e.state for e in app.state.registry.entries.values()}


def metric(app: Any, name: str, **labels: str) -> float:
    return app.state.metrics.value(name, labels)


# ------------------------------------------------------------------ on demand, LRU


def test_a_request_loads_its_model_and_the_least_recently_used_idle_one_goes(
        make: Callable[..., Settings], weights: Path) -> None:
    app = create_app(make(models_memory_bytes=TWO))
    registry = app.state.registry
    x = x_(2, seed=1)
    want = expected(weights, x)

    async def infer(client: httpx.AsyncClient, model: str) -> dict[str, Any]:
        r = await client.post(f"/v2/models/{model}/infer", json=v2(x))
        assert r.status_code == 200, r.text
        body = r.json()
        assert_close(np.asarray(body["outputs"][0]["data"]).reshape(want.shape), want)
        return body["parameters"]

    async def main() -> None:
        async with running(app) as client:
            # at start: the first two fit, the third is left to load on demand; ready
            assert states(app) == {"a": "ready", "b": "ready", "c": "unloaded"}
            assert (await client.get("/v2/health/ready")).status_code == 200
            c = registry.entries["c"]
            assert "loads on its first request" in c.reason
            meta = (await client.get("/v2/models/c")).json()  # known before it loads
            assert meta["outputs"][0]["shape"] == [-1, 4096]
            assert meta["parameters"]["state"] == "unloaded"
            assert_error(await client.get("/v2/models/c/ready"), 503, "unloaded")
            kept = registry.memory.models.kept()
            assert set(kept) == {"a", "b"} and kept["a"] == registry.entries["a"].kept_bytes
            assert registry.memory.plan_free() == TWO - sum(kept.values())

            assert (await infer(client, "a"))["load_wait_s"] == 0  # a used after b
            module = weakref.ref(registry.entries["b"].prepared.capture.model.module)
            params = await infer(client, "c")  # room for c: b goes, the least recently used
            assert params["load_wait_s"] > 0
            assert states(app) == {"a": "ready", "b": "unloaded", "c": "ready"}
            assert "make room" in registry.entries["b"].reason
            gc.collect()
            assert module() is None, "the unloaded model's weights are still referenced"
            kept = registry.memory.models.kept()  # b counted back: what plans may use grew by it
            assert set(kept) == {"a", "c"}
            assert registry.memory.plan_free() == TWO - sum(kept.values())
            assert registry.entries["b"].worker is None and registry.entries["b"].batcher is None

            await infer(client, "b")  # now a is the least recently used
            assert states(app) == {"a": "unloaded", "b": "ready", "c": "ready"}
            r = await client.post("/infer", params={"model": "a"}, json={"inputs": x.tolist()})
            assert r.status_code == 200 and r.json()["timing"]["load_wait_s"] > 0
            assert states(app) == {"a": "ready", "b": "ready", "c": "unloaded"}  # c: used before b
            kept = registry.memory.models.kept()

            models = (await client.get("/models")).json()
            assert models["models_memory"]["configured_bytes"] == TWO
            assert {m["name"]: m["state"] for m in models["models"]} == states(app)
            assert all(m["table"]["plans"] >= 1 for m in models["models"])  # kept when unloaded
            plan = await client.get("/plan", params={"model": "c", "mem": "1MB"})
            assert plan.status_code == 200, plan.text  # /plan answers for an unloaded model
            for name in "abc":
                assert metric(app, "vbs_model_unloads_total", model=name, reason="memory") == 1
            assert metric(app, "vbs_model_loads_total", model="a") == 2
            assert metric(app, "vbs_model_load_seconds_count", model="c") == 1
            assert metric(app, "vbs_model_kept_bytes", model="c") == 0
            assert metric(app, "vbs_model_kept_bytes", model="b") == kept["b"]

    run(main())


def test_a_busy_model_is_not_unloaded_the_request_waits_for_it(
        make: Callable[..., Settings]) -> None:
    # each model on its own torch thread: a batch held in a does not hold b's load
    app = create_app(make("ab", models_memory_bytes=ONE, cpu_model_threads="per_model",
                          drain_after_s=60))  # (draining a: the next test)
    registry = app.state.registry
    x = x_()

    async def main() -> None:
        async with running(app) as client:
            assert states(app) == {"a": "ready", "b": "unloaded"}
            gate = Gate(registry.entries["a"])
            held = asyncio.create_task(client.post("/v2/models/a/infer", json=v2(x)))
            await asyncio.wait_for(gate.entered.wait(), 30)
            waiting = asyncio.create_task(client.post("/v2/models/b/infer", json=v2(x)))
            await asyncio.sleep(0.5)
            assert not waiting.done() and states(app) == {"a": "ready", "b": "unloaded"}
            gate.remove()
            for task in (held, waiting):
                r = await task
                assert r.status_code == 200, r.text
            assert r.json()["parameters"]["load_wait_s"] >= 0.5
            assert states(app) == {"a": "unloaded", "b": "ready"}

    run(main())


def test_a_load_that_waited_for_an_idle_model_drains_the_least_recently_used_busy_one(
        make: Callable[..., Settings], weights: Path) -> None:
    """Under steady traffic a model is never idle: a load that only waited for an idle one
    starved (section 8, round 6). After ``drain_after_s`` the coldest busy model is drained:
    no request let through from then (one that comes waits and loads it again), the one let
    through answered, then unloaded; every request answered with ``model(x)``."""
    app = create_app(make("abc", models_memory_bytes=TWO, cpu_model_threads="per_model",
                          drain_after_s=0.2))
    registry = app.state.registry
    x = x_(seed=2)
    want = expected(weights, x)

    async def main() -> None:
        async with running(app) as client:
            assert states(app) == {"a": "ready", "b": "ready", "c": "unloaded"}
            gates = [Gate(registry.entries[n]) for n in "ba"]  # b used first: the colder
            held = []
            for gate, name in zip(gates, "ba"):
                held.append(asyncio.create_task(client.post(f"/v2/models/{name}/infer",
                                                            json=v2(x))))
                await asyncio.wait_for(gate.entered.wait(), 30)
            waiting = asyncio.create_task(client.post("/v2/models/c/infer", json=v2(x)))
            await wait_until(lambda: states(app)["b"] == "unloading", 30)
            assert states(app)["a"] == "ready"  # the more recently used stays
            again = asyncio.create_task(client.post("/v2/models/b/infer", json=v2(x)))
            await asyncio.sleep(0.3)
            assert not waiting.done() and not again.done()  # b lets nothing new through
            for gate in gates:
                gate.remove()
            for task in (*held, waiting, again):
                r = await task
                assert r.status_code == 200, r.text
                body = r.json()
                assert_close(np.asarray(body["outputs"][0]["data"]).reshape(want.shape), want)
            assert metric(app, "vbs_model_unloads_total", model="b", reason="memory") >= 1

    run(main())


def test_a_request_that_cannot_wait_long_enough_gets_503_with_retry_after(
        make: Callable[..., Settings]) -> None:
    app = create_app(make("ab", models_memory_bytes=ONE, cpu_model_threads="per_model",
                          request_timeout_s=1.0))
    registry = app.state.registry

    async def main() -> None:
        async with running(app) as client:
            gate = Gate(registry.entries["a"])
            held = asyncio.create_task(client.post("/v2/models/a/infer", json=v2(x_())))
            await asyncio.wait_for(gate.entered.wait(), 30)
            r = await client.post("/v2/models/b/infer", json=v2(x_()))
            assert_error(r, 503, "model b is not loaded", "request_timeout_s")
            assert int(r.headers["retry-after"]) >= 1
            gate.remove()
            assert (await held).status_code in (200, 504)  # its own timeout passed meanwhile
            # a idle now: a retry starts b's load in a's place, which goes on when the retry
            # itself gives up (its 1 s may not hold the load on a busy machine: 503 while b
            # loads, or 504 where it got in line with too little of its second left); a
            # client retrying as told gets its answer
            for _ in range(30):
                r = await client.post("/v2/models/b/infer", json=v2(x_()))
                if r.status_code not in (503, 504):
                    break
                assert_error(r, r.status_code, "model b", "request_timeout_s", "retry")
                await asyncio.sleep(int(r.headers.get("retry-after", 1)))
            assert r.status_code == 200, r.text
            assert states(app) == {"a": "unloaded", "b": "ready"}

    run(main())


def test_a_load_that_leaves_no_room_to_make_its_session_waits_for_a_busy_model(
        make: Callable[..., Settings]) -> None:
    """b fits beside a, but not with the room making its largest session takes as it loads
    (what its last load measured, ``ModelEntry.making_bytes``): while a is busy, b's load
    waits rather than going ahead beside it (section 8's kill), then a goes and b loads. A
    model that alone leaves no such room is refused 413, not loaded."""
    app = create_app(make("abc", models_memory_bytes=TWO, cpu_model_threads="per_model",
                          drain_after_s=60))
    registry = app.state.registry
    x = x_()

    async def main() -> None:
        async with running(app) as client:
            assert states(app) == {"a": "ready", "b": "ready", "c": "unloaded"}
            c = registry.entries["c"]
            c.making_bytes = 4_000_000  # free to make its session, beside what stays
            gate = Gate(registry.entries["a"])
            held = asyncio.create_task(client.post("/v2/models/a/infer", json=v2(x)))
            await asyncio.wait_for(gate.entered.wait(), 30)
            waiting = asyncio.create_task(client.post("/v2/models/c/infer", json=v2(x)))
            # b, idle, goes for c; then c fits beside a, but not with that room
            await wait_until(lambda: states(app)["b"] == "unloaded", 30)
            await asyncio.sleep(0.5)
            assert not waiting.done() and states(app) == {"a": "ready", "b": "unloaded",
                                                          "c": "unloaded"}  # not loading
            gate.remove()
            for task in (held, waiting):
                r = await task
                assert r.status_code == 200, r.text
            assert states(app) == {"a": "unloaded", "b": "unloaded", "c": "ready"}
            b = registry.entries["b"]
            b.making_bytes = 3 * TWO  # alone, its load leaves no room to make its session
            r = await client.post("/v2/models/b/infer", json=v2(x))
            assert_error(r, 413, "model b", "its load, making its largest session",
                         "models_memory_bytes")
            assert states(app) == {"a": "unloaded", "b": "unloaded", "c": "ready"}

    run(main())


def test_a_model_that_can_never_fit_is_refused_with_413_naming_the_limit(
        make: Callable[..., Settings]) -> None:
    app = create_app(make(models=[f"small={HEAVY}", f"big={HEAVIER}"], weights=None,
                          models_memory_bytes=ONE))

    async def main() -> None:
        async with running(app) as client:
            assert states(app) == {"small": "ready", "big": "unloaded"}
            assert (await client.get("/v2/health/ready")).status_code == 200
            big = app.state.registry.entries["big"]
            assert "models_memory_bytes" in big.reason
            x = x_()
            for r in (await client.post("/v2/models/big/infer", json=v2(x)),
                      await client.post("/infer", params={"model": "big"},
                                        json={"inputs": x.tolist()}),
                      await client.post("/v2/repository/models/big/load")):
                assert_error(r, 413, "model big", "models_memory_bytes", str(ONE))
            assert (await client.post("/v2/models/small/infer", json=v2(x))).status_code == 200
            assert states(app) == {"small": "ready", "big": "unloaded"}

    run(main())


# ------------------------------------------------------------------ the repository API


def test_the_repository_endpoints_load_and_unload_models(make: Callable[..., Settings]) -> None:
    app = create_app(make("ab", api_key=KEY))
    auth = {"Authorization": f"Bearer {KEY}"}

    async def main() -> None:
        async with running(app) as client:
            assert_error(await client.post("/v2/repository/index"), 401)
            index = (await client.post("/v2/repository/index", headers=auth)).json()
            assert index == [{"name": n, "version": "1", "state": "READY", "reason": ""}
                             for n in "ab"]
            r = await client.post("/v2/repository/models/a/unload", headers=auth,
                                  json={"parameters": {"unload_dependents": False}})
            assert r.status_code == 200 and r.json()["state"] == "UNAVAILABLE"
            index = (await client.post("/v2/repository/index", headers=auth)).json()
            assert index[0] == {"name": "a", "version": "1", "state": "UNAVAILABLE",
                                "reason": "unloaded through the repository API"}
            ready = await client.post("/v2/repository/index", headers=auth,
                                      json={"ready": True})
            assert [m["name"] for m in ready.json()] == ["b"]
            # unloaded through the API: not loaded on demand, a request is told how to
            r = await client.post("/v2/models/a/infer", headers=auth, json=v2(x_()))
            assert_error(r, 503, "POST /v2/repository/models/a/load")
            assert (await client.get("/v2/health/ready")).status_code == 200
            r = await client.post("/v2/repository/models/a/load", headers=auth)
            assert r.json() == {"name": "a", "version": "1", "state": "READY", "reason": ""}
            r = await client.post("/v2/models/a/infer", headers=auth, json=v2(x_()))
            assert r.status_code == 200, r.text
            assert metric(app, "vbs_model_unloads_total", model="a", reason="request") == 1
            # refusals naming the field
            assert_error(await client.post("/v2/repository/models/nope/load", headers=auth),
                         404, "nope")
            assert_error(await client.post("/v2/repository/models/a/load", headers=auth,
                                           json={"parameters": {"config": "{}"}}),
                         400, "parameters.config")
            assert_error(await client.post("/v2/repository/index", headers=auth,
                                           json={"ready": "yes"}), 400, "ready")
            assert_error(await client.post("/v2/repository/index", headers=auth,
                                           content=b"[1"), 400, "body")

    run(main())


def test_the_proto_has_tritons_repository_messages() -> None:
    for name in ("RepositoryIndexRequest", "RepositoryIndexResponse", "ModelRepositoryParameter",
                 "RepositoryModelLoadRequest", "RepositoryModelLoadResponse",
                 "RepositoryModelUnloadRequest", "RepositoryModelUnloadResponse"):
        ours, theirs = pb.DESCRIPTOR.message_types_by_name[name], \
            triton_pb.DESCRIPTOR.message_types_by_name[name]
        for message in (ours, *ours.nested_types):
            other = theirs if message is ours else theirs.nested_types_by_name[message.name]
            assert [(f.name, f.number, f.type) for f in message.fields] == \
                [(f.name, f.number, f.type) for f in other.fields], message.full_name
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for rpc in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"):
        method = service.methods_by_name[rpc]
        assert method.input_type.name == f"{rpc}Request"
        assert method.output_type.name == f"{rpc}Response"


@pytest.fixture
def served(make: Callable[..., Settings]) -> Iterator[tuple[ServerThread, int]]:
    port = free_port()
    with ServerThread(create_app(make("ab", models_memory_bytes=ONE, grpc_port=port))) as server:
        yield server, port


def test_tritons_clients_control_the_models_over_http_and_grpc(
        served: tuple[ServerThread, int]) -> None:
    server, port = served
    clients = (thttp.InferenceServerClient(server.url.removeprefix("http://")),
               tgrpc.InferenceServerClient(f"127.0.0.1:{port}"))
    try:
        for client in clients:
            grpc = isinstance(client, tgrpc.InferenceServerClient)
            index = client.get_model_repository_index(**({"as_json": True} if grpc else {}))
            models = index["models"] if grpc else index
            assert {m["name"]: m["state"] for m in models} == {"a": "READY", "b": "UNAVAILABLE"}
            client.load_model("b")  # only one fits: a is unloaded for it
            assert client.is_model_ready("b") and not client.is_model_ready("a")
            client.unload_model("b")
            assert not client.is_model_ready("b")
            client.load_model("a")
            assert client.is_model_ready("a")
            with pytest.raises(InferenceServerException) as refused:
                client.load_model("nope")
            assert "nope" in refused.value.message()
            tensor = (tgrpc if grpc else thttp).InferInput("input", [1, *INPUT], "FP32")
            tensor.set_data_from_numpy(x_())
            with pytest.raises(InferenceServerException) as refused:  # b: unloaded by the API
                client.infer("b", [tensor])
            assert "/v2/repository/models/b/load" in refused.value.message()
            assert client.infer("a", [tensor]).as_numpy("output").shape == (1, 4096)
    finally:
        for client in clients:
            client.close()
    metrics = server.app.state.metrics
    assert metrics.value("vbs_model_loads_total", {"model": "b"}) == 2


# ------------------------------------------------------------------ traffic


def test_traffic_cycling_through_more_models_than_fit_is_all_answered(
        make: Callable[..., Settings], weights: Path) -> None:
    app = create_app(make("abcd", models_memory_bytes=TWO))
    registry = app.state.registry
    names = "abcd"
    rounds, clients = 3, 4
    xs = [x_(1 + k % 2, seed=k) for k in range(rounds * len(names))]
    wants = [expected(weights, x) for x in xs]
    seen: list[int] = []

    async def client(http: httpx.AsyncClient, c: int) -> list[str]:
        problems = []
        for k in range(rounds * len(names)):
            model = names[(c + k) % len(names)]
            r = await http.post("/infer", params={"model": model},
                                json={"inputs": xs[k].tolist()})
            seen.append(sum(registry.memory.models.kept().values()))
            if r.status_code != 200:
                problems.append(f"{model}: {r.status_code} {r.text}")
                continue
            assert_close(r.json()["outputs"], wants[k])
        return problems

    async def main() -> None:
        async with running(app) as http:
            found = await asyncio.gather(*(client(http, c) for c in range(clients)))
            assert not [p for got in found for p in got]  # every request answered
            assert max(seen) <= TWO
            for name in names:
                assert metric(app, "vbs_model_loads_total", model=name) >= 1
            unloads = sum(metric(app, "vbs_model_unloads_total", model=n, reason="memory")
                          for n in names)
            loads = sum(metric(app, "vbs_model_loads_total", model=n) for n in names)
            assert unloads >= 2 and loads == unloads + 2  # two loaded at the end
            assert sum(e.ready for e in registry.entries.values()) == 2
            text = (await http.get("/metrics")).text
            assert 'vbs_model_unloads_total{model="a",reason="memory"}' in text

    run(main(), timeout_s=300)


def test_the_models_memory_is_a_setting_and_a_flag() -> None:
    args = build_parser().parse_args(["serve", "--model", "resnet50", "--models-memory", "2GB"])
    assert serve_settings(args).models_memory_bytes == 2_000_000_000
    assert Settings(models_memory_bytes="512MiB").models_memory_bytes == 512 * 2**20
