"""``.npy`` bodies (``application/x-npy``): one array ``(N, *input_shape)``, or one sample.

The header is read and checked before any value (``np.load`` is never called, so nothing is
unpickled), and the data is read in place: the samples are a read-only view of the body.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from service.errors import field_error
from service.wire.common import BINARY_SCHEMA, Format, check_tensor, shape_str

MEDIA_TYPES = ("application/x-npy", "application/npy", "application/x-numpy")
_NPY_MAGIC = b"\x93NUMPY"


@functools.lru_cache(maxsize=64)
def _npy_header(header: bytes) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    """(shape, fortran order, dtype) of a ``.npy`` header (its bytes up to the data), parsed by
    numpy once per distinct header: clients send the same shape again and again, and the
    header is a Python literal that numpy reads with ``ast.literal_eval``."""
    fmt = np.lib.format
    stream = io.BytesIO(header)
    version = fmt.read_magic(stream)
    if version == (1, 0):
        return fmt.read_array_header_1_0(stream)
    if version == (2, 0):
        return fmt.read_array_header_2_0(stream)
    raise ValueError(f"format version {version} is not supported")


def decode_npy(body: bytes, input_shape: Sequence[int], max_samples: int, *,
               shape_text: str | None = None, dtype_text: str | None = None) -> np.ndarray:
    """One array from ``.npy`` bytes, read in place; the header is checked first, pickles are
    refused. The header says the shape and dtype: a query's or header's are not read."""
    try:
        if not body.startswith(_NPY_MAGIC) or len(body) < 10:
            raise ValueError("it does not start with the .npy magic bytes")
        size = 2 if body[6] == 1 else 4
        start = 8 + size + int.from_bytes(body[8:8 + size], "little")
        if start > len(body):
            raise ValueError("its header is cut short")
        shape, fortran, dtype = _npy_header(body[:start])
    except (ValueError, OSError, SyntaxError, TypeError, EOFError) as exc:
        raise field_error("body", f"is not a .npy array ({exc}); write it with numpy.save, or "
                                  "send JSON") from exc
    if dtype.hasobject or dtype.names is not None or dtype.kind not in "biuf":
        raise field_error("body", f"the .npy dtype {dtype} is not a plain numeric type (object "
                                  "arrays are never unpickled); send float32 values")
    count = math.prod(shape)
    follows = len(body) - start
    if count * dtype.itemsize != follows:
        raise field_error("body", f"the .npy header says shape {shape_str(shape)} of {dtype} "
                                  f"({count * dtype.itemsize} bytes) but {follows} bytes follow")
    # The data in place: a read-only view of the body, no copy.
    array = np.frombuffer(body, dtype=dtype, count=count, offset=start)
    array = array.reshape(shape, order="F" if fortran else "C")
    return check_tensor(array, input_shape, "body", max_samples)


FORMAT = Format("application/x-npy", MEDIA_TYPES, "tensor", decode_npy,
                {"application/x-npy": BINARY_SCHEMA})
