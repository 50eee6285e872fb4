"""Which models are loaded: at start those that fit, then each when a request needs it, the
least recently used idle one given back when another needs its memory.

Why: a server given more models than its memory holds dies loading them all (under a cgroup
limit the kernel kills it), and Triton's explicit mode leaves loading and unloading to the
client. A model's cost is known before it loads: what it kept the last time it was loaded,
else what `vbs plan` measured a worker without torch keeps of it (``workers.load_cost``), else
its weights (built on the meta device, ``planner.models.sketch_model``), and its plans' bytes
from its table. Whether a set of models fits is the device's one owner of memory's
answer (``DeviceMemory.models``, ``workers.models_memory``); this module only chooses which
model goes first. At start a model's working bytes stand for its one-sample plan, so the
models loaded then run near full speed.

One change at a time: every load and unload runs under one lock, in a task of its own, so a
request that stops waiting (its timeout) does not stop a load half way. A request pins its
model from when it is let through until it is answered; a pinned model, or one whose batcher
has work, is busy. A load unloads idle models first; a model under steady traffic is never
idle, so a load that waited ``drain_after_s`` for one drains the least recently used busy
model instead. An unloading model lets no request through, those let through are answered,
and one that comes meanwhile waits and loads it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from core.errors import RequestTooLargeError
from service.entry import FAILED, LOADING, READY, REPOSITORY_STATES, UNLOADED, UNLOADING, \
    ModelEntry
from service.errors import ModelTooLargeError, UnavailableError
from service.loading import ModelLoader
from service.metrics import Metrics
from service.settings import Settings
from workers.device_memory import DeviceMemory

log = logging.getLogger("vbs.service")

POLL_S = 0.05  # a load waiting for room looks again this often (memory frees outside too)
STOP_S = 5.0   # closing waits this long for a load or unload under way


@dataclass(eq=False)
class Use:
    """A request's pin on its model, from when it is let through until it is answered."""

    entry: ModelEntry
    waited_s: float  # waiting for the model to load (0: it was loaded)
    released: bool = False


class Room:
    """Which loaded model goes first to make room, asking the device's memory owner
    (``DeviceMemory.models``) whether a set of models fits and why one never does."""

    def __init__(self, entries: dict[str, ModelEntry], memory: DeviceMemory) -> None:
        self.entries, self.models = entries, memory.models

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.state in (READY, UNLOADING)]

    def victim(self, keep: ModelEntry | None) -> ModelEntry | None:
        """The least recently used loaded model that is idle (None: every other one is busy)."""
        idle = [e for e in self.entries.values()
                if e.state == READY and e is not keep and not e.busy]
        return min(idle, key=lambda e: e.last_used) if idle else None

    def drained(self, keep: ModelEntry) -> ModelEntry | None:
        """The least recently used loaded model that is busy, to drain: no request let
        through from now, those let through answered, then unloaded (None: no other)."""
        busy = [e for e in self.entries.values() if e.state == READY and e is not keep]
        return min(busy, key=lambda e: e.last_used) if busy else None

    def fits(self, entries: list[ModelEntry], working: bool = False,
             loading: ModelEntry | None = None) -> bool:
        """Whether ``entries`` fit loaded together (``loading``: with room to make that one's
        largest session, as its load does)."""
        return self.models.fit((e.cost() for e in entries), working,
                               loading.name if loading is not None else None).fits

    def never_fits(self, entry: ModelEntry, loading: bool = False) -> ModelTooLargeError | None:
        """Why ``entry`` can never be loaded, even alone (None: it can, or only the device's
        free memory bounds it, which may grow); ``loading``: with room to make its largest
        session as its load does."""
        why = self.models.never_fits(entry.cost(), loading)
        return ModelTooLargeError(f"model {entry.name}: {why}") if why is not None else None

    def admit(self, entry: ModelEntry) -> bool:
        """A place for ``entry``'s load beside what requests hold (False: not now)."""
        try:
            return self.models.admit_load(entry.cost())
        except RequestTooLargeError as exc:
            raise ModelTooLargeError(f"model {entry.name}: {exc}") from exc


