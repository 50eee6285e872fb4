"""uvicorn's HTTP/1.1 protocol (httptools) with a response's head and its body sent in one
system call.

uvicorn writes a response's status line and headers to the socket as soon as the app sends
``http.response.start``, and the body when the app sends it: two ``write`` calls for every
response (seen with strace on `vbs serve`: a 128-byte head, then the body), and on loopback
two deliveries, each waking the client. ``HttpProtocol`` hands uvicorn a transport that holds
a response head back until the next write, and sends both with one ``writelines`` (uvloop:
one ``writev``, no copy). A head followed by nothing in the same step of the loop (a streamed
response whose body comes later) goes out at the loop's next turn; closing the connection
sends what is held first. Everything else passes through untouched, in order.

`vbs serve` runs uvicorn with it (``service.grpc_server.run(..., http=HttpProtocol)``, uvicorn's
run); an app served by plain uvicorn answers the same, with two writes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_HEAD_START = b"HTTP/1.1 "  # uvicorn's status lines (``STATUS_LINE``)
_HEAD_END = b"\r\n\r\n"


class _HeadHeld:
    """A transport that holds a response head until the next write (see the module doc)."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: Any) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.writelines((held, data))
        elif data[:9] == _HEAD_START and data[-4:] == _HEAD_END:
            self._held = bytes(data)
            self._loop.call_soon(self.flush)  # nothing more this step: it goes alone
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():  # (the client went: nobody to send it to)
                self._transport.write(held)

    def writelines(self, data: Any) -> None:
        self.flush()
        self._transport.writelines(data)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:  # flow control, extra info, abort, ...
        return getattr(self._transport, name)


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, writing a response's head with its body (module doc)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeadHeld(transport, self.loop))  # type: ignore[arg-type]



def http_protocol(fast_path: bool) -> Any:
    """uvicorn's ``http`` option: ``HttpProtocol`` on the fast path, else uvicorn's own."""
    return HttpProtocol if fast_path else "auto"
