"""Request decoding and response encoding: every way a tensor or an image reaches the service.

Decoders turn a body into a numpy array of shape ``(N, *input_shape)`` (N >= 1, a numeric
dtype, native byte order, C-contiguous; binary bodies are read in place, not copied, so the
array may be read-only: the batcher copies it once, into its batch buffer), or raise a
RequestError naming the field and the problem. Decoding a binary body reads none of its
values: that NaN and infinities are refused (400, naming the field) is checked by the batcher
as it copies the samples into its batch, in the model's dtype. They are plain functions of bytes:
binary ones cost microseconds and run on the event loop for small bodies, JSON and images in a
worker thread (torch is only touched by image preprocessing, and never on the event loop). Nothing from a request is unpickled, imported or used as a path:
``.npy`` headers are read and checked before ``np.load(allow_pickle=False)``, images are
decoded by Pillow from memory, restricted to JPEG and PNG.

Formats:

- ``/infer`` JSON: ``{"inputs": [[...]], "shape"?: [...], "dtype"?: "float32", "model"?: NAME,
  "top_k"?: K}``. ``inputs`` is a nested list of samples, or a flat list with ``shape``
  (the whole tensor's ``[N, *input_shape]`` or one sample's ``input_shape``). One sample
  may be sent without the batch dimension.
- ``.npy`` (``application/x-npy``): one array ``(N, *input_shape)`` or one sample.
- ``application/octet-stream``: raw little-endian values; ``shape`` and ``dtype`` come from
  the query (``?shape=4,3,224,224&dtype=float32``) or the ``X-Tensor-Shape`` /
  ``X-Tensor-Dtype`` headers; without a shape the samples are counted from the length.
- images: ``multipart/form-data`` with one or many JPEG/PNG files, or one image as the body
  (``image/jpeg``, ``image/png``); preprocessed with the model's transforms.
- Open Inference Protocol v2 JSON (``inputs``: name, shape, datatype, data), and its binary
  tensor extension (header ``Inference-Header-Content-Length``, ``binary_data_size``).
"""

from __future__ import annotations

import functools
import io
import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field

from core.errors import UsageError
from core.shapes import parse_shape
from service.errors import PayloadTooLargeError, RequestError, field_error

# -- dtypes -----------------------------------------------------------------------------------

DTYPE_NAMES = ("float32", "float16", "float64", "uint8", "int8", "int16", "int32", "int64", "bool")
V2_DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
}
V2_UNSUPPORTED = {"BYTES": "strings", "BF16": "bfloat16 (send FP32 or FP16)"}
V2_OF_DTYPE = {np.dtype(v).name: k for k, v in V2_DATATYPES.items()}
OUTPUT_NAME = "output"
IMAGE_FORMATS = ("JPEG", "PNG")
_MAX_RANK = 8


def parse_dtype(text: str, where: str) -> np.dtype[Any]:
    name = text.strip().lower()
    if name not in DTYPE_NAMES:
        raise field_error(where, f"dtype {text!r} is not supported; use one of "
                                 f"{', '.join(DTYPE_NAMES)}")
    return np.dtype(name)


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def model_shape_text(input_shape: Sequence[int]) -> str:
    return "[N," + ",".join(str(d) for d in input_shape) + "]"


# -- checks shared by every decoder ----------------------------------------------------------


def _as_array(data: Any, where: str, dtype: np.dtype[Any] | None = None) -> np.ndarray:
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
        raise field_error(where, f"shape {_shape_text(array.shape)} does not match the model's "
                                 f"input {model_shape_text(shape)}: send samples of shape "
                                 f"{_shape_text(shape)} (the shape the model was planned for)")
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


