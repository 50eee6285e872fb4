"""One served model as the service keeps it: what it is, its state, its worker and batcher
while loaded, its tables, and the answers /plan and the page computed from them.

A model is loaded and unloaded while the service runs (``service.residency``). What it keeps
only while loaded (the captured model with its weights, the worker and its runtimes, the
batcher) goes when it is unloaded; what describes it (shapes, tables, profile, labels, what
it kept) stays, so metadata, /plan and the page answer for a model that is not loaded now.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.spec import ModelSpec
from core.lru import LRU
from core.precision import Precision
from core.table import INTERIM, PlanTable
from planner.families import Preprocess
from service.batcher import Batcher
from workers.load_cost import LoadCost
from workers.models_memory import ModelCost
from workers.shares import working_bytes

# answers kept per model for /plan and the page: plan descriptions (a few KB each), curves, tree
CACHED_ANSWERS = 4096

UNLOADED, LOADING, READY, UNLOADING, FAILED = "unloaded", "loading", "ready", "unloading", "failed"
# the states as Triton's model repository index names them (a failed model is UNAVAILABLE too)
REPOSITORY_STATES = {UNLOADED: "UNAVAILABLE", LOADING: "LOADING", READY: "READY",
                     UNLOADING: "UNLOADING", FAILED: "UNAVAILABLE"}


@dataclass(eq=False)
class ModelEntry:
    """One served model: what it is, its worker and batcher while loaded, and its table."""

    name: str                       # the name it is served under (URLs, metrics)
    spec: ModelSpec
    state: str = LOADING
    error: str | None = None        # why it failed, or what its load waits for
    reason: str | None = None       # why it is not loaded (the repository index's reason)
    starting: bool = True           # its load at start is under way: requests get 503 at once
    explicit: bool = False          # unloaded through the repository API: loaded only through it
    # while loaded
    prepared: Any = None            # planner.pipeline.Prepared, or planner.stored.StoredModel
    lean: bool = False              # served from its compiled form, without torch
    worker: Any = None              # workers.worker.Worker
    batcher: Batcher | None = None
    # kept when unloaded
    tables: dict[str, PlanTable] = field(default_factory=dict)  # every strategy's, for /plan
    solver: str | None = None       # which of them it serves
    table_version: int | None = None
    table_meta: dict[str, Any] = field(default_factory=dict)
    profile: Any = None             # planner's Profile (the tree the page draws)
    # its planning beside serving (service.first_start.Planning) while it serves an interim
    # table, and after (what became of it)
    planning: Any = None
    fingerprint: str | None = None
    table_id: str | None = None
    labels: list[str] | None = None
    preprocess: Preprocess | None = None
    image_mode: str | None = None
    shapes: tuple[tuple[int, ...], tuple[int, ...] | None] | None = None  # input, output
    weights_bytes: int = 0          # its weights (from its sketch, before it first loads)
    load_cost: LoadCost | None = None  # what `vbs plan` measured it keeps loaded (compiled)
    estimate: PlanTable | None = None  # its table as the store had it before it first loaded
    kept_bytes: int | None = None   # what it kept the last time it was loaded
    making_bytes: int | None = None  # what making its largest session asked free, last load
    held_bytes: int | None = None    # of kept_bytes, its runtimes' sessions, last load
    load_s: float | None = None
    loads: int = 0
    # use: requests let through and not answered yet, requests waiting for it to load, and
    # when one last came or went
    pins: int = 0
    waiting: int = 0
    last_used: float = 0.0
    cache: LRU[Any] = field(default_factory=lambda: LRU(CACHED_ANSWERS), repr=False)

    @property
    def ready(self) -> bool:
        """Loaded: it takes requests now."""
        return self.state == READY

    @property
    def planned(self) -> bool:
        """Its tables are known (it has been loaded once): /plan and the page can answer."""
        return self.solver is not None and self.solver in self.tables

    @property
    def interim(self) -> bool:
        """It serves an interim table (``planner.interim``) until its planned one is swapped in."""
        return self.solver == INTERIM

    @property
    def input_shape(self) -> tuple[int, ...]:
        if self.shapes is not None:
            return self.shapes[0]
        return tuple(self.spec.input_shape or ())

    @property
    def output_shape(self) -> tuple[int, ...]:
        return tuple(self.shapes[1] or ()) if self.shapes is not None else ()

    @property
    def table(self) -> PlanTable:
        """The table it serves (the worker's while loaded: swapped in by the table watch)."""
        if self.worker is not None:
            return self.worker.table
        assert self.solver is not None
        return self.tables[self.solver]

    @property
    def busy(self) -> bool:
        """A request is let through and not answered or waits for it to load, or its batcher
        has work."""
        batcher = self.batcher
        return bool(self.pins or self.waiting or
                    (batcher is not None and (batcher.running or batcher.waiting)))

    def demand(self) -> int:
        """Samples queued and running (the memory owner divides memory by it; 0 unloaded)."""
        batcher = self.batcher
        return batcher.demand() if batcher is not None else 0

    def cost(self) -> ModelCost:
        """What it takes loaded, as known before it loads: the bytes it keeps (what it kept
        the last time, else what `vbs plan` measured it keeps, else its weights), its
        one-sample plan and its working bytes (from its table; 0 when not known yet), and
        what making its largest session takes (as the last load, else `vbs plan`, saw it)."""
        recorded = self.load_cost
        kept = (self.kept_bytes if self.kept_bytes is not None else
                recorded.kept_bytes if recorded is not None else self.weights_bytes)
        making = (self.making_bytes if self.making_bytes is not None else
                  recorded.making_bytes if recorded is not None else 0)
        # what making counts already: the sessions (a torch worker's recorded peak: all)
        made = (self.held_bytes if self.held_bytes is not None else
                0 if recorded is None else
                recorded.kept_bytes if recorded.with_torch else recorded.held_bytes)
        table = self.table if self.planned or self.worker is not None else self.estimate
        if table is None:
            return ModelCost(self.name, kept, 0, 0, making, made)
        return ModelCost(self.name, kept, int(table.min_peaks[0]), working_bytes(table), making,
                         made)

    def cached(self, key: Any, compute: Any) -> Any:
        """An answer that depends only on this model's table (for /plan), kept in a small LRU."""
        return self.cache.get_or_make(key, compute)

    @property
    def precision(self) -> Precision | None:
        """What its ONNX Runtime units run at, as `vbs plan` chose and measured it (None until
        its profile is known)."""
        if self.profile is None:
            return None
        return Precision.from_json(self.profile.meta.get("precision"))

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "model": self.spec.name, "state": self.state,
                               "dtype": self.spec.dtype, "device": self.spec.device,
                               "input_shape": list(self.input_shape) or None,
                               "loads": self.loads, "kept_bytes": self.kept_bytes}
        if self.worker is not None:  # what runs it: the captured torch model, or the compiled one
            out["runs_on"] = ("compiled ONNX graphs, without torch" if self.lean
                              else "the captured torch model")
        if self.load_cost is not None:  # what `vbs plan` measured, known before its first load
            out["planned_load"] = {"kept_bytes": self.load_cost.kept_bytes,
                                   "making_bytes": self.load_cost.making_bytes,
                                   "making_factor": self.load_cost.making_factor,
                                   "load_s": self.load_cost.load_s}
        if self.error:
            out["error"] = self.error
        if self.reason and not self.ready:
            out["reason"] = self.reason
        if self.planned:
            table = self.table
            out.update({
                "output_shape": list(self.output_shape), "batch_max": table.batch_max,
                "fingerprint": self.fingerprint, "labels": self.labels is not None,
                "images": self.preprocess is not None,
                "table": {"id": self.table_id, "version": self.table_version,
                          "solver": table.solver, "objective": table.objective,
                          "slot_bytes": table.slot_bytes, "top_bytes": table.top_bytes,
                          "min_bytes": int(table.min_peaks[0]), "plans": len(table.plans),
                          "compared": sorted(s for s in self.tables if s != table.solver),
                          "kind": INTERIM if self.interim else "planned"},
                "queue": self.batcher.waiting if self.batcher else 0,
                "precision": self.precision.to_json() if self.precision else None,
                "load_s": self.load_s,
            })
        if self.planning is not None:
            out["planning"] = self.planning.describe()
        if self.worker is not None:
            out["memory_limit_bytes"] = self.worker.probe.limit
            memory = self.worker.memory
            out["memory_share_bytes"] = memory.shares().get(self.name) if memory else None
        return out
