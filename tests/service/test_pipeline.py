"""The pipelined batcher on the CPU (``pipeline="on"``): the model's thread issues a batch, the
finisher encodes it, the next batch is issued meanwhile, two in flight at most, answered in
the order issued; a failure in either stage goes to every request of its batch, an encoding
error to its request alone; closing drains both stages. Batches are held on the finisher by
an encoder that waits on a threading.Event, and awaited with asyncio.Events, never with
sleeps. The CUDA half (streams, events, pinned slots) is tests/gpu/test_pipeline.py's."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from core.errors import InfeasibleError
from service.batch_stage import BatchStage
from service.errors import UnavailableError
from service.main import create_app
from service.pipeline_stage import PipelinedStage
from service.settings import Settings
from tests.service.conftest import (TINY_SHAPE, Gate, assert_close, reference, run, running,
                                    wait_until)


def x_(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *TINY_SHAPE)).astype(np.float32)


class Held:
    """An encoder that holds the finisher's thread until opened; ``entered`` (asyncio) is set
    once it is reached. ``fail``: raised instead of encoding."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.entered = asyncio.Event()
        self.threads: list[str] = []
        self.fail = fail
        self._open = threading.Event()

    def __call__(self, rows: np.ndarray) -> Any:
        self.threads.append(threading.current_thread().name)
        self.loop.call_soon_threadsafe(self.entered.set)
        if not self._open.wait(timeout=60):
            raise RuntimeError("never opened")
        if self.fail is not None:
            raise self.fail
        return rows.tolist()

    def open(self) -> None:
        self._open.set()


class Issues:
    """The batches the model's thread runs (wraps ``worker.infer``): their inputs' addresses,
    its thread's name; ``fail`` is raised instead of the next run."""

    def __init__(self, entry: Any) -> None:
        loop = asyncio.get_running_loop()
        self.ptrs: list[int] = []
        self.threads: list[str] = []
        self.fail: Exception | None = None
        self._ran = asyncio.Event()
        real = entry.worker.infer

        def infer(x: Any, *args: Any, **kwargs: Any) -> Any:
            self.ptrs.append(x.data_ptr())
            self.threads.append(threading.current_thread().name)
            try:
                if self.fail is not None:
                    raise self.fail
                return real(x, *args, **kwargs)
            finally:
                loop.call_soon_threadsafe(self._ran.set)

        entry.worker.infer = infer

    async def reached(self, n: int) -> None:
        """Until n batches have run."""
        while len(self.ptrs) < n:
            await asyncio.wait_for(self._ran.wait(), 30)
            self._ran.clear()


def pipelined(make_settings: Callable[..., Settings], **overrides: Any) -> Any:
    return create_app(make_settings(pipeline="on", max_batch_delay_ms=0, **overrides))


async def two_in_flight(entry: Any, issues: Issues, held: Held) -> tuple[Any, Any]:
    """Batch A (x_(1, 1)) held on the finisher by ``held``, batch B (x_(3, 2)) issued meanwhile:
    the pipeline full. Their tasks."""
    batcher = entry.batcher
    a = asyncio.create_task(batcher.submit(x_(1, 1), encode=held))
    await asyncio.wait_for(held.entered.wait(), 30)
    b = asyncio.create_task(batcher.submit(x_(3, 2)))  # the model's thread is free: B runs
    await issues.reached(2)
    assert len(batcher._inflight) == 2 and not batcher._free.is_set()
    return a, b


def test_on_the_cpu_the_pipeline_is_off_unless_asked_for(
        make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch) -> None:
    settings = make_settings()
    assert settings.pipeline == "auto"
    assert not settings.pipelined("cpu") and settings.pipelined("cuda")
    assert make_settings(pipeline="off").pipelined("cuda") is False
    monkeypatch.setenv("VBS_PIPELINE", "on")
    assert Settings().pipelined("cpu")
    with pytest.raises(ValueError, match="pipeline"):
        Settings(pipeline="sometimes")
    app = create_app(settings)

    async def main() -> None:
        async with running(app) as client:
            batcher = app.state.registry.entries["tiny"].batcher
            assert type(batcher.stage) is BatchStage and batcher.runs.finisher is None
            assert batcher.runs.depth == 1
            r = await client.post("/infer", json={"inputs": x_(2, 0).tolist()})
            assert r.status_code == 200, r.text

    run(main())


