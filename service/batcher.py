"""The dynamic batcher of one model: requests gathered into batches, each run with the plan for
the memory free at that moment.

One asyncio queue and one future per request (as in Ray Serve's ``batching.py``). A loop
takes the first waiting request, then gathers more until the batch holds the gather limit's
samples or ``max_batch_delay_ms`` has passed, concatenates them, runs ``worker.infer`` in the
model's own thread (a single-thread executor: torch never runs on the event loop, and one
model runs one batch at a time) and splits the outputs back to the futures. A failure goes to
every future of its batch. While a batch runs, new requests wait in the queue, so under load
the next batch is gathered at once.

The gather limit is the table's largest request size (``worker.batch_max``); with a latency
target it is ``table.largest_batch_within(free, target)`` (the paper's latency bound: the
largest request size whose plan finishes in time), re-read in the worker thread after every
batch. A request larger than the
limit runs as a batch of its own (the worker splits it along the table's sizes).

Closing drains: requests already accepted are run and answered; new ones get 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from planner.errors import InfeasibleError
from service.errors import UnavailableError
from service.metrics import Metrics
from workers.worker import RunInfo, Worker

log = logging.getLogger("vbs.service.batcher")


@dataclass(frozen=True)
class Outcome:
    """What one request got: its outputs and how its batch ran."""

    y: np.ndarray          # (n, *output_shape) float32: this request's rows of the batch
    info: RunInfo          # the plans that ran the batch
    batch_samples: int     # samples in the batch it ran in
    queue_s: float         # from submit to the start of its batch's run
    run_s: float           # the batch's run (worker.infer and the copies around it)
    table_version: int | None


@dataclass(eq=False)
class _Pending:
    x: np.ndarray
    future: asyncio.Future[Outcome]
    submitted: float

    @property
    def n(self) -> int:
        return int(self.x.shape[0])


_STOP = object()
_WIDEN = (np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64))  # torch casts few of these


class Batcher:
    """Batches requests for one model's worker (see the module doc)."""

    def __init__(self, name: str, worker: Worker, *, max_delay_s: float, max_queue: int,
                 latency_target_s: float | None, metrics: Metrics,
                 table_version: Callable[[], int | None] = lambda: None) -> None:
        self.name = name
        self.worker = worker
        self.max_delay_s = max_delay_s
        self.max_queue = max_queue
        self.latency_target_s = latency_target_s
        self.metrics = metrics
        self._table_version = table_version
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._carry: _Pending | None = None
        self._waiting = 0           # requests queued (including the carried one), not yet run
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"vbs-{name}")
        self.gather_limit = worker.batch_max
        self.running = False        # a batch is on the worker now

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.gather_limit = await loop.run_in_executor(self._executor, self._next_limit)
        self._task = asyncio.create_task(self._loop(), name=f"vbs-batcher-{self.name}")

    async def close(self, timeout_s: float | None = None) -> None:
        """Stop taking requests, run and answer every accepted one, then stop the thread."""
        if self._closing:
            return
        self._closing = True
        if self._task is not None:
            self._queue.put_nowait(_STOP)
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except asyncio.TimeoutError:
                log.warning("%s: %d requests still waiting after %.1f s of draining; cancelling",
                            self.name, self._waiting, timeout_s or 0)
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
                self._fail_waiting(UnavailableError(f"model {self.name} is shutting down"))
                self._executor.shutdown(wait=False)  # a batch still on the thread is left to end
                return
        self._executor.shutdown(wait=True)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def closing(self) -> bool:
        return self._closing

    # ------------------------------------------------------------------ requests

    async def submit(self, x: np.ndarray) -> Outcome:
        """Queue ``x`` (N samples) and wait for its outputs; 503 when full or closing."""
        if self._closing:
            self.metrics.rejected.labels(self.name, "closing").inc()
            raise UnavailableError(f"model {self.name} is shutting down: retry on another "
                                   "replica", retry_after=1)
        if self._waiting >= self.max_queue:
            self.metrics.rejected.labels(self.name, "queue_full").inc()
            raise UnavailableError(f"model {self.name}: {self._waiting} requests are waiting, "
                                   f"the most the queue holds (max_queue); retry shortly",
                                   retry_after=1)
        pending = _Pending(x, asyncio.get_running_loop().create_future(), time.perf_counter())
        self._waiting += 1
        self.metrics.queue_depth.labels(self.name).set(self._waiting)
        self._queue.put_nowait(pending)
        return await pending.future

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        stopping = False
        while not (stopping and self._carry is None):
            batch, stop = await self._gather(stopping)
            stopping = stopping or stop
            if batch:
                await self._run(batch)

    def _taken(self, item: _Pending) -> bool:
        """Count ``item`` out of the queue; False when its request has gone (timed out)."""
        self._waiting -= 1
        self.metrics.queue_depth.labels(self.name).set(self._waiting)
        return not item.future.done()

    async def _gather(self, stopping: bool) -> tuple[list[_Pending], bool]:
        """The next batch, and whether the stop mark was met."""
        loop = asyncio.get_running_loop()
        batch: list[_Pending] = []
        if self._carry is not None:
            first, self._carry = self._carry, None
            if self._taken(first):
                batch.append(first)
        if stopping and not batch:
            return [], True
        while not batch:
            item = await self._queue.get()
            if item is _STOP:
                return [], True
            assert isinstance(item, _Pending)
            if self._taken(item):
                batch.append(item)
        limit = max(1, self.gather_limit)
        n = batch[0].n
        deadline = loop.time() + self.max_delay_s
        while n < limit:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            if item is _STOP:
                return batch, True
            assert isinstance(item, _Pending)
            if item.future.done():
                self._taken(item)
                continue
            if n + item.n > limit:
                self._carry = item  # still counted as waiting
                break
            self._taken(item)
            batch.append(item)
            n += item.n
        return batch, False

    async def _run(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        version = self._table_version()
        self.running = True
        try:
            y, info, run_s, limit = await loop.run_in_executor(
                self._executor, self._infer, [p.x for p in batch])
        except asyncio.CancelledError:
            for p in batch:
                p.future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - the failure goes to every request of the batch
            log.warning("%s: a batch of %d requests failed: %s", self.name, len(batch), exc)
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        finally:
            self.running = False
        self.gather_limit = limit
        total = int(y.shape[0])
        m = self.metrics
        m.batch_size.labels(self.name).observe(total)
        m.samples.labels(self.name).inc(total)
        m.run_time.labels(self.name).observe(run_s)
        if info.oom_retries:
            m.oom_retries.labels(self.name).inc(info.oom_retries)
        if info.splits:
            m.splits.labels(self.name).inc(info.splits)
        for choice in info.choices:
            m.choice_time.labels(self.name).observe(choice.seconds)
        if info.choices:
            last = info.choices[-1]
            m.free_memory.labels(self.name).set(last.free_bytes)
            m.plan_peak.labels(self.name).set(last.peak_bytes)
        offset = 0
        for p in batch:
            queue_s = started - p.submitted
            m.queue_time.labels(self.name).observe(queue_s)
            if not p.future.done():
                p.future.set_result(Outcome(y[offset:offset + p.n], info, total, queue_s, run_s,
                                            version))
            offset += p.n

    # ------------------------------------------------------------------ the worker thread

    def _infer(self, arrays: list[np.ndarray]) -> tuple[np.ndarray, RunInfo, float, int]:
        import torch

        t0 = time.perf_counter()
        loaded = self.worker.capture.model
        with torch.inference_mode():
            parts = [torch.from_numpy(a if a.dtype not in _WIDEN else a.astype(np.float64))
                     .to(device=loaded.device, dtype=loaded.torch_dtype) for a in arrays]
            x = parts[0] if len(parts) == 1 else torch.cat(parts)
            y, info = self.worker.infer(x)
            out = y.detach().to(device="cpu", dtype=torch.float32).numpy()
        run_s = time.perf_counter() - t0
        return out, info, run_s, self._next_limit()

    def _next_limit(self) -> int:
        """Samples the next batch may gather (runs in the worker thread: it reads free memory)."""
        if self.latency_target_s is None:
            return self.worker.batch_max
        try:
            return self.worker.table.largest_batch_within(self.worker.probe.free(),
                                                          self.latency_target_s)
        except InfeasibleError:
            return 1

    def _fail_waiting(self, exc: Exception) -> None:
        pending = [self._carry] if self._carry is not None else []
        self._carry = None
        while True:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            if isinstance(item, _Pending):
                pending.append(item)
        for p in pending:
            if not p.future.done():
                p.future.set_exception(exc)
        self._waiting = 0
