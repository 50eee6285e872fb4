"""Loading and unloading the served models: each prepared on its torch thread, then given a
batcher; unloaded, its runtimes, worker and weights given back.

``planner.pipeline.prepare`` reads a model's tables from the store by the profile's
fingerprint, or profiles, solves and publishes them; the model gets a worker (counted by the
device's memory owner, ``workers.device_memory``) and a batcher. A model that waits for the
store retries with backoff; one that cannot be served (a bad name, an untraceable model, a
malformed stored table) is marked failed with the reason the readiness endpoints show. Which
models are loaded, and when, is ``service.residency``'s: this module does one load or unload
and tells the device's memory owner what the model keeps (``DeviceMemory.models``).

Torch threads: on the CPU one thread runs all the process's torch work, loading and every
batch of every model, because every thread that starts an OpenMP region gets a team of its
own, and with more OpenMP threads than cores each region pays for waking its threads
(docs/operations.md, "Threads in one process"). On CUDA, or with
``VBS_CPU_MODEL_THREADS=per_model``, each model has its own thread.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from core.errors import StoreError, TableFormatError, TableNotFoundError, UsageError, VbsError
from core.precision import Precision
from core.table import INTERIM
from planner.families import build_preprocess, labels_for
from planner.store import Backoff, PlanStore, open_store, printable_location
from service.batcher import Batcher
from service.entry import ModelEntry
from service.first_start import BackgroundPlans, interim_prepared
from service.metrics import Metrics
from service.settings import Settings
from service.sketch import sketch, stored_inputs
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
        # `vbs plan` beside the models served from interim tables (``service.first_start``)
        self.plans = BackgroundPlans(settings, lambda tid: self._sync_store().table_version(tid))
        # whether ONNX Runtime's arena keeps what a call used: the device's memory owner says
        self.arena = memory.arena

    def torch_thread(self, entry: ModelEntry) -> ThreadPoolExecutor:
        """The thread that runs ``entry``'s torch work: the process's one on the CPU, unless
        each model gets its own (``cpu_model_threads``)."""
        if entry.spec.device == "cpu" and self.settings.cpu_model_threads == "shared":
            return self._cpu_thread
        if entry.name not in self._executors:
            self._executors[entry.name] = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"vbs-torch-{entry.name}")
        return self._executors[entry.name]

    async def load(self, entry: ModelEntry, i: int = 1, total: int = 1) -> bool:
        """Load ``entry`` (``i`` of ``total`` being loaded, for the log): True when it is
        served now, False when it cannot be (``entry.error`` says why); one that waits for
        the store retries with backoff."""
        loop = asyncio.get_running_loop()
        executor = self.torch_thread(entry)
        attempt = 0
        self.memory.models.loading(entry.name)  # the group read now, to measure what it keeps
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
                return False
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
                return False
            except Exception as exc:  # noqa: BLE001 - a model that cannot load must not stop the rest
                log.exception("%s: loading failed", entry.name)
                self._failed(entry, f"{type(exc).__name__}: {exc}")
                return False
            finally:
                heartbeat.cancel()
            break
        try:
            await self._serve(entry, executor, started)
        except Exception as exc:  # noqa: BLE001 - prepared, but its batcher or memory failed
            log.exception("%s: starting to serve failed", entry.name)
            if entry.batcher is not None:
                await entry.batcher.close(self.settings.request_timeout_s)
            self._failed(entry, f"{type(exc).__name__}: {exc}")
            return False
        if entry.interim:  # served now; its tables are planned beside it
            self.plans.start(entry)
        return True

    async def _serve(self, entry: ModelEntry, executor: ThreadPoolExecutor, started: float
                     ) -> None:
        """A prepared model's batcher started, its memory counted: ready."""
        batcher = Batcher(entry.name, entry.worker, executor,
                          max_delay_s=self.settings.max_batch_delay_ms / 1000,
                          max_queue=self.settings.max_queue,
                          latency_target_s=self.settings.latency_target_s, metrics=self.metrics,
                          follow_up=self.settings.batch_follow_up,
                          timeout_s=self.settings.request_timeout_s,
                          table_version=lambda: entry.table_version,
                          # the two stages hand torch tensors over: not for a model served
                          # without torch (on the CPU nothing overlaps anyway)
                          pipelined=self.settings.pipelined(entry.spec.device) and not entry.lean)
        weights, minimums = self.settings.memory_weights, self.settings.memory_minimums
        # registered by the entry (not its worker or batcher, which go when it is unloaded)
        self.memory.register(entry.name, lambda: entry.table, entry.demand,
                             weight=weights.get(entry.name, 1.0),  # type: ignore[union-attr]
                             minimum=minimums.get(entry.name, 0))  # type: ignore[union-attr]
        await batcher.start()
        entry.batcher = batcher
        entry.load_s = round(time.monotonic() - started, 3)
        entry.error = entry.reason = None
        entry.loads += 1
        # what stays with this model loaded: weights, sessions, buffers, or what the group
        # grew by while it loaded where a cgroup limit applies, if more (the memory owner's)
        kept = entry.kept_bytes = self.memory.models.loaded(entry.name,
                                                            entry.worker.kept_bytes())
        entry.making_bytes = entry.worker.making_bytes
        entry.held_bytes = entry.worker.held_bytes
        m = self.metrics
        m.model_ready.labels(entry.name).set(1)
        m.model_loads.labels(entry.name).inc()
        m.load_time.labels(entry.name).observe(entry.load_s)
        m.model_kept.labels(entry.name).set(kept)
        m.table_version.labels(entry.name).set(entry.table_version or 0)
        table = entry.table
        log.info("%s: ready in %.1f s: input %s, table v%s (%s, %d plans, b <= %d, fingerprint "
                 "%s), keeps %d bytes", entry.name, entry.load_s, list(entry.input_shape),
                 entry.table_version, table.solver, len(table.plans), table.batch_max,
                 entry.fingerprint, kept)

    async def _heartbeat(self, entry: ModelEntry, started: float) -> None:
        doing = ("capturing it and measuring the whole model in ONNX Runtime (its interim table) "
                 "where its store has no table" if self.settings.first_start == "interim" else
                 "profiling every layer at every batch size happens once per model and device")
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            log.info("%s: still preparing (%.0f s): %s", entry.name, time.monotonic() - started,
                     doing)

    def _failed(self, entry: ModelEntry, message: str) -> None:
        """Why ``entry`` cannot be served (its state is the residency's to set)."""
        self.memory.models.load_ended(entry.name)
        entry.error = " ".join(message.split())
        entry.worker = entry.prepared = entry.batcher = None  # what a half load made goes
        log.error("%s: cannot be served: %s", entry.name, entry.error)

    def _sync_store(self) -> PlanStore:
        with self._store_lock:  # models on CUDA prepare on threads of their own
            if self._store is None:
                self._store = open_store(self.settings.store_location)
            return self._store

    def _prepare(self, entry: ModelEntry) -> None:
        """Capture, table (from the store, solved, or interim: ``service.first_start``),
        worker, labels, preprocessing (a thread); or, served without torch
        (``Settings.lean_for``), the compiled model from the store."""
        from core.runtimes.base import RuntimeOptions
        from planner.store.keys import table_id
        from workers.worker import Worker

        store = self._sync_store()
        s = self.settings
        # a session asks free what `vbs plan` measured the model's sessions take to make
        factor = entry.load_cost.making_factor if entry.load_cost is not None else None
        options = RuntimeOptions(spin=s.ort_spin, max_sessions=s.ort_sessions, arena=self.arena,
                                 making_factor=factor)
        runtimes: dict[str, Any] = {}  # made already (the interim table's): the worker's
        from planner.stored import planned_for

        planned = planned_for(s, store, entry.name, entry.spec)  # what `vbs plan` recorded
        found = self._compiled(entry, store, planned)
        lean = found is not None
        if found is not None:
            prepared, model = found
        else:
            prepared, runtimes = self._torch_model(entry, store, options, planned)
            model = prepared.capture
        interim = not lean and prepared.solver == INTERIM
        table = prepared.tables[INTERIM if interim else s.solver]
        # the id of the table it serves, or will once planned (the watch swaps that one in)
        tid = table_id(prepared.fingerprint, s.solver, s.objective if interim else table.objective)
        version = 0 if interim else store.table_version(tid)  # 0: interim, never stored
        # the device's one reading of its free memory, shared by every model on it
        worker = Worker(model, table, self.memory.probe, name=entry.name,
                        memory=self.memory, lease_timeout_s=s.request_timeout_s,
                        runtimes=runtimes, runtime_options=options)
        self.memory.budget()  # read here, on the torch thread: known from the start
        in_shape, out_shape = tuple(worker.model.input_shape), tuple(worker.model.output_shape)
        if lean:  # what `vbs plan` read of the model's family, stored with it
            labels, pre = stored_inputs(prepared.compiled.meta)
        else:
            labels = labels_for(entry.spec.name, out_shape[0]) if len(out_shape) == 1 else None
            pre = build_preprocess(entry.spec.name, in_shape)
        entry.prepared, entry.worker, entry.tables = prepared, worker, dict(prepared.tables)
        entry.solver, entry.profile = table.solver, prepared.profile
        entry.fingerprint, entry.table_id = prepared.fingerprint, tid
        entry.lean = lean
        entry.shapes = (in_shape, out_shape)
        entry.table_version = version
        entry.table_meta = {"solver": table.solver, "slot_bytes": table.slot_bytes}
        entry.labels = labels
        if pre is not None:
            entry.preprocess, entry.image_mode = pre

    def _compiled(self, entry: ModelEntry, store: PlanStore, planned: Any
                  ) -> tuple[Any, Any] | None:
        """The compiled model from the store and the model a worker without torch runs
        (``workers.array_backend``) where ``entry`` is served so (``Settings.lean_for``, or
        ``lean_if_compiled`` and the store holds it compiled with tables that run so); else
        None: it is served with torch."""
        from planner.stored import follows, read_compiled
        from workers.array_backend import ArrayModel

        s, device = self.settings, entry.spec.device
        must = s.lean_for(device)
        if not must and not s.lean_if_compiled(device):
            return None
        half = planned.precision.dtype if planned is not None and planned.precision.half else ""
        if half:  # (a compiled model of it is an older plan's)
            if must:
                raise UsageError(f"{entry.name}: planned at {half}, which a worker without "
                                 "torch cannot run: serve it with torch (VBS_LEAN=auto or off, "
                                 "torch installed)")
            log.info("%s: served with torch: planned at %s", entry.name, half)
            return None
        try:
            # its weights in a file of the cache directory (a disk), not twice in memory
            prepared = read_compiled(store, entry.name, entry.spec, s.solver, s.objective,
                                     weights_dir=s.cache_dir / "weights")
        except TableNotFoundError as exc:
            if must:
                raise
            log.info("%s: served with torch: %s", entry.name, exc)
            return None
        compiled = Precision.from_json(prepared.compiled.meta.get("precision"))
        # planned int8 and VBS_PRECISION names float32 or a half: that one's tables (a float32
        # compiled model is served whatever is named, as before: where int8 was asked of
        # `vbs plan`, its guard or speed check kept float32)
        if compiled.int8 and not follows(s, compiled.name):
            if must:
                raise UsageError(f"{entry.name}: its compiled model {prepared.compiled_id} is "
                                 f"{compiled.name}, and {s.precision} is asked (VBS_PRECISION): "
                                 f"plan it at {s.precision}, or serve it with torch")
            log.info("%s: served with torch: its compiled model is %s, %s asked", entry.name,
                     compiled.name, s.precision)
            return None
        model = ArrayModel(prepared.compiled, prepared.profile.root, prepared.fingerprint)
        why = "" if must else model.unrunnable(prepared.tables[s.solver])
        if why:  # (where it must, the worker refuses it, naming the fix; int8 units: the
            # torch worker runs the stored graphs, ``planner.pipeline.capture_served``)
            log.info("%s: served with torch: its compiled model %s %s", entry.name,
                     prepared.compiled_id, why)
            return None
        log.info("%s: served without torch from compiled model %s", entry.name,
                 prepared.compiled_id)
        return prepared, model

    def _torch_model(self, entry: ModelEntry, store: PlanStore, options: Any, planned: Any
                     ) -> tuple[Any, dict[str, Any]]:
        """The captured model (at what `vbs plan` recorded: ``planned``) with its tables from
        the store; without them, with an interim table and the runtimes it was measured on
        (``first_start="interim"``, where ONNX Runtime runs the whole model), else profiled,
        solved and published here first."""
        from planner.pipeline import capture_served, prepare, read_prepared

        s = self.settings
        model = capture_served(entry.spec, s, store, entry.name, planned, batch_max=s.batch_max,
                               weights_dir=s.cache_dir / "weights")
        prepared = read_prepared(model, store, solver=s.solver, objective=s.objective,
                                 repair=False)
        if prepared is not None:
            return prepared, {}
        if s.first_start == "interim" and entry.spec.device == "cpu":
            # its runtime's sessions made as the worker's are: within the memory free now
            interim = interim_prepared(entry.name, model, s,
                                       replace(options, room=self.memory.probe.device_free))
            if interim is not None:
                return interim
        # read just now and missing: profiled, solved and published without reading again
        return prepare(entry.spec, s, store, batch_max=s.batch_max, solver=s.solver,
                       objective=s.objective, repair=False, progress=False, model=model,
                       replan=True), {}

    async def unload(self, entry: ModelEntry) -> None:
        """Give back what ``entry`` keeps loaded (its batcher closed and drained first): its
        runtimes' sessions and graphs, its worker, its weights; the device's memory owner
        counts it back (what the group gave back, where a cgroup limit applies)."""
        self.memory.models.unloading(entry.name)
        await asyncio.get_running_loop().run_in_executor(self.torch_thread(entry), _release,
                                                         entry, self.memory)
        released, kept = self.memory.models.unloaded(entry.name)
        entry.kept_bytes = kept  # as counted last (a load overlapping others: shared since)
        self.metrics.model_ready.labels(entry.name).set(0)
        self.metrics.model_kept.labels(entry.name).set(0)
        log.info("%s: unloaded, %d of the %d bytes it kept given back", entry.name, released,
                 kept)

    def sketch(self, entry: ModelEntry) -> None:
        """What ``entry`` takes before it is first loaded, known now (on its torch thread:
        ``service.sketch``)."""
        sketch(entry, self.settings, self._sync_store)

    async def close(self) -> None:
        """Stop the planners beside serving; give back the torch threads (their batchers
        drained first) and the store."""
        await self.plans.close()
        for executor in {self._cpu_thread, *self._executors.values()}:
            executor.shutdown(wait=False)  # drained; a batch stuck past it is left to end
        if self._store is not None:
            await asyncio.to_thread(self._store.close)


def _release(entry: ModelEntry, memory: DeviceMemory) -> None:
    """On the model's torch thread: its runtimes released, every reference to its worker,
    capture and batcher dropped, the garbage collected (cycles hold modules) and what the
    device's caches keep of it given back."""
    worker = entry.worker
    if worker is not None:
        worker.release()
    entry.worker = entry.prepared = entry.batcher = None
    del worker
    gc.collect()
    memory.give_back_cached()
