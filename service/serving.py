"""What the inference handlers do: decode a request for its model, run it through the model's
batcher within the request timeout, and say what ran it.

Thread hops, at most two per request: a binary body (.npy, raw bytes, OIP v2 binary) up to
``INLINE_DECODE_BYTES`` is decoded on the event loop (a header and a view of the bytes:
microseconds), a larger one, JSON or images in one worker thread; the batch runs on the model's
own thread, which also encodes each request's outputs (orjson, straight from the array); the
event loop only moves futures and splices the encoded outputs into the response (an
``orjson.Fragment``: not encoded twice). The response names the plan (request size, the memory
it was chosen for, its exact peak, plan id, predicted time) and where the time went (queue,
compute input, compute infer, compute output, as Triton's perf_analyzer reports them).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import orjson
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import Response

from service.settings import Settings
from service.batch_stage import Outcome
from service.claims import of as claims_of
from service.deps import InferQuery, inference_call
from service.errors import PayloadTooLargeError, UnsupportedMediaError, field_error
from service.media import media_type
from service.entry import ModelEntry
from service.registry import Registry
from service.wire import SUPPORTED, body_format
from service.wire import common as wire
from service.wire import v2 as oip
from service.wire.images import ImagePart
from service.wire.infer_json import infer_json_from, is_v2_body, tensor_from_json

INLINE_DECODE_BYTES = 2 * 2**20  # binary bodies up to this are decoded on the event loop
V2_FIELD = "inputs[0].data"
T = TypeVar("T")  # where an OIP v2 request carries its samples
Q = TypeVar("Q", bound=BaseModel)  # a route's query parameters


@dataclass(frozen=True)
class Decoded:
    """A request ready to run: its model, its samples, what it asked for."""

    entry: ModelEntry
    x: np.ndarray
    top_k: int | None = None
    v2: oip.V2Request | None = None  # an OIP v2 body: answered in kind
    decode_s: float = 0.0               # how long decoding took
    field: str = "inputs"               # where the body carries the samples (for errors)

    def encoder(self) -> Callable[[np.ndarray], bytes]:
        """What the model's thread makes of this request's rows: the response's outputs."""
        if self.top_k is not None:
            k, labels = self.top_k, self.entry.labels
            return lambda y: orjson.dumps(wire.top_k(y, k, labels))
        if self.v2 is not None:
            binary = self.v2.binary_output
            return lambda y: oip.v2_encode(y, binary)
        return wire.encode_array


def _timed(decode: Callable[..., np.ndarray], *args: Any, **kwargs: Any) -> tuple[np.ndarray, float]:
    t0 = time.perf_counter()
    x = decode(*args, **kwargs)
    return x, time.perf_counter() - t0


