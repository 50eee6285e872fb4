"""What every wire format shares: dtype names, the checks a decoded tensor passes
(``check_tensor``: the planned input shape is the contract), JSON parsing and the helpers that
name a bad field, and the encoding of outputs (``encode_array``, ``top_k``).

Every error is a ``RequestError`` naming the field and the problem, so that a client's
mistake reads the same whichever format it came in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from service.errors import PayloadTooLargeError, field_error

DTYPE_NAMES = ("float32", "float16", "float64", "uint8", "int8", "int16", "int32", "int64", "bool")
MAX_RANK = 8
BINARY_SCHEMA = {"schema": {"type": "string", "format": "binary"}}  # OpenAPI: a body of bytes


@dataclass(frozen=True)
class Format:
    """A ``/infer`` body format, its entry in ``service.wire.FORMATS``: the Content-Types it
    is sent as, how the 415 answer names it, what the OpenAPI document shows (``openapi``:
    media type -> media type object) and how ``service.serving`` reads it (``reads``):

    - ``"tensor"``: ``decode(body, input_shape, max_samples, shape_text=, dtype_text=)``, the
      samples of a model named by the query (``shape_text`` and ``dtype_text`` from the query or
      the ``X-Tensor-*`` headers); on the event loop when small, else in a worker thread;
    - ``"json"``: ``decode(body)``, the document, which may name its model; in a worker thread;
    - ``"image"`` (the body is one image) or ``"multipart"`` (image files in a form):
      ``decode(parts, preprocess, mode, input_shape, max_samples, max_pixels)``, in a worker
      thread.
    """

    label: str
    media_types: tuple[str, ...]
    reads: str
    decode: Callable[..., Any]
    openapi: dict[str, Any]


# -- dtypes ----------------------------------------------------------------------------------


def parse_dtype(text: str, where: str) -> np.dtype[Any]:
    name = text.strip().lower()
    if name not in DTYPE_NAMES:
        raise field_error(where, f"dtype {text!r} is not supported; use one of "
                                 f"{', '.join(DTYPE_NAMES)}")
    return np.dtype(name)


def shape_str(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def model_shape_text(input_shape: Sequence[int]) -> str:
    return "[N," + ",".join(str(d) for d in input_shape) + "]"


# -- checks shared by every decoder ----------------------------------------------------------


def as_array(data: Any, where: str, dtype: np.dtype[Any] | None = None) -> np.ndarray:
    """Numbers (nested lists) as an array of ``dtype``, checking what a silent cast would hide."""
    try:
        raw = np.asarray(data)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise field_error(where, f"must be numbers in (nested) lists of equal length ({exc})") from exc
    if raw.dtype.kind not in "biuf":
        kind = "text" if raw.dtype.kind in "US" else "objects or mixed values"
        raise field_error(where, f"must hold numbers, not {kind}")
    if dtype is None:
        return raw
    return _cast(raw, dtype, where)


def _cast(raw: np.ndarray, dtype: np.dtype[Any], where: str) -> np.ndarray:
    if raw.dtype == dtype:
        return raw
    if dtype.kind == "b":
        if raw.dtype.kind != "b":
            raise field_error(where, f"datatype {dtype.name} takes true/false values")
        return raw.astype(dtype)
    if dtype.kind in "iu":
        if raw.dtype.kind == "f":
            if not np.all(np.isfinite(raw)) or not np.all(np.floor(raw) == raw):
                raise field_error(where, f"datatype {dtype.name} takes whole numbers")
        if raw.size:
            info = np.iinfo(dtype)
            low, high = raw.min(), raw.max()
            if low < info.min or high > info.max:
                raise field_error(where, f"values {low}..{high} do not fit in {dtype.name} "
                                         f"({info.min}..{info.max})")
    with np.errstate(over="ignore", invalid="ignore"):
        return raw.astype(dtype)


def check_tensor(array: np.ndarray, input_shape: Sequence[int], where: str, max_samples: int,
                 *, single_ok: bool = True) -> np.ndarray:
    """``array`` as ``(N, *input_shape)``: the planned input shape is the contract."""
    shape = tuple(input_shape)
    if single_ok and array.shape == shape:
        array = array.reshape((1, *shape))
    if array.ndim != len(shape) + 1 or tuple(array.shape[1:]) != shape:
        raise field_error(where, f"shape {shape_str(array.shape)} does not match the model's "
                                 f"input {model_shape_text(shape)}: send samples of shape "
                                 f"{shape_str(shape)} (the shape the model was planned for)")
    n = array.shape[0]
    if n < 1:
        raise field_error(where, "holds no samples: send at least one")
    if n > max_samples:
        raise field_error(where, f"{n} samples are more than the {max_samples} one request may "
                                 "hold (max_samples_per_request): split the request",
                          PayloadTooLargeError)
    if array.dtype.kind not in "biuf":
        raise field_error(where, f"dtype {array.dtype} is not numeric")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array


# -- JSON ------------------------------------------------------------------------------------


def parse_json(body: bytes, where: str = "body") -> Any:
    """A JSON document (orjson: UTF-8, nested at most 1024 deep). The NaN and Infinity that
    Python's ``json.dumps`` writes are read too (by the standard library, only when orjson
    refuses the body), so that the field holding them is named rather than the body."""
    if not body.strip():
        raise field_error(where, "is empty: send a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        strict = exc
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise field_error(where, f"malformed JSON: {strict.msg} at line {strict.lineno} column "
                                 f"{strict.colno}") from strict


def json_object(value: Any, where: str, allowed: Sequence[str], required: Sequence[str] = ()
                ) -> dict[str, Any]:
    """``value`` as a JSON object holding only the ``allowed`` fields and every ``required``
    one."""
    if not isinstance(value, dict):
        raise field_error(where, f"must be a JSON object, not {json_type(value)}")
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise field_error(f"{where}.{unknown[0]}" if where != "body" else unknown[0],
                          f"unknown field; this object takes {', '.join(allowed)}")
    for key in required:
        if key not in value:
            raise field_error(f"{where}.{key}" if where != "body" else key,
                              "is required but missing")
    return value


def json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number", type(None): "null"}.get(type(value), "a value")


def shape_field(value: Any, where: str, wildcard: bool = False) -> tuple[int, ...]:
    """A shape: whole numbers >= 0 (with ``wildcard``, the first may be -1: "as many as fit")."""
    if (not isinstance(value, list) or not value or len(value) > MAX_RANK
            or not all(isinstance(d, int) and not isinstance(d, bool)
                       and (d >= 0 or (wildcard and k == 0 and d == -1))
                       for k, d in enumerate(value))):
        first = " (the first may be -1)" if wildcard else ""
        raise field_error(where, f"must be a list of 1 to {MAX_RANK} whole numbers >= 0{first}, "
                                 f"got {json.dumps(value)[:80]}")
    return tuple(value)


def int_field(value: Any, where: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise field_error(where, f"must be a whole number {bound}, got {json.dumps(value)[:40]}")
    return value


def bool_field(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise field_error(where, f"must be true or false, not {json_type(value)}")
    return value


def parse_top_k(value: Any, where: str = "top_k") -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip().isdigit():
            raise field_error(where, f"must be a whole number >= 1, got {value!r}")
        value = int(value)
    return int_field(value, where, 1, 100_000)


# -- outputs ---------------------------------------------------------------------------------


def encode_array(y: np.ndarray) -> bytes:
    """A numeric array as JSON nested lists, straight from its memory (orjson); NaN and
    infinities become null (JSON has no such numbers); float32 values as their shortest text."""
    return orjson.dumps(np.ascontiguousarray(y), option=orjson.OPT_SERIALIZE_NUMPY)


def top_k(y: np.ndarray, k: int, labels: Sequence[str] | None) -> list[list[dict[str, Any]]]:
    """The k most likely classes of every sample, with softmax scores."""
    if y.ndim != 2:
        raise field_error("top_k", f"needs a classifier (one score per class), but this model "
                                   f"outputs shape {shape_str(y.shape[1:])} per sample")
    classes = y.shape[1]
    if k > classes:
        raise field_error("top_k", f"{k} is more than the model's {classes} classes")
    logits = y.astype(np.float64)
    logits = logits - np.max(np.where(np.isfinite(logits), logits, -np.inf), axis=1, keepdims=True)
    with np.errstate(over="ignore", invalid="ignore"):
        scores = np.exp(logits)
        scores /= scores.sum(axis=1, keepdims=True)
    order = np.argsort(-np.nan_to_num(scores, nan=-1.0), axis=1, kind="stable")[:, :k]
    out = []
    for row, idx in enumerate(order):
        out.append([{"index": int(i), "label": labels[i] if labels else str(int(i)),
                     "score": float(scores[row, i]) if np.isfinite(scores[row, i]) else None}
                    for i in idx])
    return out
