"""``vbs loadtest``: N concurrent clients against a local vbs-serve for T seconds.

Each client sends ``POST /infer?model=NAME`` with K random samples (``.npy`` or JSON) as fast
as answers come back. The report: requests, errors by status, throughput (requests and
samples per second), latency p50/p99, and the service's own overhead per request at p50/p99
(response time seen by the client minus the run time the response reports: queueing,
decoding, encoding, HTTP). Only loopback hosts are accepted: this is a bench for the machine
the service runs on, not a tool to load someone else's server.
"""

from __future__ import annotations

import asyncio
import io
import ipaddress
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from planner.errors import UsageError

MAX_CLIENTS = 256
MAX_DURATION_S = 600.0
MAX_SAMPLES = 1024


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
    samples: int = 0
    errors: dict[str, int] = field(default_factory=dict)   # status (or exception) -> count

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
        }


def _npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x, allow_pickle=False)
    return buf.getvalue()


async def run_loadtest(url: str, model: str, *, clients: int, duration_s: float, samples: int = 1,
                       fmt: str = "npy", api_key: str | None = None, timeout_s: float = 60.0,
                       seed: int = 0) -> dict[str, Any]:
    """Run the load test and return its summary (see ``Result.summary``)."""
    import httpx

    base = check_loopback(url)
    if not 1 <= clients <= MAX_CLIENTS:
        raise UsageError(f"--clients {clients}: give 1..{MAX_CLIENTS}")
    if not 0 < duration_s <= MAX_DURATION_S:
        raise UsageError(f"--duration {duration_s}: give 0..{MAX_DURATION_S:g} seconds")
    if not 1 <= samples <= MAX_SAMPLES:
        raise UsageError(f"--samples {samples}: give 1..{MAX_SAMPLES}")
    if fmt not in ("npy", "json"):
        raise UsageError(f"--format {fmt!r}: use npy or json")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=timeout_s,
                                 limits=limits) as client:
        try:
            meta = await client.get(f"/v2/models/{model}")
        except httpx.HTTPError as exc:
            raise UsageError(f"cannot reach the service at {base} ({exc}): is `vbs serve` "
                             "running there?") from exc
        if meta.status_code != 200:
            raise UsageError(f"model {model!r} at {base}: {meta.status_code} "
                             f"{_error_text(meta)}")
        shape = [int(d) for d in meta.json()["inputs"][0]["shape"][1:]]
        x = np.random.default_rng(seed).standard_normal((samples, *shape)).astype(np.float32)
        if fmt == "npy":
            body, ctype = _npy(x), "application/x-npy"
        else:
            body, ctype = json.dumps({"inputs": x.tolist()}).encode(), "application/json"
        result = Result(duration_s=0.0)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + duration_s

        async def one_client() -> None:
            while loop.time() < deadline:
                t0 = time.perf_counter()
                try:
                    response = await client.post("/infer", params={"model": model}, content=body,
                                                 headers={"Content-Type": ctype})
                except httpx.HTTPError as exc:
                    result.add_error(type(exc).__name__)
                    continue
                elapsed = time.perf_counter() - t0
                if response.status_code != 200:
                    result.add_error(str(response.status_code))
                    continue
                doc = response.json()
                result.latencies.append(elapsed)
                result.overheads.append(max(0.0, elapsed - float(doc["timing"]["run_s"])))
                result.samples += int(doc["samples"])

        await asyncio.gather(*(one_client() for _ in range(clients)))
        result.duration_s = loop.time() - started
    return result.summary(url=base, model=model, clients=clients, samples=samples)


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
    ]
    if summary["errors_by_status"]:
        rows.append(("errors by status", ", ".join(f"{k}: {v}" for k, v in
                                                    summary["errors_by_status"].items())))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
