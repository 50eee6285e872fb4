"""A worker: one model, its plan table, and the memory free now → the plan that fits → outputs.

Per batch: read the memory free now and look the plan up in the table (``PlanTable.find``: a
binary search over breakpoints that are the executor's exact peaks, so the plan found fits as
it is, splits included). A batch larger than any plan that fits runs as consecutive pieces,
each the most samples the table says fit (``PlanTable.largest_fitting``, a lookup too); a
single sample that cannot fit is an InfeasibleError saying how much memory is missing. Nothing
on this path walks a program or runs the DP: ``vbs plan`` did that offline. If the device
still runs out of memory (another process took some meanwhile), the plan steps down below
what failed and the piece is retried, the allocator's cache released first: a batch is never
lost. A batch reads the table once, so a table swapped in meanwhile never mixes with it.

With several models on a device, a worker built with the device's ``memory`` (its one owner,
``workers.device_memory``; or an ``Arbiter`` alone) does not read free memory on its own:
before each piece runs it leases the bytes of the plan it picks (the piece's exact peak)
within what the owner lets it take (its share,
or less when other models' batches hold the rest: a smaller plan, or a wait in line), and
returns the lease when the piece ends, also on error or out-of-memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from typing import TYPE_CHECKING, Any, Protocol

from core import runtimes as rt
from core.errors import InfeasibleError, OutOfMemoryError, UsageError
from core.gate import MODULE_GATE
from core.lru import OwnedLRU
from core.program import Plan, Program, Step
from core.runs import TreeIndex
from core.runtimes.base import RuntimeOptions, UnitRuntime
from core.table import PlanTable, TablePlan
from core.tree import Series
from workers.arbiter import Lease, Leases
from workers.array_backend import ArrayModel
from workers.memory import MemoryProbe, cpu_free, release_cached

if TYPE_CHECKING:
    from core.units import Capture

log = logging.getLogger("vbs.worker")


class Served(Protocol):
    """What a worker runs: a captured torch model (``workers.executor.TorchModel``) or a
    compiled one on numpy arrays (``workers.array_backend.ArrayModel``)."""

    name: Any
    tree: Series
    input_shape: Any
    output_shape: Any

    @property
    def weights_bytes(self) -> int: ...

    @property
    def resident_weights_bytes(self) -> int: ...  # of them, those it holds in memory

    @property
    def sample_bytes(self) -> int: ...

    def load_runtime(self, name: str, options: RuntimeOptions) -> UnitRuntime: ...

    def prepare(self, steps: tuple[Step, ...], splits: dict[int, list[int]] | None,
                runs: dict[int, int] | None, samples: int) -> Any: ...

    def concat(self, outputs: list[Any]) -> Any: ...

    def host_buffer(self, n: int) -> tuple[Any, Any]: ...

    def to_input(self, x: Any) -> Any: ...

    def to_host(self, y: Any, buffer: Any) -> Any: ...


def served(model: "Capture | ArrayModel") -> Served:
    """A captured model (torch, imported now) or a compiled one, as a worker runs it."""
    if isinstance(model, ArrayModel):
        return model
    from workers.executor import TorchModel

    return TorchModel(model)


@dataclass(frozen=True)
class Choice:
    """The plan picked for one piece of a batch: a table entry and the memory it was picked for."""

    table: PlanTable
    index: int
    batch: int          # samples of the piece
    free_bytes: int     # the memory it was picked for (free, or what the arbiter let it take)
    seconds: float      # how long the lookup took
    waited_s: float = 0.0       # time waiting for its memory lease (0 without an arbiter)
    stepped_down: bool = False  # the arbiter gave less than its share: other batches held it

    @property
    def entry(self) -> TablePlan:
        return self.table.plans[self.index]

    @property
    def peak_bytes(self) -> int:
        """What the executor allocates running it (the table's breakpoint)."""
        return self.entry.peak_bytes

    @property
    def plan_id(self) -> str:
        return self.entry.plan_id

    @property
    def time_total(self) -> float:
        return self.entry.time_total

    @property
    def program(self) -> Program:
        return self.table.program(self.index)

    @property
    def splits(self) -> dict[int, list[int]]:
        """The outputs the executor splits at once (step -> sizes), as the table laid it out."""
        return {k: list(sizes) for k, sizes in self.entry.splits}

    @property
    def runs(self) -> dict[int, int]:
        """The runs of one runtime call (first step -> last step), as the table laid them out."""
        return dict(self.entry.runs)

    @property
    def plan(self) -> Plan:
        """The full Plan (its program built from the table; cached there)."""
        return self.table.plan(self.index, self.batch, self.free_bytes)


@dataclass(frozen=True)
class RunInfo:
    """What one batch cost: the plans that ran it, and the retries on the way."""

    choices: tuple[Choice, ...]
    oom_retries: int
    splits: int

    @property
    def lease_wait_s(self) -> float:
        """Seconds the batch waited for memory leases, all pieces together."""
        return sum(c.waited_s for c in self.choices)

    @property
    def step_downs(self) -> int:
        """Pieces that ran a smaller plan than their share because other batches held memory."""
        return sum(c.stepped_down for c in self.choices)


@dataclass
class WorkerStats:
    """Counters the service exports as metrics."""

    batches: int = 0
    oom_retries: int = 0
    splits: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, info: RunInfo) -> None:
        with self.lock:
            self.batches += 1
            self.oom_retries += info.oom_retries
            self.splits += info.splits


