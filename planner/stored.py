"""A model's profile and tables in the store, read and written without torch.

What `vbs plan` publishes and a worker reads back: the served solver's table and those it is
compared with, under the profile's fingerprint, and the model's alias (``model_key``) that
points at its current table. ``planner.pipeline`` profiles and solves when they are missing;
a worker serving a compiled model (``core.compiled``) finds everything here by the alias.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from core.compiled import CompiledModel
from core.errors import ProfileError, TableFormatError, TableNotFoundError
from core.precision import AUTO, FLOAT32, Precision
from core.spec import ModelSpec
from core.table import PlanTable
from core.tree import Profile, profile_from_json, profile_to_json
from planner.store import PlanStore
from planner.store.keys import table_id

log = logging.getLogger("vbs.plan")

# Every strategy `vbs plan` stores a table for: the served one and what it is compared with.
COMPARED = ("vbs", "paper", "greedy", "fbs", "fbs-best")


def model_key(spec: ModelSpec, solver: str, objective: str, precision: str = FLOAT32) -> str:
    """The name a model's current table of one solver and objective is found under (its int8
    tables beside its float32 ones: ``core.precision``)."""
    shape = "x".join(map(str, spec.input_shape)) if spec.input_shape else "default"
    tail = "" if precision == FLOAT32 else f":{precision}"
    return f"{spec.name}:{shape}:{spec.dtype}:{spec.device}:{solver}:{objective}{tail}"



def compiled_key(served: str, spec: ModelSpec) -> str:
    """The alias a served model's compiled form is found under (``planner.compile``): its
    served name, input shape as given (or ``default``), dtype and device."""
    shape = spec.input_shape
    text = "x".join(map(str, shape)) if shape else "default"
    return f"compiled:{served}:{text}:{spec.dtype}:{spec.device}"


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
            extra: dict[str, Any] | None = None, *, aliased: bool = True) -> dict[str, int]:
    """Put a profile and its tables in the store (each announced to workers), the first of
    ``tables`` last, so a worker woken by its announcement finds the others; returns versions.
    ``aliased``: the model's key points at them (not for the tables only a compiled model
    names, ``planner.pipeline``)."""
    fp = profile.fingerprint
    precision = Precision.from_json(profile.meta.get("precision")).name
    store.put_profile(fp, json.dumps(profile_to_json(profile)).encode())
    versions = {}
    for solver, table in reversed(list(tables.items())):
        meta = {"model": spec.name, "solver": solver, "objective": table.objective,
                "batch_max": table.batch_max, "slot_bytes": table.slot_bytes,
                "fingerprint": fp, "device": profile.meta.get("device_name"), **(extra or {})}
        versions[solver] = store.put_table(table_id(fp, solver, table.objective), table.to_bytes(),
                                           meta, model_key=model_key(
                                               spec, solver, table.objective, precision)
                                           if aliased else None)
    return versions


def plan_hint(served: str, spec: ModelSpec, location: str) -> str:
    """The command that puts ``served``'s compiled model and tables in the store at
    ``location``, in words."""
    shape = "@" + ",".join(map(str, spec.input_shape)) if spec.input_shape else ""
    return (f"run `vbs plan --model {served}={spec.name}{shape} --store {location}` (with "
            "--weights FILE if it has its own) first")


@dataclass(frozen=True)
class StoredModel:
    """What a worker without torch serves, all from the store: the compiled model, its
    profile and the tables of the served solver and those compared with it."""

    compiled: CompiledModel
    compiled_id: str
    profile: Profile
    tables: dict[str, PlanTable]

    @property
    def fingerprint(self) -> str:
        return self.profile.fingerprint


def served_key(served: str, spec: ModelSpec) -> str:
    """The alias under which `vbs plan` records the profile it planned ``served`` to (``spec``
    as the service is given it: input shape as given, or ``default``, dtype and device)."""
    shape = "x".join(map(str, spec.input_shape)) if spec.input_shape else "default"
    return f"served:{served}:{shape}:{spec.dtype}:{spec.device}"


@dataclass(frozen=True)
class Planned:
    """What `vbs plan` recorded for a served name: the profile it planned the name to, and
    that profile's precision."""

    fingerprint: str
    precision: Precision


