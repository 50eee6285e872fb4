"""Model → capture → profile (cached) → plan table → store: what `vbs plan` and workers share.

``prepare`` gives everything a worker needs for one model. The table is looked up in the
store by the profile's fingerprint (architecture, input shape, dtype, device, library
versions), so each kind of device gets its own tables; when the store has none, the model is
profiled (or the cached profile reused) and solved, and the table is published.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from planner.errors import TableNotFoundError
from planner.graph.capture import Capture, capture
from planner.models import ModelSpec, apply_threads, load_model
from planner.profiling.profiler import ProfileOptions, cached_profile, fingerprint
from planner.settings import Settings
from planner.solver.table import PlanTable, build_table
from planner.store import PlanStore
from planner.tree import Profile, profile_from_json, profile_to_json

log = logging.getLogger("vbs.plan")


@dataclass(frozen=True)
class Prepared:
    """A model ready to serve: its units, profile and plan table."""

    capture: Capture
    profile: Profile
    table: PlanTable
    published: bool  # the table was solved now (not read from the store)

    @property
    def fingerprint(self) -> str:
        return self.profile.fingerprint


def model_key(spec: ModelSpec) -> str:
    """The name a model's current table is found under in the store."""
    shape = "x".join(map(str, spec.input_shape)) if spec.input_shape else "default"
    return f"{spec.name}:{shape}:{spec.dtype}:{spec.device}"


def options_from(settings: Settings, batch_max: int | None = None, grid: bool = False) -> ProfileOptions:
    return ProfileOptions(batch_max=batch_max or settings.batch_max, repeats=settings.profile_repeats,
                          warmup=settings.profile_warmup, grid=grid)


def _read(store: PlanStore, fp: str) -> tuple[Profile, PlanTable] | None:
    try:
        stored = store.get_table(fp)
    except TableNotFoundError:
        return None
    raw_profile = store.get_profile(fp)
    if raw_profile is None:
        return None
    return profile_from_json(json.loads(raw_profile)), PlanTable.from_bytes(stored.blob)


def publish(store: PlanStore, spec: ModelSpec, profile: Profile, table: PlanTable,
            extra: dict[str, Any] | None = None) -> int:
    """Put a profile and its table in the store (announced to workers); returns the version."""
    fp = profile.fingerprint
    store.put_profile(fp, json.dumps(profile_to_json(profile)).encode())
    meta = {"model": spec.name, "solver": table.solver, "batch_max": table.batch_max,
            "slot_bytes": table.slot_bytes, "device": profile.meta.get("device_name"),
            **(extra or {})}
    return store.put_table(fp, table.to_bytes(), meta, model_key=model_key(spec))


def prepare(spec: ModelSpec, settings: Settings, store: PlanStore, *, batch_max: int | None = None,
            solver: str = "vbs", grid: bool = False, replan: bool = False,
            progress: bool = True) -> Prepared:
    """Capture a model and get its table: from the store, or profiled, solved and published."""
    apply_threads(settings.threads)
    cap = capture(load_model(spec))
    options = options_from(settings, batch_max, grid)
    fp = fingerprint(cap, options)
    if not replan:
        found = _read(store, fp)
        if found is not None and found[1].solver == solver:
            log.info("%s: table %s read from the store", spec.name, fp)
            return Prepared(cap, found[0], found[1], published=False)
    log.info("%s: profiling (b = 1..%d) and planning; this takes a while once", spec.name,
             options.batch_max)
    profile, hit = cached_profile(cap, options, settings.profile_cache, progress=progress)
    t0 = time.perf_counter()
    slot_bytes = settings.slot_bytes or None
    table = build_table(profile, solver=solver, slot_bytes=slot_bytes, slot_count=settings.slot_count)
    solve_s = time.perf_counter() - t0
    publish(store, spec, profile, table, {"solve_s": round(solve_s, 3), "profile_cached": hit})
    log.info("%s: table %s solved in %.2f s and published", spec.name, fp, solve_s)
    return Prepared(cap, profile, table, published=True)
