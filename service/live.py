"""Live figures of each model for the page (``GET /models/{name}/stats``): throughput, p50/p99
latency and the plan the last batch ran, over the last seconds of answered requests.

Why not from ``/metrics`` alone: its histograms count latency in buckets since the start, and
an operator watching a page wants the percentiles of the last seconds and the id of the plan
that just ran, which no metric can hold (an id as a label would be unbounded). So the metrics
middleware records every answered inference here (``Live.record``: a deque append on the event
loop) and the stats handler reads them (``Live.figures``). Counters that ``/metrics`` already
has (OOM retries, samples) are read from there, not counted twice.

When each model began serving its table: the registry keeps no such time, so ``watch_tables``
(started with the app by the stats router) looks at every model's table a few times a second
and stamps a new table object or version when it first sees it (a few attribute reads).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

WINDOW_S = 10.0          # the span throughput and percentiles are taken over
# Requests kept per model at most: a bound on memory and on the time ``figures`` takes on the
# event loop (about 0.1 us a request); above 2,000 requests/s the window is the last 20,000.
MAX_KEPT = 20_000
TABLE_LOOK_S = 0.25      # how often watch_tables looks for a swapped table


@dataclass(frozen=True)
class LastBatch:
    """The plan that ran the last batch answered (its last piece when the batch was split)."""

    at: float                 # unix time it was answered
    plan_id: str
    solver: str
    batch: int                # samples of the piece the plan ran
    samples: int              # samples of the whole batch
    pieces: int               # plans the batch ran as (more than 1: split for memory)
    budget_bytes: int         # the memory free when the plan was chosen
    peak_bytes: int           # what the plan allocates (its table breakpoint)
    predicted_time_s: float
    oom_retries: int
    table_version: int | None


@dataclass(frozen=True)
class Figures:
    """One model's requests over the last ``window_s`` seconds (fewer above ``MAX_KEPT``)."""

    window_s: float
    requests: int
    samples: int
    samples_per_s: float
    p50_s: float | None
    p99_s: float | None
    last: LastBatch | None


@dataclass(frozen=True)
class TableStamp:
    """A table version and when this process began serving it (unix time)."""

    version: int | None
    loaded_at: float


class Live:
    """Recent answered requests and table stamps, per model (event loop only: no locks)."""

    def __init__(self, window_s: float = WINDOW_S, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.window_s = window_s
        self._clock = clock
        self._wall = wall
        self._recent: dict[str, collections.deque[tuple[float, float, int]]] = {}
        self._last: dict[str, tuple[float, Any, int, int | None]] = {}
        self._tables: dict[str, tuple[int, TableStamp]] = {}  # model -> (id(table), stamp)

    def record(self, model: str, latency_s: float, outcome: Any) -> None:
        """One answered inference of ``model`` (a ``service.batcher.Outcome``)."""
        now = self._clock()
        recent = self._recent.get(model)
        if recent is None:
            recent = self._recent[model] = collections.deque(maxlen=MAX_KEPT)
        recent.append((now, latency_s, int(outcome.y.shape[0])))
        self._trim(recent, now)
        self._last[model] = (self._wall(), outcome.info, outcome.batch_samples,
                             outcome.table_version)

    def _trim(self, recent: collections.deque[tuple[float, float, int]], now: float) -> None:
        start = now - self.window_s
        while recent and recent[0][0] < start:
            recent.popleft()

    def figures(self, model: str) -> Figures:
        recent = self._recent.get(model)
        if recent:
            self._trim(recent, self._clock())
        latencies = np.fromiter((r[1] for r in recent or ()), dtype=np.float64)
        samples = sum(r[2] for r in recent or ())
        p50 = p99 = None
        span = self.window_s
        if latencies.size:
            p50, p99 = (float(v) for v in np.percentile(latencies, [50, 99]))
            if recent is not None and len(recent) == recent.maxlen:  # the window holds fewer
                span = max(self._clock() - recent[0][0], 1e-9)
        return Figures(span, int(latencies.size), samples, samples / span, p50, p99,
                       self._last_batch(model))

    def _last_batch(self, model: str) -> LastBatch | None:
        found = self._last.get(model)
        if found is None:
            return None
        at, info, samples, version = found
        if not info.choices:
            return None
        c = info.choices[-1]
        return LastBatch(at=at, plan_id=c.plan_id, solver=c.table.solver, batch=c.batch,
                         samples=samples, pieces=len(info.choices), budget_bytes=c.free_bytes,
                         peak_bytes=c.peak_bytes, predicted_time_s=c.time_total,
                         oom_retries=info.oom_retries, table_version=version)

    def note_table(self, model: str, table: Any, version: int | None) -> TableStamp:
        """The stamp of ``model``'s table: kept while it is the same table, new when not."""
        seen = self._tables.get(model)
        if seen is not None and seen[0] == id(table) and seen[1].version == version:
            return seen[1]
        stamp = TableStamp(version, self._wall())
        self._tables[model] = (id(table), stamp)
        return stamp

    def table_stamp(self, model: str) -> TableStamp | None:
        found = self._tables.get(model)
        return found[1] if found is not None else None


async def watch_tables(entries: Callable[[], Any], live: Live, every_s: float = TABLE_LOOK_S
                       ) -> None:
    """Stamp every ready model's table when it is first seen (until cancelled)."""
    while True:
        for entry in entries():
            if entry.ready:
                live.note_table(entry.name, entry.table, entry.table_version)
        await asyncio.sleep(every_s)
