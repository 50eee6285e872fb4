"""The dynamic batcher of one model: requests gathered into batches, each run with the plan for
the memory free at that moment.

One asyncio queue and one future per request, and a failure goes to every future of its
batch (as in Ray Serve's ``batching.py``). Nothing waits on a timer when the model is idle: a
request that finds it idle with nothing queued goes straight to the model's thread, and
requests that come while a batch runs are gathered, up to the table's largest request size
(or, with a latency target, the largest whose plan finishes in time), once the model can
take another batch.
``max_batch_delay_ms`` makes a batch wait for company; ``follow_up`` may wait for the last
batch's clients when the table says one merged batch saves more than the wait costs
(off by default: docs/operations.md, "Batching").

Torch never runs on the event loop: a batch goes to the model's thread, where its stage
(``service.batch_stage``: the batch buffer, the device, the encoders) runs it; the loop is
woken once to answer every request of it. Pipelined (``service.finisher``, CUDA's default),
the model's thread only issues a batch and a second thread finishes it, so the next batch is
gathered and issued while the device runs this one: two batches in flight at most. How many
samples a batch gathers and how long it may wait is the gather policy's (``service.gather``).
Closing drains: requests already accepted are run and answered, new ones get 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.batch_stage import BatchStage, Done, Encoder, Outcome
from service.errors import RequestTimeoutError, UnavailableError
from service.finisher import BatchRuns, Result
from service.gather import GatherPolicy
from service.metrics import Metrics
from service.pipeline_stage import PipelinedStage
from workers.worker import Worker

log = logging.getLogger("vbs.service.batcher")


@dataclass(eq=False)
class _Pending:
    x: np.ndarray
    future: asyncio.Future[Outcome]
    submitted: float
    decode_s: float
    encode: Encoder | None
    field: str  # where the request carried its samples, for an error about their values
    counted: bool = True  # in ``Batcher.waiting``: until taken for a batch or given up on

    @property
    def n(self) -> int:
        return int(self.x.shape[0])


_STOP = object()

class _Expired(Exception):
    """A request's timeout went off (``Batcher.submit`` answers it with 504)."""


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(_Expired())


class _Queue:
    """The one queue of a model's requests, with what the rest of the service reads of it:
    how many wait, their samples (demand, for the memory owner), and the request carried over
    to the next batch (it did not fit this one, or came while a batch ran)."""

    def __init__(self, depth: Any) -> None:
        self.items: asyncio.Queue[object] = asyncio.Queue()
        self.carry: _Pending | None = None
        self.waiting = 0   # requests queued (including the carried one), not yet run
        self.samples = 0   # their samples
        self._depth = depth  # the queue-depth gauge

    def put(self, item: _Pending) -> None:
        self.waiting += 1
        self.samples += item.n
        self._depth.set(self.waiting)
        self.items.put_nowait(item)

    def uncount(self, item: _Pending) -> None:
        """Count ``item`` out of ``waiting``, once (taken for a batch, or given up on)."""
        if item.counted:
            item.counted = False
            self.waiting -= 1
            self.samples -= item.n
            self._depth.set(self.waiting)

    def taken(self, item: _Pending) -> bool:
        """Count ``item`` out of the queue; False when its request has gone (timed out)."""
        self.uncount(item)
        return not item.future.done()

    def drain(self) -> list[_Pending]:
        """Every request still waiting, taken out (closing)."""
        pending = [self.carry] if self.carry is not None else []
        self.carry = None
        while True:
            try:
                item = self.items.get_nowait()
            except asyncio.QueueEmpty:
                break
            if isinstance(item, _Pending):
                pending.append(item)
        self.waiting = self.samples = 0
        return pending


