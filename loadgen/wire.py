"""What a client process of ``vbs loadtest --processes`` sends and reads
(``loadgen.processes``).

Every request is encoded once, before the load starts: over HTTP a whole HTTP/1.1 request (head
and body) in the Open Inference Protocol v2 with its binary tensor extension, asking for the
output in binary too, so that the answer's JSON header is small; over gRPC a serialized
``ModelInferRequest`` with the samples as ``raw_input_contents``, sent as bytes (no serializer).
An answer is read only as far as the report needs: its status, and the timings the service puts
in its parameters (HTTP: the JSON header before the binary output; gRPC: the response's
``parameters``). ``HttpClient`` and ``GrpcClient`` are a client process's two clients
(``acquire`` a connection, ``send`` the request on it, ``release`` it).

``HttpConnection`` is one keep-alive connection carrying one request at a time: a plain
``asyncio.Protocol`` that finds the head's end, reads ``Content-Length`` bytes of body and hands
back the status and the answer's JSON header. It knows only what vbs-serve (uvicorn) answers: a
``Content-Length`` on every answer, no chunked bodies.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import orjson

from loadgen.loadtest import Answer, RequestFailed

GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
_LENGTH = b"\r\ncontent-length:"
_HEADER_LENGTH = b"\r\ninference-header-content-length:"


def http_request(host: str, port: int, model: str, input_name: str, x: np.ndarray,
                 authorization: str | None = None) -> bytes:
    """The whole HTTP/1.1 request ``POST /v2/models/MODEL/infer`` carrying ``x`` as one FP32
    input in the binary tensor extension, the output asked for in binary."""
    data = np.ascontiguousarray(x, dtype="<f4").tobytes()
    head = json.dumps({"inputs": [{"name": input_name, "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(data)}}],
                       "parameters": {"binary_data_output": True}},
                      separators=(",", ":")).encode()
    lines = [f"POST /v2/models/{model}/infer HTTP/1.1", f"Host: {host}:{port}",
             "Content-Type: application/octet-stream",
             f"Inference-Header-Content-Length: {len(head)}",
             f"Content-Length: {len(head) + len(data)}"]
    if authorization:
        lines.append(f"Authorization: {authorization}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + head + data


def grpc_request(model: str, input_name: str, x: np.ndarray) -> bytes:
    """A serialized ``ModelInferRequest`` carrying ``x`` as raw FP32 bytes."""
    from service.oip import pb

    request = pb.ModelInferRequest(model_name=model,
                                   raw_input_contents=[np.ascontiguousarray(x, "<f4").tobytes()])
    request.inputs.add(name=input_name, datatype="FP32", shape=list(x.shape))
    return request.SerializeToString()


def http_timing(header: bytes | memoryview) -> dict[str, Any] | None:
    """vbs-serve's timings from an OIP answer's JSON header (None where it has none)."""
    params = orjson.loads(header).get("parameters")
    return params if isinstance(params, dict) and "run_s" in params else None


def parameters_of(source: Any) -> dict[str, Any]:
    """A map of OIP ``InferParameter`` as plain scalars (read on every answer: one look at each)."""
    params = {}
    for key, value in source.items():
        which = value.WhichOneof("parameter_choice")
        if which:
            params[key] = getattr(value, which)
    return params


def grpc_timing(answer: bytes) -> dict[str, Any] | None:
    """vbs-serve's timings from a serialized ``ModelInferResponse`` (None where it has none)."""
    from service.oip import pb

    params = parameters_of(pb.ModelInferResponse.FromString(answer).parameters)
    return params if "run_s" in params else None


def _header_int(head: bytes, name: bytes) -> int | None:
    at = head.find(name)
    if at < 0:
        return None
    start = at + len(name)
    end = head.find(b"\r\n", start)
    return int(head[start:end if end >= 0 else len(head)])


class HttpConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time (see the module doc)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.need = -1          # bytes of the answer in ``buf`` once its head is read
        self.body_at = 0
        self.header_length: int | None = None
        self.status = 0
        self.closed = False

    @classmethod
    async def open(cls, host: str, port: int) -> HttpConnection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(cls, host, port)
        except OSError as exc:
            raise RequestFailed(type(exc).__name__) from exc
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes) -> asyncio.Future[tuple[int, bytes]]:
        """Write ``request``; the future gives the answer's status and its JSON header (the
        whole body where the answer has no ``Inference-Header-Content-Length``)."""
        if self.closed or self.transport is None:
            raise RequestFailed("ConnectionClosed")
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.need < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end + 2]).lower()
            length = _header_int(head, _LENGTH)
            if length is None:
                self._fail("NoContentLength")
                return
            self.status = int(head[9:12])
            self.header_length = _header_int(head, _HEADER_LENGTH)
            self.body_at = end + 4
            self.need = self.body_at + length
        if len(buf) < self.need:
            return
        stop = self.need if self.header_length is None else self.body_at + self.header_length
        header = bytes(buf[self.body_at:stop])
        del buf[:self.need]
        self.need = -1
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self.status, header))

    def _fail(self, label: str) -> None:
        self.closed = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(RequestFailed(label))
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail("ConnectionClosed")

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class HttpClient:
    """``HttpConnection``s to one server, each carrying one request at a time: at most ``cap``
    (what the closed loop keeps in flight, or what the open loop may need), idle ones reused;
    past ``cap`` a request waits for one to come free (and is then sent late)."""

    def __init__(self, host: str, port: int, request: bytes, samples: int, cap: int) -> None:
        self.host, self.port, self.request, self.samples = host, port, request, samples
        self.cap = cap
        self.idle: list[HttpConnection] = []
        self.waiting: list[asyncio.Future[HttpConnection | None]] = []
        self.opened = 0
        self.waits = 0  # requests that found all ``cap`` connections busy

    async def start(self) -> None:
        """Open the first connections (up to 8) before the load starts."""
        for conn in [await self.acquire() for _ in range(min(self.cap, 8))]:
            self.release(conn)

    async def acquire(self) -> HttpConnection:
        while True:
            if self.idle:
                return self.idle.pop()
            if self.opened < self.cap:
                self.opened += 1
                try:
                    return await HttpConnection.open(self.host, self.port)
                except RequestFailed:
                    self.opened -= 1
                    raise
            waiter = asyncio.get_running_loop().create_future()
            self.waiting.append(waiter)
            self.waits += 1
            conn = await waiter
            if conn is not None:  # (None: one closed, so one may be opened)
                return conn

    def release(self, conn: HttpConnection) -> None:
        free: HttpConnection | None = conn
        if conn.closed:
            self.opened -= 1
            free = None
        while self.waiting:
            waiter = self.waiting.pop(0)
            if not waiter.done():  # (one cancelled at the window's end waits no more)
                waiter.set_result(free)
                return
        if free is not None:
            self.idle.append(free)

    async def send(self, conn: HttpConnection) -> Answer:
        """The request on ``conn``: its samples, the service's timings and batch (None where
        the answer has none); RequestFailed with the status when not 200."""
        status, header = await conn.send(self.request)
        if status != 200:
            raise RequestFailed(str(status))
        timing = http_timing(header)
        return self.samples, timing, None if timing is None else int(timing["batch"])

    async def close(self) -> None:
        for conn in self.idle:
            conn.close()


class GrpcClient:
    """One gRPC channel (HTTP/2): every request a stream on it, its bytes sent as made."""

    def __init__(self, address: str, request: bytes, samples: int, authorization: str | None,
                 ready_s: float) -> None:
        self.address, self.request, self.samples, self.ready_s = address, request, samples, ready_s
        self.metadata = (("authorization", authorization),) if authorization else ()
        self.opened, self.waits = 1, 0  # (HTTP/2: never a connection to wait for)

    async def start(self) -> None:
        import grpc

        self.error = grpc.aio.AioRpcError
        self.channel = grpc.aio.insecure_channel(self.address, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        await asyncio.wait_for(self.channel.channel_ready(), self.ready_s)
        self.infer = self.channel.unary_unary(GRPC_INFER)  # no serializers: bytes in and out

    async def acquire(self) -> None:
        return None

    def release(self, conn: None) -> None:
        pass

    async def send(self, conn: None) -> Answer:
        try:
            answer = await self.infer(self.request, metadata=self.metadata)
        except self.error as exc:
            raise RequestFailed(exc.code().name) from exc
        timing = grpc_timing(answer)
        return self.samples, timing, None if timing is None else int(timing["batch"])

    async def close(self) -> None:
        await self.channel.close(None)


__all__ = ["GRPC_INFER", "GrpcClient", "HttpClient", "HttpConnection", "grpc_request",
           "grpc_timing", "http_request", "http_timing", "parameters_of"]