class Worker:
    """Runs batches of one captured model with the table's plan for the memory free now."""

    def __init__(self, capture: "Capture | ArrayModel", table: PlanTable, probe: MemoryProbe,
                 *, max_oom_retries: int = 4, name: str | None = None,
                 memory: Leases | None = None, lease_timeout_s: float = 30.0,
                 runtimes: dict[str, UnitRuntime] | None = None,
                 runtime_options: RuntimeOptions | None = None) -> None:
        self.capture = capture  # a torch Capture, or the compiled ArrayModel
        self.model = served(capture)
        self.probe = probe
        self.max_oom_retries = max_oom_retries
        self.stats = WorkerStats()
        self.name = name or self.model.name  # as the device's memory knows it
        self.memory = memory
        self.lease_timeout_s = lease_timeout_s
        self.runtimes: dict[str, UnitRuntime] = dict(runtimes or {})
        for loaded in self.runtimes.values():
            self._loaded(loaded)
        # what the runtimes loaded here read before they make a session or capture a graph:
        # the process's memory on the CPU, the device's free memory on CUDA (not a plan budget)
        room = probe.device_free if probe.device.startswith("cuda") else cpu_free
        self.runtime_options = dataclasses.replace(runtime_options or RuntimeOptions(), room=room)
        why = self.unusable(table)
        if why:
            raise UsageError(why)
        self.table = table
        self._prepared: OwnedLRU[Any] = OwnedLRU(256)  # by table, plan and samples
        self.prepare(table)

    def runtime(self, name: str) -> UnitRuntime:
        """The runtime ``name``'s units of this model, loaded the first time it is asked for
        (what it keeps of the device allocator's cache, a CUDA graph's pool, the probe never
        counts as free: ``workers.memory``)."""
        found = self.runtimes.get(name)
        if found is None:
            found = self.runtimes[name] = self.model.load_runtime(name, self.runtime_options)
            self._loaded(found)
        return found

    def _loaded(self, runtime: UnitRuntime) -> None:
        """What ``runtime``'s calls cache is the device's memory owner's to give back."""
        if self.memory is not None:
            self.memory.runtime_loaded(runtime)

    @property
    def held_bytes(self) -> int:
        """What this model's runtimes keep between calls (sessions, graphs and their pools)."""
        return sum(r.held_bytes for r in list(self.runtimes.values()))

    @property
    def making_bytes(self) -> int:
        """The most memory one of its runtimes needs free to make what it keeps (a session):
        what its load needs free (the device's memory owner makes room for it)."""
        return max((r.making_bytes for r in list(self.runtimes.values())), default=0)

    @property
    def making_seen(self) -> float:
        """The most one of its runtimes' sessions grew the process by while it was made, per
        byte of its weights (``UnitRuntime.making_seen``)."""
        return max((r.making_seen for r in list(self.runtimes.values())), default=0.0)

    def kept_bytes(self) -> int:
        """What this model keeps loaded, as its parts say: its weights, what its runtimes keep
        between calls, and on the CPU its batch buffer (on CUDA that is host memory)."""
        return int(self.model.resident_weights_bytes + self.held_bytes + self.buffer_bytes)

    @property
    def buffer_bytes(self) -> int:
        """Of ``kept_bytes``, the batch buffer: the table's largest batch of input samples, at
        any precision (on CUDA it is host memory, not counted)."""
        if self.probe.device.startswith("cuda"):
            return 0
        return int(self.table.batch_max * self.model.sample_bytes)

    def unusable(self, table: PlanTable) -> str:
        """Why this worker cannot run some plan of ``table`` ('' when it can run them all): a
        worker without torch runs only plans of ONNX Runtime runs (``ArrayModel.unrunnable``)."""
        if isinstance(self.model, ArrayModel):
            why = self.model.unrunnable(table)
            if why:
                return (f"{self.name}: {why}, and this worker serves the compiled model without "
                        "torch: plan it with --runtime auto (the default) or onnxruntime, or "
                        "serve it with torch "
                        "(VBS_LEAN=off)")
        return ""

    def prepare(self, table: PlanTable, free: int | None = None) -> None:
        """Get ready to run ``table``'s plans: the runtimes its plans call, and what they make
        for the runs of the plan each request size gets with ``free`` bytes (default: the most
        any plan needs: sessions, graphs), so the first batches do not wait for them; other
        runs get theirs the first time they run."""
        calling = [name for name in table.runtimes if rt.KINDS.get(name) and rt.KINDS[name].calls]
        for name in calling:  # loading one makes nothing yet
            self.runtime(name)
        if not calling:
            return
        free = table.top_bytes if free is None else free
        tree = TreeIndex.of(self.model.tree)
        # the largest requests first: a graph's static buffers are sized by the first runs
        for r in range(table.batch_max, 0, -1):
            fit = table.largest_fitting(r, free)
            if not fit:
                continue
            index = table.find(fit, free)
            steps = table.program(index).steps
            for start, end in table.plans[index].runs:
                nodes = tree.run_nodes(steps, start, end)
                name = steps[start].runtime or calling[0]
                try:
                    # a graph's capture calls the modules: never beside a trace
                    gate = MODULE_GATE.running() if rt.KINDS[name].modules else \
                        contextlib.nullcontext()
                    with gate:
                        self.runtime(name).prepare(nodes, steps[start].samples)
                except OutOfMemoryError as exc:  # made when it first runs, if memory allows
                    log.info("%s: %s not made ahead: %s", self.name, name, exc)
                    return

    def release(self) -> None:
        """Give back what every runtime keeps (the model is being unloaded), then what its
        calls left cached (ONNX Runtime's arena: the blocks its sessions freed)."""
        for name, loaded in list(self.runtimes.items()):
            if self.memory is not None:
                self.memory.runtime_released(loaded)
            loaded.release()
            loaded.give_back()
            del self.runtimes[name]

    @property
    def batch_max(self) -> int:
        return self.table.batch_max

    def allowance(self) -> int:
        """Bytes the next batch may plan for: its share of the device's memory, else what is
        free."""
        return self.memory.allowance(self.name) if self.memory is not None else self.probe.free()

    def pick(self, table: PlanTable, r: int, free: int) -> Choice | None:
        """The plan for the most samples, up to r, that fit in ``free`` bytes (None: not one
        sample fits): lookups only."""
        t0 = time.perf_counter()
        fit = table.largest_fitting(r, free)
        if fit == 0:
            return None
        return Choice(table, table.find(fit, free), fit, free, time.perf_counter() - t0)

    def choose(self, table: PlanTable, r: int, free: int) -> Choice:
        """``pick``, or InfeasibleError saying how much memory is missing."""
        choice = self.pick(table, r, free)
        if choice is None:
            need = int(table.min_peaks[0])
            raise InfeasibleError(f"{self.model.name}: no plan of one sample fits in "
                                  f"{free} free bytes; it needs {need}, {max(0, need - free)} "
                                  "bytes more")
        return choice

    def _lease(self, table: PlanTable, r: int, below: int | None,
               free: Callable[[], int] | None) -> tuple[Choice, Lease[Choice] | None]:
        """The plan of the next piece and its lease (None without the device's memory, or when the
        caller gives the free memory itself)."""
        if self.memory is None or free is not None:
            read = free or self.probe.free
            avail = read() if below is None else min(read(), below)
            return self.choose(table, r, avail), None
        need = int(table.min_peaks[0])
        if below is not None and below < need:
            raise InfeasibleError(f"{self.name}: no plan of one sample fits below the {below + 1} "
                                  f"bytes that ran out of memory; it needs {need}")

        def pick(avail: int) -> Choice | None:
            return self.pick(table, r, avail if below is None else min(avail, below))

        lease = self.memory.acquire(self.name, pick, need=need, timeout_s=self.lease_timeout_s)
        c = lease.choice  # built whole: dataclasses.replace costs more than the lookup
        return Choice(c.table, c.index, c.batch, c.free_bytes, c.seconds, lease.waited_s,
                      lease.stepped_down), lease

    def _plan_run(self, choice: Choice) -> Any:
        """The executor's way of running ``choice``'s plan, decided the first time it runs."""
        return self._prepared.get_or_make(
            choice.table, (choice.index, choice.batch),
            lambda: self.model.prepare(choice.program.steps, choice.splits, choice.runs,
                                       choice.batch))

    def infer(self, x: Any, free: Callable[[], int] | None = None) -> tuple[Any, RunInfo]:
        """``model(x)`` for a batch of any size, within the memory free when each piece runs
        (``free`` overrides the reading, and the leases: for tests and benchmarks)."""
        table = self.table  # one table for the whole batch, whatever is swapped in meanwhile
        n = int(x.shape[0])
        if n < 1:
            raise UsageError(f"{self.model.name}: a batch needs at least one sample")
        outputs: list[Any] = []
        choices: list[Choice] = []
        retries = attempts = 0
        below: int | None = None  # after an out-of-memory: stay below what failed
        start = 0
        while start < n:
            choice, lease = self._lease(table, min(n - start, table.batch_max), below, free)
            try:
                run = self._plan_run(choice)
                piece = x if start == 0 and choice.batch == n else x[start:start + choice.batch]
                # never beside a trace (another model loading), unless it calls no module
                with MODULE_GATE.running() if run.calls_modules else contextlib.nullcontext():
                    y = run(piece, self.runtimes)
            except OutOfMemoryError as exc:
                message = str(exc)  # keep no reference to the failed attempt's frames
            else:
                outputs.append(y)
                choices.append(choice)
                start += choice.batch
                below, attempts = None, 0
                continue
            finally:
                if lease is not None:
                    self.memory.release(lease)  # type: ignore[union-attr]
            retries += 1
            attempts += 1
            if attempts > self.max_oom_retries:
                raise OutOfMemoryError(f"{self.model.name}: still out of memory "
                                       f"after {self.max_oom_retries} smaller plans: {message}")
            log.warning("%s; retry %d with a smaller plan", message, attempts)
            # Outside the except block: the failed attempt's tensors are freed by now, so the
            # allocator's cache can really be given back.
            release_cached(self.probe.device)
            below = choice.peak_bytes - 1
        info = RunInfo(tuple(choices), retries, len(choices) - 1)
        self.stats.add(info)
        return (outputs[0] if len(outputs) == 1 else self.model.concat(outputs)), info
