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

Torch never runs on the event loop: on the model's thread, every request is copied into one
reusable batch buffer (pinned on CUDA, so the batch moves in one transfer), the worker runs
it, and each request's rows are encoded there; the loop is woken once to answer them all. The
timings each answer carries are Triton's perf_analyzer breakdown (``Timing``). Closing
drains: requests already accepted are run and answered, new ones get 503.
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

from core.errors import InfeasibleError
from service.errors import RequestTimeoutError, UnavailableError, field_error
from service.metrics import Metrics
from workers.worker import RunInfo, Worker

log = logging.getLogger("vbs.service.batcher")

Encoder = Callable[[np.ndarray], Any]  # a request's rows of the output -> its encoded outputs


@dataclass(frozen=True)
class Timing:
    """Where one request's time went on the server (seconds)."""

    queue_s: float    # from submit to the start of its batch
    input_s: float    # decoding it (before submit) and copying it into the batch buffer
    infer_s: float    # the plan's run on the batch
    output_s: float   # the batch output to the host, and encoding its own rows
    run_s: float      # the batch on the worker thread, from its first copy to its last encoding


@dataclass(frozen=True)
class Outcome:
    """What one request got: its outputs and how its batch ran."""

    y: np.ndarray          # (n, *output_shape) float32: this request's rows (a view of the batch's)
    encoded: Any           # what its encoder made of ``y`` (None without an encoder)
    info: RunInfo          # the plans that ran the batch
    batch_samples: int     # samples in the batch it ran in
    timing: Timing
    table_version: int | None

    @property
    def queue_s(self) -> float:
        return self.timing.queue_s

    @property
    def run_s(self) -> float:
        return self.timing.run_s


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


@dataclass(frozen=True)
class _Done:
    """A batch's results, handed from the worker thread back to the loop."""

    # per request: its rows, their encoding (or the error encoding them), copy s, encode s
    rows: list[tuple[np.ndarray, Any, float, float]]
    info: RunInfo
    infer_s: float
    transfer_s: float  # the batch to the device and its output back: shared by its requests
    run_s: float
    samples: int       # in the batch


_STOP = object()

# The least saving, as a share of the merged batch's time, worth waiting for: a wait idles the
# model and spreads its clients' arrivals: a small promised saving is not worth it (on a
# 2-core CPU, waiting for 3% split resnet50's batches into pieces of 1 to 6 samples).
MIN_SAVING = 0.1


class _Expired(Exception):
    """A request's timeout went off (``Batcher.submit`` answers it with 504)."""


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(_Expired())


