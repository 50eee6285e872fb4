"""Where the server's time outside the model goes, stage by stage, at one client.

    python bench/stages.py [--model squeezenet1_0] [--duration 20] [--warmup 3]

The service's own app (``create_app``, the default settings and tables) under uvicorn in
this process, with a timestamp taken at the boundaries of a request's stages (the functions
the request passes through are wrapped; nothing else changes), and ``vbs loadtest``'s
generator with one client sending one-sample ``.npy`` requests from another process. Prints
the median and p90 of every stage over the requests after the warm-up, in the order a
request passes them:

    app      uvicorn calls the app -> the inference handler starts (Starlette/FastAPI layers,
             the metrics middleware, routing)
    call     the handler -> its body starts to be read (API key, query parameters)
    receive  reading the body (paced by the client and loopback)
    decode   .npy header, finite check (a view of the body)
    submit   decoded -> the batch is handed to the model's thread (queue; from the handler
             itself when the model is idle, else from the batcher's loop)
    to model the batcher hands the batch to the model's thread -> that thread starts
    model    the model's thread: copy into the batch buffer, the plan's run, encoding
    to loop  the model's thread is done -> the loop answers the batch's requests
    resume   the answer -> the handler resumes
    respond  the handler builds its response -> uvicorn starts sending it
    send     the response's start -> its last byte handed to the socket
    after    -> uvicorn gets control back (middleware bookkeeping, unwinding)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import uvicorn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.settings import Settings  # noqa: E402
from service import batcher, deps, finisher, serving  # noqa: E402
from service.main import create_app  # noqa: E402
from service.fast.protocol import HttpProtocol  # noqa: E402
from service.routers import inference  # noqa: E402
from served import free_port, wait_ready  # noqa: E402

STAGES = ("app", "call", "receive", "decode", "submit", "to model", "model", "to loop", "resume",
          "respond", "send", "after")
MARKS = ("in", "handler", "body", "body_end", "decoded", "batch", "thread", "thread_end",
         "answered", "resumed", "response", "sent", "out")

now = time.perf_counter
current: dict[str, float] = {}  # the one request in flight (one client)
rows: list[dict[str, float]] = []


def mark(name: str) -> None:
    current.setdefault(name, now())


def wrap_async(owner: Any, name: str, before: str | None, after: str | None) -> None:
    real = getattr(owner, name)

    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            mark(before)
        result = await real(*args, **kwargs)
        if after:
            mark(after)
        return result

    setattr(owner, name, wrapped)


def wrap_sync(owner: Any, name: str, before: str | None, after: str | None) -> None:
    real = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            mark(before)
        result = real(*args, **kwargs)
        if after:
            mark(after)
        return result

    setattr(owner, name, wrapped)


def instrument() -> None:
    wrap_async(serving, "inference_call", "handler", None)
    wrap_async(deps, "read_body", "body", "body_end")
    wrap_async(serving, "decode_infer", None, "decoded")
    wrap_async(serving, "run", None, "resumed")
    wrap_sync(serving, "infer_response", None, "response")
    wrap_sync(batcher.Batcher, "_dispatch", "batch", None)
    wrap_sync(finisher.BatchRuns, "_run", "thread", "thread_end")
    wrap_sync(batcher.Batcher, "_answer", "answered", None)


Scope = MutableMapping[str, Any]


def outermost(app: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    async def timed(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/infer":
            await app(scope, receive, send)
            return
        current.clear()
        mark("in")

        async def sending(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                mark("response")
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                mark("sent")

        await app(scope, receive, sending)
        mark("out")
        if all(m in current for m in MARKS):
            rows.append(dict(current))
    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="squeezenet1_0")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    args = ap.parse_args()
    instrument()
    port = free_port()
    config = uvicorn.Config(outermost(create_app(Settings(models=[args.model]))),
                            host="127.0.0.1", port=port, log_level="warning",
                            http=HttpProtocol)  # as `vbs serve`
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"{url}/v2/health/ready", None)  # the first start may profile and plan the model
    subprocess.run([sys.executable, "-m", "service.commands", "loadtest", "--url", url,
                    "--model", args.model, "--clients", "1", "--duration", str(args.duration),
                    "--warmup", str(args.warmup)], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    server.should_exit = True
    thread.join(timeout=60)
    kept = rows[int(len(rows) * args.warmup / (args.warmup + args.duration)):]
    print(f"{args.model}, one client, {len(kept)} requests: ms per stage")
    print("| stage | p50 | p90 |")
    print("|---|---|---|")
    outside = []
    for stage, (a, b) in zip(STAGES, zip(MARKS, MARKS[1:])):
        spans = sorted(1e3 * (r[b] - r[a]) for r in kept)
        print(f"| {stage} | {statistics.median(spans):.3f} | {spans[int(0.9 * len(spans))]:.3f} |")
    for r in kept:
        outside.append(1e3 * ((r["out"] - r["in"]) - (r["body_end"] - r["body"])
                              - (r["thread_end"] - r["thread"])))
    print(f"| outside the model and receive (sum) | {statistics.median(outside):.3f} | "
          f"{sorted(outside)[int(0.9 * len(outside))]:.3f} |")


if __name__ == "__main__":
    main()
