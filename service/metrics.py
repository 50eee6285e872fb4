"""Prometheus metrics of one app: a registry of its own, so apps (and tests) never share counts.

Labels are bounded: ``model`` is a served model's name or ``"-"`` (never a name a client
made up), ``endpoint`` one of a fixed set, ``status`` an HTTP status code.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from service.claims import Claims
from service.live import Live

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)
# the server's own parts of a request: fine around a millisecond, where the medians fall
FINE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 4e-4, 5e-4, 6e-4, 7e-4, 8e-4,
                9e-4, 1e-3, 1.25e-3, 1.5e-3, 2e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
ENDPOINTS = ("infer", "v2_infer", "plan", "models", "health", "metrics", "other",
             "grpc_infer", "grpc")  # the last two: gRPC ModelInfer and every other gRPC call

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]


@dataclass(frozen=True)
class ModelMetrics:
    """One model's children of the per-model metrics, looked up once: ``labels()`` takes a lock
    and a dict lookup per call, and a batch updates a dozen of them on the request path."""

    queue_time: Any
    input_time: Any
    infer_time: Any
    output_time: Any
    run_time: Any
    batch_size: Any
    samples: Any
    choice_time: Any
    free_memory: Any
    plan_peak: Any
    oom_retries: Any
    splits: Any
    queue_depth: Any

    def observe_request(self, timing: Any) -> None:
        """One request's breakdown (``service.batch_stage.Timing``)."""
        self.queue_time.observe(timing.queue_s)
        self.input_time.observe(timing.input_s)
        self.infer_time.observe(timing.infer_s)
        self.output_time.observe(timing.output_s)

    def observe_batch(self, done: Any, outcomes: Any) -> None:
        """A batch (``service.batch_stage.Done``) and its requests' breakdowns (each an
        ``Outcome``, or the error that request got)."""
        if not done.samples:  # every request of it was refused (values not finite): none ran
            return
        info = done.info
        self.batch_size.observe(done.samples)
        self.samples.inc(done.samples)
        self.run_time.observe(done.run_s)
        if info.oom_retries:
            self.oom_retries.inc(info.oom_retries)
        if info.splits:
            self.splits.inc(info.splits)
        for choice in info.choices:
            self.choice_time.observe(choice.seconds)
        if info.choices:
            last = info.choices[-1]
            self.free_memory.set(last.free_bytes)
            self.plan_peak.set(last.peak_bytes)
        for outcome in outcomes:
            timing = getattr(outcome, "timing", None)
            if timing is not None:
                self.observe_request(timing)


