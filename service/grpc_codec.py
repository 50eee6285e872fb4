"""OIP v2 gRPC messages in the HTTP route's terms, and outputs in gRPC's.

A ``ModelInferRequest`` becomes the same ``V2Request`` the HTTP route decodes
(``service.wire.v2``), so ``v2_tensor`` checks it (names, datatypes, shapes, counts, sample
limits) and refuses it with the same words; only the field named is gRPC's
(``raw_input_contents[0]``, ``inputs[0].contents.fp32_contents``). Values come either typed
(the repeated field of their datatype) or raw (little-endian bytes, read in place); the
answer comes the same way: raw output for raw input, as Triton answers tritonclient, typed for
typed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.errors import field_error
from service.oip import pb
from service.wire.v2 import OUTPUT_NAME, V2_OF_DTYPE, V2Input, V2Request, v2_encode

# The typed field of every datatype that has one (FP16 and BF16 travel raw only), and what
# protobuf holds in it.
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                  "UINT16": "uint_contents", "UINT32": "uint_contents",
                  "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
                  "BYTES": "bytes_contents"}
FIELD_DTYPE = {"bool_contents": np.bool_, "int_contents": np.int32, "int64_contents": np.int64,
               "uint_contents": np.uint32, "uint64_contents": np.uint64,
               "fp32_contents": np.float32, "fp64_contents": np.float64}


@dataclass(frozen=True)
class Received:
    """A ``ModelInferRequest`` as it came: the message, and its size on the wire, which the
    deserializer has for free where ``ByteSize()`` would size the whole message again on the
    event loop (for the admission ledger and the choice to decode inline or in a thread)."""

    message: Any
    wire_bytes: int


def received(data: bytes) -> Received:
    """The server's deserializer of ``ModelInfer``'s requests (``grpc_api.add_to_server``)."""
    return Received(pb.ModelInferRequest.FromString(data), len(data))


def read_request(msg: Any) -> V2Request:
    """The request as ``V2Request``: its tensors, ids and outputs checked as the HTTP
    route checks a JSON body (``binary_output``: it came raw, so it is answered raw)."""
    raw = list(msg.raw_input_contents)
    if raw and len(raw) != len(msg.inputs):
        raise field_error("raw_input_contents", f"{len(raw)} entries for {len(msg.inputs)} "
                                                "inputs: give one per input, in their order")
    inputs = []
    for i, tensor in enumerate(msg.inputs):
        where = f"inputs[{i}]"
        shape = tuple(int(d) for d in tensor.shape)
        if any(d < 0 for d in shape):
            raise field_error(f"{where}.shape", f"{list(shape)} has a negative dimension: give "
                                                "the tensor's own sizes")
        if raw:
            if tensor.contents.ListFields():
                raise field_error(f"{where}.contents", "must be empty when raw_input_contents "
                                                       "is given: send every input one way")
            at = f"raw_input_contents[{i}]"
            inputs.append(V2Input(tensor.name, shape, tensor.datatype, raw=raw[i],
                                  data_where=at, raw_where=at))
        else:
            data, at = _typed(tensor.contents, tensor.datatype, where)
            inputs.append(V2Input(tensor.name, shape, tensor.datatype, data=data,
                                  data_where=at))
    if not inputs:
        raise field_error("inputs", "must hold the input tensor: the model takes one")
    outputs = []
    for i, wanted in enumerate(msg.outputs):
        if wanted.name != OUTPUT_NAME:
            raise field_error(f"outputs[{i}].name", f"unknown output {wanted.name!r}; the model "
                                                    f"has one output, {OUTPUT_NAME!r}")
        outputs.append(wanted.name)
    return V2Request(msg.id or None, tuple(inputs), tuple(outputs), bool(raw))


def _typed(contents: Any, datatype: str, where: str) -> tuple[Any, str]:
    """A tensor's typed values as an array, and the field they came in (for errors)."""
    name = CONTENTS_FIELD.get(datatype.upper())
    given = [f.name for f, _ in contents.ListFields()]
    if name is None:
        if datatype.upper() == "FP16":
            raise field_error(f"{where}.contents", "FP16 has no typed field: send it in "
                                                   "raw_input_contents")
        return None, f"{where}.contents"  # v2_tensor names the datatype's problem
    for other in given:
        if other != name:
            raise field_error(f"{where}.contents.{other}", f"datatype {datatype} takes its "
                                                           f"values in contents.{name}")
    at = f"{where}.contents.{name}"
    values = getattr(contents, name)
    if name not in FIELD_DTYPE:  # bytes_contents: refused by v2_tensor for its datatype
        return None, at
    return np.fromiter(values, dtype=FIELD_DTYPE[name], count=len(values)), at


def encoder(raw: bool) -> Callable[[np.ndarray], Any]:
    """What the model's thread makes of a request's rows: little-endian bytes, or the output
    tensor with its values typed."""
    if raw:
        return lambda y: v2_encode(y, True)
    return _typed_output


def _typed_output(y: np.ndarray) -> Any:
    datatype = V2_OF_DTYPE.get(y.dtype.name, "FP32")
    tensor = pb.ModelInferResponse.InferOutputTensor(name=OUTPUT_NAME, datatype=datatype,
                                                     shape=list(y.shape))
    getattr(tensor.contents, CONTENTS_FIELD[datatype]).extend(y.reshape(-1).tolist())
    return tensor


def response(model: str, request_id: str | None, y: np.ndarray, encoded: Any, raw: bool,
             parameters: Mapping[str, Any]) -> Any:
    """The ``ModelInferResponse``: ``encoded`` is ``encoder(raw)(y)``, made on the model's
    thread; ``parameters`` the HTTP answer's (scalars)."""
    answer = pb.ModelInferResponse(model_name=model, model_version="1", id=request_id or "")
    if raw:
        answer.outputs.add(name=OUTPUT_NAME,
                           datatype=V2_OF_DTYPE.get(y.dtype.name, "FP32"),
                           shape=list(y.shape))
        answer.raw_output_contents.append(encoded)
    else:
        answer.outputs.append(encoded)
    set_parameters(answer.parameters, parameters)
    return answer


def set_parameters(target: Any, values: Mapping[str, Any]) -> None:
    """Scalars into a map of ``InferParameter``: bool, int64, double (Triton's field) or
    string."""
    for key, value in values.items():
        if isinstance(value, bool):
            target[key].bool_param = value
        elif isinstance(value, int):
            target[key].int64_param = value
        elif isinstance(value, float):
            target[key].double_param = value
        elif value is not None:
            target[key].string_param = str(value)


__all__ = ["CONTENTS_FIELD", "Received", "encoder", "read_request", "received", "response",
           "set_parameters"]
