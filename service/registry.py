"""The models a service serves: their entries, the device's memory they share, and their life.

Every model named in the settings has an entry from the start (what it is, its state);
``service.loading`` prepares them (tables, worker, batcher) and ``service.table_watch`` keeps
their tables current from the store. The models share the device's memory, which one owner
counts (``workers.device_memory``: the probe, the margin, the leases, and under a cgroup
limit what requests hold); the registry makes it, with the line of the HTTP edge that admits
requests against it (``service.admission``), and the loader registers each model with it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from core.loaded import ModelSpec
from planner.store import Backoff
from service.admission import AdmissionLine
from service.entry import FAILED, LOADING, ModelEntry
from service.errors import ModelNotFoundError, RequestError, UnavailableError
from service.loading import ModelLoader
from service.metrics import MemoryListener, Metrics
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
            listener=MemoryListener(metrics))
        self.admission = AdmissionLine(self.memory, settings.line_wait_s)
        backoff = Backoff(base=settings.store_retry_base_s, cap=settings.store_retry_cap_s)
        rng = random.Random()
        self.loader = ModelLoader(settings, metrics, self.memory, backoff, rng)
        self.watcher = TableWatcher(settings, metrics, self.entries, backoff, rng)
        self._load_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._loaded = asyncio.Event()   # every model loaded or failed

    # ------------------------------------------------------------------ queries

    @property
    def ready(self) -> bool:
        return bool(self.entries) and all(e.ready for e in self.entries.values())

    def not_ready_reason(self) -> str:
        if not self.entries:
            return "no models configured: start with --model NAME (or VBS_MODELS)"
        waiting = [f"{e.name} {e.state}" + (f" ({e.error})" if e.error else "")
                   for e in self.entries.values() if not e.ready]
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
        entry = self.resolve(name)
        if entry.state == LOADING:
            raise UnavailableError(f"model {entry.name} is still loading (profiling and planning "
                                   "take a while once); retry shortly", retry_after=5)
        if entry.state == FAILED:
            raise UnavailableError(f"model {entry.name} failed to load: {entry.error}",
                                   retry_after=60)
        return entry

    @property
    def store_up(self) -> bool | None:
        """Whether the store's watch is live (None: not watching yet)."""
        return self.watcher.store_up

    def arbiters(self) -> list[dict[str, Any]]:
        """The device's arbiter: budget, shares, leases, high water, overcommits (JSON)."""
        return [self.memory.snapshot().to_json()]

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every model is loaded; raise UnavailableError if one failed or time ran out."""
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
            await self.loader.load_all(list(self.entries.values()))
        finally:
            self._loaded.set()
        if self.ready:
            log.info("ready: %s", ", ".join(self.entries))
        if any(e.ready for e in self.entries.values()):
            self._watch_task = asyncio.create_task(self.watcher.run(), name="vbs-watch-tables")

    async def close(self) -> None:
        """Stop loading and watching; drain every batcher (accepted requests are answered)."""
        await asyncio.gather(*(_stop(t) for t in (self._load_task, self._watch_task)
                               if t is not None))
        batchers = [e.batcher for e in self.entries.values() if e.batcher is not None]
        await asyncio.gather(*(b.close(self.settings.request_timeout_s) for b in batchers),
                             return_exceptions=True)
        await self.loader.close()
        await self.watcher.close()