def _object(value: Any, where: str, allowed: Sequence[str], required: Sequence[str] = ()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise field_error(where, f"must be a JSON object, not {_json_type(value)}")
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise field_error(f"{where}.{unknown[0]}" if where != "body" else unknown[0],
                          f"unknown field; this object takes {', '.join(allowed)}")
    for key in required:
        if key not in value:
            raise field_error(f"{where}.{key}" if where != "body" else key,
                              "is required but missing")
    return value


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number", type(None): "null"}.get(type(value), "a value")


def _shape_field(value: Any, where: str, wildcard: bool = False) -> tuple[int, ...]:
    """A shape: whole numbers >= 0 (with ``wildcard``, the first may be -1: "as many as fit")."""
    if (not isinstance(value, list) or not value or len(value) > _MAX_RANK
            or not all(isinstance(d, int) and not isinstance(d, bool)
                       and (d >= 0 or (wildcard and k == 0 and d == -1))
                       for k, d in enumerate(value))):
        first = " (the first may be -1)" if wildcard else ""
        raise field_error(where, f"must be a list of 1 to {_MAX_RANK} whole numbers >= 0{first}, "
                                 f"got {json.dumps(value)[:80]}")
    return tuple(value)


def _int_field(value: Any, where: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise field_error(where, f"must be a whole number {bound}, got {json.dumps(value)[:40]}")
    return value


def parse_top_k(value: Any, where: str = "top_k") -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip().isdigit():
            raise field_error(where, f"must be a whole number >= 1, got {value!r}")
        value = int(value)
    return _int_field(value, where, 1, 100_000)


# -- /infer JSON -----------------------------------------------------------------------------


# Declared once: the fields, which are required and their documentation (OpenAPI, from the
# docstring and descriptions) come from here; ``infer_json_from`` refuses any other field and a
# missing required one by these fields, then checks each value, naming the field in its error.
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


def parse_infer_json(body: bytes) -> InferJson:
    return infer_json_from(parse_json(body))


def infer_json_from(doc: Any) -> InferJson:
    doc = _object(doc, "body", _INFER_FIELDS, _INFER_REQUIRED)
    inputs = doc["inputs"]
    if not isinstance(inputs, list):
        raise field_error("inputs", f"must be a list of samples (nested lists of numbers), not "
                                    f"{_json_type(inputs)}")
    shape = _shape_field(doc["shape"], "shape", wildcard=True) if doc.get("shape") is not None else None
    dtype_text = doc.get("dtype", "float32")
    if not isinstance(dtype_text, str):
        raise field_error("dtype", f"must be a string such as 'float32', not {_json_type(dtype_text)}")
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise field_error("model", f"must be a model name, not {_json_type(model)}")
    return InferJson(inputs, shape, parse_dtype(dtype_text, "dtype"), model,
                     parse_top_k(doc.get("top_k")))


def tensor_from_json(req: InferJson, input_shape: Sequence[int], max_samples: int) -> np.ndarray:
    array = _as_array(req.inputs, "inputs", req.dtype)
    if req.shape is not None:
        shape = req.shape
        per_sample = tuple(input_shape)
        if shape == per_sample:
            shape = (-1, *shape)
        expected = math.prod(d for d in shape if d >= 0)
        if shape[0] == -1:
            if expected == 0 or array.size % expected:
                raise field_error("inputs", f"{array.size} values are not whole samples of shape "
                                            f"{_shape_text(per_sample)} ({expected} values each)")
        elif array.size != expected:
            raise field_error("inputs", f"holds {array.size} values but shape "
                                        f"{_shape_text(req.shape)} needs {expected}")
        array = array.reshape(shape)
    return check_tensor(array, input_shape, "inputs", max_samples)


# -- .npy and raw bytes ----------------------------------------------------------------------


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


def decode_npy(body: bytes, input_shape: Sequence[int], max_samples: int) -> np.ndarray:
    """One array from ``.npy`` bytes, read in place; the header is checked first, pickles are
    refused."""
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
        raise field_error("body", f"the .npy header says shape {_shape_text(shape)} of {dtype} "
                                  f"({count * dtype.itemsize} bytes) but {follows} bytes follow")
    # The data in place: a read-only view of the body, no copy.
    array = np.frombuffer(body, dtype=dtype, count=count, offset=start)
    array = array.reshape(shape, order="F" if fortran else "C")
    return check_tensor(array, input_shape, "body", max_samples)


def _parse_shape_text(text: str, where: str) -> tuple[int, ...]:
    try:
        return parse_shape(text, batch=True, max_rank=_MAX_RANK, what="shape")
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
                                      f"{_shape_text(per_sample)} {dtype.name} "
                                      f"({sample_bytes} bytes each)")
        shape = (len(body) // sample_bytes, *per_sample)
    if any(d < 0 for d in shape):
        raise field_error("shape", f"{_shape_text(shape)}: only the first dimension may be -1")
    need = math.prod(shape) * dtype.itemsize
    if need != len(body):
        raise field_error("body", f"{len(body)} bytes, but shape {_shape_text(shape)} of "
                                  f"{dtype.name} needs {need}")
    array = np.frombuffer(body, dtype=dtype).reshape(shape)
    return check_tensor(array, input_shape, "body", max_samples)


# -- images ----------------------------------------------------------------------------------

Preprocess = Callable[[Any], Any]  # a PIL image -> a (C, H, W) float tensor or array


@dataclass(frozen=True)
class ImagePart:
    """One uploaded image: where it came from (for errors) and its bytes."""

    where: str
    data: bytes


def decode_images(parts: Sequence[ImagePart], preprocess: Preprocess, mode: str,
                  input_shape: Sequence[int], max_samples: int, max_pixels: int) -> np.ndarray:
    """Decode JPEG/PNG images with Pillow and preprocess them into ``(N, *input_shape)``."""
    from PIL import Image, UnidentifiedImageError

    if not parts:
        raise field_error("files", "no image in the request: send JPEG or PNG files as "
                                   "multipart/form-data")
    if len(parts) > max_samples:
        raise field_error("files", f"{len(parts)} images are more than the {max_samples} one "
                                   "request may hold (max_samples_per_request)", PayloadTooLargeError)
    samples = []
    for part in parts:
        if not part.data:
            raise field_error(part.where, "is empty: send a JPEG or PNG image")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(part.data), formats=list(IMAGE_FORMATS)) as image:
                    width, height = image.size
                    if width * height > max_pixels:
                        raise field_error(part.where, f"{width}x{height} pixels are more than "
                                                      f"{max_pixels} (max_image_pixels)",
                                          PayloadTooLargeError)
                    image.load()
                    converted = image.convert(mode)
        except RequestError:
            raise
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError,
                ValueError, EOFError, TypeError) as exc:
            raise field_error(part.where, f"cannot be decoded as a JPEG or PNG image ({exc})") from exc
        sample = np.asarray(preprocess(converted), dtype=np.float32)
        samples.append(sample)
    array = np.stack(samples)
    return check_tensor(array, input_shape, "files", max_samples, single_ok=False)


