"""Raw bodies (``application/octet-stream``): little-endian values, read in place.

``shape`` and ``dtype`` come beside the body, from the query (``?shape=4,3,224,224&dtype=
float32``) or the ``X-Tensor-Shape`` / ``X-Tensor-Dtype`` headers; without a shape the samples
are counted from the length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from core.errors import UsageError
from core.shapes import parse_shape
from service.errors import field_error
from service.wire.common import (
    BINARY_SCHEMA,
    MAX_RANK,
    Format,
    check_tensor,
    parse_dtype,
    shape_str,
)

MEDIA_TYPES = ("application/octet-stream",)


def _parse_shape_text(text: str, where: str) -> tuple[int, ...]:
    try:
        return parse_shape(text, batch=True, max_rank=MAX_RANK, what="shape")
    except UsageError as exc:
        raise field_error(where, str(exc)) from exc


def decode_raw(body: bytes, input_shape: Sequence[int], max_samples: int, *,
               shape_text: str | None, dtype_text: str | None) -> np.ndarray:
    """Raw little-endian values: shape and dtype given beside the body."""
    dtype = parse_dtype(dtype_text, "dtype") if dtype_text else np.dtype(np.float32)
    dtype = dtype.newbyteorder("<")
    per_sample = tuple(input_shape)
    sample_bytes = math.prod(per_sample) * dtype.itemsize
    if shape_text:
        shape = _parse_shape_text(shape_text, "shape")
        if shape == per_sample:
            shape = (-1, *shape)
    else:
        shape = (-1, *per_sample)
    if shape[0] == -1 and tuple(shape[1:]) == per_sample:
        if len(body) % sample_bytes or not body:
            raise field_error("body", f"{len(body)} bytes are not whole samples of "
                                      f"{shape_str(per_sample)} {dtype.name} "
                                      f"({sample_bytes} bytes each)")
        shape = (len(body) // sample_bytes, *per_sample)
    if any(d < 0 for d in shape):
        raise field_error("shape", f"{shape_str(shape)}: only the first dimension may be -1")
    need = math.prod(shape) * dtype.itemsize
    if need != len(body):
        raise field_error("body", f"{len(body)} bytes, but shape {shape_str(shape)} of "
                                  f"{dtype.name} needs {need}")
    array = np.frombuffer(body, dtype=dtype).reshape(shape)
    return check_tensor(array, input_shape, "body", max_samples)


FORMAT = Format("application/octet-stream", MEDIA_TYPES, "tensor", decode_raw,
                {"application/octet-stream": BINARY_SCHEMA})
