"""The fast path: nothing waits on a timer when the model is free, binary bodies are read in
place, every request is copied once into a reusable batch buffer and gets a view of the output,
at most two thread hops per request, and on the CPU all torch work runs on one thread."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torchvision
from PIL import Image

from planner.settings import Settings
from service import codecs, serving
from service.main import create_app
from tests.service.conftest import (TINY_SHAPE, Gate, assert_close, reference, run, running,
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
    got = codecs.decode_npy(body, TINY_SHAPE, 16)
    assert np.array_equal(got, x) and np.shares_memory(got, np.frombuffer(body, np.uint8))
    raw = x.tobytes()
    got = codecs.decode_raw(raw, TINY_SHAPE, 16, shape_text=None, dtype_text="float32")
    assert np.array_equal(got, x) and np.shares_memory(got, np.frombuffer(raw, np.uint8))
    head = (b'{"inputs":[{"name":"x","shape":[3,3,8,8],"datatype":"FP32",'
            b'"parameters":{"binary_data_size":%d}}]}' % len(raw))
    v2 = head + raw
    got = codecs.v2_tensor(codecs.parse_v2(v2, str(len(head))), TINY_SHAPE, 16)
    assert np.array_equal(got, x) and np.shares_memory(got, np.frombuffer(v2, np.uint8))
    # A big-endian or Fortran-ordered array is made native and C-ordered (a copy, then)
    swapped = codecs.decode_npy(npy(x.astype(">f4")), TINY_SHAPE, 16)
    assert swapped.dtype.isnative and np.array_equal(swapped, x)
    fortran = codecs.decode_npy(npy(np.asfortranarray(x)), TINY_SHAPE, 16)
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


def test_one_buffer_per_batch_and_views_of_the_output(make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings())

    async def main() -> None:
        async with running(app):
            entry = app.state.registry.entries["tiny"]
            batcher = entry.batcher
            gate = Gate(entry)
            held = asyncio.create_task(batcher.submit(x_(1, 9)))
            await asyncio.wait_for(gate.entered.wait(), 30)
            xs = [x_(1, 10), x_(2, 11)]
            both = [asyncio.create_task(batcher.submit(x)) for x in xs]
            await asyncio.sleep(0)  # both queued before the gate opens
            buffer = batcher._buffer
            gate.open()
            outcomes = [await t for t in both]
            await held
            assert batcher._buffer is buffer  # reused, not allocated per batch
            assert outcomes[0].batch_samples == 3
            for x, o in zip(xs, outcomes):
                np.testing.assert_allclose(o.y, reference(entry, x), rtol=1e-4, atol=1e-5)
            # the two requests' outputs are views of the one output of their batch
            assert np.shares_memory(outcomes[0].y.base, outcomes[1].y.base)

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
            real_infer = entry.batcher._infer

            def infer(batch: Any) -> Any:
                runs.append(threading.get_ident())
                return real_infer(batch)

            entry.batcher._infer = infer  # type: ignore[method-assign]
            x = x_(2, 3)
            r = await client.post("/infer", content=npy(x),
                                  headers={"Content-Type": "application/x-npy"})
            assert r.status_code == 200 and hops == [] and len(runs) == 1
            r = await client.post("/infer", json={"inputs": x.tolist()})
            assert r.status_code == 200 and hops == ["_decode_json"] and len(runs) == 2

    run(main())


def test_all_torch_work_of_a_cpu_service_runs_on_one_thread(
        make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading and every batch: one OpenMP team in the process (see service.registry)."""
    from service.registry import Registry

    threads: list[int] = []
    real = Registry._prepare

    def prepare(self: Registry, entry: Any) -> None:
        threads.append(threading.get_ident())
        real(self, entry)

    monkeypatch.setattr(Registry, "_prepare", prepare)
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
    pre, mode = codecs.build_preprocess("resnet50", (3, 224, 224))
    weights = torchvision.models.get_model_weights("resnet50").DEFAULT
    assert mode == "RGB"
    assert np.array_equal(pre(image), weights.transforms()(image).numpy())


def test_the_follow_up_window_waits_only_right_after_a_larger_batch(
        make_settings: Callable[..., Settings]) -> None:
    """Closed-loop clients: a batch of 2 just ended, one request waits for the other to come back
    (within a tenth of that batch's run time); long after, a lone request runs alone."""
    app = create_app(make_settings(max_batch_delay_ms=0, batch_follow_up=0.1))

    async def main() -> None:
        async with running(app):
            batcher = app.state.registry.entries["tiny"].batcher
            loop = asyncio.get_running_loop()
            batcher._last = (2, 600.0, loop.time())  # 2 samples ran for 10 min, just now
            a = asyncio.create_task(batcher.submit(x_(1, 1)))
            await wait_until(lambda: batcher.waiting == 0, what="the first request taken")
            b = asyncio.create_task(batcher.submit(x_(1, 2)))
            assert (await a).batch_samples == 2 == (await b).batch_samples
            batcher._last = (2, 600.0, loop.time() - 3600)  # an hour ago: the model is idle
            assert (await batcher.submit(x_(1, 3))).batch_samples == 1

    run(main())