def build_preprocess(model_name: str, input_shape: Sequence[int]) -> tuple[Preprocess, str] | None:
    """The preprocessing of a model's images, and its Pillow mode; None when images do not fit.

    Torchvision classification models use their weights' transforms (resize, centre crop,
    normalise: ``get_model_weights(name).DEFAULT.transforms()``) with the crop set to the
    planned input size and the resize scaled alike (a planned 224 gives exactly the default
    transforms); other models resize to the planned size and scale to [0, 1]. The geometry is
    torchvision's functional API on the Pillow image (Pillow does the work), the scaling and
    normalisation numpy's, as the transforms compute them in float32: no torch op runs here,
    so decoding threads never start OpenMP teams beside the model's (``service.registry``).
    Models whose input is not one image (C, H, W) with 1 or 3 channels take no images.
    """
    if len(input_shape) != 3 or input_shape[0] not in (1, 3):
        return None
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    channels, height, width = (int(d) for d in input_shape)
    mode = "RGB" if channels == 3 else "L"
    weights = _torchvision_weights(model_name) if channels == 3 else None
    if weights is not None:
        default = weights.transforms()
        crop, resize = _first(default.crop_size), _first(default.resize_size)
        interpolation = default.interpolation
        mean = np.asarray(default.mean, dtype=np.float32)
        std = np.asarray(default.std, dtype=np.float32)
        if height == width:
            size = max(height, round(height * resize / crop))

            def geometry(image: Any) -> Any:
                return F.center_crop(F.resize(image, [size], interpolation=interpolation),
                                     [height, width])
        else:  # a non-square input: resize to it, then the weights' normalisation
            def geometry(image: Any) -> Any:
                return F.resize(image, [height, width], interpolation=interpolation)
        how = f"{model_name} weights' transforms, crop {height}x{width}"
        return _Preprocess(geometry, mean, std, how), mode

    def plain(image: Any) -> Any:
        return F.resize(image, [height, width], interpolation=InterpolationMode.BILINEAR)
    return _Preprocess(plain, None, None, f"resize to {height}x{width}, scale to [0, 1]"), mode