class Batcher:
    """Batches requests for one model's worker (see the module doc)."""

    def __init__(self, name: str, worker: Worker, executor: Executor, *, max_delay_s: float,
                 max_queue: int, latency_target_s: float | None, metrics: Metrics,
                 follow_up: float = 0.0, timeout_s: float | None = None,
                 table_version: Callable[[], int | None] = lambda: None,
                 pipelined: bool = False) -> None:
        self.name = name
        self._worker = worker
        self.max_delay_s = max_delay_s
        self.timeout_s = timeout_s  # a request not answered by then gets 504
        self.max_queue = max_queue
        self.policy = GatherPolicy(worker, latency_target_s, follow_up)
        self.stage = PipelinedStage(worker) if pipelined else BatchStage(worker)
        self.metrics = metrics
        self._m = metrics.for_model(name)
        self._table_version = table_version
        self.queue = _Queue(self._m.queue_depth)
        self._running_samples = 0   # samples of the batch on the worker now
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._executor = executor  # its owner shuts it down
        self.runs = BatchRuns(name, self.stage, executor, self.policy, pipelined=pipelined)
        self._inflight: list[list[_Pending]] = []  # batches on the worker now, in issue order
        self._issuing: list[_Pending] | None = None  # the one on the model's thread
        self._free = asyncio.Event()  # set while the model's thread may take a batch
        self._drained = asyncio.Event()  # set while no batch is in flight (awaited by closing)
        self._free.set()
        self._drained.set()

    @property
    def worker(self) -> Worker:
        return self._worker

    @worker.setter
    def worker(self, worker: Worker) -> None:
        """Another worker from the next batch on (its stage and gather policy too)."""
        self._worker = self.stage.worker = self.policy.worker = worker

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.policy.take(await loop.run_in_executor(self._executor, self.policy.outlook))
        # the batch buffer now, not at the first batch: under a memory limit it is part of
        # what stays (the device's memory owner reads that when the model is ready)
        await loop.run_in_executor(self._executor, self.stage.host, self.worker.batch_max)
        self._task = asyncio.create_task(self._loop(), name=f"vbs-batcher-{self.name}")

    async def close(self, timeout_s: float | None = None) -> None:
        """Stop taking requests, run and answer every accepted one."""
        if self._closing:
            return
        self._closing = True
        if self._task is not None:
            self.queue.items.put_nowait(_STOP)
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except asyncio.TimeoutError:
                log.warning("%s: %d requests still waiting after %.1f s of draining; cancelling",
                            self.name, self.queue.waiting, timeout_s or 0)
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
                self._fail_waiting(UnavailableError(f"model {self.name} is shutting down"))
        self.runs.close()

    @property
    def running(self) -> bool:
        """A batch is on the worker now (issued and not answered, when pipelined)."""
        return bool(self._inflight)

    @property
    def waiting(self) -> int:
        return self.queue.waiting

    def demand(self) -> int:
        """Samples queued and running: what the memory arbiter divides memory by (read from
        the torch threads; plain ints)."""
        return self.queue.samples + self._running_samples

    @property
    def closing(self) -> bool:
        return self._closing

    # ------------------------------------------------------------------ requests

    async def submit(self, x: np.ndarray, *, decode_s: float = 0.0,
                     encode: Encoder | None = None, field: str = "inputs",
                     waited_s: float = 0.0) -> Outcome:
        """Queue ``x`` (N samples) and wait for its outputs; 503 when full or closing, 504
        when not answered within ``timeout_s`` (of which ``waited_s`` were spent before, in
        line for memory), 400 naming ``field`` when its values are not all finite in the
        model's dtype (checked as they are copied into the batch).

        ``decode_s`` is the time its decoding took (reported as part of compute input);
        ``encode`` turns its rows of the output into what the response sends, on the model's
        thread right after the batch, or on the finisher's when pipelined (its result is
        ``Outcome.encoded``).
        """
        if self._closing:
            self.metrics.rejected.labels(self.name, "closing").inc()
            raise UnavailableError(f"model {self.name} is shutting down: retry on another "
                                   "replica", retry_after=1)
        if self.queue.waiting >= self.max_queue:
            self.metrics.rejected.labels(self.name, "queue_full").inc()
            raise UnavailableError(f"model {self.name}: {self.queue.waiting} requests are waiting, "
                                   f"the most the queue holds (max_queue); retry shortly",
                                   retry_after=1)
        loop = asyncio.get_running_loop()
        pending = _Pending(x, loop.create_future(), time.perf_counter(), decode_s, encode, field)
        self.policy.since_last += pending.n
        if (self._free.is_set() and self.queue.carry is None and self.queue.items.empty()
                and self.max_delay_s <= 0 and self.policy.follow_up <= 0
                and self._task is not None):
            pending.counted = False  # the model is idle and nothing waits: it runs now
            self._dispatch([pending])
        else:
            self.queue.put(pending)
        # the timeout as one timer on the request's own future (asyncio.wait_for would wrap
        # this coroutine in a task of its own: a loop turn more for every answer)
        timer = (loop.call_later(max(0.0, self.timeout_s - waited_s), _expire, pending.future)
                 if self.timeout_s is not None else None)
        try:
            return await pending.future
        except _Expired:
            self.queue.uncount(pending)
            self.metrics.rejected.labels(self.name, "timeout").inc()
            raise RequestTimeoutError(
                f"model {self.name}: no answer within {self.timeout_s:g} s (request_timeout_s"
                + (f", {waited_s:.3g} s of it in line for memory" if waited_s else "") + "): "
                "the service is busy or the request is large; retry, or send fewer samples"
            ) from None
        except asyncio.CancelledError:  # the client went: no ghost in the count
            self.queue.uncount(pending)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        stopping = False
        try:
            while not (stopping and self.queue.carry is None):
                batch, stop = await self._gather(stopping)
                stopping = stopping or stop
                if batch:
                    self._dispatch(batch)
                    await self._free.wait()  # answered, or issued: the next batch is gathered
                batch = []  # not kept while it is: its samples are given back now
            await self._drained.wait()  # every batch in flight answered before closing ends
        except asyncio.CancelledError:
            for b in self._inflight:
                for p in b:
                    p.future.cancel()
            raise

    async def _gather(self, stopping: bool) -> tuple[list[_Pending], bool]:
        """The next batch, and whether the stop mark was met."""
        loop = asyncio.get_running_loop()
        batch: list[_Pending] = []
        queue = self.queue
        if queue.carry is not None:
            first, queue.carry = queue.carry, None
            if queue.taken(first):
                batch.append(first)
        if stopping and not batch:
            return [], True
        while not batch:
            item = await queue.items.get()
            if item is _STOP:
                return [], True
            assert isinstance(item, _Pending)
            if not self._free.is_set():  # a batch ``submit`` started: gather once it is off
                queue.carry = item  # (carried meanwhile: still waiting, failed on a cancel)
                await self._free.wait()  # the model's thread
                queue.carry = None
            if queue.taken(item):
                batch.append(item)
        limit = max(1, self.policy.limit)
        n = batch[0].n
        deadline = loop.time() + self.max_delay_s
        while n < limit:
            try:
                item = queue.items.get_nowait()  # everything already waiting, at once
            except asyncio.QueueEmpty:
                if self.max_delay_s > 0:
                    remaining = deadline - loop.time()
                else:
                    remaining = self.policy.wait_left(n, batch[0].submitted, self._closing)
                if remaining <= 0:  # nothing to wait for (the default when idle): run it now
                    break
                try:
                    item = await asyncio.wait_for(queue.items.get(), remaining)
                except asyncio.TimeoutError:
                    break
            if item is _STOP:
                return batch, True
            assert isinstance(item, _Pending)
            if item.future.done():
                queue.taken(item)
                continue
            if n + item.n > limit:
                queue.carry = item  # still counted as waiting
                break
            queue.taken(item)
            batch.append(item)
            n += item.n
        return batch, False

    def _dispatch(self, batch: list[_Pending]) -> None:
        """Hand ``batch`` to the model's thread (``self.runs``): it runs the batch, or issues
        it and the finisher finishes it, and every request is answered in one call on the
        loop (``_answer``), so an answer costs one loop turn after the batch."""
        self._inflight.append(batch)
        self._issuing = batch
        self._running_samples += sum(p.n for p in batch)
        self._moved()
        try:
            self.runs.submit(batch, time.perf_counter(), self._table_version(),
                             asyncio.get_running_loop(), self._issued, self._answer)
        except Exception as exc:  # noqa: BLE001 - e.g. the executor shut down: fail the batch
            self._answer(batch, exc)

    def _moved(self) -> None:
        """A batch was handed over, issued or answered: whether the model's thread may take
        the next (from the loop, or from ``submit``), whether any is in flight."""
        if self._issuing is None and len(self._inflight) < self.runs.depth:
            self._free.set()
        else:
            self._free.clear()
        if self._inflight:
            self._drained.clear()
        else:
            self._drained.set()

    def _issued(self, batch: list[_Pending]) -> None:
        """On the loop: the model's thread has issued ``batch`` (pipelined): it is free."""
        if self._issuing is batch:
            self._issuing = None
            self._moved()

    def _answer(self, batch: list[_Pending], result: Result, done: Done | None = None) -> None:
        """On the loop: every request of ``batch`` gets its outcome, or the batch's failure;
        the batch is counted in the metrics after that, once its handlers have answered."""
        for i, b in enumerate(self._inflight):
            if b is batch:
                del self._inflight[i]
                self._running_samples -= sum(p.n for p in batch)
                break
        if self._issuing is batch:
            self._issuing = None
        self._moved()
        if isinstance(result, Exception):
            log.warning("%s: a batch of %d requests failed: %s", self.name, len(batch), result)
            result = [result] * len(batch)
        for p, outcome in zip(batch, result):
            if p.future.done():  # timed out, or its client went
                continue
            if isinstance(outcome, Exception):
                p.future.set_exception(outcome)
            else:
                p.future.set_result(outcome)
        if done is not None:
            self.policy.answered(done.samples)
            # scheduled after the handlers' wake-ups: each writes its response first
            asyncio.get_running_loop().call_soon(self._m.observe_batch, done, result)

    def _fail_waiting(self, exc: Exception) -> None:
        for p in self.queue.drain():
            if not p.future.done():
                p.future.set_exception(exc)
