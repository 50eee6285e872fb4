"""The fast path: nothing waits on a timer when the model is free, binary bodies are read in
place, every request is copied once into a reusable batch buffer and gets a view of the output,
at most two thread hops per request, and on the CPU all torch work runs on one thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np
import pytest
import torchvision
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image
from starlette.exceptions import HTTPException

from service.claims import of as claims_of
from service.settings import Settings
from planner.solver.tables import build_table
from core.tree import Layer, Profile
from planner.families import build_preprocess
from service import errors, serving
from service.deps import InferQuery, inference_call
from service.errors import UnavailableError, field_error
from service.fast.app import FastPathApp
from service.fast.route import LeanRoute
from service.main import create_app
from service.metrics import Metrics, RequestMetricsMiddleware
from service.wire.npy import decode_npy
from service.wire.raw import decode_raw
from service.wire.v2 import parse_v2, v2_tensor
from workers.worker import Worker
from tests.service.conftest import (TINY_SHAPE, Gate, ServerThread, assert_close, reference, run,
                                    running,
                                    wait_until)


def x_(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *TINY_SHAPE)).astype(np.float32)


def npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x)
    return buf.getvalue()


def test_binary_bodies_are_read_in_place() -> None:
    x = x_(3, 0)
    body = npy(x)
    got = decode_npy(body, TINY_SHAPE, 16)
    assert np.array_equal(got, x) and np.shares_memory(got, np.frombuffer(body, np.uint8))
    raw = x.tobytes()
    got = decode_raw(raw, TINY_SHAPE, 16, shape_text=None, dtype_text="float32")
    assert np.array_equal(got, x) and np.shares_memory(got, np.frombuffer(raw, np.uint8))
    head = (b'{"inputs":[{"name":"x","shape":[3,3,8,8],"datatype":"FP32",'
            b'"parameters":{"binary_data_size":%d}}]}' % len(raw))
    v2 = head + raw
    got = v2_tensor(parse_v2(v2, str(len(head))), TINY_SHAPE, 16)
    assert np.array_equal(got, x) and np.shares_memory(got, np.frombuffer(v2, np.uint8))
    # A big-endian or Fortran-ordered array is made native and C-ordered (a copy, then)
    swapped = decode_npy(npy(x.astype(">f4")), TINY_SHAPE, 16)
    assert swapped.dtype.isnative and np.array_equal(swapped, x)
    fortran = decode_npy(npy(np.asfortranarray(x)), TINY_SHAPE, 16)
    assert fortran.flags.c_contiguous and np.array_equal(fortran, x)


def test_a_lone_request_runs_at_once_and_requests_gather_while_the_model_is_busy(
        make_settings: Callable[..., Settings]) -> None:
    assert Settings().max_batch_delay_ms == 0  # the default: no waiting on a timer
    app = create_app(make_settings(max_batch_delay_ms=0))

    async def main() -> None:
        async with running(app) as client:
            entry = app.state.registry.entries["tiny"]
            gate = Gate(entry)
            first = asyncio.create_task(client.post("/infer", json={"inputs": x_(1, 0).tolist()}))
            await asyncio.wait_for(gate.entered.wait(), 30)  # it ran alone, nobody waited for
            inputs = [x_(1, s) for s in (1, 2, 3)]
            rest = [asyncio.create_task(client.post("/infer", content=npy(x),
                                                    headers={"Content-Type": "application/x-npy"}))
                    for x in inputs]
            await wait_until(lambda: entry.batcher.waiting == 3, what="3 requests queued")
            gate.open()
            assert (await first).json()["batch"] == 1
            for x, task in zip(inputs, rest):
                body = (await task).json()
                assert body["batch"] == 3  # the queue built up during the run: one batch
                assert_close(body["outputs"], reference(entry, x))
            assert gate.batches == 2

    run(main())


def test_a_request_that_finds_the_model_idle_goes_to_it_from_submit(
        make_settings: Callable[..., Settings]) -> None:
    """No queue and no loop turn when the model is idle; the loop gathers what comes meanwhile
    once that batch is answered, and closing waits for such a batch."""
    app = create_app(make_settings(max_batch_delay_ms=0))

    async def main() -> None:
        async with running(app):
            entry = app.state.registry.entries["tiny"]
            batcher, gate = entry.batcher, Gate(entry)
            first = asyncio.create_task(batcher.submit(x_(1, 0)))
            await asyncio.sleep(0)  # one turn: ``first`` runs up to its await, the loop not
            assert batcher.running and batcher.waiting == 0 and batcher.queue.items.empty()
            await asyncio.wait_for(gate.entered.wait(), 30)
            xs = [x_(1, s) for s in (1, 2)]
            rest = [asyncio.create_task(batcher.submit(x)) for x in xs]
            await wait_until(lambda: batcher.waiting == 2, what="2 requests queued")
            gate.open()
            assert (await first).batch_samples == 1
            for x, task in zip(xs, rest):
                outcome = await task
                assert outcome.batch_samples == 2  # gathered together after the first batch
                assert_close(outcome.y, reference(entry, x))

            gate = Gate(entry)  # closed again: a lone request held on the model
            lone = asyncio.create_task(batcher.submit(x_(1, 3)))
            await asyncio.wait_for(gate.entered.wait(), 30)
            closing = asyncio.create_task(batcher.close(timeout_s=30))
            for _ in range(20):  # loop turns (no timer): closing would be over in 4 if it
                await asyncio.sleep(0)  # did not wait for the batch on the model
            assert not closing.done()
            gate.open()
            assert_close((await lone).y, reference(entry, x_(1, 3)))
            await asyncio.wait_for(closing, 30)

    run(main())


@contextlib.asynccontextmanager
async def one_batch_held(app: Any) -> AsyncIterator[tuple[Any, Gate, asyncio.Task[Any]]]:
    """The tiny model's app running, with one batch held on the model's thread (its gate
    closed): the model's entry, the gate and the held request's task."""
    async with running(app):
        entry = app.state.registry.entries["tiny"]
        gate = Gate(entry)
        held = asyncio.create_task(entry.batcher.submit(x_(1, 9)))
        await asyncio.wait_for(gate.entered.wait(), 30)
        yield entry, gate, held


def test_one_buffer_per_batch_and_views_of_the_output(make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings())

    async def main() -> None:
        async with one_batch_held(app) as (entry, gate, held):
            batcher = entry.batcher
            xs = [x_(1, 10), x_(2, 11)]
            both = [asyncio.create_task(batcher.submit(x)) for x in xs]
            await asyncio.sleep(0)  # both queued before the gate opens
            buffer = batcher.stage.buffer
            gate.open()
            outcomes = [await t for t in both]
            await held
            assert batcher.stage.buffer is buffer  # reused, not allocated per batch
            assert outcomes[0].batch_samples == 3
            for x, o in zip(xs, outcomes):
                np.testing.assert_allclose(o.y, reference(entry, x), rtol=1e-4, atol=1e-5)
            # the two requests' outputs are views of the one output of their batch
            assert np.shares_memory(outcomes[0].y.base, outcomes[1].y.base)

    run(main())


def test_a_request_with_values_that_are_not_finite_fails_alone(
        make_settings: Callable[..., Settings]) -> None:
    """Values are first read when copied into the batch buffer, and checked there: a request
    holding NaN is answered 400 naming its field, the requests batched with it run as if it
    had never been sent."""
    app = create_app(make_settings())

    async def main() -> None:
        async with one_batch_held(app) as (entry, gate, held):
            batcher = entry.batcher
            bad = x_(1, 12)
            bad[0, 1, 2, 3] = np.nan
            xs = [x_(1, 10), bad, x_(2, 11)]
            tasks = [asyncio.create_task(batcher.submit(x, field="body")) for x in xs]
            await wait_until(lambda: batcher.waiting == 3, what="3 requests queued")
            gate.open()
            await held
            good = [await tasks[0], await tasks[2]]
            with pytest.raises(errors.RequestError, match="body: holds NaN"):
                await tasks[1]
            assert [o.batch_samples for o in good] == [3, 3]  # one batch, without the bad one
            for x, o in zip((xs[0], xs[2]), good):
                np.testing.assert_allclose(o.y, reference(entry, x), rtol=1e-4, atol=1e-5)

    run(main())


def test_at_most_two_thread_hops_per_request(make_settings: Callable[..., Settings],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A .npy request is decoded on the event loop (0 hops) and runs on the model's thread (1);
    a JSON one is decoded in one worker thread (1) and runs on the model's thread (1)."""
    app = create_app(make_settings())
    hops: list[str] = []
    real = serving.run_in_threadpool

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(fn, "__name__", "?"))
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(serving, "run_in_threadpool", counted)

    async def main() -> None:
        async with running(app) as client:
            entry = app.state.registry.entries["tiny"]
            runs = []
            real_run = entry.batcher.stage.run

            def infer(batch: Any) -> Any:
                runs.append(threading.get_ident())
                return real_run(batch)

            entry.batcher.stage.run = infer  # type: ignore[method-assign]
            x = x_(2, 3)
            r = await client.post("/infer", content=npy(x),
                                  headers={"Content-Type": "application/x-npy"})
            assert r.status_code == 200 and hops == [] and len(runs) == 1
            r = await client.post("/infer", json={"inputs": x.tolist()})
            assert r.status_code == 200 and hops == ["_decode_json"] and len(runs) == 2

    run(main())


