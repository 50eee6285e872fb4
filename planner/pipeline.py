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

import logging
import time
from dataclasses import dataclass

from core.units import Capture
from planner.compile import ensure_compiled
from planner.graph.capture import capture
from core.spec import ModelSpec
from planner.models import apply_threads, load_model
from planner.profiling.profiler import ProfileOptions, cached_profile, fingerprint
from planner.settings import Settings
from planner.solver.tables import build_tables
from planner.store import PlanStore
from planner.store.keys import table_id
from planner.stored import COMPARED, model_key, publish, read, strategies
from core.table import PlanTable
from core.tree import Profile

__all__ = ["COMPARED", "Prepared", "model_key", "options_from", "prepare", "publish", "read",
           "strategies"]

log = logging.getLogger("vbs.plan")


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


def options_from(settings: Settings, batch_max: int | None = None, grid: bool | None = None
                 ) -> ProfileOptions:
    """How to profile: from the settings, ``batch_max`` and ``grid`` overriding them."""
    return ProfileOptions(batch_max=batch_max or settings.batch_max, repeats=settings.profile_repeats,
                          warmup=settings.profile_warmup,
                          grid=settings.profile_grid if grid is None else grid,
                          runtime=settings.runtime)


def prepare(spec: ModelSpec, settings: Settings, store: PlanStore, *, batch_max: int | None = None,
            solver: str = "vbs", objective: str = "time", grid: bool | None = None,
            replan: bool = False, repair: bool = True, progress: bool = True,
            compile: bool = False, served: str | None = None) -> Prepared:
    """Capture a model and get its tables: from the store, or profiled, solved and published.

    ``repair``: a stored table that cannot be read is planned again (else TableFormatError).
    ``compile``: the model's units are also stored for workers without torch
    (``planner.compile``), under the alias of ``served`` (default the model's name)."""
    apply_threads(settings.threads)
    cap = capture(load_model(spec))
    options = options_from(settings, batch_max, grid)
    fp = fingerprint(cap, options)
    wanted = strategies(solver)
    if not replan:
        found = read(store, fp, wanted, objective, repair=repair)
        if found is not None:
            log.info("%s: tables of %s read from the store", spec.name, fp)
            if compile:
                ensure_compiled(store, cap, fp, served)
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
    if compile:
        ensure_compiled(store, cap, fp, served)
    return Prepared(cap, profile, tables, solver, published=True)
