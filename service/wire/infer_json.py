"""The ``/infer`` JSON body: ``{"inputs": [[...]], "shape"?: [...], "dtype"?: "float32",
"model"?: NAME, "top_k"?: K}``.

``inputs`` is a nested list of samples, or a flat list with ``shape`` (the whole tensor's
``[N, *input_shape]`` or one sample's ``input_shape``); one sample may be sent without the batch
dimension. A body whose inputs are OIP v2 tensor objects is read by ``service.wire.v2``
(``is_v2_body``). The fields are declared once, in ``InferBody``: the OpenAPI document and the
checks (unknown and missing fields) both come from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from service.errors import field_error
from service.media import JSON_TYPES
from service.wire.common import (
    Format,
    as_array,
    check_tensor,
    json_object,
    json_type,
    parse_dtype,
    parse_json,
    parse_top_k,
    shape_field,
    shape_str,
)


# ``infer_json_from`` refuses any other field and a missing required one by these fields, then
# checks each value, naming the field in its error.
class InferBody(BaseModel):
    """A JSON body of samples (or of OIP v2 tensors)."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[Any] = Field(description="samples, nested lists [N, *input_shape] (or flat "
                                          "with 'shape'); or OIP v2 tensor objects")
    shape: list[int] | None = Field(None, description="the shape of a flat 'inputs': "
                                                      "[N, *input_shape] or one sample's")
    dtype: str = Field("float32", description="the values' dtype (float32, float16, ...)")
    model: str | None = Field(None, description="served model name; default: the only one")
    top_k: int | None = Field(None, ge=1, description="return the k best labels")


_INFER_FIELDS = tuple(InferBody.model_fields)
_INFER_REQUIRED = tuple(k for k, f in InferBody.model_fields.items() if f.is_required())


@dataclass(frozen=True)
class InferJson:
    """A parsed ``/infer`` JSON body, before it is checked against a model."""

    inputs: Any
    shape: tuple[int, ...] | None
    dtype: np.dtype[Any]
    model: str | None
    top_k: int | None


def is_v2_body(doc: Any) -> bool:
    """A JSON body whose inputs are OIP v2 tensor objects (``/infer`` takes those too)."""
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    return isinstance(inputs, list) and bool(inputs) and all(isinstance(i, dict) for i in inputs)


def infer_json_from(doc: Any) -> InferJson:
    doc = json_object(doc, "body", _INFER_FIELDS, _INFER_REQUIRED)
    inputs = doc["inputs"]
    if not isinstance(inputs, list):
        raise field_error("inputs", f"must be a list of samples (nested lists of numbers), not "
                                    f"{json_type(inputs)}")
    shape = shape_field(doc["shape"], "shape", wildcard=True) if doc.get("shape") is not None else None
    dtype_text = doc.get("dtype", "float32")
    if not isinstance(dtype_text, str):
        raise field_error("dtype", f"must be a string such as 'float32', not {json_type(dtype_text)}")
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise field_error("model", f"must be a model name, not {json_type(model)}")
    return InferJson(inputs, shape, parse_dtype(dtype_text, "dtype"), model,
                     parse_top_k(doc.get("top_k")))


def tensor_from_json(req: InferJson, input_shape: Sequence[int], max_samples: int) -> np.ndarray:
    array = as_array(req.inputs, "inputs", req.dtype)
    if req.shape is not None:
        shape = req.shape
        per_sample = tuple(input_shape)
        if shape == per_sample:
            shape = (-1, *shape)
        expected = math.prod(d for d in shape if d >= 0)
        if shape[0] == -1:
            if expected == 0 or array.size % expected:
                raise field_error("inputs", f"{array.size} values are not whole samples of shape "
                                            f"{shape_str(per_sample)} ({expected} values each)")
        elif array.size != expected:
            raise field_error("inputs", f"holds {array.size} values but shape "
                                        f"{shape_str(req.shape)} needs {expected}")
        array = array.reshape(shape)
    return check_tensor(array, input_shape, "inputs", max_samples)


FORMAT = Format("application/json", JSON_TYPES, "json", parse_json,
                {"application/json": {"schema": InferBody.model_json_schema()}})
