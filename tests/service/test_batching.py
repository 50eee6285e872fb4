"""The dynamic batcher through real HTTP (ASGI): gathering, the latency bound, a full queue
(503 + Retry-After), the request timeout (504), failures going to every request of a batch,
and a shutdown that answers every accepted request. Batches are held on the worker thread by
a gate (threading.Event) and awaited with asyncio.Events, never with sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from core.errors import InfeasibleError
from service.errors import RequestTimeoutError
from service.settings import Settings
from service.main import create_app
from tests.service.conftest import (TINY_SHAPE, Gate, assert_close, assert_error, reference,
                                    run, running, wait_until)


def x_(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *TINY_SHAPE)).astype(np.float32)


def test_concurrent_requests_are_gathered_into_one_batch(make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(max_batch_delay_ms=200))

    async def main() -> None:
        async with running(app) as client:
            entry = app.state.registry.entries["tiny"]
            batcher = entry.batcher
            gate = Gate(entry)
            first = asyncio.create_task(client.post("/infer", json={"inputs": x_(1, 0).tolist()}))
            await asyncio.wait_for(gate.entered.wait(), 30)  # batch 1 is on the worker
            inputs = [x_(1, s) for s in (1, 2, 3)]
            rest = [asyncio.create_task(client.post("/infer", json={"inputs": x.tolist()}))
                    for x in inputs]
            await wait_until(lambda: batcher.waiting == 3, what="3 requests queued")
            gate.open()
            answers = [await t for t in rest]
            assert (await first).json()["batch"] == 1
            for x, r in zip(inputs, answers):
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["batch"] == 3 and body["plan"]["batch"] == 3  # one batch of 3
                assert_close(body["outputs"], reference(entry, x))
            assert gate.batches == 2

    run(main())


def test_the_latency_target_limits_what_a_batch_gathers(make_settings: Callable[..., Settings]) -> None:
    async def batch_sizes(target: float) -> list[int]:
        app = create_app(make_settings(max_batch_delay_ms=100, latency_target_s=target))
        async with running(app) as client:
            entry = app.state.registry.entries["tiny"]
            gate = Gate(entry)
            first = asyncio.create_task(client.post("/infer", json={"inputs": x_(1, 0).tolist()}))
            await asyncio.wait_for(gate.entered.wait(), 30)
            rest = [asyncio.create_task(client.post("/infer", json={"inputs": x_(1, s).tolist()}))
                    for s in range(3)]
            await wait_until(lambda: entry.batcher.waiting == 3, what="3 requests queued")
            gate.open()
            await first
            return [(await t).json()["batch"] for t in rest]

    async def main() -> None:
        # No plan finishes within a nanosecond: batches of one sample.
        assert await batch_sizes(1e-9) == [1, 1, 1]
        # An hour: the table's largest request size, so all three run together.
        assert await batch_sizes(3600.0) == [3, 3, 3]

    run(main())


def test_a_full_queue_answers_503_with_retry_after(make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(max_queue=2, max_batch_delay_ms=1))

    async def main() -> None:
        async with running(app) as client:
            entry = app.state.registry.entries["tiny"]
            gate = Gate(entry)
            body = {"inputs": x_(1, 0).tolist()}
            running_one = asyncio.create_task(client.post("/infer", json=body))
            await asyncio.wait_for(gate.entered.wait(), 30)
            queued = [asyncio.create_task(client.post("/infer", json=body)) for _ in range(2)]
            await wait_until(lambda: entry.batcher.waiting == 2, what="a full queue")
            full = await client.post("/infer", json=body)
            assert_error(full, 503, "max_queue")
            assert full.headers["Retry-After"] == "1"
            gate.open()
            for task in [running_one, *queued]:
                assert (await task).status_code == 200  # every accepted request is answered
            assert (await client.post("/infer", json=body)).status_code == 200
            metrics = app.state.metrics
            assert metrics.value("vbs_rejected_total", {"model": "tiny", "reason": "queue_full"}) == 1
            assert metrics.value("vbs_requests_total", {"model": "tiny", "endpoint": "infer",
                                                        "status": "503"}) == 1

    run(main())


def test_a_request_not_answered_in_time_gets_504(make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(request_timeout_s=0.3))

    async def main() -> None:
        async with running(app) as client:
            entry = app.state.registry.entries["tiny"]
            gate = Gate(entry)
            body = {"inputs": x_(1, 0).tolist()}
            slow = asyncio.create_task(client.post("/infer", json=body))  # runs, held at the gate
            await asyncio.wait_for(gate.entered.wait(), 30)
            queued = await client.post("/infer", json=body)  # waits behind it: times out
            assert_error(queued, 504, "request_timeout_s")
            assert_error(await slow, 504)
            gate.open()
            ok = await client.post("/infer", json=body)
            assert ok.status_code == 200
            assert_close(ok.json()["outputs"], reference(entry, np.asarray(body["inputs"])))
            # the timed-out request queued behind the held batch never ran
            await wait_until(lambda: entry.batcher.waiting == 0)
            assert gate.batches == 2

    run(main())


def test_a_wait_in_line_for_memory_counts_toward_the_timeout(
        make_settings: Callable[..., Settings]) -> None:
    """A request that spent its whole request_timeout_s in line for memory (``waited_s``,
    service.admission) gets 504 at once when queued, not another timeout later."""
    app = create_app(make_settings(request_timeout_s=60))

    async def main() -> None:
        async with running(app) as client:
            entry = app.state.registry.entries["tiny"]
            gate = Gate(entry)
            body = {"inputs": x_(1, 0).tolist()}
            held = asyncio.create_task(client.post("/infer", json=body))  # the model is busy
            await asyncio.wait_for(gate.entered.wait(), 30)
            late = entry.batcher.submit(x_(1, 1), waited_s=60.0)
            with pytest.raises(RequestTimeoutError, match="60 s of it in line for memory"):
                await asyncio.wait_for(late, 10)  # not the 60 s of a fresh request
            await wait_until(lambda: entry.batcher.waiting == 0)
            gate.open()
            assert (await held).status_code == 200

    run(main())


def test_timed_out_requests_leave_the_queue_count_at_once(
        make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(max_queue=2, request_timeout_s=1.0))

    async def main() -> None:
        async with running(app) as client:
            entry = app.state.registry.entries["tiny"]
            batcher = entry.batcher
            gate = Gate(entry)
            body = {"inputs": x_(1, 0).tolist()}
            held = asyncio.create_task(client.post("/infer", json=body))
            await asyncio.wait_for(gate.entered.wait(), 30)
            ghosts = await asyncio.gather(*(client.post("/infer", json=body) for _ in range(2)))
            for r in ghosts:
                assert_error(r, 504, "request_timeout_s")
            # still queued behind the held batch, but no longer counted: no 503 from ghosts
            assert batcher.waiting == 0
            assert app.state.metrics.value("vbs_queue_depth", {"model": "tiny"}) == 0
            app.state.settings.request_timeout_s = 120  # the next one must not time out
            fresh = asyncio.create_task(client.post("/infer", json=body))
            await wait_until(lambda: batcher.waiting == 1, what="a new request accepted")
            gate.open()
            r = await fresh
            assert r.status_code == 200, r.text
            assert_close(r.json()["outputs"], reference(entry, np.asarray(body["inputs"])))
            await held
            assert batcher.waiting == 0 and gate.batches == 2  # the ghosts never ran

    run(main())


def test_a_failed_batch_fails_every_request_in_it(make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(max_batch_delay_ms=200))

    async def main() -> None:
        async with running(app) as client:
            entry = app.state.registry.entries["tiny"]
            gate = Gate(entry)
            first = asyncio.create_task(client.post("/infer", json={"inputs": x_(1, 0).tolist()}))
            await asyncio.wait_for(gate.entered.wait(), 30)
            real = gate._real

            def no_memory(x, *args, **kwargs):  # type: ignore[no-untyped-def]
                raise InfeasibleError("no plan of 1 samples fits in 10 free bytes")
            gate._real = no_memory
            both = [asyncio.create_task(client.post("/infer", json={"inputs": x_(1, s).tolist()}))
                    for s in (1, 2)]
            await wait_until(lambda: entry.batcher.waiting == 2)
            gate.open()
            assert_error(await first, 503, "no plan")  # the held batch meets the failure too
            for task in both:
                r = await task
                assert_error(r, 503, "no plan of 1 samples")
                assert r.headers["Retry-After"]
            gate._real = real
            assert (await client.post("/infer", json={"inputs": x_(1, 3).tolist()})).status_code == 200

    run(main())


@pytest.mark.parametrize("delay_ms", [0, 1])  # 0: the first request went to the model from submit
def test_shutdown_answers_every_accepted_request(make_settings: Callable[..., Settings],
                                                 delay_ms: int) -> None:
    app = create_app(make_settings(max_batch_delay_ms=delay_ms))

    async def main() -> None:
        inputs = [x_(4, s) for s in range(6)]  # 4 samples: one request per batch
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        await app.state.registry.wait_ready(60)
        import httpx
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://vbs.test") as client:
            entry = app.state.registry.entries["tiny"]
            gate = Gate(entry)
            tasks = [asyncio.create_task(client.post("/infer", json={"inputs": x.tolist()}))
                     for x in inputs]
            await asyncio.wait_for(gate.entered.wait(), 30)
            await wait_until(lambda: entry.batcher.waiting == 5, what="all requests accepted")
            closing = asyncio.create_task(lifespan.__aexit__(None, None, None))
            await wait_until(lambda: entry.batcher.closing, what="shutdown started")
            late = await client.post("/infer", json={"inputs": inputs[0].tolist()})
            assert_error(late, 503, "shutting down")
            gate.open()
            for x, task in zip(inputs, tasks):
                r = await task
                assert r.status_code == 200, r.text
                assert_close(r.json()["outputs"], reference(entry, x))
            await asyncio.wait_for(closing, 30)

    run(main())
