"""What a model takes before it is first loaded, so the residency can decide which models fit.

Nothing here fails a model: what cannot be known now is known once it loads. A model served
without torch is read from its compiled form in the store (its weights, shapes, inputs, and
what `vbs plan` measured it keeps loaded, ``workers.load_cost``); one served with torch (a
name planned at a half precision among them, whatever compiled model an older plan left) is
built on the meta device (``planner.models.sketch_model``: its weights and shapes). Its plans'
bytes come from its table as the store has it: the compiled model's, else the one `vbs plan`
planned the name to, else the model's float32 one (a table of another fingerprint may differ
a little: an estimate).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from core.errors import TableFormatError
from core.table import PlanTable
from planner.families import build_preprocess, labels_for
from planner.store import PlanStore
from service.entry import ModelEntry
from service.settings import Settings
from workers.load_cost import LoadCost, read_load

log = logging.getLogger("vbs.service")


def sketch(entry: ModelEntry, settings: Settings, store: Callable[[], PlanStore]) -> None:
    """Fill in what ``entry`` takes before it is first loaded (on its torch thread)."""
    from planner.store.keys import table_id
    from planner.stored import model_key, planned_for

    try:
        planned = planned_for(settings, store(), entry.name, entry.spec)
    except Exception as exc:  # noqa: BLE001 - the store is down, or its record unreadable
        log.debug("%s: no record of its plan: %s", entry.name, exc)
        planned = None
    try:
        weights, in_shape, out_shape, meta, cost = _read(entry, settings, store, planned)
    except Exception as exc:  # noqa: BLE001 - its load says what is wrong
        log.debug("%s: no sketch: %s", entry.name, exc)
        return
    entry.weights_bytes, entry.load_cost = weights, cost
    if entry.shapes is None:
        entry.shapes = (in_shape, out_shape)
        if meta is not None:
            entry.labels, pre = stored_inputs(meta)
        else:
            if out_shape is not None and len(out_shape) == 1:
                entry.labels = labels_for(entry.spec.name, out_shape[0])
            pre = build_preprocess(entry.spec.name, in_shape)
        if pre is not None:
            entry.preprocess, entry.image_mode = pre
    s = settings
    try:
        opened = store()
        # a compiled model's own tables (those its worker runs), else those `vbs plan` planned
        # the name to, else the model's
        fp = ((meta or {}).get("fingerprint") or (planned.fingerprint if planned else None)
              or opened.get_model(model_key(entry.spec, s.solver, s.objective)))
        if fp is not None:
            tid = table_id(fp, s.solver, s.objective)
            entry.estimate = PlanTable.from_bytes(opened.get_table(tid).blob, tid)
    except Exception as exc:  # noqa: BLE001 - not planned yet, or the store is down
        log.debug("%s: no table to estimate its plans by: %s", entry.name, exc)


def _read(entry: ModelEntry, settings: Settings, store: Callable[[], PlanStore], planned: Any
          ) -> tuple[int, tuple[int, ...], tuple[int, ...] | None, dict[str, Any] | None,
                     LoadCost | None]:
    """(weights bytes, input shape, output shape, the compiled model's meta or None, what
    `vbs plan` measured it keeps loaded or None) of a model not loaded yet (``planned``: what
    `vbs plan` recorded of its name, ``planner.stored.planned_for``)."""
    device = entry.spec.device
    if settings.lean_for(device) or settings.lean_if_compiled(device):
        from core.compiled import CompiledModel
        from planner.stored import compiled_key

        opened = store()
        # planned at a half precision, its compiled model (if any) is an older plan's
        cid = None if planned is not None and planned.precision.half else opened.get_model(
            compiled_key(entry.name, entry.spec))
        blob = opened.get_compiled(cid) if cid else None
        if blob is not None:
            shapes, meta = CompiledModel.manifest(blob, f"compiled model {cid}")
            try:
                cost = read_load(opened, cid)
            except TableFormatError as exc:  # figures of an older `vbs plan`: as if none
                log.warning("%s: %s", entry.name, exc)
                cost = None
            return (int(meta.get("weight_bytes", 0)), shapes.input_shape, shapes.output_shape,
                    meta, cost)
        if settings.lean_for(device):
            raise LookupError(f"no compiled model of {entry.name} in {opened.location}")
    from planner.models import sketch_model

    built = sketch_model(entry.spec)
    return built.weights_bytes, built.input_shape, built.output_shape, None, None


def stored_inputs(meta: dict[str, Any]) -> tuple[list[str] | None, tuple[Any, str] | None]:
    """A compiled model's class names and image preprocessing (with its Pillow mode), as
    `vbs plan` stored them from the model's family (``planner.compile``)."""
    from planner.families.common import ImageSpec

    images = meta.get("images")
    pre = (ImageSpec.from_json(images).preprocess(), str(images["mode"])) if images else None
    labels = meta.get("labels")
    return (list(map(str, labels)) if labels else None), pre
