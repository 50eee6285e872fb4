"""Loading the served models: each prepared on its torch thread, then given a batcher.

``planner.pipeline.prepare`` reads a model's tables from the store by the profile's
fingerprint, or profiles, solves and publishes them; the model gets a worker (counted by the
device's memory owner, ``workers.device_memory``) and a batcher. A model that waits for the
store retries with backoff; one that cannot be served (a bad name, an untraceable model, a
malformed stored table) is marked failed with the reason the readiness endpoints show.

Torch threads: on the CPU one thread runs all the process's torch work, loading and every
batch of every model, because every thread that starts an OpenMP region gets a team of its
own, and with more OpenMP threads than cores each region pays for waking its threads
(docs/operations.md, "Threads in one process"). On CUDA, or with
``VBS_CPU_MODEL_THREADS=per_model``, each model has its own thread.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from core.errors import StoreError, TableFormatError, VbsError
from planner.families import build_preprocess, labels_for
from planner.store import Backoff, PlanStore, open_store, printable_location
from service.batcher import Batcher
from service.entry import FAILED, READY, ModelEntry
from service.metrics import Metrics
from service.settings import Settings
from workers.device_memory import DeviceMemory

log = logging.getLogger("vbs.service")
HEARTBEAT_S = 15.0


class ModelLoader:
    """Prepares models on their torch threads and makes their batchers (see the module doc)."""

    def __init__(self, settings: Settings, metrics: Metrics, memory: DeviceMemory,
                 backoff: Backoff, rng: random.Random) -> None:
        self.settings, self.metrics, self.memory = settings, metrics, memory
        self.backoff, self._rng = backoff, rng
        self._cpu_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vbs-torch")
        self._executors: dict[str, ThreadPoolExecutor] = {}  # model -> its torch thread
        self._store: PlanStore | None = None
        self._store_lock = threading.Lock()

    async def load_all(self, entries: list[ModelEntry]) -> None:
        """Load every model at once; one that waits for the store or fails does not hold the
        others back."""
        total = len(entries)
        await asyncio.gather(*(self._load(entry, i, total) for i, entry in enumerate(entries, 1)))

    def torch_thread(self, entry: ModelEntry) -> ThreadPoolExecutor:
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
        executor = self.torch_thread(entry)
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
        self.memory.register(entry.name, lambda: entry.worker.table, batcher.demand,
                             weight=weights.get(entry.name, 1.0),  # type: ignore[union-attr]
                             minimum=minimums.get(entry.name, 0))  # type: ignore[union-attr]
        await batcher.start()
        entry.batcher = batcher
        entry.load_s = round(time.monotonic() - started, 3)
        entry.error = None
        entry.state = READY
        self.metrics.model_ready.labels(entry.name).set(1)
        self.memory.rebase()  # what stays with this model loaded: weights, buffers
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
        # the device's one reading of its free memory, shared by every model on it
        worker = Worker(prepared.capture, prepared.table, self.memory.probe, name=entry.name,
                        memory=self.memory, lease_timeout_s=s.request_timeout_s,
                        runtime_options=RuntimeOptions(spin=s.ort_spin,
                                                       max_sessions=s.ort_sessions))
        self.memory.budget()  # read here, on the torch thread: known from the start
        out_shape = tuple(prepared.capture.output_shape)
        labels = labels_for(entry.spec.name, out_shape[0]) if len(out_shape) == 1 else None
        pre = build_preprocess(entry.spec.name, tuple(prepared.capture.input_shape))
        entry.prepared, entry.worker, entry.tables = prepared, worker, dict(prepared.tables)
        entry.table_version = version
        entry.table_meta = {"solver": prepared.table.solver, "slot_bytes": prepared.table.slot_bytes}
        entry.labels = labels
        if pre is not None:
            entry.preprocess, entry.image_mode = pre

    async def close(self) -> None:
        """Give back the torch threads (their batchers drained first) and the store."""
        for executor in {self._cpu_thread, *self._executors.values()}:
            executor.shutdown(wait=False)  # drained; a batch stuck past it is left to end
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
