"""``vbs loadtest``: N concurrent clients against a local vbs-serve for T seconds.

Each client sends ``POST /infer?model=NAME`` with K random samples (``.npy`` or JSON) as fast
as answers come back (or, with the ``oip`` format, ``POST /v2/models/NAME/infer`` in the Open
Inference Protocol v2 with its binary tensor extension, the form Triton takes); requests in the
first ``--warmup`` seconds are not counted. The report: requests, errors by status, throughput
(requests and samples per second), latency p50/p99, the overhead per request at p50/p99
(response time seen by the client minus the batch's run time), and where each request's time
went, as Triton's perf_analyzer reports it, from the timings the service returns: queue,
compute input, compute infer, compute output, and the rest (HTTP both ways, routing, handing
over between threads: the client's time minus the four). Only loopback hosts are accepted: this
is a bench for the machine the service runs on, not a tool to load someone else's server.

These clients share one Python process, whose CPU per request (httpx, encoding each request)
counts in what is measured; ``vbs loadtest --processes`` (``loadgen.processes``) runs the load
in client processes instead, requests encoded once, closed or open loop, the processes' own
CPU reported beside the same figures.
"""

from __future__ import annotations

import asyncio
import io
import ipaddress
import json
import math
import time
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from core.errors import UsageError

MAX_CLIENTS = 256
MAX_DURATION_S = 600.0
MAX_SAMPLES = 1024
PARTS = ("queue", "input", "infer", "output", "rest")  # the breakdown, in the order time is spent
FORMATS = ("npy", "json", "npy-form", "oip")
OIP_INPUT = "x"  # the input named in an OIP request: vbs-serve takes any, bench/peers.py's Triton x


def check_loopback(url: str) -> str:
    """``url`` without a trailing slash, if it is http(s) on a loopback host; else UsageError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"--url {url!r}: give http://127.0.0.1:PORT")
    host = parts.hostname
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise UsageError(f"--url {url!r}: the load test only targets this machine (localhost, "
                             "127.0.0.0/8 or ::1); run it beside the service")
    return url.rstrip("/")


@dataclass
class Result:
    """What the clients saw."""

    duration_s: float
    latencies: list[float] = field(default_factory=list)   # successful requests
    overheads: list[float] = field(default_factory=list)   # latency - reported run time
    parts: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in PARTS})
    batches: dict[int, int] = field(default_factory=dict)  # batch size -> requests it answered
    samples: int = 0
    errors: dict[str, int] = field(default_factory=dict)   # status (or exception) -> count

    def add(self, elapsed: float, samples: int, timing: dict[str, Any] | None) -> None:
        """A request answered in ``elapsed`` s; ``timing`` is vbs-serve's breakdown, if any."""
        self.latencies.append(elapsed)
        self.samples += samples
        if timing is None:  # another server: no breakdown
            return
        self.overheads.append(max(0.0, elapsed - float(timing["run_s"])))
        spent = 0.0
        for key in PARTS[:-1]:
            value = float(timing[f"{key}_s"])
            self.parts[key].append(value)
            spent += value
        self.parts["rest"].append(max(0.0, elapsed - spent))

    def add_error(self, key: str) -> None:
        self.errors[key] = self.errors.get(key, 0) + 1

    def summary(self, *, url: str, model: str, clients: int, samples: int) -> dict[str, Any]:
        ok = len(self.latencies)
        failed = sum(self.errors.values())

        def pct(values: list[float], q: float) -> float | None:
            return float(np.percentile(values, q)) if values else None

        return {
            "url": url, "model": model, "clients": clients, "samples_per_request": samples,
            "duration_s": round(self.duration_s, 3), "requests": ok + failed, "ok": ok,
            "errors": failed, "errors_by_status": dict(sorted(self.errors.items())),
            "throughput_rps": ok / self.duration_s if self.duration_s > 0 else 0.0,
            "throughput_samples_per_s": self.samples / self.duration_s if self.duration_s > 0 else 0.0,
            "latency_p50_s": pct(self.latencies, 50), "latency_p99_s": pct(self.latencies, 99),
            "overhead_p50_s": pct(self.overheads, 50), "overhead_p99_s": pct(self.overheads, 99),
            "breakdown_p50_s": {k: pct(v, 50) for k, v in self.parts.items()},
            "breakdown_p99_s": {k: pct(v, 99) for k, v in self.parts.items()},
            "requests_by_batch_size": dict(sorted(self.batches.items())),
        }


def _npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x, allow_pickle=False)
    return buf.getvalue()