def test_all_torch_work_of_a_cpu_service_runs_on_one_thread(
        make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading and every batch: one OpenMP team in the process (see service.loading)."""
    from service.loading import ModelLoader

    threads: list[int] = []
    real = ModelLoader._prepare

    def prepare(self: ModelLoader, entry: Any) -> None:
        threads.append(threading.get_ident())
        real(self, entry)

    monkeypatch.setattr(ModelLoader, "_prepare", prepare)
    app = create_app(make_settings(models=["tiny=tests.planner.factories:two_layer@3x8x8",
                                           "other=tests.planner.factories:two_layer@3x8x8"]))

    async def main() -> None:
        async with running(app) as client:
            for name in ("tiny", "other"):
                entry = app.state.registry.entries[name]
                real_infer = entry.worker.infer

                def infer(x: Any, *a: Any, real_infer: Any = real_infer, **k: Any) -> Any:
                    threads.append(threading.get_ident())
                    return real_infer(x, *a, **k)

                entry.worker.infer = infer
                r = await client.post(f"/infer?model={name}", json={"inputs": x_(1, 1).tolist()})
                assert r.status_code == 200, r.text
            assert len(threads) == 4 and len(set(threads)) == 1
            assert threads[0] != threading.get_ident()  # and never the event loop's

    run(main())


def test_image_preprocessing_is_torchvision_s_without_torch() -> None:
    """The weights' transforms, computed with Pillow and numpy: bit-exact."""
    rng = np.random.default_rng(5)
    image = Image.fromarray(rng.integers(0, 256, (300, 420, 3), dtype=np.uint8))
    pre, mode = build_preprocess("resnet50", (3, 224, 224))
    weights = torchvision.models.get_model_weights("resnet50").DEFAULT
    assert mode == "RGB"
    assert np.array_equal(pre(image), weights.transforms()(image).numpy())


def _costed(profile: Profile, fixed_s: float, per_sample_s: float = 1e-3) -> Profile:
    """``profile`` with a table-making cost per call: ``fixed_s`` + ``per_sample_s`` a sample
    per layer and no workspaces, on torch alone (no other runtime's figures or call costs).
    With a fixed cost, one batch of n + k samples is predicted to save (layers x ``fixed_s``)
    over a batch of n and one of k; without, nothing."""
    def redo(node: Any) -> Any:
        if isinstance(node, Layer):
            b = range(1, len(node.time) + 1)
            return dataclasses.replace(node, time=tuple(fixed_s + per_sample_s * k for k in b),
                                       ws=tuple(0 for _ in b), runtimes=(), runtime=(),
                                       unsupported=())
        return dataclasses.replace(node, children=tuple(redo(c) for c in node.children))
    return dataclasses.replace(profile, root=redo(profile.root))


async def _with_costs(app: Any, fixed_s: float, per_sample_s: float = 1e-3) -> Any:
    """The tiny model's batcher, its worker on a table of ``_costed`` times (one batch run so
    the batcher has read them)."""
    entry = app.state.registry.entries["tiny"]
    profile = _costed(entry.prepared.profile, fixed_s, per_sample_s)
    worker = Worker(entry.prepared.capture, build_table(profile, slot_bytes=64),
                    entry.worker.probe)
    entry.worker = entry.batcher.worker = worker
    await entry.batcher.submit(x_(1, 0))
    if entry.batcher.policy.follow_up > 0:  # (turned off, the batcher reads no times at all)
        expected = worker.table.times_within(worker.allowance())
        await wait_until(lambda: entry.batcher.policy.times == expected,
                         what="the new table's times read")
    return entry.batcher


def _just_answered(batcher: Any, samples: int, ago_s: float = 0.0) -> None:
    """As if a batch of ``samples`` was answered ``ago_s`` seconds ago, none of its clients back."""
    batcher.policy.last = (samples, time.perf_counter() - ago_s)
    batcher.policy.since_last = 0


@pytest.mark.parametrize("fixed_s", [30.0])
def test_the_batcher_waits_for_the_last_batch_s_clients_when_the_table_says_it_pays(
        make_settings: Callable[..., Settings], fixed_s: float) -> None:
    """Closed-loop clients: a batch of 2 was just answered; the first client back waits for the
    second (the table says one batch of 2 saves 2 x 30 s over two of 1), and they run as one."""
    app = create_app(make_settings(max_batch_delay_ms=0, batch_follow_up=1.0))

    async def main() -> None:
        async with running(app):
            batcher = await _with_costs(app, fixed_s)
            times = batcher.policy.times
            assert times[1] * 2 - times[2] == pytest.approx(2 * fixed_s)
            _just_answered(batcher, 2)
            a = asyncio.create_task(batcher.submit(x_(1, 1)))
            await wait_until(lambda: batcher.waiting == 0, what="the first request taken")
            assert not a.done()  # waiting for the other client, not running alone
            b = asyncio.create_task(batcher.submit(x_(1, 2)))
            assert (await a).batch_samples == 2 == (await b).batch_samples
            # and the outputs are still each request's own
            entry = app.state.registry.entries["tiny"]
            np.testing.assert_allclose((await a).y, reference(entry, x_(1, 1)), rtol=1e-4,
                                       atol=1e-5)

    run(main())


@pytest.mark.parametrize("case", ["no saving", "small saving", "single client", "long ago",
                                  "turned off"])
def test_the_batcher_runs_at_once_when_waiting_cannot_pay(
        make_settings: Callable[..., Settings], case: str) -> None:
    """No wait (a wait would be 60 s, past the test's bound): when the table predicts no saving,
    or one under MIN_SAVING of the merged batch (2 x 1 s of 2 x 61 s), when the one client of
    the last batch is the one back, when the last batch ended long ago, or with
    ``batch_follow_up`` = 0."""
    app = create_app(make_settings(max_batch_delay_ms=0,
                                   batch_follow_up=0.0 if case == "turned off" else 1.0))

    async def main() -> None:
        async with running(app):
            if case == "small saving":
                batcher = await _with_costs(app, 1.0, per_sample_s=30.0)
                times = batcher.policy.times
                assert 0 < 2 * times[1] - times[2] < 0.1 * times[2]
            else:
                batcher = await _with_costs(app, 0.0 if case == "no saving" else 30.0)
            _just_answered(batcher, 1 if case == "single client" else 2,
                           ago_s=3600.0 if case == "long ago" else 0.0)
            outcome = await asyncio.wait_for(batcher.submit(x_(1, 1)), 20)
            assert outcome.batch_samples == 1 and outcome.timing.queue_s < 1

    run(main())


def test_a_lean_route_refuses_what_it_would_not_run() -> None:
    """A LeanRoute calls its endpoint with the request and str path parameters only: a query
    parameter, a non-str path parameter or a dependency would silently be skipped, so such a
    route is refused when it is built."""
    async def ok(request: Request, name: str) -> None: ...
    async def bare(request: Request) -> None: ...
    async def query(request: Request, top_k: int = 1) -> None: ...
    async def number(request: Request, name: int) -> None: ...
    async def dependency(request: Request, x: Any = Depends(lambda: 1)) -> None: ...

    router = APIRouter(route_class=LeanRoute)
    router.add_api_route("/ok/{name}", ok, methods=["POST"])
    for path, endpoint in (("/q", query), ("/n/{name}", number), ("/d", dependency)):
        with pytest.raises(TypeError, match="LeanRoute"):
            router.add_api_route(path, endpoint, methods=["POST"])
    with pytest.raises(TypeError, match="LeanRoute"):
        APIRouter(route_class=LeanRoute, dependencies=[Depends(lambda: 1)]).add_api_route(
            "/r", bare, methods=["POST"])
    router.add_api_route("/bare", bare, methods=["POST"])


def _echo_apps(settings: Settings) -> tuple[FastPathApp, FastAPI]:
    """The same lean route, errors and metrics middleware in a FastPathApp and in plain FastAPI."""
    router = APIRouter(prefix="/p", route_class=LeanRoute)

    async def echo(request: Request, name: str) -> Response:
        claims_of(request.state).endpoint = "infer"
        query, body = await inference_call(request, InferQuery)
        if name == "bad":
            raise field_error("body", "is not what it should be")
        if name == "taken":
            raise HTTPException(409, "taken")
        if name == "busy":
            raise UnavailableError("busy now", retry_after=3)
        if name == "boom":
            raise RuntimeError("boom")
        return JSONResponse({"name": name, "top_k": query.top_k, "bytes": len(body)})

    router.add_api_route("/echo/{name}", echo, methods=["POST"])
    apps: list[Any] = []
    for cls in (FastPathApp, FastAPI):
        app = cls()
        app.state.settings = settings
        app.state.metrics = Metrics()
        errors.install(app)
        app.add_middleware(RequestMetricsMiddleware, metrics=app.state.metrics)
        app.include_router(router)
        apps.append(app)
    return apps[0], apps[1]


@pytest.mark.parametrize("api_key", [None, "a-secret-key"])
def test_lean_routes_skip_the_framework_and_answer_exactly_as_it_would(api_key: str | None) -> None:
    """``FastPathApp`` calls a lean route's endpoint without Starlette's and FastAPI's layers
    (the framework's middleware stack is never even built), and every answer, error or not,
    is the one plain FastAPI gives: status, headers, JSON body and the metrics counted."""
    fast, plain = _echo_apps(Settings(models=[], api_key=api_key))
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    requests: list[tuple[str, dict[str, str]]] = [
        ("/p/echo/ok", auth), ("/p/echo/ok?top_k=3", auth), ("/p/echo/ok?top_k=0", auth),
        ("/p/echo/ok?top_k=x", auth), ("/p/echo/bad", auth), ("/p/echo/taken", auth),
        ("/p/echo/ok?top_k=3", auth), ("/p/echo/ok?top_k=0", auth),  # (parsed once: again)
        (f"/p/echo/ok?top_k=2&pad={'x' * 1100}", auth),  # too long to cache: parsed anyway
        (f"/p/echo/ok?top_k=0&pad={'x' * 1100}", auth),
        ("/p/echo/busy", auth), ("/p/echo/boom", auth), ("/p/echo/ok", {}),
        ("/p/echo/ok", {"Authorization": "Bearer wrong-key-here"})]

    async def answers(app: Any) -> list[tuple[int, dict[str, str], Any]]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            out = []
            for path, headers in requests:
                r = await client.post(path, content=b"12345", headers=headers)
                kept = {k: v for k, v in r.headers.items() if k in ("retry-after", "www-authenticate",
                                                                    "content-type")}
                out.append((r.status_code, kept, r.json()))
            return out

    got, want = run(answers(fast)), run(answers(plain))
    assert got == want
    assert {status for status, _, _ in got} >= {200, 400, 409, 500, 503}
    assert fast.middleware_stack is None  # no request went through the framework's stack
    for status in {str(s) for s, _, _ in got}:
        labels = {"model": "-", "endpoint": "infer", "status": status}
        assert (fast.state.metrics.value("vbs_requests_total", labels)
                == plain.state.metrics.value("vbs_requests_total", labels) > 0)

    async def elsewhere(app: Any) -> tuple[int, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return ((await client.get("/p/echo/ok")).status_code,
                    (await client.post("/p/nothing")).status_code)

    assert run(elsewhere(fast)) == run(elsewhere(plain)) == (405, 404)  # FastAPI's answers

    async def unexpected(app: Any) -> None:  # raised for the server to log, as FastAPI does
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            with pytest.raises(RuntimeError, match="boom"):
                await client.post("/p/echo/boom", headers=auth)

    run(unexpected(fast))
    run(unexpected(plain))


def test_a_client_that_goes_away_mid_body_is_answered_400() -> None:
    """The body is read from the ASGI messages themselves: a disconnect before its last byte
    is a 400 naming the body (nothing is decoded or run)."""
    app = create_app(Settings(models=[]))
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": b"\x93NUMPY\x01\x00", "more_body": True},
        {"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/infer", "raw_path": b"/infer", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "headers": [(b"content-type", b"application/x-npy"), (b"content-length", b"1000")]}
    run(app(scope, receive, send))
    assert sent[0]["status"] == 400
    assert b"went away" in sent[1]["body"] and not messages


@pytest.mark.parametrize("body_format", ["json", "npy", "v2"])
def test_infer_answers_the_same_with_the_fast_path_off(make_settings: Callable[..., Settings],
                                                       body_format: str) -> None:
    """``VBS_FAST_PATH=false`` serves /infer and the OIP v2 route through FastAPI's own routes
    and stock uvicorn: the same status, media type and outputs as the fast path, over HTTP."""
    x = x_(2, 21)
    npy = io.BytesIO()
    np.save(npy, x)
    requests = {
        "json": ("/infer", {"json": {"inputs": x.tolist()}}),
        "npy": ("/infer", {"content": npy.getvalue(),
                           "headers": {"content-type": "application/x-npy"}}),
        "v2": ("/v2/models/tiny/infer", {"json": {"inputs": [{
            "name": "input", "shape": list(x.shape), "datatype": "FP32",
            "data": x.ravel().tolist()}]}}),
    }
    path, kwargs = requests[body_format]
    answers = []
    for fast in (True, False):  # each app loads the model anew (random weights): its own reference
        app = create_app(make_settings(fast_path=fast))
        assert isinstance(app, FastPathApp) is fast
        with ServerThread(app) as server, server.client() as client:
            answer = client.post(path, **kwargs)
            too_big = client.post("/infer", content=b"\0" * (65 * 2**20),
                                  headers={"content-type": "application/octet-stream"})
            want = reference(app.state.registry.entries["tiny"], x)
        doc = answer.json()
        outputs = doc["outputs"][0]["data"] if body_format == "v2" else doc["outputs"]
        assert_close(np.asarray(outputs).reshape(want.shape), want)
        answers.append((answer.status_code, answer.headers["content-type"], sorted(doc),
                        too_big.status_code, too_big.json()))
    assert answers[0][0] == 200 and answers[0][3] == 413
    assert answers[0] == answers[1]
