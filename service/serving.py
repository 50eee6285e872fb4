"""What the inference handlers do: decode a request for its model, run it through the model's
batcher within the request timeout, and say what ran it.

Decoding runs in a worker thread (JSON, .npy, images), the batch in the model's own thread;
the event loop only moves futures. The response names the plan (request size, the memory it
was chosen for, the table breakpoint, plan id, predicted time), the time spent queued and
running, and the outputs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.responses import JSONResponse, Response

from planner.settings import Settings
from service import codecs
from service.batcher import Outcome
from service.errors import (PayloadTooLargeError, RequestTimeoutError, UnsupportedMediaError,
                            field_error)
from service.registry import ModelEntry, Registry

JSON_TYPES = ("application/json", "text/json")
NPY_TYPES = ("application/x-npy", "application/npy", "application/x-numpy")
RAW_TYPES = ("application/octet-stream",)
IMAGE_TYPES = ("image/jpeg", "image/jpg", "image/png")
MULTIPART = "multipart/form-data"
SUPPORTED = "application/json, application/x-npy, application/octet-stream, " \
            "multipart/form-data (JPEG/PNG files), image/jpeg or image/png"


@dataclass(frozen=True)
class Decoded:
    """A request ready to run: its model, its samples, what it asked for."""

    entry: ModelEntry
    x: np.ndarray
    top_k: int | None = None
    v2: codecs.V2Request | None = None  # an OIP v2 body sent to /infer: answered in kind


def media_type(headers: Mapping[str, str]) -> str:
    return headers.get("content-type", "").split(";")[0].strip().lower()


def _pick_model(query: str | None, body: str | None) -> str | None:
    if query is not None and body is not None and query != body:
        raise field_error("model", f"the query names {query!r} but the body names {body!r}")
    return query if query is not None else body


def _check_top_k(entry: ModelEntry, k: int | None) -> int | None:
    if k is None:
        return None
    shape = entry.output_shape
    if len(shape) != 1:
        raise field_error("top_k", f"needs a classifier (one score per class), but {entry.name} "
                                   f"outputs shape {list(shape)} per sample")
    if k > shape[0]:
        raise field_error("top_k", f"{k} is more than the {shape[0]} classes of {entry.name}")
    return k


async def decode_infer(headers: Headers, body: bytes, registry: Registry, settings: Settings,
                       state: Any, *, model: str | None, top_k: int | None,
                       shape: str | None, dtype: str | None) -> Decoded:
    """A ``POST /infer`` request as samples of the model it names (see ``service.codecs``)."""
    kind = media_type(headers) or "application/json"
    limit = settings.max_samples_per_request
    top_k = codecs.parse_top_k(top_k)

    def named(name: str | None) -> ModelEntry:
        entry = registry.ready_entry(name)
        state.vbs_model = entry.name
        return entry

    if kind in JSON_TYPES or kind.endswith("+json"):
        doc = await run_in_threadpool(codecs.parse_json, body)
        if codecs.is_v2_body(doc):  # OIP v2 tensors, with the model named in the body or query
            name = doc.pop("model", None)
            if name is not None and not isinstance(name, str):
                raise field_error("model", "must be a model name")
            entry = named(_pick_model(model, name))
            v2 = codecs.parse_v2_doc(doc)
            x = await run_in_threadpool(codecs.v2_tensor, v2, entry.input_shape, limit)
            return Decoded(entry, x, _check_top_k(entry, top_k), v2)
        req = codecs.infer_json_from(doc)
        entry = named(_pick_model(model, req.model))
        k = _check_top_k(entry, top_k if top_k is not None else req.top_k)
        x = await run_in_threadpool(codecs.tensor_from_json, req, entry.input_shape, limit)
        return Decoded(entry, x, k)
    if kind in NPY_TYPES or kind in RAW_TYPES:
        entry = named(model)
        k = _check_top_k(entry, top_k)
        if kind in NPY_TYPES:
            x = await run_in_threadpool(codecs.decode_npy, body, entry.input_shape, limit)
        else:
            x = await run_in_threadpool(
                codecs.decode_raw, body, entry.input_shape, limit,
                shape_text=shape or headers.get("x-tensor-shape"),
                dtype_text=dtype or headers.get("x-tensor-dtype"))
        return Decoded(entry, x, k)
    if kind in IMAGE_TYPES or kind == MULTIPART:
        if kind == MULTIPART:
            parts, fields = await _multipart(headers, body, limit)
        else:
            parts, fields = [codecs.ImagePart("body", body)], {}
        entry = named(_pick_model(model, fields.get("model")))
        k = _check_top_k(entry, top_k if top_k is not None else codecs.parse_top_k(
            fields.get("top_k"), "form field top_k"))
        if entry.preprocess is None or entry.image_mode is None:
            raise field_error("files", f"{entry.name} takes input "
                                       f"{codecs.model_shape_text(entry.input_shape)}, not "
                                       "images: send tensors (JSON, .npy or raw bytes)")
        x = await run_in_threadpool(codecs.decode_images, parts, entry.preprocess,
                                    entry.image_mode, entry.input_shape, limit,
                                    settings.max_image_pixels)
        return Decoded(entry, x, k)
    raise UnsupportedMediaError(f"header Content-Type: {kind!r} is not supported; use {SUPPORTED}")


async def _multipart(headers: Headers, body: bytes, max_samples: int
                     ) -> tuple[list[codecs.ImagePart], dict[str, str]]:
    async def stream() -> Any:
        yield body

    parser = MultiPartParser(headers, stream(), max_files=max_samples + 1, max_fields=16,
                             max_part_size=64 * 1024)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise field_error("body", f"malformed multipart/form-data ({exc.message})") from exc
    try:
        parts: list[codecs.ImagePart] = []
        fields: dict[str, str] = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                label = repr((value.filename or "")[:80])
                where = f"files[{len(parts)}] ({key!r}, filename {label})"
                parts.append(codecs.ImagePart(where, await value.read()))
            elif key in ("model", "top_k"):
                fields[key] = value
            else:
                raise field_error(f"form field {key!r}", "unknown; send image files, and "
                                                         "optionally 'model' and 'top_k'")
    finally:
        await form.close()
    if len(parts) > max_samples:
        raise field_error("files", f"{len(parts)}+ images are more than the {max_samples} one "
                                   "request may hold (max_samples_per_request)", PayloadTooLargeError)
    return parts, fields


async def decode_v2(headers: Headers, body: bytes, entry: ModelEntry, settings: Settings
                    ) -> tuple[codecs.V2Request, np.ndarray]:
    header = headers.get("inference-header-content-length")

    def decode() -> tuple[codecs.V2Request, np.ndarray]:
        req = codecs.parse_v2(body, header)
        return req, codecs.v2_tensor(req, entry.input_shape, settings.max_samples_per_request)

    return await run_in_threadpool(decode)


async def run(entry: ModelEntry, x: np.ndarray, settings: Settings) -> Outcome:
    """Queue ``x`` on the model's batcher; 504 when it is not answered within the timeout."""
    assert entry.batcher is not None
    timeout = settings.request_timeout_s
    try:
        return await asyncio.wait_for(entry.batcher.submit(x), timeout)
    except asyncio.TimeoutError as exc:
        entry.batcher.metrics.rejected.labels(entry.name, "timeout").inc()
        raise RequestTimeoutError(
            f"model {entry.name}: no answer within {timeout:g} s (request_timeout_s): the service "
            "is busy or the request is large; retry, or send fewer samples") from exc


