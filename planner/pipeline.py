"""Model → capture → profile (cached) → plan tables → store: what `vbs plan` and workers share.

``prepare`` gives everything a worker needs for one model. Tables are looked up in the store
by table id: the profile's fingerprint (architecture, input shape, dtype, device, library
versions), the solver and the objective, so each kind of device and each solver gets its own
tables. Besides the served solver's table, ``vbs plan`` stores the tables of every strategy
compared with it (``COMPARED``: the paper's DP and the baselines), so that /plan, `vbs show`
and `vbs bench` answer side by side from lookups. When the store lacks one of them, or holds
one it cannot read (an old schema, a damaged blob), the model is profiled (or the cached
profile reused), solved and the tables published.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from core.errors import ProfileError, TableFormatError, TableNotFoundError
from core.units import Capture
from planner.graph.capture import capture
from core.loaded import ModelSpec
from planner.models import apply_threads, load_model
from planner.profiling.profiler import ProfileOptions, cached_profile, fingerprint
from planner.settings import Settings
from core.table import PlanTable
from planner.solver.tables import build_tables
from planner.store import PlanStore
from planner.store.keys import table_id
from core.tree import Profile, profile_from_json, profile_to_json

log = logging.getLogger("vbs.plan")

# Every strategy `vbs plan` stores a table for: the served one and what it is compared with.
COMPARED = ("vbs", "paper", "greedy", "fbs", "fbs-best")


@dataclass(frozen=True)
class Prepared:
    """A model ready to serve: its units, profile and plan tables (the served one and the rest)."""

    capture: Capture
    profile: Profile
    tables: dict[str, PlanTable]
    solver: str
    published: bool  # the tables were solved now (not read from the store)

    @property
    def table(self) -> PlanTable:
        return self.tables[self.solver]

    @property
    def fingerprint(self) -> str:
        return self.profile.fingerprint

    @property
    def table_id(self) -> str:
        return table_id(self.fingerprint, self.solver, self.table.objective)


def model_key(spec: ModelSpec, solver: str, objective: str) -> str:
    """The name a model's current table of one solver and objective is found under."""
    shape = "x".join(map(str, spec.input_shape)) if spec.input_shape else "default"
    return f"{spec.name}:{shape}:{spec.dtype}:{spec.device}:{solver}:{objective}"


def options_from(settings: Settings, batch_max: int | None = None, grid: bool | None = None
                 ) -> ProfileOptions:
    """How to profile: from the settings, ``batch_max`` and ``grid`` overriding them."""
    return ProfileOptions(batch_max=batch_max or settings.batch_max, repeats=settings.profile_repeats,
                          warmup=settings.profile_warmup,
                          grid=settings.profile_grid if grid is None else grid,
                          runtime=settings.runtime)


def strategies(solver: str) -> tuple[str, ...]:
    """The served solver first, then every other compared strategy."""
    return (solver, *[s for s in COMPARED if s != solver])


def read(store: PlanStore, fp: str, solvers: tuple[str, ...], objective: str, *,
         repair: bool = True) -> tuple[Profile, dict[str, PlanTable]] | None:
    """The profile and every table of ``solvers`` from the store, or None when one is missing.

    One that cannot be read (an old schema, a damaged blob, bad meta) is planned again when
    ``repair`` (`vbs plan`: None is returned); else its TableFormatError, naming the key and
    the problem, is raised (a service must not re-plan behind its operator's back)."""
    tables = {}
    for solver in solvers:
        tid = table_id(fp, solver, objective)
        try:
            stored = store.get_table(tid)
            tables[solver] = PlanTable.from_bytes(stored.blob,
                                                  f"table {tid} in store {store.location}")
        except TableNotFoundError:
            return None
        except TableFormatError as exc:
            if not repair:
                raise
            log.warning("table %s in %s cannot be used, planning it again: %s", tid,
                        store.location, exc)
            return None
    raw_profile = store.get_profile(fp)
    if raw_profile is None:
        return None
    try:
        return profile_from_json(json.loads(raw_profile)), tables
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ProfileError) as exc:
        if not repair:
            raise TableFormatError(f"profile {fp} in store {store.location} cannot be read "
                                   f"({exc}): run `vbs plan --replan` to rewrite it") from exc
        log.warning("profile %s in %s cannot be used, profiling again: %s", fp, store.location,
                    exc)
        return None


def publish(store: PlanStore, spec: ModelSpec, profile: Profile, tables: dict[str, PlanTable],
            extra: dict[str, Any] | None = None) -> dict[str, int]:
    """Put a profile and its tables in the store (each announced to workers), the first of
    ``tables`` last, so a worker woken by its announcement finds the others; returns versions."""
    fp = profile.fingerprint
    store.put_profile(fp, json.dumps(profile_to_json(profile)).encode())
    versions = {}
    for solver, table in reversed(list(tables.items())):
        meta = {"model": spec.name, "solver": solver, "objective": table.objective,
                "batch_max": table.batch_max, "slot_bytes": table.slot_bytes,
                "fingerprint": fp, "device": profile.meta.get("device_name"), **(extra or {})}
        versions[solver] = store.put_table(table_id(fp, solver, table.objective), table.to_bytes(),
                                           meta, model_key=model_key(spec, solver, table.objective))
    return versions


def prepare(spec: ModelSpec, settings: Settings, store: PlanStore, *, batch_max: int | None = None,
            solver: str = "vbs", objective: str = "time", grid: bool | None = None,
            replan: bool = False, repair: bool = True, progress: bool = True) -> Prepared:
    """Capture a model and get its tables: from the store, or profiled, solved and published.

    ``repair``: a stored table that cannot be read is planned again (else TableFormatError)."""
    apply_threads(settings.threads)
    cap = capture(load_model(spec))
    options = options_from(settings, batch_max, grid)
    fp = fingerprint(cap, options)
    wanted = strategies(solver)
    if not replan:
        found = read(store, fp, wanted, objective, repair=repair)
        if found is not None:
            log.info("%s: tables of %s read from the store", spec.name, fp)
            return Prepared(cap, found[0], found[1], solver, published=False)
    log.info("%s: profiling (b = 1..%d) and planning; this takes a while once", spec.name,
             options.batch_max)
    profile, hit = cached_profile(cap, options, settings.profile_cache, progress=progress)
    t0 = time.perf_counter()
    tables = build_tables(profile, wanted, objective=objective,
                          slot_bytes=settings.slot_bytes or None, slot_count=settings.slot_count)
    solve_s = time.perf_counter() - t0
    publish(store, spec, profile, tables, {"solve_s": round(solve_s, 3), "profile_cached": hit})
    log.info("%s: %d tables of %s solved in %.2f s and published", spec.name, len(tables), fp,
             solve_s)
    return Prepared(cap, profile, tables, solver, published=True)
