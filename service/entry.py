"""One served model as the service keeps it: what it is, its state, its worker and batcher
once loaded, its tables, and the answers /plan and the page computed from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.loaded import ModelSpec
from core.lru import LRU
from core.table import PlanTable
from planner.families import Preprocess
from service.batcher import Batcher

# answers kept per model for /plan and the page: plan descriptions (a few KB each), curves, tree
CACHED_ANSWERS = 4096

LOADING, READY, FAILED = "loading", "ready", "failed"


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
                "memory_share_bytes": self.worker.memory.shares().get(self.name)
                if self.worker.memory is not None else None,
                "load_s": self.load_s,
            })
        return out