class Batcher:
    """Batches requests for one model's worker (see the module doc)."""

    def __init__(self, name: str, worker: Worker, executor: Executor, *, max_delay_s: float,
                 max_queue: int, latency_target_s: float | None, metrics: Metrics,
                 follow_up: float = 0.0, timeout_s: float | None = None,
                 table_version: Callable[[], int | None] = lambda: None) -> None:
        self.name = name
        self.worker = worker
        self.max_delay_s = max_delay_s
        self.timeout_s = timeout_s  # a request not answered by then gets 504
        self.max_queue = max_queue
        self.latency_target_s = latency_target_s
        self.follow_up = follow_up
        self._last = (0, 0.0)       # the last batch: samples, perf_counter() when it was answered
        self._since_last = 0        # samples submitted since then (its clients coming back)
        self._times: tuple[float, ...] = ()  # predicted seconds per request size (see _outlook)
        self.metrics = metrics
        self._m = metrics.for_model(name)
        self._table_version = table_version
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._carry: _Pending | None = None
        self._waiting = 0           # requests queued (including the carried one), not yet run
        self._queued_samples = 0    # their samples (demand, for the memory arbiter)
        self._running_samples = 0   # samples of the batch on the worker now
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._executor = executor  # its owner shuts it down
        self._buffer: Any = None    # the batch buffer (a torch tensor) and its numpy view
        self.gather_limit = worker.batch_max
        self._inflight: list[_Pending] = []  # the batch on the worker now
        self._idle = asyncio.Event()  # set while none is (awaited by the loop and by closing)
        self._idle.set()

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.gather_limit, self._times = await loop.run_in_executor(self._executor, self._outlook)
        # the batch buffer now, not at the first batch: under a memory limit it is part of
        # what stays (service.admission reads that when the model is ready)
        await loop.run_in_executor(self._executor, self._batch_buffer, self.worker.batch_max)
        self._task = asyncio.create_task(self._loop(), name=f"vbs-batcher-{self.name}")

    async def close(self, timeout_s: float | None = None) -> None:
        """Stop taking requests, run and answer every accepted one."""
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

    @property
    def running(self) -> bool:
        """A batch is on the worker now."""
        return bool(self._inflight)

    @property
    def waiting(self) -> int:
        return self._waiting

    def demand(self) -> int:
        """Samples queued and running: what the memory arbiter divides memory by (read from
        the torch threads; plain ints)."""
        return self._queued_samples + self._running_samples

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
        if self._waiting >= self.max_queue:
            self.metrics.rejected.labels(self.name, "queue_full").inc()
            raise UnavailableError(f"model {self.name}: {self._waiting} requests are waiting, "
                                   f"the most the queue holds (max_queue); retry shortly",
                                   retry_after=1)
        loop = asyncio.get_running_loop()
        pending = _Pending(x, loop.create_future(), time.perf_counter(), decode_s, encode, field)
        self._since_last += pending.n
        if (not self.running and self._carry is None and self._queue.empty()
                and self.max_delay_s <= 0 and self.follow_up <= 0 and self._task is not None):
            pending.counted = False  # the model is idle and nothing waits: it runs now
            self._dispatch([pending])
        else:
            self._waiting += 1
            self._queued_samples += pending.n
            self._m.queue_depth.set(self._waiting)
            self._queue.put_nowait(pending)
        # the timeout as one timer on the request's own future (asyncio.wait_for would wrap
        # this coroutine in a task of its own: a loop turn more for every answer)
        timer = (loop.call_later(max(0.0, self.timeout_s - waited_s), _expire, pending.future)
                 if self.timeout_s is not None else None)
        try:
            return await pending.future
        except _Expired:
            self._uncount(pending)
            self.metrics.rejected.labels(self.name, "timeout").inc()
            raise RequestTimeoutError(
                f"model {self.name}: no answer within {self.timeout_s:g} s (request_timeout_s"
                + (f", {waited_s:.3g} s of it in line for memory" if waited_s else "") + "): "
                "the service is busy or the request is large; retry, or send fewer samples"
            ) from None
        except asyncio.CancelledError:  # the client went: no ghost in the count
            self._uncount(pending)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        stopping = False
        try:
            while not (stopping and self._carry is None):
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

    def _uncount(self, item: _Pending) -> None:
        """Count ``item`` out of ``waiting``, once (taken for a batch, or given up on)."""
        if item.counted:
            item.counted = False
            self._waiting -= 1
            self._queued_samples -= item.n
            self._m.queue_depth.set(self._waiting)

    def _taken(self, item: _Pending) -> bool:
        """Count ``item`` out of the queue; False when its request has gone (timed out)."""
        self._uncount(item)
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
            if self.running:  # a batch ``submit`` started: gather once it has been answered
                self._carry = item  # (carried meanwhile: still waiting, failed on a cancel)
                await self._idle.wait()
                self._carry = None
            if self._taken(item):
                batch.append(item)
        limit = max(1, self.gather_limit)
        n = batch[0].n
        deadline = loop.time() + self.max_delay_s
        while n < limit:
            try:
                item = self._queue.get_nowait()  # everything already waiting, at once
            except asyncio.QueueEmpty:
                if self.max_delay_s > 0:
                    remaining = deadline - loop.time()
                else:
                    remaining = self._follow_up_left(n, limit, batch[0].submitted)
                if remaining <= 0:  # nothing to wait for (the default when idle): run it now
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

    def _follow_up_left(self, n: int, limit: int, first_submitted: float) -> float:
        """Seconds the batch of ``n`` samples may still wait for the last batch's clients (see
        "Waiting for the last batch's clients"); 0 or less: run it now. With a latency target,
        never so long that the merged batch would end after its first request's target."""
        last_samples, answered_at = self._last
        k = min(last_samples - self._since_last, limit - n)
        times = self._times
        if k <= 0 or self.follow_up <= 0 or n + k >= len(times) or self._closing:
            return 0.0  # (closing: nobody is let in to wait for)
        saving = times[n] + times[k] - times[n + k]  # inf - inf is nan: not >, no wait
        if not saving > MIN_SAVING * times[n + k]:
            return 0.0
        until = answered_at + self.follow_up * saving
        if self.latency_target_s is not None:
            until = min(until, first_submitted + self.latency_target_s - times[n + k])
        return until - time.perf_counter()

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
                answered: asyncio.Future[Any], done: _Done | None = None) -> None:
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
            self._last, self._since_last = (done.samples, time.perf_counter()), 0
            # scheduled after the handlers' wake-ups: each writes its response first
            asyncio.get_running_loop().call_soon(self._count, done, result)

    def _count(self, done: _Done, result: list[Outcome | Exception]) -> None:
        """The batch and its requests' breakdowns in the metrics."""
        info = done.info
        m = self._m
        if not done.samples:  # every request of it was refused (values not finite): none ran
            return
        m.batch_size.observe(done.samples)
        m.samples.inc(done.samples)
        m.run_time.observe(done.run_s)
        if info.oom_retries:
            m.oom_retries.inc(info.oom_retries)
        if info.splits:
            m.splits.inc(info.splits)
        for choice in info.choices:
            m.choice_time.observe(choice.seconds)
        if info.choices:
            last = info.choices[-1]
            m.free_memory.set(last.free_bytes)
            m.plan_peak.set(last.peak_bytes)
        for outcome in result:
            if isinstance(outcome, Outcome):
                m.observe_request(outcome.timing)

    # ------------------------------------------------------------------ the worker thread

    def _work(self, batch: list[_Pending], started: float, version: int | None,
              loop: asyncio.AbstractEventLoop, answered: asyncio.Future[Any]) -> None:
        """On the model's thread: run the batch and answer it on the loop."""
        done: _Done | None = None
        result: list[Outcome | Exception] | Exception
        try:
            done = self._infer(batch)
            result = [encoded if isinstance(encoded, Exception)  # only this request's failed
                      else Outcome(y, encoded, done.info, done.samples,
                                   Timing(queue_s=started - p.submitted,
                                          input_s=p.decode_s + copy_s, infer_s=done.infer_s,
                                          output_s=done.transfer_s + encode_s, run_s=done.run_s),
                                   version)
                      for p, (y, encoded, copy_s, encode_s) in zip(batch, done.rows)]
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
            outlook = self._outlook()
        except Exception as exc:  # noqa: BLE001 - the next batches go by the last reading
            log.warning("%s: reading the memory free for the next batch failed: %s", self.name,
                        exc)
            return
        try:
            loop.call_soon_threadsafe(self._look_ahead, outlook)
        except RuntimeError:
            pass  # closed meanwhile

    def _look_ahead(self, outlook: tuple[int, tuple[float, ...]]) -> None:
        self.gather_limit, self._times = outlook

    def _batch_buffer(self, n: int) -> tuple[Any, np.ndarray]:
        """The reusable host buffer for n samples (pinned on CUDA), grown when a batch is
        larger, and a numpy view of it."""
        import torch

        if self._buffer is None or self._buffer[0].shape[0] < n:
            loaded = self.worker.capture.model
            # numpy has no bfloat16: such a batch is written as float32 and cast on the device
            dtype = torch.float32 if loaded.torch_dtype == torch.bfloat16 else loaded.torch_dtype
            buffer = torch.empty((max(n, self.worker.batch_max), *self.worker.capture.input_shape),
                                 dtype=dtype, pin_memory=loaded.device.type == "cuda")
            # its pages now, not when the first full batch writes them: in the group's working
            # set from the start, which the memory limit's ledger reads as what stays
            buffer.numpy().fill(0)
            self._buffer = (buffer, buffer.numpy())
        return self._buffer

    def _infer(self, batch: list[_Pending]) -> _Done:
        import torch

        t0 = time.perf_counter()
        loaded = self.worker.capture.model
        buffer, host = self._batch_buffer(sum(p.n for p in batch))
        copies: list[float] = []
        refused: dict[int, Exception] = {}
        offset = 0
        for i, p in enumerate(batch):  # each request written into its rows of the batch: one copy
            c0 = time.perf_counter()
            rows = host[offset:offset + p.n]
            if p.x.dtype == rows.dtype:
                np.copyto(rows, p.x)
            else:  # a value out of the model's dtype's range becomes infinite: refused below
                with np.errstate(over="ignore", invalid="ignore"):
                    np.copyto(rows, p.x, casting="unsafe")
            # its values first read here, and checked as the model will see them (in its dtype:
            # a float64 1e39 is infinite in float32): NaN propagates through max and min, and
            # an infinity is one of them; a refused request's rows are written over
            if rows.dtype.kind == "f" and not (np.isfinite(rows.max()) and np.isfinite(rows.min())):
                refused[i] = field_error(p.field, "holds NaN or infinite values: send finite "
                                                  "numbers")
            else:
                offset += p.n
            copies.append(time.perf_counter() - c0)
        total = offset
        t1 = time.perf_counter()
        if not total:
            return _Done([(host[:0], refused[i], copies[i], 0.0) for i in range(len(batch))],
                         RunInfo((), 0, 0), infer_s=0.0, transfer_s=0.0,
                         run_s=time.perf_counter() - t0, samples=0)
        x = buffer[:total]
        if x.device != loaded.device or x.dtype != loaded.torch_dtype:  # not on a CPU float32
            x = x.to(device=loaded.device, dtype=loaded.torch_dtype, non_blocking=True)
        t2 = time.perf_counter()
        y, info = self.worker.infer(x)
        t3 = time.perf_counter()
        if y.device.type != "cpu" or y.dtype != torch.float32:
            y = y.to(device="cpu", dtype=torch.float32)
        if buffer.data_ptr() <= y.data_ptr() < buffer.data_ptr() + buffer.nbytes:
            y = y.clone()  # a model that returns its input: the buffer is reused next batch
        out = y.numpy()
        t4 = time.perf_counter()
        rows = []
        offset = 0
        for i, (p, copy_s) in enumerate(zip(batch, copies)):
            if i in refused:
                rows.append((out[:0], refused[i], copy_s, 0.0))
                continue
            e0 = time.perf_counter()
            mine = out[offset:offset + p.n]
            try:
                encoded = p.encode(mine) if p.encode is not None else None
            except Exception as exc:  # noqa: BLE001 - it goes to its own request only
                encoded = exc
            rows.append((mine, encoded, copy_s, time.perf_counter() - e0))
            offset += p.n
        return _Done(rows, info, infer_s=t3 - t2, transfer_s=(t2 - t1) + (t4 - t3),
                     run_s=time.perf_counter() - t0, samples=total)

    def _outlook(self) -> tuple[int, tuple[float, ...]]:
        """The next batch's gather limit and the table's predicted seconds per request size
        for the memory free now (on the model's thread: it reads free memory). Without a
        latency target or a follow-up wait, neither needs the memory: nothing is read."""
        if self.latency_target_s is None and self.follow_up <= 0:
            return self.worker.batch_max, ()
        table, free = self.worker.table, self.worker.allowance()
        times = table.times_within(free) if self.follow_up > 0 else ()
        if self.latency_target_s is None:
            return self.worker.batch_max, times
        try:
            return table.largest_batch_within(free, self.latency_target_s), times
        except InfeasibleError:
            return 1, times

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
        self._queued_samples = 0