def planned(store: PlanStore, served: str, spec: ModelSpec) -> Planned | None:
    """What `vbs plan` last planned ``served`` to, or None where it recorded nothing (planned
    by an older release, or never)."""
    fp = store.get_model(served_key(served, spec))
    data = store.get_profile(fp) if fp else None
    if fp is None or data is None:
        return None
    try:
        meta = profile_from_json(json.loads(data)).meta
    except (ValueError, RecursionError, ProfileError) as exc:
        raise TableFormatError(f"the profile {fp} in {store.location} cannot be read ({exc}): "
                               f"plan {served} again") from exc
    return Planned(fp, Precision.from_json(meta.get("precision")))


def planned_for(settings: Any, store: PlanStore, served: str, spec: ModelSpec
                ) -> Planned | None:
    """What `vbs plan` recorded for ``served`` (``planned``) where it decides what a worker
    serves: the settings name no precision, or that one, or `auto` ("the planned table where
    one exists"); None where nothing was recorded or the settings name another (the table of
    the precision they name is served, as `vbs serve --precision` says)."""
    found = planned(store, served, spec)
    return found if found is not None and follows(settings, found.precision.name) else None


def follows(settings: Any, precision: str) -> bool:
    """Whether the settings let ``precision`` be served: they name none (``VBS_PRECISION``
    or ``--precision`` not given), or `auto`, or that one."""
    named = "precision" in getattr(settings, "model_fields_set", ())
    return not named or settings.precision in (AUTO, precision)


def planned_int8(store: PlanStore, served: str, spec: ModelSpec, *,
                 weights_dir: str | os.PathLike[str] | None = None) -> CompiledModel | None:
    """The compiled model ``vbs plan`` stored for ``served`` where it was planned with int8
    units (its graphs the ones quantized and guarded then, its meta their ``Precision``), else
    None (planned float32 or at a half precision, or never compiled). Only its manifest is
    read before that is known."""
    cid = store.get_model(compiled_key(served, spec))
    blob = store.get_compiled(cid) if cid is not None else None
    if blob is None:
        return None
    where = f"compiled model {cid} in {store.location}"
    _, meta = CompiledModel.manifest(blob, where)
    if not Precision.from_json(meta.get("precision")).int8:
        return None
    return CompiledModel.from_bytes(blob, where, weights_dir=weights_dir)


def read_compiled(store: PlanStore, served: str, spec: ModelSpec, solver: str,
                  objective: str, *, weights_dir: str | os.PathLike[str] | None = None
                  ) -> StoredModel:
    """The compiled model ``vbs plan`` stored for ``served``, with its profile and tables;
    TableNotFoundError naming the `vbs plan` command to run when any is missing. With
    ``weights_dir``, its weights are kept in a file there, not in its graphs (what a worker
    does: ``core.weights_file``)."""
    fix = plan_hint(served, spec, store.location)
    cid = store.get_model(compiled_key(served, spec))
    if cid is None:
        raise TableNotFoundError(f"{served}: no compiled model in {store.location}: {fix}")
    blob = store.get_compiled(cid)
    if blob is None:
        raise TableNotFoundError(f"{served}: compiled model {cid} is missing from "
                                 f"{store.location}: {fix}")
    compiled = CompiledModel.from_bytes(blob, f"compiled model {cid} in {store.location}",
                                        weights_dir=weights_dir)
    fp = str(compiled.meta.get("fingerprint", ""))
    found = read(store, fp, strategies(solver), objective, repair=False) if fp else None
    if found is None:
        raise TableNotFoundError(f"{served}: the tables of {solver} for profile {fp or '?'} are "
                                 f"not all in {store.location}: {fix}")
    return StoredModel(compiled, cid, found[0], found[1])