# -- what ran it -----------------------------------------------------------------------------


def plan_json(choice: Any) -> dict[str, Any]:
    """One plan the worker ran: the request size and the memory it was chosen for."""
    return {"batch": choice.batch, "budget_bytes": choice.free_bytes,
            "breakpoint_bytes": choice.peak_bytes, "peak_bytes": choice.peak_bytes,
            "plan_id": choice.plan_id, "solver": choice.table.solver,
            "predicted_time_s": choice.time_total,
            "predicted_time_per_sample_s": choice.time_total / choice.batch,
            "choice_s": choice.seconds}


def run_json(outcome: Outcome) -> dict[str, Any]:
    plans = [plan_json(c) for c in outcome.info.choices]
    return {"plan": plans[0] if plans else None, "plans": plans,
            "batch": outcome.batch_samples, "splits": outcome.info.splits,
            "oom_retries": outcome.info.oom_retries, "table_version": outcome.table_version,
            "timing": {"queue_s": outcome.queue_s, "run_s": outcome.run_s}}


def infer_response(decoded: Decoded, outcome: Outcome) -> Response:
    """The /infer answer: outputs (or top-k) and what ran them; OIP v2 form for a v2 body."""
    if decoded.v2 is not None and decoded.top_k is None:
        content, headers = codecs.v2_response(decoded.entry.name, decoded.v2.id, outcome.y,
                                              decoded.v2.binary_output, v2_parameters(outcome))
        return Response(content, headers=headers)
    return JSONResponse(infer_json(decoded, outcome))


def infer_json(decoded: Decoded, outcome: Outcome) -> dict[str, Any]:
    y = outcome.y
    out: dict[str, Any] = {"model": decoded.entry.name, "samples": int(y.shape[0]),
                           "output_shape": list(y.shape)}
    if decoded.top_k is not None:
        out["top_k"] = codecs.top_k(y, decoded.top_k, decoded.entry.labels)
    else:
        out["outputs"] = codecs.finite_list(y)
    out.update(run_json(outcome))
    return out


def v2_parameters(outcome: Outcome) -> dict[str, Any]:
    """OIP response parameters (scalars only): the plan and the timings."""
    first = outcome.info.choices[0] if outcome.info.choices else None
    params: dict[str, Any] = {"batch": outcome.batch_samples, "queue_s": outcome.queue_s,
                              "run_s": outcome.run_s, "splits": outcome.info.splits,
                              "oom_retries": outcome.info.oom_retries}
    if outcome.table_version is not None:
        params["table_version"] = outcome.table_version
    if first is not None:
        params.update({"plan_id": first.plan_id, "plan_batch": first.batch,
                       "budget_bytes": first.free_bytes,
                       "predicted_time_s": first.time_total})
    return params


__all__ = ["Decoded", "decode_infer", "decode_v2", "infer_json",
           "infer_response", "plan_json", "run", "run_json", "v2_parameters"]
