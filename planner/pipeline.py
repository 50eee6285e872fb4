"""Model → capture → profile (cached) → plan tables → store: what `vbs plan` and workers share.

``prepare`` gives everything a worker needs for one model. Tables are looked up in the store
by table id: the profile's fingerprint (architecture, input shape, dtype, device, library
versions), the solver and the objective, so each kind of device and each solver gets its own
tables. Besides the served solver's table, ``vbs plan`` stores the tables of every strategy
compared with it (``COMPARED``: the paper's DP and the baselines), so that /plan, `vbs show`
and `vbs bench` answer side by side from lookups. When the store lacks one of them, or holds
one it cannot read (an old schema, a damaged blob), the model is profiled (or the cached
profile reused), solved and the tables published. ``capture_model`` and ``read_prepared`` are
its first two steps alone: a service that serves a model before it is planned
(``service.first_start``) captures it and looks its tables up, and plans it elsewhere;
``capture_served`` is the first for a model served with torch, its int8 units as stored.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core import runtimes
from core.errors import TableNotFoundError
from core.precision import FLOAT32, INT8, Precision
from core.units import Capture
from planner.compile import compilable, ensure_compiled
from planner.graph.capture import capture
from core.spec import ModelSpec
from planner.models import apply_threads, load_model
from planner.profiling.profiler import ProfileOptions, cached_profile, chosen_again, fingerprint
from planner.settings import Settings
from planner.solver.tables import build_tables
from planner.store import PlanStore
from planner.store.keys import table_id
from planner.stored import COMPARED, Planned, follows, model_key, plan_hint, planned_int8, \
    publish, read, served_key, strategies
from core.table import PlanTable
from core.tree import Profile

if TYPE_CHECKING:
    from core.runtimes.onnx_compose import UnitGraphs

__all__ = ["COMPARED", "Captured", "Prepared", "capture_model", "capture_served", "model_key",
           "options_from", "prepare", "publish", "read", "read_prepared", "strategies"]

log = logging.getLogger("vbs.plan")

# chooses a model's solved tables by running their plans: (capture, tables, served solver)
Select = Callable[[Capture, dict[str, PlanTable], str], dict[str, PlanTable]]


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


@dataclass(frozen=True)
class Captured:
    """A model captured, with how it is profiled and the fingerprint its tables are under."""

    capture: Capture
    options: ProfileOptions
    fingerprint: str


def capture_model(spec: ModelSpec, settings: Settings, *, batch_max: int | None = None,
                  grid: bool | None = None) -> Captured:
    """Load and capture a model (with the settings' thread count, part of the fingerprint),
    its units at the settings' precision (``planner.precision``: int8 units quantized from
    the calibration samples, and guarded)."""
    apply_threads(settings.threads)
    cap = capture(load_model(spec))
    if settings.precision != FLOAT32:
        from planner.precision import with_precision  # ONNX Runtime's quantizer

        cap = with_precision(cap, settings.precision, settings.calibration, settings.max_error,
                             settings.profile_cache)
    options = options_from(settings, batch_max, grid)
    return Captured(cap, options, fingerprint(cap, options))


def capture_served(spec: ModelSpec, settings: Settings, store: PlanStore, served: str,
                   planned: Planned | None, *, batch_max: int | None = None,
                   grid: bool | None = None,
                   weights_dir: str | os.PathLike[str] | None = None) -> Captured:
    """``capture_model`` for a torch worker serving ``served``, at the precision `vbs plan`
    recorded for that name (``planned``: ``planner.stored.planned_for``'s): with int8 units, the
    float32 capture with the graphs and ``Precision`` stored in its compiled model
    (``planned_int8``: nothing quantized or guarded again at load, no calibration samples
    needed); at a half precision, the model loaded at that dtype; else in float32. So its tables
    are found under the planned fingerprint, and a float32 model and its int8 or half twin are
    served side by side. Where the settings name another precision, or `vbs plan` left no record
    (an older release, or planned at the service's first start), it is captured at the settings'
    precision, a compiled model's int8 graphs taken where it holds them and the settings allow
    int8."""
    precision = planned.precision if planned is not None else None
    if precision is not None and not precision.int8:
        return _captured(spec, settings, batch_max, grid, None, precision)
    if precision is not None or follows(settings, INT8):
        compiled = planned_int8(store, served, spec, weights_dir=weights_dir)
        if compiled is not None:
            return _captured(spec, settings, batch_max, grid, compiled.graphs,
                             Precision.from_json(compiled.meta.get("precision")))
        if precision is not None:
            raise TableNotFoundError(f"{served}: planned with int8 units, and its compiled "
                                     f"model is missing from {store.location}: "
                                     f"{plan_hint(served, spec, store.location)}")
    return capture_model(spec, settings, batch_max=batch_max, grid=grid)


def _captured(spec: ModelSpec, settings: Settings, batch_max: int | None, grid: bool | None,
              graphs: UnitGraphs | None, precision: Precision) -> Captured:
    """The model of ``spec`` captured at ``precision`` as `vbs plan` chose it (a half: loaded
    at its dtype), its units' ``graphs`` where given; its fingerprint."""
    apply_threads(settings.threads)
    loaded = load_model(dataclasses.replace(spec, dtype=precision.dtype) if precision.half
                        else spec)
    cap = dataclasses.replace(capture(loaded), graphs=graphs, precision=precision)
    options = options_from(settings, batch_max, grid)
    log.info("%s: captured at %s as planned", spec.name, precision.name)
    return Captured(cap, options, fingerprint(cap, options))


def read_prepared(model: Captured, store: PlanStore, *, solver: str = "vbs",
                  objective: str = "time", repair: bool = True) -> Prepared | None:
    """``model`` with its profile and tables from the store, or None when one is missing (or,
    with ``repair``, cannot be read; without it that is a TableFormatError)."""
    found = read(store, model.fingerprint, strategies(solver), objective, repair=repair)
    if found is None:
        return None
    log.info("%s: tables of %s read from the store", model.capture.model.spec.name,
             model.fingerprint)
    return Prepared(model.capture, found[0], found[1], solver, published=False)


def prepare(spec: ModelSpec, settings: Settings, store: PlanStore, *, batch_max: int | None = None,
            solver: str = "vbs", objective: str = "time", grid: bool | None = None,
            replan: bool = False, repair: bool = True, progress: bool = True,
            compile: bool = False, served: str | None = None,
            model: Captured | None = None, select: Select | None = None) -> Prepared:
    """Capture a model and get its tables: from the store, or profiled, solved and published.

    ``repair``: a stored table that cannot be read is planned again (else TableFormatError).
    ``compile``: the model's units are also stored for workers without torch
    (``planner.compile``), under the alias of ``served`` (default the model's name), and the
    served name's record points at this profile (``planner.stored.served_key``: what a torch
    worker captures it at, ``capture_served``).
    ``model``: the model captured already (``capture_model``, with these settings).
    ``select``: what chooses the solved tables by running their plans before they are
    published (``workers.plan_selection.selected``; the planner only solves)."""
    if model is None:
        model = capture_model(spec, settings, batch_max=batch_max, grid=grid)
    cap, options, fp = model.capture, model.options, model.fingerprint
    wanted = strategies(solver)
    if not replan:
        found = read_prepared(model, store, solver=solver, objective=objective, repair=repair)
        if found is not None:
            if compile:
                compile_served(store, model, found, settings, objective, served)
                store.set_model(served_key(served or spec.name, spec), fp)
            return found
    log.info("%s: profiling (b = 1..%d) and planning; this takes a while once", spec.name,
             options.batch_max)
    profile, hit = cached_profile(cap, options, settings.profile_cache, progress=progress)
    t0 = time.perf_counter()
    tables = build_tables(profile, wanted, objective=objective,
                          slot_bytes=settings.slot_bytes or None, slot_count=settings.slot_count)
    solve_s = time.perf_counter() - t0
    if select is not None:
        tables = select(cap, tables, solver)
    publish(store, spec, profile, tables, {"solve_s": round(solve_s, 3), "profile_cached": hit})
    log.info("%s: %d tables of %s solved in %.2f s and published", spec.name, len(tables), fp,
             solve_s)
    prepared = Prepared(cap, profile, tables, solver, published=True)
    if compile:
        compile_served(store, model, prepared, settings, objective, served, replan=True,
                       select=select)
        store.set_model(served_key(served or spec.name, spec), fp)
    return prepared


def compile_served(store: PlanStore, model: Captured, prepared: Prepared, settings: Settings,
                   objective: str, served: str | None, *, replan: bool = False,
                   select: Select | None = None) -> str | None:
    """What a worker without torch serves, stored: the compiled units and tables it can run
    (their id, or None where the model has no compiled form). Where the served table runs some
    step on torch (``--runtime auto``: torch was a little faster there; or a unit ONNX Runtime
    takes only where nothing runs on torch, its layout not dense in the model), those are the
    tables of every step on ONNX Runtime (``ProfileOptions.lean``), chosen again from the same
    measurements (``chosen_again``: nothing is measured again) and stored under that
    fingerprint, which the compiled model names; the model's own key keeps pointing at the
    served profile's.
    ``replan``: those tables are solved again (the profile was measured or solved now);
    ``select``: as ``prepare``'s, for them too."""
    cap, fp = model.capture, model.fingerprint
    measured = model.options.runtimes_on(cap.model.device)
    why_not_compiled = compilable(cap)  # '' where it has a compiled form
    if (not why_not_compiled and runtimes.ONNXRUNTIME in measured
            and not model.options.lean and _runs_torch(prepared.table)):
        # every step on ONNX Runtime: the units refused only beside torch taken too
        options = dataclasses.replace(model.options, runtime=runtimes.ONNXRUNTIME, lean=True)
        fp = fingerprint(cap, options)
        wanted = tuple(prepared.tables)
        if replan or read(store, fp, wanted, objective) is None:
            profile = chosen_again(prepared.profile, cap, options)
            t0 = time.perf_counter()
            tables = build_tables(profile, wanted, objective=objective,
                                  slot_bytes=settings.slot_bytes or None,
                                  slot_count=settings.slot_count)
            if select is not None:
                tables = select(cap, tables, prepared.solver)
            publish(store, cap.model.spec, profile, tables,
                    {"solve_s": round(time.perf_counter() - t0, 3), "chosen_from":
                     prepared.fingerprint}, aliased=False)
            log.info("%s: tables of ONNX Runtime's runs alone (%s) for the worker without "
                     "torch, from profile %s", cap.model.spec.name, fp, prepared.fingerprint)
    return ensure_compiled(store, cap, fp, served)


def _runs_torch(table: PlanTable) -> bool:
    """Whether a plan of ``table`` has a step on torch (a worker without torch cannot run it)."""
    if runtimes.TORCH not in table.runtimes:
        return False
    torch_index = table.runtimes.index(runtimes.TORCH)
    return any(p.runtimes is not None and bool((p.runtimes == torch_index).any())
               for p in table.plans)