@dataclass(frozen=True)
class _Preprocess:
    geometry: Callable[[Any], Any]  # a Pillow image -> a Pillow image of the planned size
    mean: np.ndarray | None
    std: np.ndarray | None
    description: str

    def __call__(self, image: Any) -> np.ndarray:
        x = np.asarray(self.geometry(image), dtype=np.float32) / np.float32(255)
        if x.ndim == 2:
            x = x[:, :, None]
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return np.ascontiguousarray(x.transpose(2, 0, 1))


def _first(value: Any) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def _torchvision_weights(model_name: str) -> Any:
    """The default weights enum of a torchvision classification model (meta only, no download)."""
    import torchvision

    if model_name not in torchvision.models.list_models(module=torchvision.models):
        return None
    try:
        weights = torchvision.models.get_model_weights(model_name).DEFAULT
        default = weights.transforms()
    except (ValueError, KeyError, AttributeError, TypeError):
        return None
    needed = ("crop_size", "resize_size", "mean", "std", "interpolation")
    return weights if all(hasattr(default, a) for a in needed) else None


def labels_for(model_name: str, classes: int) -> list[str] | None:
    """Class names from the torchvision weights' meta ("categories"), when they fit."""
    import torchvision

    try:
        if model_name not in torchvision.models.list_models():
            return None
        categories = torchvision.models.get_model_weights(model_name).DEFAULT.meta.get("categories")
    except (ValueError, KeyError, AttributeError):
        return None
    if isinstance(categories, list) and len(categories) == classes:
        return [str(c) for c in categories]
    return None


# -- outputs ---------------------------------------------------------------------------------


def encode_array(y: np.ndarray) -> bytes:
    """A numeric array as JSON nested lists, straight from its memory (orjson); NaN and
    infinities become null (JSON has no such numbers); float32 values as their shortest text."""
    return orjson.dumps(np.ascontiguousarray(y), option=orjson.OPT_SERIALIZE_NUMPY)


def top_k(y: np.ndarray, k: int, labels: Sequence[str] | None) -> list[list[dict[str, Any]]]:
    """The k most likely classes of every sample, with softmax scores."""
    if y.ndim != 2:
        raise field_error("top_k", f"needs a classifier (one score per class), but this model "
                                   f"outputs shape {_shape_text(y.shape[1:])} per sample")
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


# -- Open Inference Protocol v2 --------------------------------------------------------------


@dataclass(frozen=True)
class V2Input:
    name: str
    shape: tuple[int, ...]
    datatype: str
    data: Any = None            # JSON data, or None when binary
    raw: bytes | memoryview | None = None  # binary tensor data (a view of the body)
    # where the request carries the values, for errors (gRPC names its own fields);
    # default: the HTTP body's inputs[i].data and inputs[i].parameters.binary_data_size
    data_where: str | None = None
    raw_where: str | None = None


