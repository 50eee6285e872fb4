"""The Open Inference Protocol v2's gRPC service, as the build compiled it from
``grpc_predict_v2.proto`` (setup.py): ``pb`` holds its messages, ``rpc`` its service.

The modules are generated, never checked in, so a source tree that was not installed with
pip (or whose .proto changed since) has none or stale ones: importing this package then says
how to build them rather than failing deep inside protobuf.
"""

from __future__ import annotations

from core.errors import UsageError

try:
    from service.oip import grpc_predict_v2_pb2 as pb
    from service.oip import grpc_predict_v2_pb2_grpc as rpc
except Exception as exc:  # noqa: BLE001 - not built (ImportError), or for another grpcio or protobuf
    raise UsageError(
        f"the gRPC protocol modules cannot be imported ({exc}): they are generated from "
        "service/oip/grpc_predict_v2.proto when the package is built; reinstall it "
        "(pip install -e . or make setup), or turn gRPC off with VBS_GRPC_PORT=0") from exc

SERVICE = "inference.GRPCInferenceService"

__all__ = ["SERVICE", "pb", "rpc"]
