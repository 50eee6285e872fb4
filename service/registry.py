"""The models a service serves, their plan tables, and keeping those tables current.

At start every model is prepared at once (``planner.pipeline.prepare``: its tables read from
the store by the profile's fingerprint, or profiled, solved and published) and gets a worker
and a batcher; one that waits for the store or fails does not hold the others back, and one
that cannot be served (a bad name, an untraceable model, a malformed stored table) is marked
failed with the reason the readiness endpoints show. The models of a device share one memory
arbiter (``workers.arbiter``), which the registry builds and reports.

Torch threads: on the CPU one thread runs all the process's torch work, loading and every
batch of every model, because every thread that starts an OpenMP region gets a team of its
own, and with more OpenMP threads than cores each region pays for waking its threads
(docs/operations.md, "Threads in one process"). On CUDA, or with ``VBS_CPU_MODEL_THREADS=per_model``, each
model has its own thread.

A background task watches the store: when the planner announces a new version of a served
table, it and the tables compared with it are read and swapped in between batches (a batch
keeps the table it started with). When the store goes away, serving goes on from the tables
in memory while the watch reconnects with backoff; a new version that cannot be used is
logged, counted and not read again, and the model keeps its table.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from core.errors import StoreError, TableFormatError, UsageError, VbsError
from core.loaded import ModelSpec
from core.lru import LRU
from service.settings import Settings
from core.table import PlanTable
from planner.store import Backoff, PlanStore, open_async_store, open_store, printable_location
from planner.store.base import AsyncPlanStore
from planner.store.keys import table_id
from service.admission import Admission
from service.batcher import Batcher
from service.codecs import Preprocess, build_preprocess, labels_for
from service.errors import ModelNotFoundError, RequestError, UnavailableError
from service.metrics import MemoryListener, Metrics
from workers.arbiter import Arbiter
from workers.memory import MemoryProbe
from workers.shares import working_bytes

log = logging.getLogger("vbs.service")
# answers kept per model for /plan and the page: plan descriptions (a few KB each), curves, tree
CACHED_ANSWERS = 4096

LOADING, READY, FAILED = "loading", "ready", "failed"
HEARTBEAT_S = 15.0


@dataclass(eq=False)
class ModelEntry:
    """One served model: what it is, its worker and batcher once loaded, and its table."""

    name: str                       # the name it is served under (URLs, metrics)
    spec: ModelSpec
    state: str = LOADING
    error: str | None = None
    prepared: Any = None            # planner.pipeline.Prepared
    worker: Any = None              # workers.worker.Worker
    batcher: Batcher | None = None
    tables: dict[str, PlanTable] = field(default_factory=dict)  # every strategy's, for /plan
    table_version: int | None = None
    table_meta: dict[str, Any] = field(default_factory=dict)
    labels: list[str] | None = None
    preprocess: Preprocess | None = None
    image_mode: str | None = None
    load_s: float | None = None
    cache: LRU[Any] = field(default_factory=lambda: LRU(CACHED_ANSWERS), repr=False)

    @property
    def ready(self) -> bool:
        return self.state == READY

    @property
    def fingerprint(self) -> str | None:
        return self.prepared.fingerprint if self.prepared is not None else None

    @property
    def table_id(self) -> str | None:
        return self.prepared.table_id if self.prepared is not None else None

    @property
    def input_shape(self) -> tuple[int, ...]:
        if self.prepared is not None:
            return tuple(self.prepared.capture.input_shape)
        return tuple(self.spec.input_shape or ())

    @property
    def output_shape(self) -> tuple[int, ...]:
        return tuple(self.prepared.capture.output_shape) if self.prepared is not None else ()

    @property
    def table(self) -> PlanTable:
        return self.worker.table

    def cached(self, key: Any, compute: Any) -> Any:
        """An answer that depends only on this model's table (for /plan), kept in a small LRU."""
        return self.cache.get_or_make(key, compute)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "model": self.spec.name, "state": self.state,
                               "dtype": self.spec.dtype, "device": self.spec.device,
                               "input_shape": list(self.input_shape) or None}
        if self.error:
            out["error"] = self.error
        if self.ready:
            table = self.table
            out.update({
                "output_shape": list(self.output_shape), "batch_max": table.batch_max,
                "fingerprint": self.fingerprint, "labels": self.labels is not None,
                "images": self.preprocess is not None,
                "table": {"id": self.table_id, "version": self.table_version,
                          "solver": table.solver, "objective": table.objective,
                          "slot_bytes": table.slot_bytes, "top_bytes": table.top_bytes,
                          "min_bytes": int(table.min_peaks[0]), "plans": len(table.plans),
                          "compared": sorted(s for s in self.tables if s != table.solver)},
                "queue": self.batcher.waiting if self.batcher else 0,
                "memory_limit_bytes": self.worker.probe.limit,
                "memory_share_bytes": self.worker.arbiter.shares().get(self.name)
                if self.worker.arbiter is not None else None,
                "load_s": self.load_s,
            })
        return out


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
    """Loads the models of ``settings.models``, serves their entries, reloads their tables."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.entries: dict[str, ModelEntry] = {}
        for served, name, shape in settings.served_models:
            spec = ModelSpec(name=name, input_shape=shape, dtype=settings.dtype,
                             device=settings.device, weights=settings.weights)
            self.entries[served] = ModelEntry(served, spec)
            metrics.model_ready.labels(served).set(0)
        self.backoff = Backoff(base=settings.store_retry_base_s, cap=settings.store_retry_cap_s)
        self._rng = random.Random()
        self._cpu_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vbs-torch")
        self._executors: dict[str, ThreadPoolExecutor] = {}  # model -> its torch thread
        self.arbiters: dict[str, Arbiter] = {}  # device -> the arbiter of its memory
        self.probes: dict[str, MemoryProbe] = {}  # device -> the one reading of its free memory
        # under a cgroup memory limit (CPU): what requests hold counts as the plans do
        self.admission = Admission(lambda: self.arbiters["cpu"].leased if "cpu" in self.arbiters
                                   else 0, self.one_sample_bytes, want=self.working_bytes,
                                   margin=settings.memory_margin_bytes,
                                   wait_s=settings.line_wait_s)
        if settings.device != "cpu":
            self.admission.active = False
        self.arbiter(settings.device)
        self._store: PlanStore | None = None
        self._store_lock = threading.Lock()
        self._astore: AsyncPlanStore | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._loaded = asyncio.Event()   # every model loaded or failed
        self._changed = asyncio.Event()  # replaced after every table swap
        self.store_up: bool | None = None
        self._unusable: dict[str, int] = {}  # model -> the last table version that could not be used

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

    def memory(self) -> list[dict[str, Any]]:
        """Every device's arbiter: budget, shares, leases, high water, overcommits (JSON)."""
        return [a.snapshot().to_json() for a in self.arbiters.values()]

    def one_sample_bytes(self, name: str | None = None) -> int:
        """The bytes of model ``name``'s one-sample plan (None or not ready: the largest of
        the ready models'; 0 when none is ready)."""
        entry = self.entries.get(name) if name is not None else None
        if entry is not None and entry.ready:
            return int(entry.table.min_peaks[0])
        return max((int(e.table.min_peaks[0]) for e in self.entries.values() if e.ready),
                   default=0)

    def working_bytes(self, name: str | None = None) -> int:
        """The bytes at which model ``name``'s batches run at working speed
        (``workers.shares.working_bytes``; None or not ready: the largest of the ready
        models'; 0 when none is ready)."""
        entry = self.entries.get(name) if name is not None else None
        if entry is not None and entry.ready:
            return working_bytes(entry.table)
        return max((working_bytes(e.table) for e in self.entries.values() if e.ready),
                   default=0)

    def arbiter(self, device: str) -> Arbiter:
        """The memory arbiter of ``device`` (one per device, built on first use)."""
        found = self.arbiters.get(device)
        if found is None:
            s = self.settings
            limited = device == "cpu" and self.admission.active  # the ledger keeps the margin
            probe = self.probes[device] = MemoryProbe(
                device=device, limit=s.memory_limit_bytes,
                margin=0 if limited else s.memory_margin_bytes,
                source=self.admission.plan_free if limited else None)
            ceiling = None
            if limited:
                def ceiling() -> int:
                    most = self.admission.ceiling()
                    return min(most, probe.limit) if probe.limit else most
            serial = device == "cpu" and s.cpu_model_threads == "shared"
            found = self.arbiters[device] = Arbiter(device, probe.free, mode=s.memory_sharing,
                                                    serial=serial, ceiling=ceiling,
                                                    listener=MemoryListener(self.metrics))
        return found

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
        entry = self.get(name)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while entry.table_version is None or entry.table_version < version:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise UnavailableError(f"model {name} still serves table {entry.table_version}, "
                                       f"not {version}, after {timeout_s} s")
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                continue

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        if not self.entries:
            log.warning("no models configured: the service answers health checks only")
            self._loaded.set()
            return
        self._load_task = asyncio.create_task(self._load_all(), name="vbs-load-models")

    async def close(self) -> None:
        """Stop loading and watching; drain every batcher (accepted requests are answered)."""
        await asyncio.gather(*(_stop(t) for t in (self._load_task, self._watch_task)
                               if t is not None))
        batchers = [e.batcher for e in self.entries.values() if e.batcher is not None]
        await asyncio.gather(*(b.close(self.settings.request_timeout_s) for b in batchers),
                             return_exceptions=True)
        for executor in {self._cpu_thread, *self._executors.values()}:
            executor.shutdown(wait=False)  # drained above; a batch stuck past it is left to end
        if self._astore is not None:
            try:
                await self._astore.aclose()
            except StoreError as exc:
                log.debug("closing the plan store: %s", exc)
        if self._store is not None:
            await asyncio.to_thread(self._store.close)

    # ------------------------------------------------------------------ loading

    async def _load_all(self) -> None:
        try:
            total = len(self.entries)
            await asyncio.gather(*(self._load(entry, i, total)
                                   for i, entry in enumerate(self.entries.values(), 1)))
        finally:
            self._loaded.set()
        if self.ready:
            log.info("ready: %s", ", ".join(self.entries))
        if any(e.ready for e in self.entries.values()):
            self._watch_task = asyncio.create_task(self._watch(), name="vbs-watch-tables")

    def _torch_thread(self, entry: ModelEntry) -> ThreadPoolExecutor:
        """The thread that runs ``entry``'s torch work: the process's one on the CPU, unless
        each model gets its own (``cpu_model_threads``)."""
        if entry.spec.device == "cpu" and self.settings.cpu_model_threads == "shared":
            return self._cpu_thread
        if entry.name not in self._executors:
            self._executors[entry.name] = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"vbs-torch-{entry.name}")
        return self._executors[entry.name]

    async def _load(self, entry: ModelEntry, i: int, total: int) -> None:
        loop = asyncio.get_running_loop()
        executor = self._torch_thread(entry)
        attempt = 0
        while True:
            started = time.monotonic()
            log.info("%s: loading %s (%d of %d) with tables from %s", entry.name, entry.spec.name,
                     i, total, printable_location(self.settings.store_location))
            heartbeat = asyncio.create_task(self._heartbeat(entry, started))
            try:
                await loop.run_in_executor(executor, self._prepare, entry)
            except TableFormatError as exc:  # bad data: retrying cannot help
                self.metrics.store_errors.inc()
                self._failed(entry, str(exc))
                return
            except StoreError as exc:
                self.metrics.store_errors.inc()
                delay = self.backoff.delay(attempt, self._rng.random())
                attempt += 1
                entry.error = f"plan store unavailable ({exc}); retrying in {delay:.1f} s"
                log.warning("%s: %s", entry.name, entry.error)
                await asyncio.sleep(delay)
                continue
            except VbsError as exc:
                self._failed(entry, str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a model that cannot load must not stop the rest
                log.exception("%s: loading failed", entry.name)
                self._failed(entry, f"{type(exc).__name__}: {exc}")
                return
            finally:
                heartbeat.cancel()
            break
        batcher = Batcher(entry.name, entry.worker, executor,
                          max_delay_s=self.settings.max_batch_delay_ms / 1000,
                          max_queue=self.settings.max_queue,
                          latency_target_s=self.settings.latency_target_s, metrics=self.metrics,
                          follow_up=self.settings.batch_follow_up,
                          timeout_s=self.settings.request_timeout_s,
                          table_version=lambda: entry.table_version)
        weights, minimums = self.settings.memory_weights, self.settings.memory_minimums
        entry.worker.arbiter.register(entry.name, lambda: entry.worker.table, batcher.demand,
                                      weight=weights.get(entry.name, 1.0),  # type: ignore[union-attr]
                                      minimum=minimums.get(entry.name, 0))  # type: ignore[union-attr]
        await batcher.start()
        entry.batcher = batcher
        entry.load_s = round(time.monotonic() - started, 3)
        entry.error = None
        entry.state = READY
        self.metrics.model_ready.labels(entry.name).set(1)
        self.admission.rebase()  # what stays with this model loaded: weights, buffers
        self.metrics.table_version.labels(entry.name).set(entry.table_version or 0)
        table = entry.table
        log.info("%s: ready in %.1f s: input %s, table v%s (%s, %d plans, b <= %d, fingerprint %s)",
                 entry.name, entry.load_s, list(entry.input_shape), entry.table_version,
                 table.solver, len(table.plans), table.batch_max, entry.fingerprint)

    async def _heartbeat(self, entry: ModelEntry, started: float) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            log.info("%s: still preparing (%.0f s): profiling every layer at every batch size "
                     "happens once per model and device", entry.name, time.monotonic() - started)

    def _failed(self, entry: ModelEntry, message: str) -> None:
        entry.state, entry.error = FAILED, " ".join(message.split())
        log.error("%s: cannot be served: %s", entry.name, entry.error)

    def _sync_store(self) -> PlanStore:
        with self._store_lock:  # models on CUDA prepare on threads of their own
            if self._store is None:
                self._store = open_store(self.settings.store_location)
            return self._store

    def _prepare(self, entry: ModelEntry) -> None:
        """Capture, table (from the store or solved), worker, labels, preprocessing (a thread)."""
        from core.runtimes.base import RuntimeOptions
        from planner.pipeline import prepare
        from workers.worker import Worker

        store = self._sync_store()
        s = self.settings
        prepared = prepare(entry.spec, s, store, batch_max=s.batch_max, solver=s.solver,
                           objective=s.objective, repair=False, progress=False)
        version = store.table_version(prepared.table_id)
        arbiter = self.arbiter(s.device)  # its probe is the device's one reading, shared
        worker = Worker(prepared.capture, prepared.table, self.probes[s.device], name=entry.name,
                        arbiter=arbiter, lease_timeout_s=s.request_timeout_s,
                        runtime_options=RuntimeOptions(spin=s.ort_spin,
                                                       max_sessions=s.ort_sessions))
        worker.arbiter.budget()  # read here, on the torch thread: known from the start
        out_shape = tuple(prepared.capture.output_shape)
        labels = labels_for(entry.spec.name, out_shape[0]) if len(out_shape) == 1 else None
        pre = build_preprocess(entry.spec.name, tuple(prepared.capture.input_shape))
        entry.prepared, entry.worker, entry.tables = prepared, worker, dict(prepared.tables)
        entry.table_version = version
        entry.table_meta = {"solver": prepared.table.solver, "slot_bytes": prepared.table.slot_bytes}
        entry.labels = labels
        if pre is not None:
            entry.preprocess, entry.image_mode = pre

    # ------------------------------------------------------------------ watching the store

    def _set_store_up(self, up: bool) -> None:
        self.store_up = up
        self.metrics.store_up.set(1 if up else 0)

    async def _watch(self) -> None:
        try:
            self._astore = open_async_store(self.settings.store_location,
                                            poll_interval=self.settings.store_poll_s)
        except StoreError as exc:
            self.metrics.store_errors.inc()
            log.error("cannot watch the plan store for new tables: %s", exc)
            return
        attempt = 0
        while True:
            try:
                async with self._astore.watch() as announcements:
                    if attempt:
                        log.info("plan store %s is back; checking for tables published "
                                 "meanwhile", self._astore.location)
                    self._set_store_up(True)
                    attempt = 0
                    await self._catch_up(self._astore)
                    async for announcement in announcements:
                        for entry in self._serving(announcement.fingerprint):
                            await self._reload(self._astore, entry, announcement.version)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the watch must outlive any one failure
                if not isinstance(exc, StoreError):
                    log.exception("plan store watch failed unexpectedly")
                self._set_store_up(False)
                self.metrics.store_errors.inc()
                delay = self.backoff.delay(attempt, self._rng.random())
                attempt += 1
                log.warning("plan store: %s; serving goes on from the tables in memory; "
                            "retrying in %.2f s", " ".join(str(exc).split()), delay)
                await asyncio.sleep(delay)

    def _serving(self, table_id: str) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.ready and e.table_id == table_id]

    async def _catch_up(self, store: AsyncPlanStore) -> None:
        for entry in [e for e in self.entries.values() if e.ready]:
            try:
                version = await store.table_version(entry.table_id)
            except TableFormatError as exc:  # this model's counter: the others go on
                self.metrics.store_errors.inc()
                log.error("%s: keeping table v%s: %s", entry.name, entry.table_version, exc)
                continue
            if version is not None:
                await self._reload(store, entry, version)

    async def _reload(self, store: AsyncPlanStore, entry: ModelEntry, version: int) -> None:
        """Swap in version ``version`` (or a later one) of ``entry``'s table if it is usable;
        else keep serving the one in memory. Only a store that is down raises (StoreError)."""
        seen = max(entry.table_version or 0, self._unusable.get(entry.name, 0))
        if version <= seen:
            return
        where = f"table {entry.table_id} in store {store.location}"
        try:
            stored = await store.get_table(entry.table_id)
        except TableFormatError as exc:  # bad meta: this version is skipped, not retried
            self.metrics.store_errors.inc()
            log.error("%s: table v%d cannot be used, keeping v%s: %s", entry.name, version,
                      entry.table_version, exc)
            self._unusable[entry.name] = version
            return
        if stored.version <= seen:
            return
        try:
            table = await asyncio.to_thread(PlanTable.from_bytes, stored.blob, where)
            if (table.fingerprint, table.solver, table.objective) != (
                    entry.fingerprint, self.settings.solver, self.settings.objective):
                raise UsageError(f"the table under {entry.table_id} holds {table.solver!r} plans "
                                 f"for {table.objective!r} of fingerprint {table.fingerprint}")
            tables = {table.solver: table}
            for solver in entry.tables:  # the strategies /plan compares it with, if readable
                if solver == table.solver:
                    continue
                try:
                    tid = table_id(entry.fingerprint, solver, table.objective)
                    other = await store.get_table(tid)
                    tables[solver] = await asyncio.to_thread(
                        PlanTable.from_bytes, other.blob, f"table {tid} in store {store.location}")
                except StoreError as exc:
                    log.warning("%s: keeping the %s table in memory: %s", entry.name, solver, exc)
                    tables[solver] = entry.tables[solver]
        except Exception as exc:  # noqa: BLE001 - malformed or mismatched: keep serving the old
            self.metrics.store_errors.inc()
            log.error("%s: table v%d cannot be used, keeping v%s: %s", entry.name, stored.version,
                      entry.table_version, exc, exc_info=not isinstance(exc, VbsError))
            self._unusable[entry.name] = stored.version  # not read again until a newer one
            return
        await asyncio.to_thread(entry.worker.prepare, table)  # its runtimes' sessions, off the loop
        entry.worker.table = table
        entry.tables = tables
        old = entry.table_version
        entry.table_version = stored.version
        entry.table_meta = dict(stored.meta)
        entry.cache.clear()
        self.metrics.table_reloads.labels(entry.name).inc()
        self.metrics.table_version.labels(entry.name).set(stored.version)
        log.info("%s: table v%s -> v%d swapped in (%s, %d plans)", entry.name, old,
                 stored.version, table.solver, len(table.plans))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
