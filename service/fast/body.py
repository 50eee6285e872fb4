"""The body of a fast-path request, read from the ASGI messages themselves.

Starlette's ``request.stream()`` is an async generator around ``receive``: a frame more per
chunk. Reading ``request.receive`` directly refuses a body at its limit while it arrives, and
the body read is stored where Starlette's ``Request`` caches it (``request._body``, private),
so that ``request.form()`` (multipart images) parses it without reading again.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request

from service.errors import PayloadTooLargeError, RequestError


async def receive_body(request: Request, limit: int,
                       over: Callable[[], PayloadTooLargeError]) -> bytes:
    """The whole body; ``over()`` raised as soon as more than ``limit`` bytes have come."""
    chunks: list[bytes] = []
    size = 0
    receive = request.receive  # the ASGI messages themselves: Starlette's stream() is an
    more = True                # async generator around them, a frame more per chunk
    while more:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            raise RequestError("body: the client went away before sending all of it")
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if chunk:
            size += len(chunk)
            if size > limit:
                raise over()
            chunks.append(chunk)
    # one chunk is the body as it came (no copy); several are joined, the one copy a body gets
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    request._body = body  # noqa: SLF001 - Starlette's cache: request.form() reads it from here
    return body
