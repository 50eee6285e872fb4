"""Open Inference Protocol v2 (KServe / Triton): JSON tensors (``inputs``: name, shape,
datatype, data), and the binary tensor extension (header ``Inference-Header-Content-Length``,
``binary_data_size``), whose tensors are read in place from the body.

The HTTP route (``/v2/models/{name}/infer``), a v2 body sent to ``/infer`` and gRPC
(``service.grpc_codec``) all become one ``V2Request``, so ``v2_tensor`` checks every one alike
and refuses it with the same words; only the field named differs (``data_where``,
``raw_where``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from service.errors import field_error
from service.wire.common import (
    as_array,
    bool_field,
    check_tensor,
    encode_array,
    int_field,
    json_object,
    json_type,
    model_shape_text,
    parse_json,
    shape_field,
    shape_str,
)

V2_DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
}
V2_UNSUPPORTED = {"BYTES": "strings", "BF16": "bfloat16 (send FP32 or FP16)"}
V2_OF_DTYPE = {np.dtype(v).name: k for k, v in V2_DATATYPES.items()}
OUTPUT_NAME = "output"


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
        raise field_error(where, f"must be a JSON object, not {json_type(value)}")
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
    doc = json_object(doc, "body", ("id", "parameters", "inputs", "outputs"), ("inputs",))
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise field_error("id", f"must be a string, not {json_type(request_id)}")
    params = _parameters(doc.get("parameters"), "parameters")
    raw_inputs = doc["inputs"]
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise field_error("inputs", "must be a non-empty list of input tensors")
    inputs = _inputs(raw_inputs, binary, header_given)
    binary_output = bool_field(params.get("binary_data_output", False),
                               "parameters.binary_data_output")
    outputs, binary_asked = _outputs(doc.get("outputs"))
    return V2Request(request_id, inputs, outputs, binary_output or binary_asked, params)


def _inputs(raw_inputs: list[Any], binary: bytes | memoryview, header_given: bool
            ) -> tuple[V2Input, ...]:
    """The input tensors, their binary data cut from ``binary`` in their order."""
    offset = 0
    inputs = []
    for i, item in enumerate(raw_inputs):
        where = f"inputs[{i}]"
        item = json_object(item, where, ("name", "shape", "datatype", "data", "parameters"),
                           ("name", "shape", "datatype"))
        if not isinstance(item["name"], str):
            raise field_error(f"{where}.name", f"must be a string, not {json_type(item['name'])}")
        shape = shape_field(item["shape"], f"{where}.shape")
        datatype = item["datatype"]
        if not isinstance(datatype, str):
            raise field_error(f"{where}.datatype", f"must be a string, not {json_type(datatype)}")
        p = _parameters(item.get("parameters"), f"{where}.parameters")
        if "binary_data_size" in p:
            size = int_field(p["binary_data_size"], f"{where}.parameters.binary_data_size", 0)
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
    return tuple(inputs)


def _outputs(raw_outputs: Any) -> tuple[tuple[str, ...], bool]:
    """The outputs asked for (only ``output`` exists), and whether one asks for binary data."""
    outputs: list[str] = []
    binary_output = False
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise field_error("outputs", f"must be a list, not {json_type(raw_outputs)}")
        for i, item in enumerate(raw_outputs):
            where = f"outputs[{i}]"
            item = json_object(item, where, ("name", "parameters"), ("name",))
            if item["name"] != OUTPUT_NAME:
                raise field_error(f"{where}.name", f"unknown output {item['name']!r}; the model "
                                                   f"has one output, {OUTPUT_NAME!r}")
            op = _parameters(item.get("parameters"), f"{where}.parameters")
            flag = bool_field(op.get("binary_data", False), f"{where}.parameters.binary_data")
            binary_output = binary_output or flag
            outputs.append(item["name"])
    return tuple(outputs), binary_output


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
        raise field_error(f"{where}.shape", f"{shape_str(shape)} does not match the model's "
                                            f"input {model_shape_text(input_shape)}")
    count = math.prod(shape)
    data_where = tensor.data_where or f"{where}.data"
    if tensor.raw is not None:
        need = count * dtype.itemsize
        if len(tensor.raw) != need:
            raise field_error(tensor.raw_where or f"{where}.parameters.binary_data_size",
                              f"{len(tensor.raw)} bytes, but shape {shape_str(shape)} of "
                              f"{datatype} needs {need}")
        array = np.frombuffer(tensor.raw, dtype=dtype.newbyteorder("<")).reshape(shape)
    else:
        array = as_array(tensor.data, data_where, dtype)
        if array.size != count:
            raise field_error(data_where, f"holds {array.size} values but shape "
                                          f"{shape_str(shape)} needs {count}")
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
