"""A client process of ``vbs loadtest --processes`` (``loadgen.processes`` starts it as
``python -c 'import loadgen.child as c; c.main(FD)'`` with one end of a pipe).

It reads its ``Load`` from the pipe, pins itself to ``Load.cpus``, encodes its request and
connects (``loadgen.wire``), says "ready", waits for the common start instant, then
runs its share of the closed loop (its requests in flight, each sent again when answered) or
of the open loop (its arrivals a second, each sent at its time whatever is in flight), and
sends back a ``ChildReport`` of the window: answers and errors received in it, requests sent
in it (arrivals due in it), arrivals sent late, what is in flight at its end and its own CPU
over it (``getrusage``, every thread). HTTP runs on uvloop where it is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import resource
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from loadgen.loadtest import Answer, RequestFailed, Result
from loadgen.processes import LATE_S, MAX_CONNECTIONS, READY_TIMEOUT_S, ChildReport, Load


def main(fd: int) -> None:
    """A client process's body: its ``Load`` from the pipe, "ready" once connected, the start
    instant back, then the load, and its ``ChildReport`` (or the error that stopped it)."""
    conn = Connection(fd)
    try:
        load: Load = conn.recv()
        if load.cpus:
            os.sched_setaffinity(0, load.cpus)
        runner = asyncio.run
        if load.protocol == "http":  # (grpc.aio gains little from uvloop)
            try:
                import uvloop
                runner = uvloop.run
            except ImportError:  # the standard loop does the same, with more CPU
                pass
        conn.send(("report", runner(_one_process(load, conn))))
    except Exception as exc:  # noqa: BLE001 - any failure goes back to the parent, named
        with contextlib.suppress(OSError):  # (unless the parent is gone)
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


class _Tally:
    """What a process counts: answers and errors received in [w0, w1), sends in it."""

    def __init__(self, w0: float, w1: float) -> None:
        self.w0, self.w1 = w0, w1
        self.result = Result(duration_s=w1 - w0)
        self.sent = self.late = self.in_flight = 0
        self.lags: list[float] = []
        self.over = False  # the window has ended: nothing more is counted

    def sending(self, due: float | None, now: float) -> None:
        self.in_flight += 1
        if self.w0 <= (now if due is None else due) < self.w1:
            self.sent += 1
            if due is not None:
                self.lags.append(now - due)
                self.late += now - due > LATE_S

    def answered(self, sent: float, answer: Answer | str) -> None:
        self.in_flight -= 1
        now = time.monotonic()
        if not self.w0 <= now < self.w1 or self.over:
            return
        if isinstance(answer, str):
            self.result.add_error(answer)
            return
        samples, timing, batch = answer
        self.result.add(now - sent, samples, timing)
        if batch is not None:
            self.result.batches[batch] = self.result.batches.get(batch, 0) + 1


async def _one_process(load: Load, conn: Connection) -> ChildReport:
    client = await _client(load)
    conn.send(("ready", None))
    start = await asyncio.to_thread(conn.recv)  # (the loop keeps serving the connections)
    w0 = start + load.warmup_s
    tally = _Tally(w0, w0 + load.duration_s)
    concurrency, rate = load.share()
    tasks = [asyncio.create_task(_sender(client, tally)) for _ in range(concurrency)]
    if rate > 0:
        tasks.append(asyncio.create_task(_arrivals(client, tally, load, rate, start)))
    await _until(w0)
    cpu0, waits0 = _cpu_s(), client.waits
    await _until(tally.w1)
    cpu_s = _cpu_s() - cpu0
    tally.over = True
    in_flight = tally.in_flight
    for task in tasks:
        task.cancel()
    await client.close()
    return ChildReport(tally.result, tally.sent, tally.late, tally.lags, in_flight, cpu_s,
                       client.opened, client.waits - waits0)


async def _until(at: float) -> None:
    """Sleep until the monotonic clock reads ``at`` (a loop's timer may fire a little early)."""
    while (left := at - time.monotonic()) > 0:
        await asyncio.sleep(left)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _sender(client: Any, tally: _Tally) -> None:
    """A closed loop: one request in flight, sent again when answered."""
    while True:
        await _request(client, tally, None)


async def _arrivals(client: Any, tally: _Tally, load: Load, rate: float, start: float) -> None:
    """An open loop: a request at each arrival time, whatever is still in flight."""
    rng = random.Random(load.seed * 7919 + load.index)
    poisson = load.arrivals == "poisson"
    due = start + (rng.expovariate(rate) if poisson else load.index / (rate * load.processes))
    pending: set[asyncio.Task[None]] = set()
    while due < tally.w1:
        wait = due - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        task = asyncio.create_task(_request(client, tally, due))
        pending.add(task)
        task.add_done_callback(pending.discard)
        due += rng.expovariate(rate) if poisson else 1.0 / rate
    await asyncio.sleep(math.inf)  # (cancelled at the window's end, with ``pending``)


async def _request(client: Any, tally: _Tally, due: float | None) -> None:
    try:
        conn = await client.acquire()
    except RequestFailed as exc:  # no connection: counted, and a pause not to spin
        tally.sending(due, time.monotonic())
        tally.answered(time.monotonic(), exc.label)
        await asyncio.sleep(0.01)
        return
    sent = time.monotonic()
    tally.sending(due, sent)
    try:
        answer: Answer | str = await client.send(conn)
    except RequestFailed as exc:
        answer = exc.label
    finally:
        client.release(conn)
    tally.answered(sent, answer)


async def _client(load: Load) -> Any:
    """The process's client, its request encoded, its first connections open and one request
    answered."""
    from loadgen import wire

    x = np.random.default_rng(load.seed + load.index).standard_normal(
        (load.samples, *load.shape)).astype("<f4")
    auth = f"Bearer {load.api_key}" if load.api_key else None
    client: Any
    if load.protocol == "http":
        concurrency, _ = load.share()
        request = wire.http_request(load.host, load.port, load.model, load.input_name, x, auth)
        client = wire.HttpClient(load.host, load.port, request, load.samples,
                                 cap=concurrency or MAX_CONNECTIONS)
    else:
        client = wire.GrpcClient(f"{load.host}:{load.port}",
                                 wire.grpc_request(load.model, load.input_name, x), load.samples,
                                 auth, READY_TIMEOUT_S)
    await client.start()
    conn = await client.acquire()
    try:  # one request before the start: every first use on the way is paid for here
        await client.send(conn)
    except RequestFailed:  # (an error the load will meet again, and count)
        pass
    finally:
        client.release(conn)
    return client


__all__ = ["main"]