class Residency:
    """Loads models at start while they fit and on demand, unloads the least recently used
    idle ones to make room, and answers the repository API (see the module doc)."""

    def __init__(self, settings: Settings, metrics: Metrics, entries: dict[str, ModelEntry],
                 loader: ModelLoader, memory: DeviceMemory) -> None:
        self.settings, self.metrics, self.entries = settings, metrics, entries
        self.loader, self.memory = loader, memory
        self.room = Room(entries, memory)
        self._lock = asyncio.Lock()
        self._jobs: dict[str, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ requests

    async def use(self, entry: ModelEntry, timeout_s: float) -> Use:
        """Pin ``entry`` for a request, loaded: at once, or after waiting up to ``timeout_s``
        for its load (503 with Retry-After after that; 413 when it can never fit; 503 when
        it failed, is still at its first load, or was unloaded through the repository API)."""
        waited = 0.0 if entry.state == READY else await self._bring_in(entry, timeout_s)
        assert entry.state == READY
        entry.pins += 1
        entry.last_used = time.monotonic()
        return Use(entry, waited)

    def done(self, use: Use | None) -> None:
        """The request is answered: its model is no longer pinned by it (once)."""
        if use is None or use.released:
            return
        use.released = True
        entry = use.entry
        entry.pins -= 1
        entry.last_used = time.monotonic()
        if not entry.pins:
            self._notify()

    def refuse(self, entry: ModelEntry) -> None:
        """Raise what a request for ``entry`` gets at once, if it may not wait for a load."""
        if entry.state == FAILED:
            raise UnavailableError(f"model {entry.name} failed to load: {entry.error}",
                                   retry_after=60)
        if entry.starting:
            why = ("a first load measures its interim table" if self.settings.first_start ==
                   "interim" else "profiling and planning take a while once")
            raise UnavailableError(f"model {entry.name} is still loading ({why}); retry shortly",
                                   retry_after=5)
        if entry.explicit and entry.state in (UNLOADED, UNLOADING):
            raise UnavailableError(
                f"model {entry.name} is unloaded (through the repository API): load it with "
                f"POST /v2/repository/models/{entry.name}/load", retry_after=5)
        too_large = self.room.never_fits(entry)
        if too_large is not None:
            raise too_large

    async def _bring_in(self, entry: ModelEntry, timeout_s: float) -> float:
        entry.waiting += 1  # busy once loaded, until this request pins it (or gives up)
        try:
            return await self._wait_loaded(entry, timeout_s)
        finally:
            entry.waiting -= 1
            if not entry.waiting:
                self._notify()

    async def _wait_loaded(self, entry: ModelEntry, timeout_s: float) -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        while entry.state != READY:
            self.refuse(entry)
            job = self._job(entry, load=True)
            remaining = started + timeout_s - loop.time()
            if remaining > 0:
                await asyncio.wait({job}, timeout=remaining)
            if not job.done():
                raise UnavailableError(
                    f"model {entry.name} is not loaded, and making room for it and loading it "
                    f"took longer than this request may wait ({timeout_s:.3g} s, "
                    "request_timeout_s); retry shortly", retry_after=max(1, round(timeout_s / 4)))
            if job.exception() is not None:
                raise job.exception()  # type: ignore[misc]
        return loop.time() - started

    # ------------------------------------------------------------------ the repository API

    async def load(self, entry: ModelEntry) -> None:
        """Load ``entry`` now (a failed one is tried again), making room as a request would,
        and wait until it is ready (413 when it can never fit)."""
        entry.explicit = False
        if entry.state == FAILED:
            entry.state, entry.error = UNLOADED, None
        too_large = self.room.never_fits(entry)
        if too_large is not None:
            raise too_large
        while entry.state != READY:
            job = self._job(entry, load=True)
            await asyncio.wait({job})
            if job.exception() is not None:
                raise job.exception()  # type: ignore[misc]

    async def unload(self, entry: ModelEntry) -> None:
        """Unload ``entry`` once the requests let through are answered; it stays unloaded
        until loaded through the repository API."""
        entry.explicit = True
        while entry.state not in (UNLOADED, FAILED):
            job = self._job(entry, load=False)
            await asyncio.wait({job})
            if job.exception() is not None:
                raise job.exception()  # type: ignore[misc]

    def index(self, ready: bool = False) -> list[dict[str, str]]:
        """Every model (or the loaded ones) as Triton's repository index lists it."""
        return [self.index_of(e) for e in self.entries.values() if e.ready or not ready]

    @staticmethod
    def index_of(entry: ModelEntry) -> dict[str, str]:
        """One model's line of the index: its one version, its state, why it is not ready."""
        return {"name": entry.name, "version": "1", "state": REPOSITORY_STATES[entry.state],
                "reason": "" if entry.ready else (entry.error or entry.reason or "")}

    # ------------------------------------------------------------------ start and stop

    async def start(self) -> None:
        """Weigh every model, then load those that fit (all at once where all fit, as before
        loading on demand; else one at a time in the order given); the rest load on demand."""
        entries = list(self.entries.values())
        loop = asyncio.get_running_loop()
        async with self._lock:
            await asyncio.gather(*(loop.run_in_executor(self.loader.torch_thread(e),
                                                        self.loader.sketch, e) for e in entries))
            self.memory.rebase()  # what the process holds before any model (torch imported)
            total = len(entries)
            # each with room to make its sessions as it loads (all at once: the largest's)
            making = max(entries, key=lambda e: e.cost().remaking, default=None)
            if self.room.fits(entries, working=True, loading=making):
                await asyncio.gather(*(self._start_one(e, i, total)
                                       for i, e in enumerate(entries, 1)))
            else:
                for i, e in enumerate(entries, 1):
                    if self.room.fits([*self.room.loaded(), e], working=True, loading=e):
                        await self._start_one(e, i, total)
                    else:
                        self._defer(e)
            await self._settle(None)

    async def _start_one(self, entry: ModelEntry, i: int, total: int) -> None:
        try:
            self._loaded(entry, await self.loader.load(entry, i, total))
        finally:
            entry.starting = False
            self._notify()

    @staticmethod
    def _loaded(entry: ModelEntry, loaded: bool) -> bool:
        """``entry`` served now, or failed (its loader said why)."""
        entry.state = READY if loaded else FAILED
        return loaded

    def _defer(self, entry: ModelEntry) -> None:
        entry.state, entry.starting = UNLOADED, False
        too_large = self.room.never_fits(entry)
        entry.reason = (str(too_large) if too_large is not None else
                        "not loaded at start (the models loaded before it take the memory it "
                        "needs): loads on its first request")
        log.info("%s: %s", entry.name, entry.reason)
        self.metrics.model_ready.labels(entry.name).set(0)

    async def close(self) -> None:
        """Stop the loads and unloads under way (a load's torch work ends on its thread)."""
        jobs = [j for j in self._jobs.values() if not j.done()]
        for job in jobs:
            job.cancel()
        if jobs:
            await asyncio.wait(jobs, timeout=STOP_S)

    # ------------------------------------------------------------------ jobs (one at a time)

    def _job(self, entry: ModelEntry, *, load: bool) -> asyncio.Task[None]:
        """The load or unload of ``entry`` under way, or a new one (the one under way may be
        of the other kind: the caller looks again when it ends)."""
        job = self._jobs.get(entry.name)
        if job is None or job.done():
            work = self._load_job(entry) if load else self._unload_job(entry)
            job = asyncio.create_task(work, name=f"vbs-{'load' if load else 'unload'}-"
                                                 f"{entry.name}")
            job.add_done_callback(_retrieved)
            self._jobs[entry.name] = job
        return job

    async def _load_job(self, entry: ModelEntry) -> None:
        async with self._lock:
            if entry.state == READY:
                return
            await self._make_room(entry)
            entry.state, entry.error = LOADING, None
            self._notify()
            try:
                loaded = self._loaded(entry, await self.loader.load(entry))
            finally:
                self.memory.models.load_ended(entry.name)  # its place, however the load ended
            if not loaded:
                self._notify()
                raise UnavailableError(f"model {entry.name} failed to load: {entry.error}",
                                       retry_after=60)
            entry.last_used = time.monotonic()  # loaded for a request: recently used
            self._notify()
            await self._settle(entry)

    async def _unload_job(self, entry: ModelEntry) -> None:
        async with self._lock:
            if entry.state == READY:
                await self._unload(entry, "request")

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload idle models, the least recently used first, until ``entry`` fits beside
        the rest with room to make its sessions as it loads, and a place for its load in the
        memory owner's ledger of what requests hold; where every other model is busy, wait,
        and after ``drain_after_s`` drain the least recently used busy one; 503 after
        ``request_timeout_s``."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        drain_at = started + min(self.settings.drain_after_s, self.settings.request_timeout_s / 2)
        # 413 where, alone, its load would leave no room to make its largest session
        too_large = self.room.never_fits(entry, loading=True)
        if too_large is not None:
            raise too_large
        while True:
            together = [*self.room.loaded(), entry]
            # room to make its sessions as it loads (loading beside busy models without it
            # was the kernel's kill, docs/benchmarks.md section 8); alone with no limit, it
            # loads (a session is made when a plan needs it, if it can be)
            if self.room.fits(together, loading=entry) or (
                    len(together) == 1 and self.room.fits(together)):
                if self.room.admit(entry):
                    return
            else:  # (one that can never fit was refused above)
                # a hot model is never idle: only waiting for one starved the models it
                # would replace (section 8, round 6), so after a while the coldest busy goes
                victim = self.room.victim(entry) or (
                    self.room.drained(entry) if loop.time() >= drain_at else None)
                if victim is not None:
                    await self._unload(victim, "memory")
                    continue
            remaining = started + self.settings.request_timeout_s - loop.time()
            if remaining <= 0:
                busy = ", ".join(e.name for e in self.room.loaded()) or "requests held"
                raise UnavailableError(
                    f"model {entry.name} does not fit beside {busy}, busy for "
                    f"{self.settings.request_timeout_s:g} s (request_timeout_s); retry",
                    retry_after=1)
            await self._wait_change(min(POLL_S, remaining))

    async def _settle(self, loaded: ModelEntry | None) -> None:
        """After a load (its cost is known now, or estimates were off): unload idle models
        until those loaded fit; ``loaded`` itself, if it can never fit (413)."""
        while not self.room.fits(self.room.loaded()):
            victim = self.room.victim(loaded)
            if victim is not None:
                await self._unload(victim, "memory")
                continue
            too_large = self.room.never_fits(loaded) if loaded is not None else None
            if too_large is not None:
                await self._unload(loaded, "memory")  # type: ignore[arg-type]
                loaded.reason = str(too_large)  # type: ignore[union-attr]
                raise too_large
            break  # beside busy models: the arbiter and the ledger hold their plans back

    async def _unload(self, entry: ModelEntry, reason: str) -> None:
        """Unload ``entry`` (inside the lock): no request let through from now, those let
        through answered, its batcher drained and closed, what it keeps given back."""
        entry.state = UNLOADING
        self._notify()
        try:
            while entry.pins:  # drained, or through the repository API
                await self._wait_change(POLL_S)
            if entry.batcher is not None:
                await entry.batcher.close(self.settings.request_timeout_s)
            await self.loader.unload(entry)
        except BaseException as exc:
            entry.state, entry.error = FAILED, f"unloading failed: {exc}"
            raise
        entry.state = UNLOADED
        entry.reason = ("unloaded through the repository API" if reason == "request" else
                        "unloaded to make room for another model: loads on its next request")
        self.metrics.model_unloads.labels(entry.name, reason).inc()
        self._notify()

    # ------------------------------------------------------------------ changes

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _wait_change(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass


def _retrieved(job: asyncio.Task[Any]) -> None:
    """A job's failure is its waiters' (each raises it); one nobody waited for is logged."""
    if not job.cancelled() and job.exception() is not None:
        log.debug("%s: %s", job.get_name(), job.exception())


__all__ = ["Residency", "Use"]
