"""The models a service serves: their entries, the device's memory they share, and their life.

Every model named in the settings has an entry from the start (what it is, its state);
``service.residency`` decides which are loaded (at start those that fit, then on demand, the
least recently used idle one given back for another), ``service.loading`` loads and unloads
one (tables, worker, batcher) and ``service.table_watch`` keeps the loaded ones' tables
current from the store. The models share the device's memory, which one owner counts
(``workers.device_memory``: the probe, the margin, the leases, what loaded models keep, and
under a cgroup limit what requests hold); the registry makes it, with the line of the HTTP
edge that admits requests against it (``service.admission``).

Ready (``/v2/health/ready``): once every model's start is over (loaded, or left to load on
demand because the memory does not hold it beside the others), none failed.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from core.spec import ModelSpec
from planner.store import Backoff
from service.admission import AdmissionLine
from service.entry import FAILED, ModelEntry
from service.errors import ModelNotFoundError, RequestError, UnavailableError
from service.loading import ModelLoader
from service.metrics import MemoryListener, Metrics
from service.residency import Residency
from service.settings import Settings
from service.table_watch import TableWatcher
from workers.device_memory import DeviceMemory

log = logging.getLogger("vbs.service")


async def _stop(task: asyncio.Task[Any], attempts: int = 3, wait_s: float = 2.0) -> None:
    """Cancel ``task`` and wait for it, a bounded time: shutdown must not hang on the store.

    A cancellation can be lost (Python 3.11's ``asyncio.wait_for`` drops one that races with
    the inner future's completion, and redis-py reads under such timeouts), so it is repeated.
    """
    for _ in range(attempts):
        if task.done():
            break
        task.cancel()
        await asyncio.wait({task}, timeout=wait_s)
    if not task.done():
        log.warning("%s did not stop within %g s; leaving it", task.get_name(),
                    attempts * wait_s)
    elif not task.cancelled() and task.exception() is not None:
        log.debug("%s ended with %r", task.get_name(), task.exception())


class Registry:
    """The served models' entries, their memory, loading and watching (see the module doc)."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.entries: dict[str, ModelEntry] = {}
        for served, name, shape in settings.served_models:
            spec = ModelSpec(name=name, input_shape=shape, dtype=settings.dtype,
                             device=settings.device, weights=settings.weights)
            self.entries[served] = ModelEntry(served, spec)
            metrics.model_ready.labels(served).set(0)
        # the one owner of the device's memory, and the edge's line of requests waiting for it
        self.memory = DeviceMemory(
            settings.device, limit=settings.memory_limit_bytes,
            margin=settings.memory_margin_bytes, sharing=settings.memory_sharing,
            serial=settings.device == "cpu" and settings.cpu_model_threads == "shared",
            listener=MemoryListener(metrics), cache_idle_s=settings.device_cache_idle_s,
            total=settings.models_memory_bytes, ort_arena=settings.ort_arena)
        self.admission = AdmissionLine(self.memory, settings.line_wait_s)
        backoff = Backoff(base=settings.store_retry_base_s, cap=settings.store_retry_cap_s)
        rng = random.Random()
        self.loader = ModelLoader(settings, metrics, self.memory, backoff, rng)
        self.watcher = TableWatcher(settings, metrics, self.entries, backoff, rng)
        self.residency = Residency(settings, metrics, self.entries, self.loader, self.memory)
        self._load_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._loaded = asyncio.Event()   # every model's start is over (loaded, left, failed)

    # ------------------------------------------------------------------ queries

    @property
    def ready(self) -> bool:
        """Every model loaded or loadable on demand: none at its first load, none failed."""
        return bool(self.entries) and all(not e.starting and e.state != FAILED
                                          for e in self.entries.values())

    def not_ready_reason(self) -> str:
        if not self.entries:
            return "no models configured: start with --model NAME (or VBS_MODELS)"
        waiting = [f"{e.name} {e.state}" + (f" ({e.error})" if e.error else "")
                   for e in self.entries.values() if e.starting or e.state == FAILED]
        return "not ready: " + "; ".join(waiting)

    def get(self, name: str) -> ModelEntry:
        entry = self.entries.get(name)
        if entry is None:
            served = ", ".join(self.entries) or "none"
            raise ModelNotFoundError(f"model: no model {name!r} is served here; served: {served}")
        return entry

    def resolve(self, name: str | None) -> ModelEntry:
        """The model a request names, or the only one served when it names none."""
        if name is None:
            if len(self.entries) == 1:
                return next(iter(self.entries.values()))
            raise RequestError(f"model: this service serves {len(self.entries)} models; name one "
                               f"with ?model= (one of {', '.join(self.entries) or 'none'})")
        return self.get(name)

    def ready_entry(self, name: str | None) -> ModelEntry:
        """The model a request names, if it may take one: loaded, or loaded on demand (503
        when it failed, is still at its first load or was unloaded through the repository
        API; 413 when it can never fit)."""
        entry = self.resolve(name)
        if not entry.ready:
            self.residency.refuse(entry)
        return entry

    def described_entry(self, name: str | None) -> ModelEntry:
        """A model whose shapes are known (loaded once, or weighed at start), for metadata."""
        entry = self.ready_entry(name)
        if entry.shapes is None or entry.shapes[1] is None:
            raise UnavailableError(f"model {entry.name} is {entry.state}: its outputs are known "
                                   "once it is loaded (on its first request, or POST "
                                   f"/v2/repository/models/{entry.name}/load)", retry_after=5)
        return entry

    def planned_entry(self, name: str | None) -> ModelEntry:
        """A model whose tables are known (loaded once), for /plan and the page."""
        entry = self.resolve(name)
        if entry.planned:
            return entry
        self.ready_entry(name)
        raise UnavailableError(f"model {entry.name} is {entry.state}: its tables are read when "
                               "it is first loaded (on its first request, or POST "
                               f"/v2/repository/models/{entry.name}/load)", retry_after=5)

    def entry_of(self, name: str | None) -> ModelEntry | None:
        """The model a request names (the only one when it names none), or None: what is
        wrong with the name is said where the request is read."""
        if name is None:
            return next(iter(self.entries.values())) if len(self.entries) == 1 else None
        return self.entries.get(name)

    @property
    def store_up(self) -> bool | None:
        """Whether the store's watch is live (None: not watching yet)."""
        return self.watcher.store_up

    def arbiters(self) -> list[dict[str, Any]]:
        """The device's arbiter: budget, shares, leases, high water, overcommits (JSON)."""
        return [self.memory.snapshot().to_json()]

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every model's start is over (loaded, or left to load on demand); raise
        UnavailableError if one failed or time ran out."""
        try:
            await asyncio.wait_for(self._loaded.wait(), timeout_s)
        except asyncio.TimeoutError as exc:
            raise UnavailableError(f"models not loaded within {timeout_s} s: "
                                   f"{self.not_ready_reason()}") from exc
        if not self.ready:
            raise UnavailableError(self.not_ready_reason())

    async def wait_table(self, name: str, version: int, timeout_s: float) -> None:
        """Wait until model ``name`` serves table ``version`` or a later one."""
        self.get(name)
        await self.watcher.wait_table(name, version, timeout_s)

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        if not self.entries:
            log.warning("no models configured: the service answers health checks only")
            self._loaded.set()
            return
        self._load_task = asyncio.create_task(self._load_all(), name="vbs-load-models")

    async def _load_all(self) -> None:
        try:
            await self.residency.start()
        finally:
            self._loaded.set()
        if self.ready:
            log.info("ready: %s", ", ".join(f"{e.name} ({e.state})"
                                            for e in self.entries.values()))
        if any(e.state != FAILED for e in self.entries.values()):
            self._watch_task = asyncio.create_task(self.watcher.run(), name="vbs-watch-tables")

    async def close(self) -> None:
        """Stop loading and watching; drain every batcher (accepted requests are answered)."""
        await asyncio.gather(*(_stop(t) for t in (self._load_task, self._watch_task)
                               if t is not None))
        await self.residency.close()
        batchers = [e.batcher for e in self.entries.values() if e.batcher is not None]
        await asyncio.gather(*(b.close(self.settings.request_timeout_s) for b in batchers),
                             return_exceptions=True)
        await self.loader.close()
        await self.watcher.close()
        self.memory.close()
