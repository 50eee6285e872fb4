"""How many samples a model's next batch gathers, and how long it may wait for company.

Read from the table for the memory free now (on the model's thread, after each batch: it
reads free memory): with a latency target, the largest request size whose plan finishes in
time; with ``follow_up`` (docs/operations.md, "Batching"), the table's predicted seconds per
request size, by which a batch waits for the last batch's clients to come back when one
merged batch saves more than the wait costs. Without either, nothing is read: a batch
gathers up to the table's largest request size and never waits.
"""

from __future__ import annotations

import time

from core.errors import InfeasibleError
from workers.worker import Worker

# The least saving, as a share of the merged batch's time, worth waiting for: a wait idles the
# model and spreads its clients' arrivals: a small promised saving is not worth it (on a
# 2-core CPU, waiting for 3% split resnet50's batches into pieces of 1 to 6 samples).
MIN_SAVING = 0.1

Outlook = tuple[int, tuple[float, ...]]  # the gather limit, predicted seconds per request size


class GatherPolicy:
    """The gather limit and the follow-up wait of one model's batches (see the module doc)."""

    def __init__(self, worker: Worker, latency_target_s: float | None, follow_up: float) -> None:
        self.worker = worker
        self.latency_target_s = latency_target_s
        self.follow_up = follow_up
        self.limit = worker.batch_max
        self.times: tuple[float, ...] = ()  # predicted seconds per request size (``outlook``)
        self.last = (0, 0.0)  # the last batch: samples, perf_counter() when it was answered
        self.since_last = 0   # samples submitted since then (its clients coming back)

    def outlook(self) -> Outlook:
        """The next batch's gather limit and the table's predicted seconds per request size
        for the memory free now (on the model's thread: it reads free memory)."""
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

    def take(self, outlook: Outlook) -> None:
        """What the next batches are gathered by, from now on (on the loop)."""
        self.limit, self.times = outlook

    def answered(self, samples: int) -> None:
        """A batch of ``samples`` was answered now: its clients may come back."""
        self.last, self.since_last = (samples, time.perf_counter()), 0

    def wait_left(self, n: int, first_submitted: float, closing: bool) -> float:
        """Seconds a batch of ``n`` samples may still wait for the last batch's clients; 0 or
        less: run it now. With a latency target, never so long that the merged batch would
        end after its first request's target."""
        limit = max(1, self.limit)
        last_samples, answered_at = self.last
        k = min(last_samples - self.since_last, limit - n)
        times = self.times
        if k <= 0 or self.follow_up <= 0 or n + k >= len(times) or closing:
            return 0.0  # (closing: nobody is let in to wait for)
        saving = times[n] + times[k] - times[n + k]  # inf - inf is nan: not >, no wait
        if not saving > MIN_SAVING * times[n + k]:
            return 0.0
        until = answered_at + self.follow_up * saving
        if self.latency_target_s is not None:
            until = min(until, first_submitted + self.latency_target_s - times[n + k])
        return until - time.perf_counter()