def test_pipelined_answers_equal_the_model_and_are_encoded_on_the_finisher(
        make_settings: Callable[..., Settings]) -> None:
    app = pipelined(make_settings)

    async def main() -> None:
        async with running(app) as client:
            entry = app.state.registry.entries["tiny"]
            batcher = entry.batcher
            assert isinstance(batcher.stage, PipelinedStage) and batcher.runs.depth == 2
            issues = Issues(entry)
            xs = [x_(n, n) for n in (1, 3, 4, 2)]
            answers = await asyncio.gather(*(client.post("/infer", json={"inputs": x.tolist()})
                                             for x in xs))
            for x, r in zip(xs, answers):
                assert r.status_code == 200, r.text
                assert_close(r.json()["outputs"], reference(entry, x))
                t = r.json()["timing"]
                assert all(v >= 0 for v in t.values()) and 0 < t["infer_s"] <= t["run_s"]
            held = Held()
            held.open()
            outcome = await batcher.submit(x_(2, 7), encode=held)
            assert_close(outcome.encoded, reference(entry, x_(2, 7)))
            assert held.threads == ["vbs-finish-tiny_0"]  # encoded off the model's thread
            assert issues.threads and all(t.startswith("vbs-torch") for t in issues.threads)

    run(main())


def test_two_batches_in_flight_at_most_answered_in_issue_order(
        make_settings: Callable[..., Settings]) -> None:
    """A is held on the finisher; B, which comes meanwhile, is issued at once (the model's
    thread is free); C and D wait (two in flight) and go as one batch once A is answered. The
    two slots are used in turn."""
    app = pipelined(make_settings)

    async def main() -> None:
        async with running(app):
            entry = app.state.registry.entries["tiny"]
            batcher = entry.batcher
            most = [0]
            real_moved = batcher._moved

            def moved() -> None:
                real_moved()
                most[0] = max(most[0], len(batcher._inflight))
            batcher._moved = moved
            answered: list[int] = []  # each batch's samples, in the order answered
            real_answer = batcher._answer

            def answer(batch: Any, *args: Any) -> None:
                answered.append(sum(p.n for p in batch))
                real_answer(batch, *args)
            batcher._answer = answer
            issues, held = Issues(entry), Held()
            a, b = await two_in_flight(entry, issues, held)
            xs = {"c": x_(1, 3), "d": x_(1, 4)}
            rest = {k: asyncio.create_task(batcher.submit(x)) for k, x in xs.items()}
            await wait_until(lambda: batcher.waiting == 2, what="C and D queued")
            for _ in range(20):  # loop turns: a third batch would be dispatched in one or two
                await asyncio.sleep(0)
            assert len(issues.ptrs) == 2 and not b.done()
            held.open()
            outcomes = {"a": await a, "b": await b, **{k: await t for k, t in rest.items()}}
            assert answered == [1, 3, 2]
            assert [outcomes[k].batch_samples for k in "abcd"] == [1, 3, 2, 2]
            for k, x in (("a", x_(1, 1)), ("b", x_(3, 2)), *xs.items()):
                np.testing.assert_allclose(outcomes[k].y, reference(entry, x), rtol=1e-4,
                                           atol=1e-5)
            assert most[0] == 2
            first, second = (buf.data_ptr() for buf in batcher.stage.buffers)
            assert first != second and issues.ptrs == [first, second, first]

    run(main())


@pytest.mark.parametrize("stage", ["issue", "finish"])
def test_a_failure_in_either_stage_goes_to_every_request_of_its_batch(
        make_settings: Callable[..., Settings], stage: str) -> None:
    app = pipelined(make_settings)

    async def main() -> None:
        async with running(app):
            entry = app.state.registry.entries["tiny"]
            batcher = entry.batcher
            issues, held = Issues(entry), Held()
            a, b = await two_in_flight(entry, issues, held)
            c, d = (asyncio.create_task(batcher.submit(x_(1, s))) for s in (3, 4))
            await wait_until(lambda: batcher.waiting == 2, what="C and D queued")
            if stage == "issue":
                issues.fail = InfeasibleError("no plan of 2 samples fits in 10 free bytes")
            else:
                real = PipelinedStage._landed

                def landed(issued: Any) -> Any:
                    if issued.total == 2:
                        raise RuntimeError("the device was lost")
                    return real(issued)
                batcher.stage._landed = landed
            held.open()
            assert (await a).batch_samples == 1 and (await b).batch_samples == 3
            for task in (c, d):
                with pytest.raises((InfeasibleError, RuntimeError), match="no plan|lost"):
                    await task
            issues.fail = None
            for s in (5, 6, 7):  # nothing wedged: both slots free again
                outcome = await batcher.submit(x_(1, s))
                np.testing.assert_allclose(outcome.y, reference(entry, x_(1, s)), rtol=1e-4,
                                           atol=1e-5)

    run(main())