async def _in_thread(func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``func`` on a worker thread, its result handed over in a box emptied here: an idle
    worker thread keeps a reference to the last result it returned, which would keep the
    samples (and, under a memory limit, what they hold in ``service.admission``) alive."""
    def boxed() -> list[T]:
        return [func(*args, **kwargs)]

    boxed.__name__ = getattr(func, "__name__", "boxed")  # as the hop is named (logs, tests)
    box = await run_in_threadpool(boxed)
    return box.pop()


async def _binary(body: bytes, decode: Callable[..., np.ndarray], *args: Any, **kwargs: Any
                  ) -> tuple[np.ndarray, float]:
    """A binary body decoded on the event loop when small, else in a worker thread."""
    if len(body) <= INLINE_DECODE_BYTES:
        return _timed(decode, body, *args, **kwargs)
    return await _in_thread(_timed, decode, body, *args, **kwargs)


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


async def answer(request: Request, endpoint: str, query: type[Q], model: str | None,
                 decode: Callable[[bytes, Q], Awaitable[Decoded]],
                 respond: Callable[[Decoded, Outcome], Response]) -> Response:
    """An inference route's whole answer: the call checked, its claims taken and its body read
    (``service.deps.inference_call``), decoded, held under the memory limit, run, answered;
    its claims (``service.claims``) given back however it ends. ``endpoint`` labels its
    metrics."""
    claims = claims_of(request.state)
    claims.endpoint = endpoint
    try:
        parsed, body = await inference_call(request, query, model)
        decoded = await decode(body, parsed)
        claims.hold(len(body), body, decoded.x, decoded.entry.output_shape)
        await claims.pin(request.app.state.registry, decoded.entry)  # named in the body
        outcome = await claims.submit(decoded.entry, decoded.x, decode_s=decoded.decode_s,
                                      encode=decoded.encoder(), field=decoded.field)
        return respond(decoded, outcome)
    finally:
        claims.release()


async def decode_infer(request: Request, body: bytes, query: InferQuery) -> Decoded:
    """A ``POST /infer`` request (its ``body`` read, its ``query`` validated already) as
    samples of the model it names, read as its Content-Type's format says (``service.wire``)."""
    registry: Registry = request.app.state.registry
    settings: Settings = request.app.state.settings
    headers, claims = request.headers, claims_of(request.state)
    model, shape, dtype = query.model, query.shape, query.dtype
    kind = media_type(headers)
    limit = settings.max_samples_per_request
    top_k = wire.parse_top_k(query.top_k)

    def named(name: str | None) -> ModelEntry:
        entry = registry.ready_entry(name)
        claims.model = entry.name
        return entry

    fmt = body_format(kind)
    if fmt is None:
        raise UnsupportedMediaError(f"header Content-Type: {kind!r} is not supported; use "
                                    f"{SUPPORTED}")
    if fmt.reads == "json":
        return await _in_thread(_decode_json, fmt, body, named, model, top_k, limit)
    if fmt.reads == "tensor":
        entry = named(model)
        k = _check_top_k(entry, top_k)
        x, spent = await _binary(body, fmt.decode, entry.input_shape, limit,
                                 shape_text=shape or headers.get("x-tensor-shape"),
                                 dtype_text=dtype or headers.get("x-tensor-dtype"))
        return Decoded(entry, x, k, decode_s=spent, field="body")
    if fmt.reads == "multipart":
        parts, fields = await _multipart(request, limit)
    else:
        parts, fields = [ImagePart("body", body)], {}
    entry = named(_pick_model(model, fields.get("model")))
    k = _check_top_k(entry, top_k if top_k is not None else wire.parse_top_k(
        fields.get("top_k"), "form field top_k"))
    if entry.preprocess is None or entry.image_mode is None:
        raise field_error("files", f"{entry.name} takes input "
                                   f"{wire.model_shape_text(entry.input_shape)}, not "
                                   "images: send tensors (JSON, .npy or raw bytes)")
    x, spent = await _in_thread(_timed, fmt.decode, parts, entry.preprocess, entry.image_mode,
                                entry.input_shape, limit, settings.max_image_pixels)
    return Decoded(entry, x, k, decode_s=spent, field="files")


def _decode_json(fmt: wire.Format, body: bytes, named: Callable[[str | None], ModelEntry],
                 model: str | None, top_k: int | None, limit: int) -> Decoded:
    """A JSON /infer body, parsing to samples, in one worker thread."""
    t0 = time.perf_counter()
    doc = fmt.decode(body)
    if is_v2_body(doc):  # OIP v2 tensors, with the model named in the body or query
        name = doc.pop("model", None)
        if name is not None and not isinstance(name, str):
            raise field_error("model", "must be a model name")
        entry = named(_pick_model(model, name))
        v2 = oip.parse_v2_doc(doc)
        x = oip.v2_tensor(v2, entry.input_shape, limit)
        return Decoded(entry, x, _check_top_k(entry, top_k), v2, time.perf_counter() - t0,
                       V2_FIELD)
    req = infer_json_from(doc)
    entry = named(_pick_model(model, req.model))
    k = _check_top_k(entry, top_k if top_k is not None else req.top_k)
    x = tensor_from_json(req, entry.input_shape, limit)
    return Decoded(entry, x, k, decode_s=time.perf_counter() - t0)


async def _multipart(request: Request, max_samples: int
                     ) -> tuple[list[ImagePart], dict[str, str]]:
    """The image files and fields of a multipart body, parsed by Starlette's own form parser
    (bounded: files, fields and the size of a field), file data spooled off the event loop."""
    try:
        form = await request.form(max_files=max_samples + 1, max_fields=16,
                                  max_part_size=64 * 1024)
    except (HTTPException, MultiPartException, ValueError) as exc:
        # ValueError: python-multipart's parse errors, which older Starlette releases let through
        detail = (exc.detail if isinstance(exc, HTTPException)
                  else exc.message if isinstance(exc, MultiPartException) else str(exc))
        raise field_error("body", f"malformed multipart/form-data ({detail})") from exc
    try:
        parts: list[ImagePart] = []
        fields: dict[str, str] = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                label = repr((value.filename or "")[:80])
                where = f"files[{len(parts)}] ({key!r}, filename {label})"
                parts.append(ImagePart(where, await value.read()))
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


async def decode_v2(request: Request, name: str, body: bytes) -> Decoded:
    """An OIP v2 request to ``/v2/models/{name}/infer`` (JSON, or binary tensors)."""
    registry: Registry = request.app.state.registry
    settings: Settings = request.app.state.settings
    entry = registry.ready_entry(name)
    claims_of(request.state).model = entry.name
    header = request.headers.get("inference-header-content-length")

    def decode(data: bytes) -> tuple[oip.V2Request, np.ndarray]:
        req = oip.parse_v2(data, header)
        return req, oip.v2_tensor(req, entry.input_shape, settings.max_samples_per_request)

    if header is not None:  # binary tensors: a small JSON header and views of the bytes
        (req, x), spent = await _binary(body, decode)
    else:
        (req, x), spent = await _in_thread(_timed, decode, body)
    return Decoded(entry, x, v2=req, decode_s=spent, field=V2_FIELD)


# -- what ran it -----------------------------------------------------------------------------


def plan_json(choice: Any) -> dict[str, Any]:
    """One plan the worker ran: the request size and the memory it was chosen for."""
    return {"batch": choice.batch, "budget_bytes": choice.free_bytes,
            "breakpoint_bytes": choice.peak_bytes, "peak_bytes": choice.peak_bytes,
            "plan_id": choice.plan_id, "solver": choice.table.solver,
            "predicted_time_s": choice.time_total,
            "predicted_time_per_sample_s": choice.time_total / choice.batch,
            "measured_time_s": choice.entry.time_measured,  # by `vbs plan` (None: not run)
            "choice_s": choice.seconds, "lease_wait_s": choice.waited_s,
            "stepped_down": choice.stepped_down}


def timing_json(outcome: Outcome) -> dict[str, float]:
    t = outcome.timing
    return {"queue_s": t.queue_s, "input_s": t.input_s, "infer_s": t.infer_s,
            "output_s": t.output_s, "run_s": t.run_s, "load_wait_s": t.load_wait_s}


def run_json(outcome: Outcome) -> dict[str, Any]:
    plans = [plan_json(c) for c in outcome.info.choices]
    return {"plan": plans[0] if plans else None, "plans": plans,
            "batch": outcome.batch_samples, "splits": outcome.info.splits,
            "oom_retries": outcome.info.oom_retries, "table_version": outcome.table_version,
            "timing": timing_json(outcome)}


def infer_response(decoded: Decoded, outcome: Outcome) -> Response:
    """The /infer answer: outputs (or top-k) and what ran them; OIP v2 form for a v2 body."""
    if decoded.v2 is not None and decoded.top_k is None:
        return v2_response(decoded, outcome)
    y = outcome.y
    out: dict[str, Any] = {"model": decoded.entry.name, "samples": int(y.shape[0]),
                           "output_shape": list(y.shape)}
    out["top_k" if decoded.top_k is not None else "outputs"] = orjson.Fragment(outcome.encoded)
    out.update(run_json(outcome))
    return Response(orjson.dumps(out), media_type="application/json")


def v2_response(decoded: Decoded, outcome: Outcome) -> Response:
    assert decoded.v2 is not None
    content, headers = oip.v2_response(decoded.entry.name, decoded.v2.id, outcome.y,
                                       outcome.encoded, decoded.v2.binary_output,
                                       v2_parameters(outcome))
    return Response(content, headers=headers)


def v2_parameters(outcome: Outcome) -> dict[str, Any]:
    """OIP response parameters (scalars only): the plan and the timings."""
    first = outcome.info.choices[0] if outcome.info.choices else None
    params: dict[str, Any] = {"batch": outcome.batch_samples, **timing_json(outcome),
                              "splits": outcome.info.splits,
                              "oom_retries": outcome.info.oom_retries}
    if outcome.table_version is not None:
        params["table_version"] = outcome.table_version
    if first is not None:
        params.update({"plan_id": first.plan_id, "plan_batch": first.batch,
                       "budget_bytes": first.free_bytes,
                       "predicted_time_s": first.time_total})
    return params


__all__ = ["Decoded", "decode_infer", "decode_v2", "infer_response", "plan_json", "run_json",
           "timing_json", "v2_parameters", "v2_response"]
