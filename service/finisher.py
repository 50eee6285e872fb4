"""How a model's batches go through its threads: whole on the model's thread, or issued there
and finished on a second thread, the finisher (``VBS_PIPELINE``).

Whole (the CPU's default): a batch lives on the model's thread from its first copy to its
last encoding, and the loop is woken once to answer it: the fewest hand-overs, since on the
CPU nothing would overlap. Pipelined (CUDA's default): the model's thread only issues a batch
(``PipelinedStage.issue``: the device's work enqueued), tells the loop it is free for the
next one and hands the batch to the finisher, one thread per model, which waits for the
device, encodes and wakes the loop to answer. The batcher keeps at most two batches in
flight (``depth``: the stage has two slots); one finisher finishes them in the order they
were issued; a failure in either half goes to every request of its batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from service.batch_stage import BatchStage, Done, Outcome
from service.gather import GatherPolicy
from service.pipeline_stage import SLOTS, PipelinedStage

log = logging.getLogger("vbs.service.batcher")

Result = list[Outcome | Exception] | Exception   # each request's outcome, or the batch's failure
Answer = Callable[[list[Any], Result, Done | None], None]  # on the loop: answer a batch
Issued = Callable[[list[Any]], None]                       # on the loop: its issue is over


class BatchRuns:
    """A model's batches on its threads (see the module doc): ``submit`` from the loop, the
    callbacks called back on it."""

    def __init__(self, name: str, stage: BatchStage, executor: Executor, policy: GatherPolicy,
                 *, pipelined: bool) -> None:
        self.name = name
        self.stage = stage
        self.policy = policy
        self._executor = executor  # the model's thread (its owner shuts it down)
        self.finisher: ThreadPoolExecutor | None = None
        if pipelined:
            assert isinstance(stage, PipelinedStage)
            self.finisher = ThreadPoolExecutor(max_workers=1,
                                               thread_name_prefix=f"vbs-finish-{name}")

    @property
    def depth(self) -> int:
        """Batches that may be in flight at once."""
        return SLOTS if self.finisher is not None else 1

    def submit(self, batch: list[Any], started: float, version: int | None,
               loop: asyncio.AbstractEventLoop, issued: Issued, answer: Answer) -> None:
        """``batch`` (dispatched at ``started``, with table ``version``) to the model's thread;
        on the loop ``issued(batch)`` once that thread is free of it (pipelined only), then
        ``answer(batch, result, done)``. Raises when the model's thread takes no more work."""
        work = self._run if self.finisher is None else self._issue
        self._executor.submit(work, batch, started, version, loop, issued, answer)

    def close(self) -> None:
        """Give the finisher back (its batches answered: the batcher has drained)."""
        if self.finisher is not None:
            self.finisher.shutdown(wait=False)

    # ------------------------------------------------------------------ the model's thread

    def _run(self, batch: list[Any], started: float, version: int | None,
             loop: asyncio.AbstractEventLoop, issued: Issued, answer: Answer) -> None:
        """Whole: run the batch, answer it on the loop, then read the next batch's outlook."""
        done: Done | None = None
        result: Result
        try:
            done = self.stage.run(batch)
            result = done.outcomes(batch, started, version)
        except Exception as exc:  # noqa: BLE001 - the failure goes to every request of the batch
            # without its traceback: its frames hold the batch's samples until the cyclic
            # garbage collector runs (under a memory limit they count until then)
            result = exc.with_traceback(None)
        if self._call(loop, answer, batch, result, done):
            self._look_ahead(loop)

    def _issue(self, batch: list[Any], started: float, version: int | None,
               loop: asyncio.AbstractEventLoop, issued: Issued, answer: Answer) -> None:
        """Pipelined: issue the batch, free the model's thread for the next one, hand the batch
        (or its failure) to the finisher: finished in the order issued."""
        assert isinstance(self.stage, PipelinedStage) and self.finisher is not None
        work: Any
        try:
            work = self.stage.issue(batch)
        except Exception as exc:  # noqa: BLE001 - answered in turn, by the finisher
            work = exc.with_traceback(None)
        if not self._call(loop, issued, batch):  # (before the answer: the loop reads them in order)
            return
        try:
            self.finisher.submit(self._finish, work, batch, started, version, loop, answer)
        except RuntimeError as exc:  # the finisher has shut down (closing ran out of time)
            self._call(loop, answer, batch, work if isinstance(work, Exception) else exc, None)
        self._look_ahead(loop)

    def _look_ahead(self, loop: asyncio.AbstractEventLoop) -> None:
        """Off the answers' path: what the next batch is gathered by (a batch gathered
        meanwhile goes by the reading before)."""
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

    # ------------------------------------------------------------------ the finisher's thread

    def _finish(self, work: Any, batch: list[Any], started: float, version: int | None,
                loop: asyncio.AbstractEventLoop, answer: Answer) -> None:
        """Wait for an issued batch's output, encode it, answer it on the loop."""
        assert isinstance(self.stage, PipelinedStage)
        done: Done | None = None
        result: Result
        if isinstance(work, Exception):
            result = work
        else:
            try:
                done = self.stage.finish(work)
                result = done.outcomes(batch, started, version)
            except Exception as exc:  # noqa: BLE001 - to every request of the batch
                result = exc.with_traceback(None)
        self._call(loop, answer, batch, result, done)

    def _call(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> bool:
        """``fn(*args)`` on the loop; False when the loop has closed (nobody waits any more)."""
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            log.warning("%s: a batch finished after the event loop closed", self.name)
            return False
        return True
