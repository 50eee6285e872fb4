"""Admission's HTTP edge: a request's hold estimated from its Content-Length, and a line.

Under a cgroup memory limit what requests hold counts as the plans do; the device's memory
owner (``workers.device_memory``) keeps that ledger and answers whether a request may in now.
This is what HTTP and gRPC add: the hold a body will come to before it is read
(``HOLD_FACTORS``), and one line of the requests that do not fit now (FIFO, their bodies
unread, so holding nothing), each waiting up to ``wait_s`` (`VBS_ADMIT_WAIT_S`; by default its
whole request timeout, which the wait counts toward), then 503 with Retry-After; one that
would not fit even in an idle server gets 413 naming the limit at once. Without a limit
nothing is refused here.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import replace

from core.errors import RequestTooLargeError
from service.errors import PayloadTooLargeError, UnavailableError
from workers.device_memory import DeviceMemory
from workers.ledger import Ticket

# bytes held per byte of body until the request is decoded: the body itself plus its decoded
# samples (binary: a view or one copy; JSON: Python floats while parsed, about 32 bytes per
# number of some 10 characters, then the array; images: decompressed pixels)
HOLD_FACTORS = {"binary": 3.0, "json": 5.0, "image": 12.0}
POLL_S = 0.005           # the first in line asks again this often


def estimate_hold(content_length: int, kind: str) -> int:
    """What a body of ``content_length`` bytes of ``kind`` (binary, json, image) holds until
    it is decoded (``HOLD_FACTORS``)."""
    return int(content_length * HOLD_FACTORS.get(kind, HOLD_FACTORS["json"]))


class AdmissionLine:
    """The line of requests waiting for room on one device (see the module doc)."""

    def __init__(self, memory: DeviceMemory, wait_s: float) -> None:
        self.memory = memory
        self.wait_s = wait_s
        self._line: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def active(self) -> bool:
        """Whether requests are admitted against the memory limit's ledger."""
        return self.memory.counts_requests

    def _try(self, model: str | None, hold: int, what: str) -> Ticket | None:
        try:
            return self.memory.admit(model, hold, what)
        except RequestTooLargeError as exc:
            raise PayloadTooLargeError(str(exc)) from exc

    async def admit(self, model: str | None, hold: int, what: str = "request"
                    ) -> Ticket | None:
        """A place for a request that will hold about ``hold`` bytes (None when no limit
        applies): at once, or after waiting in line up to ``wait_s`` for memory to free; else
        503 with Retry-After. 413 when it would not fit even in an idle server."""
        if not self.active:
            return None
        if not self._line:
            ticket = self._try(model, hold, what)
            if ticket is not None:
                return ticket
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + self.wait_s
        turn = loop.create_future()
        self._line.append(turn)
        try:
            while True:
                remaining = deadline - loop.time()
                if self._line[0] is turn:  # first in line: tries, re-reading the group
                    ticket = self._try(model, hold, what)
                    if ticket is not None:
                        return replace(ticket, waited_s=loop.time() - began)
                    if remaining <= 0:
                        break
                    await asyncio.sleep(min(POLL_S, remaining))
                else:  # behind others: woken when it is first
                    if remaining <= 0:
                        break
                    await asyncio.wait([turn], timeout=remaining)
        finally:
            self._line.remove(turn)
            if self._line and not self._line[0].done():
                self._line[0].set_result(None)  # the next in line tries
        holding = self.memory.refused()
        raise UnavailableError(
            f"memory: {holding} leave no room for this one (about {hold} bytes) under the "
            f"memory limit; waited {self.wait_s:g} s; retry shortly", retry_after=1)


__all__ = ["AdmissionLine", "HOLD_FACTORS", "estimate_hold"]