def _oip(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """An OIP v2 request with the binary tensor extension: a JSON header that declares the
    tensor and its byte count, then the tensor's raw little-endian bytes (the same values as
    the .npy, without its header); no ``outputs``, so the server answers every output in JSON,
    as the other formats' answers are."""
    data = np.ascontiguousarray(x, dtype=np.dtype("<f4")).tobytes()
    head = json.dumps({"inputs": [{"name": OIP_INPUT, "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(data)}}]}).encode()
    return head + data, {"Content-Type": "application/octet-stream",
                         "Inference-Header-Content-Length": str(len(head))}


def request_body(x: np.ndarray, fmt: str) -> tuple[bytes, dict[str, str], dict[str, Any] | None]:
    """The body, headers and multipart files of one request carrying ``x`` in format ``fmt``."""
    if fmt == "npy":
        return _npy(x), {"Content-Type": "application/x-npy"}, None
    if fmt == "npy-form":  # the same .npy as a multipart file (for LitServe)
        return b"", {}, {"input": ("x.npy", _npy(x), "application/x-npy")}
    if fmt == "oip":
        body, headers = _oip(x)
        return body, headers, None
    return json.dumps({"inputs": x.tolist()}).encode(), {"Content-Type": "application/json"}, None


async def run_loadtest(url: str, model: str, *, clients: int, duration_s: float, samples: int = 1,
                       fmt: str = "npy", api_key: str | None = None, timeout_s: float = 60.0,
                       seed: int = 0, warmup_s: float = 0.0,
                       peer: tuple[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Run the load test and return its summary (see ``Result.summary``).

    ``peer=(path, input_shape)`` loads another server the same way (``bench/peers.py``): the
    same requests POSTed to ``path``, every 200 counted, no breakdown. ``fmt="oip"`` against
    vbs-serve posts to ``/v2/models/NAME/infer`` and reads the breakdown from the answer's
    parameters.
    """
    import httpx

    base = check_loopback(url)
    check_load(clients, duration_s, samples, warmup_s)
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: use npy or json")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=timeout_s,
                                 limits=limits) as client:
        if peer is None:
            path, params = "/infer", {"model": model}
            if fmt == "oip":
                path, params = f"/v2/models/{model}/infer", {}
            shape = await _input_shape(client, base, model)
        else:
            path, params, shape = peer[0], {}, list(peer[1])
        x = np.random.default_rng(seed).standard_normal((samples, *shape)).astype(np.float32)
        body, request_headers, files = request_body(x, fmt)

        async def send() -> Answer:
            try:
                if files is None:
                    response = await client.post(path, params=params, content=body,
                                                 headers=request_headers)
                else:
                    response = await client.post(path, params=params, files=files)
            except httpx.HTTPError as exc:
                raise RequestFailed(type(exc).__name__) from exc
            if response.status_code != 200:
                raise RequestFailed(str(response.status_code))
            if peer is not None:
                return samples, None, None
            doc = response.json()
            if fmt == "oip":  # the OIP answer: the timings are its parameters
                return samples, doc["parameters"], int(doc["parameters"]["batch"])
            return int(doc["samples"]), doc["timing"], int(doc["batch"])

        result = await closed_loop(send, clients=clients, duration_s=duration_s,
                                   warmup_s=warmup_s)
    return result.summary(url=base, model=model, clients=clients, samples=samples)


# One answer: its samples, the timings the service returned (None from a peer) and the size of
# the batch it ran in (None where unknown).
Answer = tuple[int, "dict[str, Any] | None", "int | None"]


class RequestFailed(Exception):
    """A request that got no answer, counted under ``label`` (a status or an error's name)."""

    def __init__(self, label: str) -> None:
        super().__init__(label)
        self.label = label


def check_load(clients: int, duration_s: float, samples: int, warmup_s: float) -> None:
    """The load's sizes, whatever the protocol; UsageError naming the option otherwise."""
    if not 1 <= clients <= MAX_CLIENTS:
        raise UsageError(f"--clients {clients}: give 1..{MAX_CLIENTS}")
    if not 0 < duration_s <= MAX_DURATION_S:
        raise UsageError(f"--duration {duration_s}: give 0..{MAX_DURATION_S:g} seconds")
    if not 1 <= samples <= MAX_SAMPLES:
        raise UsageError(f"--samples {samples}: give 1..{MAX_SAMPLES}")
    if not 0 <= warmup_s <= MAX_DURATION_S:
        raise UsageError(f"--warmup {warmup_s}: give 0..{MAX_DURATION_S:g} seconds")


async def closed_loop(send: Callable[[], Awaitable[Answer]], *, clients: int,
                      duration_s: float, warmup_s: float) -> Result:
    """``clients`` closed loops of ``send`` (each sends again when answered) for
    ``duration_s`` after ``warmup_s`` (what is sent before counts as warm-up only)."""
    result = Result(duration_s=0.0)
    loop = asyncio.get_running_loop()
    started = loop.time() + warmup_s
    deadline = started + duration_s

    async def one_client() -> None:
        while loop.time() < deadline:
            counted = loop.time() >= started
            t0 = time.perf_counter()
            try:
                samples, timing, batch = await send()
            except RequestFailed as exc:
                if counted:
                    result.add_error(exc.label)
                continue
            if not counted:
                continue
            result.add(time.perf_counter() - t0, samples, timing)
            if batch is not None:
                result.batches[batch] = result.batches.get(batch, 0) + 1

    await asyncio.gather(*(one_client() for _ in range(clients)))
    result.duration_s = loop.time() - started
    return result


async def _input_shape(client: Any, base: str, model: str) -> list[int]:
    """The model's per-sample input shape, from the service's OIP v2 metadata."""
    import httpx

    try:
        meta = await client.get(f"/v2/models/{model}")
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach the service at {base} ({exc}): is `vbs serve` "
                         "running there?") from exc
    if meta.status_code != 200:
        raise UsageError(f"model {model!r} at {base}: {meta.status_code} {_error_text(meta)}")
    return [int(d) for d in meta.json()["inputs"][0]["shape"][1:]]


def _error_text(response: Any) -> str:
    try:
        return str(response.json().get("error", response.text))
    except ValueError:
        return response.text[:200]


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a small text table."""
    def ms(value: float | None) -> str:
        return "-" if value is None or math.isnan(value) else f"{value * 1000:.2f} ms"

    rows = [
        ("url", summary["url"]), ("model", summary["model"]),
        ("clients x samples", f"{summary['clients']} x {summary['samples_per_request']}"),
        ("duration", f"{summary['duration_s']:.2f} s"),
        ("requests (ok / errors)", f"{summary['requests']} ({summary['ok']} / {summary['errors']})"),
        ("throughput", f"{summary['throughput_rps']:.1f} req/s, "
                       f"{summary['throughput_samples_per_s']:.1f} samples/s"),
        ("latency p50 / p99", f"{ms(summary['latency_p50_s'])} / {ms(summary['latency_p99_s'])}"),
        ("overhead p50 / p99", f"{ms(summary['overhead_p50_s'])} / {ms(summary['overhead_p99_s'])}"),
        ("p50 " + " / ".join(PARTS), " / ".join(ms(summary["breakdown_p50_s"][k]) for k in PARTS)),
        ("p99 " + " / ".join(PARTS), " / ".join(ms(summary["breakdown_p99_s"][k]) for k in PARTS)),
    ]
    if "loop" in summary:  # loadgen.processes's client processes
        rows += _generator_rows(summary, ms)
    if summary["errors_by_status"]:
        rows.append(("errors by status", ", ".join(f"{k}: {v}" for k, v in
                                                    summary["errors_by_status"].items())))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _generator_rows(summary: dict[str, Any], ms: Callable[[float | None], str]
                    ) -> list[tuple[str, str]]:
    """The rows ``vbs loadtest --processes`` adds: its loop, what it sent, its own CPU."""
    loop = (f"closed, {summary['concurrency']} in flight" if summary["loop"] == "closed" else
            f"open, {summary['rate_rps']:g} req/s offered ({summary['arrivals']})")
    cpu = summary["client_cpu_ms_per_request"]
    return [
        ("client processes", f"{summary['processes']} ({summary['protocol']}, "
                             f"{summary['format']}), CPUs {summary['cpus'] or 'any'}"),
        ("loop", loop),
        ("sent (achieved rate)", f"{summary['sent']} ({summary['achieved_rate_rps']:.1f} req/s)"),
        ("late / in flight at end", f"{summary['late']} ({summary['late_fraction']:.1%}; "
                                    f"{summary['connection_waits']} waited for a connection) / "
                                    f"{summary['in_flight_at_end']}"),
        ("latency p90", ms(summary["latency_p90_s"])),
        ("clients' CPU", f"{'-' if cpu is None else f'{cpu:.3f}'} ms a request, "
                         f"{summary['client_cores']:.2f} cores"),
    ]
