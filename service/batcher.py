"""The dynamic batcher of one model: requests gathered into batches, each run with the plan for
the memory free at that moment.

One asyncio queue and one future per request, and a failure goes to every future of its
batch (as in Ray Serve's ``batching.py``). Nothing waits on a timer when the model is idle: a
request that finds it idle with nothing queued goes straight to the model's thread, and
requests that come while a batch runs are gathered, up to the table's largest request size
(or, with a latency target, the largest whose plan finishes in time), once it is answered.
``max_batch_delay_ms`` makes a batch wait for company; ``follow_up`` may wait for the last
batch's clients when the table says one merged batch saves more than the wait costs
(off by default: docs/operations.md, "Batching").

Torch never runs on the event loop: a batch goes to the model's thread, where its stage
(``service.batch_stage``: the batch buffer, the device, the encoders) runs it; the loop is
woken once to answer every request of it. How many samples a batch gathers and how long it
may wait is the gather policy's (``service.gather``). Closing drains: requests already
accepted are run and answered, new ones get 503.
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
from service.gather import GatherPolicy
from service.metrics import Metrics
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
                 table_version: Callable[[], int | None] = lambda: None) -> None:
        self.name = name
        self._worker = worker
        self.max_delay_s = max_delay_s
        self.timeout_s = timeout_s  # a request not answered by then gets 504
        self.max_queue = max_queue
        self.policy = GatherPolicy(worker, latency_target_s, follow_up)
        self.stage = BatchStage(worker)
        self.metrics = metrics
        self._m = metrics.for_model(name)
        self._table_version = table_version
        self.queue = _Queue(self._m.queue_depth)
        self._running_samples = 0   # samples of the batch on the worker now
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._executor = executor  # its owner shuts it down
        self._inflight: list[_Pending] = []  # the batch on the worker now
        self._idle = asyncio.Event()  # set while none is (awaited by the loop and by closing)
        self._idle.set()

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

    @property
    def running(self) -> bool:
        """A batch is on the worker now."""
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
        thread right after the batch (its result is ``Outcome.encoded``).
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
        if (not self.running and self.queue.carry is None and self.queue.items.empty()
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
                    await self._dispatch(batch)  # answered: the next batch is gathered
                batch = []  # not kept while it is: its samples are given back now
            await self._idle.wait()  # a batch ``submit`` started: answered before closing ends
        except asyncio.CancelledError:
            for p in self._inflight:
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
            if self.running:  # a batch ``submit`` started: gather once it has been answered
                queue.carry = item  # (carried meanwhile: still waiting, failed on a cancel)
                await self._idle.wait()
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

    def _dispatch(self, batch: list[_Pending]) -> asyncio.Future[None]:
        """Hand ``batch`` to the model's thread; the future is done once it has been answered:
        the thread runs it, does the bookkeeping and answers every request in one call on the
        loop (``_answer``), so an answer costs one loop turn after the batch."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        answered: asyncio.Future[None] = loop.create_future()
        self._inflight = batch
        self._idle.clear()
        self._running_samples = sum(p.n for p in batch)
        try:
            self._executor.submit(self._work, batch, started, self._table_version(), loop,
                                  answered)
        except Exception as exc:  # noqa: BLE001 - e.g. the executor shut down: fail the batch
            self._answer(batch, exc, answered)
        return answered

    def _answer(self, batch: list[_Pending], result: list[Outcome | Exception] | Exception,
                answered: asyncio.Future[Any], done: Done | None = None) -> None:
        """On the loop: every request of ``batch`` gets its outcome, or the batch's failure;
        the batch is counted in the metrics after that, once its handlers have answered."""
        self._inflight = []  # the next batch may start (from the loop, or from ``submit``)
        self._running_samples = 0
        self._idle.set()
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
        if not answered.done():
            answered.set_result(None)
        if done is not None:
            self.policy.answered(done.samples)
            # scheduled after the handlers' wake-ups: each writes its response first
            asyncio.get_running_loop().call_soon(self._m.observe_batch, done, result)

    # ------------------------------------------------------------------ the worker thread

    def _work(self, batch: list[_Pending], started: float, version: int | None,
              loop: asyncio.AbstractEventLoop, answered: asyncio.Future[Any]) -> None:
        """On the model's thread: run the batch and answer it on the loop."""
        done: Done | None = None
        result: list[Outcome | Exception] | Exception
        try:
            done = self.stage.run(batch)
            result = done.outcomes(batch, started, version)
        except Exception as exc:  # noqa: BLE001 - the failure goes to every request of the batch
            # without its traceback: its frames hold the batch's samples until the cyclic
            # garbage collector runs (under a memory limit they count until then)
            result = exc.with_traceback(None)
        try:
            loop.call_soon_threadsafe(self._answer, batch, result, answered, done)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            log.warning("%s: a batch finished after the event loop closed", self.name)
            return
        # then, off the answers' path: what the next batch is gathered by (a batch gathered
        # meanwhile goes by the reading before)
        try:
            outlook = self.policy.outlook()
        except Exception as exc:  # noqa: BLE001 - the next batches go by the last reading
            log.warning("%s: reading the memory free for the next batch failed: %s", self.name,
                        exc)
            return
        try:
            loop.call_soon_threadsafe(self.policy.take, outlook)
        except RuntimeError:
            pass  # closed meanwhile

    def _fail_waiting(self, exc: Exception) -> None:
        for p in self.queue.drain():
            if not p.future.done():
                p.future.set_exception(exc)