class Metrics:
    """Every metric the service exports."""

    def __init__(self) -> None:
        self._models: dict[str, ModelMetrics] = {}
        self.live = Live()  # the last seconds of answered requests, for the page's live view
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("vbs_requests", "requests answered (HTTP, and gRPC calls as the "
                                "endpoints grpc_infer and grpc), by model, endpoint and status",
                                ["model", "endpoint", "status"], registry=r)
        self.latency = Histogram("vbs_request_latency_seconds", "time from request to response",
                                 ["model", "endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vbs_queue_time_seconds", "time a request waited before its "
                                    "batch ran", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.input_time = Histogram("vbs_compute_input_seconds", "per request: decoding it and "
                                    "copying it into its batch (and the batch's transfer)",
                                    ["model"], buckets=FINE_BUCKETS, registry=r)
        self.infer_time = Histogram("vbs_compute_infer_seconds", "per request: its batch's plan "
                                    "run", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.output_time = Histogram("vbs_compute_output_seconds", "per request: its outputs to "
                                     "the host and encoded", ["model"], buckets=FINE_BUCKETS,
                                     registry=r)
        self.receive_time = Histogram("vbs_receive_seconds", "per inference request: reading "
                                      "its body from the network (paced by the client)",
                                      ["model"], buckets=FINE_BUCKETS, registry=r)
        self.overhead_time = Histogram("vbs_server_overhead_seconds", "per inference request: "
                                       "the server's time that is none of receive, load wait, "
                                       "queue, input, infer and output (HTTP parsing, "
                                       "routing, handing over between threads, sending the "
                                       "response)", ["model"],
                                       buckets=FINE_BUCKETS, registry=r)
        self.run_time = Histogram("vbs_batch_run_seconds", "time a batch ran on the worker",
                                  ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("vbs_batch_size", "samples per batch run", ["model"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.samples = Counter("vbs_samples", "samples inferred", ["model"], registry=r)
        self.free_memory = Gauge("vbs_free_memory_bytes", "memory free for activations when the "
                                 "last plan was chosen", ["model"], registry=r)
        self.plan_peak = Gauge("vbs_plan_peak_bytes", "bytes the last plan used allocates (its "
                               "table breakpoint)", ["model"], registry=r)
        self.choice_time = Histogram("vbs_plan_choice_seconds", "time to choose a batch's plan: "
                                     "table lookups for the memory free now", ["model"],
                                     buckets=FINE_BUCKETS, registry=r)
        self.oom_retries = Counter("vbs_oom_retries", "batches retried with a smaller plan after "
                                   "running out of memory", ["model"], registry=r)
        self.splits = Counter("vbs_batch_splits", "batches split because no plan of their size "
                              "fitted (or over batch_max)", ["model"], registry=r)
        self.queue_depth = Gauge("vbs_queue_depth", "requests waiting", ["model"], registry=r)
        self.rejected = Counter("vbs_rejected", "requests turned away before running", ["model",
                                "reason"], registry=r)
        self.table_reloads = Counter("vbs_table_reloads", "plan tables swapped in while serving",
                                     ["model"], registry=r)
        self.table_version = Gauge("vbs_table_version", "version of the table in use", ["model"],
                                   registry=r)
        self.store_errors = Counter("vbs_store_errors", "failures talking to the plan store "
                                    "(serving goes on from the last table)", registry=r)
        self.store_up = Gauge("vbs_store_up", "1 when the plan store watch is live", registry=r)
        self.model_ready = Gauge("vbs_model_ready", "1 when a model and its table are loaded",
                                 ["model"], registry=r)
        self._loading(r)
        # The memory arbiter's (workers/arbiter.py), set through MemoryListener.
        self.memory_budget = Gauge("vbs_memory_budget_bytes", "memory free for plans now (the "
                                   "arbiter's last reading)", ["device"], registry=r)
        self.memory_lease = Gauge("vbs_memory_lease_bytes", "bytes leased by the model's "
                                  "running batch (0 when idle)", ["model"], registry=r)
        self.memory_share = Gauge("vbs_memory_share_bytes", "the model's share of the memory "
                                  "free for plans", ["model"], registry=r)
        self.memory_lease_waits = Counter("vbs_memory_lease_waits", "batches that waited in line "
                                          "for their memory lease", ["model"], registry=r)
        self.memory_step_downs = Counter("vbs_memory_step_downs", "batches that ran a smaller "
                                         "plan than their share because other models' batches "
                                         "held the memory", ["model"], registry=r)
        self.memory_overcommits = Counter("vbs_memory_overcommits", "leases that took the sum of "
                                          "live leases past the budget (only with "
                                          "memory_sharing=none)", ["device"], registry=r)

    def _loading(self, r: CollectorRegistry) -> None:
        """The metrics of loading on demand (``service.residency``)."""
        self.model_loads = Counter("vbs_model_loads", "times a model was loaded (at start, on "
                                   "demand or through the repository API)", ["model"], registry=r)
        self.model_unloads = Counter("vbs_model_unloads", "times a model was unloaded: to make "
                                     "room for another (memory) or through the repository API "
                                     "(request)", ["model", "reason"], registry=r)
        self.load_time = Histogram("vbs_model_load_seconds", "time a model took to load (its "
                                   "tables read from the store, or planned)", ["model"],
                                   buckets=LOAD_BUCKETS, registry=r)
        self.model_kept = Gauge("vbs_model_kept_bytes", "what a loaded model keeps (weights, "
                                "runtime sessions and graphs, its batch buffer); 0 when not "
                                "loaded", ["model"], registry=r)

    def for_model(self, model: str) -> ModelMetrics:
        """The per-model metrics of ``model``, labelled once (see ``ModelMetrics``)."""
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = ModelMetrics(*(
                getattr(self, name).labels(model) for name in ModelMetrics.__dataclass_fields__))
        return found

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def total(self, counter: Counter, model: str) -> float:
        """A per-model counter's count now, read from that one metric (``value`` collects the
        whole registry: milliseconds, too slow for a page that polls)."""
        for family in counter.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("model") == model:
                    return float(sample.value)
        return 0.0

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (0 when absent): for tests and the load test."""
        found = self.registry.get_sample_value(name, labels or {})
        return float(found) if found is not None else 0.0


def _child(children: dict[tuple[Gauge, str], Any], gauge: Gauge, label: str) -> Any:
    """``gauge.labels(label)``, looked up once."""
    child = children.get((gauge, label))
    if child is None:
        child = children[(gauge, label)] = gauge.labels(label)
    return child


class MemoryListener:
    """The memory arbiter's events as metrics (``workers.arbiter.ArbiterListener``)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        # the gauges set around every batch (budget, share, lease: four sets), by gauge and
        # label: a labels() lookup validates and locks each time, on the batch's own time
        self._children: dict[tuple[Gauge, str], Any] = {}

    def on_register(self, device: str, model: str) -> None:
        """Every series of a model (and its device) exported from the start, at 0."""
        m = self.metrics
        m.memory_lease.labels(model).set(0)
        m.memory_share.labels(model)
        m.memory_lease_waits.labels(model)
        m.memory_step_downs.labels(model)
        m.memory_overcommits.labels(device)

    def on_budget(self, device: str, budget: int) -> None:
        _child(self._children, self.metrics.memory_budget, device).set(budget)

    def on_shares(self, shares: Any) -> None:
        for model, share in shares.items():
            _child(self._children, self.metrics.memory_share, model).set(share)

    def on_lease(self, model: str, leased: int) -> None:
        _child(self._children, self.metrics.memory_lease, model).set(leased)

    def on_wait(self, model: str) -> None:
        self.metrics.memory_lease_waits.labels(model).inc()

    def on_step_down(self, model: str) -> None:
        self.metrics.memory_step_downs.labels(model).inc()

    def on_overcommit(self, device: str) -> None:
        self.metrics.memory_overcommits.labels(device).inc()


class RequestMetricsMiddleware:
    """Counts every HTTP request by model, endpoint and status, and times it (pure ASGI).

    Each request gets its claims (``service.claims``, ``request.state.vbs``), where handlers
    name its model and endpoint; requests that never reach one count under ``"-"`` /
    ``"other"``.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        # labelled children, looked up once per label set (``labels()`` locks and hashes)
        self._answered: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._inference: dict[str, tuple[Any, Any]] = {}

    def _children(self, model: str, endpoint: str, status: str) -> tuple[Any, Any]:
        key = (model, endpoint, status)
        found = self._answered.get(key)
        if found is None:
            found = self._answered[key] = (self.metrics.requests.labels(model, endpoint, status),
                                           self.metrics.latency.labels(model, endpoint))
        return found

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]
        claims = scope.setdefault("state", {})["vbs"] = Claims()

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            model, endpoint = claims.model, claims.endpoint
            elapsed = time.perf_counter() - started
            requests, latency = self._children(model, endpoint, str(status[0]))
            requests.inc()
            latency.observe(elapsed)
            outcome = claims.outcome
            if outcome is not None:  # an inference answered: what the rest cost
                timing, receive = outcome.timing, claims.receive_s
                spent = (receive + timing.load_wait_s + timing.queue_s + timing.input_s
                         + timing.infer_s + timing.output_s)
                m = self._inference.get(model)
                if m is None:
                    m = self._inference[model] = (self.metrics.receive_time.labels(model),
                                                  self.metrics.overhead_time.labels(model))
                m[0].observe(receive)
                m[1].observe(max(0.0, elapsed - spent))
                self.metrics.live.record(model, elapsed, outcome)