@dataclass(frozen=True)
class V2Request:
    id: str | None
    inputs: tuple[V2Input, ...]
    outputs: tuple[str, ...]    # names asked for (empty: all)
    binary_output: bool
    parameters: dict[str, Any] = field(default_factory=dict)


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise field_error(where, f"must be a JSON object, not {_json_type(value)}")
    return value


def parse_v2(body: bytes, header_length: str | None) -> V2Request:
    """An OIP v2 inference request, JSON or JSON + binary tensors."""
    binary: bytes | memoryview = b""
    head = body
    if header_length is not None:
        text = header_length.strip()
        if not text.isdigit() or not 0 < int(text) <= len(body):
            raise field_error("header Inference-Header-Content-Length",
                              f"{header_length!r} must be the length of the JSON header, "
                              f"1..{len(body)} (the body's length)")
        # views, not copies: the tensors are read in place from the body
        head, binary = body[:int(text)], memoryview(body)[int(text):]
    return parse_v2_doc(parse_json(head), binary, header_length is not None)


def parse_v2_doc(doc: Any, binary: bytes | memoryview = b"", header_given: bool = False
                 ) -> V2Request:
    """An OIP v2 request from its JSON header and the binary tensor data after it."""
    doc = _object(doc, "body", ("id", "parameters", "inputs", "outputs"), ("inputs",))
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise field_error("id", f"must be a string, not {_json_type(request_id)}")
    params = _parameters(doc.get("parameters"), "parameters")
    raw_inputs = doc["inputs"]
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise field_error("inputs", "must be a non-empty list of input tensors")
    offset = 0
    inputs = []
    for i, item in enumerate(raw_inputs):
        where = f"inputs[{i}]"
        item = _object(item, where, ("name", "shape", "datatype", "data", "parameters"),
                       ("name", "shape", "datatype"))
        if not isinstance(item["name"], str):
            raise field_error(f"{where}.name", f"must be a string, not {_json_type(item['name'])}")
        shape = _shape_field(item["shape"], f"{where}.shape")
        datatype = item["datatype"]
        if not isinstance(datatype, str):
            raise field_error(f"{where}.datatype", f"must be a string, not {_json_type(datatype)}")
        p = _parameters(item.get("parameters"), f"{where}.parameters")
        if "binary_data_size" in p:
            size = _int_field(p["binary_data_size"], f"{where}.parameters.binary_data_size", 0)
            if "data" in item:
                raise field_error(f"{where}.data", "must be absent when binary_data_size is given")
            if not header_given:
                raise field_error(f"{where}.parameters.binary_data_size",
                                  "needs the header Inference-Header-Content-Length (binary "
                                  "tensor extension)")
            if offset + size > len(binary):
                raise field_error(f"{where}.parameters.binary_data_size",
                                  f"{size} bytes from offset {offset}, but only {len(binary)} "
                                  "binary bytes follow the JSON header")
            inputs.append(V2Input(item["name"], shape, datatype, raw=binary[offset:offset + size]))
            offset += size
        else:
            if "data" not in item:
                raise field_error(f"{where}.data", "is required (or binary_data_size in its "
                                                   "parameters)")
            inputs.append(V2Input(item["name"], shape, datatype, data=item["data"]))
    if offset != len(binary):
        raise field_error("body", f"{len(binary) - offset} bytes of binary data follow the "
                                  "tensors the JSON header declares")
    outputs: list[str] = []
    binary_output = _bool_field(params.get("binary_data_output", False),
                                "parameters.binary_data_output")
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise field_error("outputs", f"must be a list, not {_json_type(raw_outputs)}")
        for i, item in enumerate(raw_outputs):
            where = f"outputs[{i}]"
            item = _object(item, where, ("name", "parameters"), ("name",))
            if item["name"] != OUTPUT_NAME:
                raise field_error(f"{where}.name", f"unknown output {item['name']!r}; the model "
                                                   f"has one output, {OUTPUT_NAME!r}")
            op = _parameters(item.get("parameters"), f"{where}.parameters")
            flag = _bool_field(op.get("binary_data", False), f"{where}.parameters.binary_data")
            binary_output = binary_output or flag
            outputs.append(item["name"])
    return V2Request(request_id, tuple(inputs), tuple(outputs), binary_output, params)


