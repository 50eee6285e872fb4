"""``service.fast.protocol.HttpProtocol``: a response's head goes out with its body in one write, and
every kind of response still arrives whole and in order (real uvicorn, real sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from service.fast.protocol import HttpProtocol

writes: list[list[bytes]] = []  # what each connection handed its socket, call by call


class _Recorded:
    """The real transport, with every write call recorded (and passed on)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.calls: list[bytes] = []
        writes.append(self.calls)

    def write(self, data: Any) -> None:
        self.calls.append(bytes(data))
        self._transport.write(data)

    def writelines(self, data: Any) -> None:
        self.calls.append(b"".join(bytes(d) for d in data))
        self._transport.writelines(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Observed(HttpProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_Recorded(transport))  # type: ignore[arg-type]


async def plain(request: Request) -> Response:
    return Response(b"x" * 5000, media_type="application/octet-stream")


async def stream(request: Request) -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        for i in range(3):
            await asyncio.sleep(0)  # a loop turn between chunks: the head goes out alone
            yield f"chunk {i};".encode()
    return StreamingResponse(chunks(), media_type="text/plain")


async def empty(request: Request) -> Response:
    return Response(status_code=204)


APP = Starlette(routes=[Route("/plain", plain, methods=["GET", "HEAD", "POST"]),
                        Route("/stream", stream), Route("/empty", empty)])


@contextlib.contextmanager
def serving(protocol: type[HttpProtocol]) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(APP, host="127.0.0.1", port=0, log_level="warning",
                                           http=protocol, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:  # readiness polling of a starting server
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_a_response_s_head_and_body_go_out_in_one_write() -> None:
    writes.clear()
    with serving(_Observed) as url, httpx.Client(base_url=url) as client:
        for _ in range(3):  # keep-alive: one connection, three responses
            r = client.post("/plain", content=b"body")
            assert r.status_code == 200 and r.content == b"x" * 5000
    [calls] = writes
    assert len(calls) == 3  # one write per response
    for call in calls:
        head, _, body = call.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 5000" in head
        assert body == b"x" * 5000


def test_every_kind_of_response_arrives_whole_and_in_order() -> None:
    writes.clear()
    with serving(HttpProtocol) as url, httpx.Client(base_url=url) as client:
        r = client.get("/stream")  # the head alone, at the next loop turn; then chunked body
        assert r.status_code == 200 and r.text == "chunk 0;chunk 1;chunk 2;"
        r = client.head("/plain")  # a head and an empty body
        assert r.status_code == 200 and r.headers["content-length"] == "5000" and r.content == b""
        r = client.get("/empty")
        assert r.status_code == 204 and r.content == b""
        r = client.get("/missing")
        assert r.status_code == 404
        r = client.get("/plain")
        assert r.status_code == 200 and r.content == b"x" * 5000
    with serving(_Observed) as url, httpx.Client(base_url=url) as client:
        assert client.get("/stream").text == "chunk 0;chunk 1;chunk 2;"
    [calls] = writes
    assert calls[0].startswith(b"HTTP/1.1 200 OK") and calls[0].endswith(b"\r\n\r\n")
    assert b"".join(calls[1:]) == (b"8\r\nchunk 0;\r\n" b"8\r\nchunk 1;\r\n" b"8\r\nchunk 2;\r\n"
                                   b"0\r\n\r\n")
