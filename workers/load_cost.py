"""What a compiled model costs loaded, measured when `vbs plan` compiles it and kept in the store.

Before a model is first loaded, the service's memory owner must know what it will keep, or a
start with several models loads more than fits and then unloads the hottest: its weights alone
are low by 4-27x (sessions, the batch buffer). So `vbs plan` loads the compiled model once as a
worker without torch does (its tables read from the store, its runtimes' sessions made for the
plans at the top budget, ``workers.worker.Worker``) and stores what the worker says it keeps
and how long that took; the service reads the figures for a model it has not loaded yet
(``service.loading``). Once a model has loaded, its own figures replace them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from core.errors import TableFormatError
from core.runtimes.base import RuntimeOptions
from core.spec import ModelSpec
from planner.store import PlanStore
from planner.stored import read_compiled
from workers.array_backend import ArrayModel
from workers.memory import MemoryProbe
from workers.worker import Worker


@dataclass(frozen=True)
class LoadCost:
    """A compiled model loaded by a worker without torch: bytes it keeps, seconds it took."""

    kept_bytes: int
    load_s: float
    weights_bytes: int  # of ``kept_bytes``
    held_bytes: int     # of ``kept_bytes``: its runtimes' sessions
    making_bytes: int   # free while its largest session is made (``Worker.making_bytes``)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "LoadCost":
        try:
            raw = json.loads(data)
            cost = cls(kept_bytes=int(raw["kept_bytes"]), load_s=float(raw["load_s"]),
                       weights_bytes=int(raw["weights_bytes"]), held_bytes=int(raw["held_bytes"]),
                       making_bytes=int(raw["making_bytes"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise TableFormatError(f"{where} cannot be read ({exc!r}): run `vbs plan` for the "
                                   "model again") from exc
        if min(cost.kept_bytes, cost.weights_bytes, cost.held_bytes, cost.making_bytes) < 0 \
                or cost.load_s < 0:
            raise TableFormatError(f"{where} holds negative figures: run `vbs plan` again")
        return cost


def measure_load(store: PlanStore, served: str, spec: ModelSpec, solver: str, objective: str,
                 options: RuntimeOptions | None = None) -> tuple[str, LoadCost]:
    """Load ``served``'s compiled model from ``store`` as a worker without torch does and
    measure it; (its compiled id, the figures). What it made is given back before returning."""
    t0 = time.perf_counter()
    stored = read_compiled(store, served, spec, solver, objective)
    model = ArrayModel(stored.compiled, stored.profile.root, stored.fingerprint)
    worker = Worker(model, stored.tables[solver], MemoryProbe("cpu"), name=served,
                    runtime_options=options)
    load_s = time.perf_counter() - t0
    try:
        cost = LoadCost(kept_bytes=worker.kept_bytes(), load_s=round(load_s, 3),
                        weights_bytes=model.weights_bytes, held_bytes=worker.held_bytes,
                        making_bytes=worker.making_bytes)
    finally:
        worker.release()
    return stored.compiled_id, cost


def record_load(store: PlanStore, served: str, spec: ModelSpec, solver: str, objective: str,
                options: RuntimeOptions | None = None) -> LoadCost:
    """``measure_load``, stored beside the compiled model (``PlanStore.put_load``)."""
    cid, cost = measure_load(store, served, spec, solver, objective, options)
    store.put_load(cid, cost.to_bytes())
    return cost


def read_load(store: PlanStore, compiled_id: str) -> LoadCost | None:
    """The figures `vbs plan` stored for ``compiled_id``, or None where it stored none."""
    data = store.get_load(compiled_id)
    if data is None:
        return None
    return LoadCost.from_bytes(data, f"load figures of compiled model {compiled_id} in "
                                     f"{store.location}")