def test_an_encoding_error_goes_to_its_request_alone(make_settings: Callable[..., Settings]) -> None:
    app = pipelined(make_settings)

    async def main() -> None:
        async with running(app):
            entry = app.state.registry.entries["tiny"]
            batcher = entry.batcher
            issues, held = Issues(entry), Held()
            a, b = await two_in_flight(entry, issues, held)
            bad = Held(fail=ValueError("cannot encode these rows"))
            bad.open()
            c = asyncio.create_task(batcher.submit(x_(1, 3)))
            d = asyncio.create_task(batcher.submit(x_(1, 4), encode=bad))
            await wait_until(lambda: batcher.waiting == 2, what="C and D queued")
            held.open()
            await a, await b
            outcome = await c
            assert outcome.batch_samples == 2  # D ran in its batch; only its encoding failed
            np.testing.assert_allclose(outcome.y, reference(entry, x_(1, 3)), rtol=1e-4, atol=1e-5)
            with pytest.raises(ValueError, match="cannot encode"):
                await d

    run(main())


def test_closing_drains_both_stages(make_settings: Callable[..., Settings]) -> None:
    """A held on the finisher, B held on the model's thread, C and D queued: closing waits
    for all four and answers each with model(x); a request after it began gets 503."""
    app = pipelined(make_settings)

    async def main() -> None:
        async with running(app):
            entry = app.state.registry.entries["tiny"]
            batcher = entry.batcher
            held = Held()
            a = asyncio.create_task(batcher.submit(x_(1, 1), encode=held))
            await asyncio.wait_for(held.entered.wait(), 30)
            gate = Gate(entry)  # B held in its issue
            xs = [x_(1, 2), x_(1, 3), x_(2, 4)]
            tasks = [asyncio.create_task(batcher.submit(xs[0]))]
            await asyncio.wait_for(gate.entered.wait(), 30)
            tasks += [asyncio.create_task(batcher.submit(x)) for x in xs[1:]]
            await wait_until(lambda: batcher.waiting == 2, what="C and D queued")
            closing = asyncio.create_task(batcher.close(timeout_s=30))
            await wait_until(lambda: batcher.closing, what="closing begun")
            with pytest.raises(UnavailableError, match="shutting down"):
                await batcher.submit(x_(1, 5))
            for _ in range(20):  # loop turns: closing would be over if it did not wait
                await asyncio.sleep(0)
            assert not closing.done()
            gate.open()
            held.open()
            assert_close((await a).encoded, reference(entry, x_(1, 1)))
            for x, task in zip(xs, tasks):
                assert_close((await task).y, reference(entry, x))
            await asyncio.wait_for(closing, 30)
            assert batcher.runs.finisher._shutdown  # given back once drained
            assert not batcher.running

    run(main())


def test_a_slot_is_not_issued_into_while_its_batch_is_in_flight(
        make_settings: Callable[..., Settings]) -> None:
    """The stage's own guard, below the batcher's two in flight: a third issue before the
    first is finished is refused, and goes once it is (its slot free again)."""
    app = pipelined(make_settings)

    class Rows:
        def __init__(self, x: np.ndarray) -> None:
            self.x, self.field, self.encode, self.submitted, self.decode_s = x, "inputs", None, 0.0, 0.0

        @property
        def n(self) -> int:
            return int(self.x.shape[0])

    async def main() -> None:
        async with running(app):
            entry = app.state.registry.entries["tiny"]
            stage = PipelinedStage(entry.worker)
            stage.host(entry.worker.batch_max)
            first, second = (stage.issue([Rows(x_(k, k))]) for k in (1, 2))
            assert (first.slot, second.slot) == tuple(stage.slots)
            with pytest.raises(RuntimeError, match="still in flight"):
                stage.issue([Rows(x_(3, 3))])
            for k, issued in ((1, first), (2, second)):
                done = stage.finish(issued)
                np.testing.assert_allclose(done.rows[0][0], reference(entry, x_(k, k)),
                                           rtol=1e-4, atol=1e-5)
            third = stage.issue([Rows(x_(3, 3))])
            assert third.slot is stage.slots[0]
            np.testing.assert_allclose(stage.finish(third).rows[0][0], reference(entry, x_(3, 3)),
                                       rtol=1e-4, atol=1e-5)

    run(main())