def _bool_field(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise field_error(where, f"must be true or false, not {_json_type(value)}")
    return value


def v2_tensor(req: V2Request, input_shape: Sequence[int], max_samples: int) -> np.ndarray:
    """The one input of a single-input model (any name), checked against its planned shape."""
    if len(req.inputs) != 1:
        raise field_error("inputs", f"{len(req.inputs)} inputs given; the model takes one")
    tensor = req.inputs[0]
    where = "inputs[0]"
    datatype = tensor.datatype.upper()
    if datatype in V2_UNSUPPORTED:
        raise field_error(f"{where}.datatype", f"{tensor.datatype} ({V2_UNSUPPORTED[datatype]}) "
                                               "is not supported")
    if datatype not in V2_DATATYPES:
        raise field_error(f"{where}.datatype", f"unknown datatype {tensor.datatype!r}; use one of "
                                               f"{', '.join(V2_DATATYPES)}")
    dtype = V2_DATATYPES[datatype]
    shape = tensor.shape
    expected = (len(input_shape) + 1, tuple(input_shape))
    if len(shape) != expected[0] or tuple(shape[1:]) != expected[1]:
        raise field_error(f"{where}.shape", f"{_shape_text(shape)} does not match the model's "
                                            f"input {model_shape_text(input_shape)}")
    count = math.prod(shape)
    data_where = tensor.data_where or f"{where}.data"
    if tensor.raw is not None:
        need = count * dtype.itemsize
        if len(tensor.raw) != need:
            raise field_error(tensor.raw_where or f"{where}.parameters.binary_data_size",
                              f"{len(tensor.raw)} bytes, but shape {_shape_text(shape)} of "
                              f"{datatype} needs {need}")
        array = np.frombuffer(tensor.raw, dtype=dtype.newbyteorder("<")).reshape(shape)
    else:
        array = _as_array(tensor.data, data_where, dtype)
        if array.size != count:
            raise field_error(data_where, f"holds {array.size} values but shape "
                                          f"{_shape_text(shape)} needs {count}")
        array = array.reshape(shape)
    return check_tensor(array, input_shape, data_where, max_samples, single_ok=False)


def v2_encode(y: np.ndarray, binary: bool) -> bytes:
    """One output's data as OIP v2 sends it: little-endian bytes, or a flat JSON list."""
    if binary:
        return np.ascontiguousarray(y, dtype=y.dtype.newbyteorder("<")).tobytes()
    return encode_array(y.reshape(-1))


def v2_response(model: str, request_id: str | None, y: np.ndarray, data: bytes, binary: bool,
                parameters: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """The body and headers of an OIP v2 response (JSON, or JSON header + binary output);
    ``data`` is ``v2_encode(y, binary)``, made beforehand (on the model's thread)."""
    datatype = V2_OF_DTYPE.get(y.dtype.name, "FP32")
    output: dict[str, Any] = {"name": OUTPUT_NAME, "datatype": datatype, "shape": list(y.shape)}
    doc: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": [output],
                           "parameters": parameters}
    if request_id is not None:
        doc["id"] = request_id
    if binary:
        output["parameters"] = {"binary_data_size": len(data)}
        head = orjson.dumps(doc)
        return head + data, {"Inference-Header-Content-Length": str(len(head)),
                             "Content-Type": "application/octet-stream"}
    output["data"] = orjson.Fragment(data)
    return orjson.dumps(doc), {"Content-Type": "application/json"}
