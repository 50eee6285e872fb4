"""The settings of `vbs serve`: the planner's (``planner.settings.Settings``: what to plan and
where the tables are, since a service plans a model the store lacks) and what only serving
reads: listening addresses, the API key, batching, request limits, memory sharing, ONNX
Runtime sessions and how the store is watched.

Environment prefix ``VBS_``, as the planner's; command-line flags override fields by
building ``Settings(**overrides)``; nothing else in the service reads the environment.
"""

from __future__ import annotations

import importlib.util

import json
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from core.errors import UsageError
from core.sizes import parse_bytes
from planner.settings import Settings as PlannerSettings


def _size(value: Any, field: str) -> Any:
    """A byte count given as a number or as text with a unit (``64MB``; MB = 10^6, MiB = 2^20)."""
    if isinstance(value, str):
        try:
            return parse_bytes(value)
        except UsageError as exc:
            raise ValueError(f"{field}: {exc}") from exc
    return value


class Settings(PlannerSettings):
    """Everything `vbs serve` can be configured with, typed and checked once at start."""

    ort_sessions: int = Field(default=128, ge=1, le=100_000,
                              description="ONNX Runtime sessions kept per model (one per run of "
                                          "units a plan uses; each holds a thread); beyond it "
                                          "the least recently used is given back")
    ort_spin: bool = Field(default=True,
                           description="ONNX Runtime's threads spin between the operators of a "
                                       "call, and sleep once it returns; false: they sleep "
                                       "between operators too (a wake-up each, slower on small "
                                       "operators; the profile is measured spinning)")
    ort_arena: Literal["auto", "shared", "none"] = Field(
        default="auto",
        description="ONNX Runtime's memory for what lives inside a call, one arena for every "
                    "session: kept at its largest after the call (shared: a memory limit's "
                    "reading counts it as used), or its free regions given back to the kernel "
                    "when each call returns (none: far less memory held, each call faulting its "
                    "activations in again, a little slower); auto: where a cgroup memory limit "
                    "applies, kept while plans run and given back when the device has been idle "
                    "device_cache_idle_s and whenever a request or a plan finds the group short; "
                    "shared elsewhere")
    hugepages: bool = Field(
        default=True,
        description="`vbs serve` starts itself again with glibc's glibc.malloc.hugetlb=1 tunable "
                    "where it is not set and the kernel gives transparent huge pages on advice: "
                    "large buffers faulted in 2 MiB at a time (ONNX Runtime's without its arena, "
                    "the batches'); false: never")

    host: str = Field(default="127.0.0.1", min_length=1, description="address the service listens on")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port of the service (0 = any free)")
    grpc_port: int = Field(default=8001, ge=0, le=65535,
                           description="TCP port of the Open Inference Protocol v2 over gRPC "
                                       "(KServe's GRPCInferenceService, beside HTTP on the same "
                                       "host; 8001 as Triton's); 0 turns gRPC off")
    fast_path: bool = Field(
        default=True,
        description="serve the inference routes on the fast path (service.fast: fewer framework "
                    "layers, one write per response); false: through plain FastAPI routes and "
                    "stock uvicorn, with the same answers")
    access_log: bool = Field(
        default=False, description="uvicorn's access log, a line per request at --log-level info "
                                   "(vbs_requests counts them; each line is written on the "
                                   "event loop)")
    api_key: SecretStr | None = Field(
        default=None, description="when set, inference and /plan need 'Authorization: Bearer KEY'")
    max_batch_delay_ms: float = Field(
        default=0.0, ge=0, le=60_000,
        description="longest a request waits for others to batch with when the model is free; "
                    "0 runs it at once (requests arriving while a batch runs are batched anyway)")
    batch_follow_up: float = Field(
        default=0.0, ge=0, le=1,
        description="when the model frees while some of the last batch's clients have not sent "
                    "again, wait for them up to this fraction of what the table says one merged "
                    "batch saves over two (0, the default: never)")
    max_queue: int = Field(default=256, ge=1, le=1_000_000,
                           description="requests waiting per model before 503 + Retry-After")
    request_timeout_s: float = Field(default=30.0, gt=0, le=3600,
                                     description="queue + run time after which a request gets 504")
    max_body_bytes: int = Field(default=64 * 2**20, ge=1024, le=2**34,
                                description="largest request body (bytes or 64MB); larger gets 413")
    max_json_bytes: int = Field(
        default=16 * 2**20, ge=1024, le=2**34,
        description="largest JSON request body (bytes or 16MB); larger gets 413 before it is "
                    "parsed (parsed JSON numbers take many times their text's bytes): send "
                    "large inputs as .npy, raw bytes or OIP v2 binary tensors")
    max_samples_per_request: int = Field(default=256, ge=1, le=100_000,
                                         description="most samples in one request; more gets 413")
    max_image_pixels: int = Field(default=40_000_000, ge=1, le=2**31,
                                  description="largest image (width x height) decoded for /infer")
    latency_target_s: float | None = Field(
        default=None, gt=0, le=3600,
        description="when set, a batch gathers only as many samples as a plan runs within it")
    memory_limit_bytes: int = Field(default=0, ge=0,
                                    description="most memory a plan may use (bytes or 64MB); 0 = what is free")
    memory_margin_bytes: int = Field(default=0, ge=0,
                                     description="memory kept back from plans (bytes or 16MB)")
    models_memory_bytes: int = Field(
        default=0, ge=0,
        description="most memory the served models take together (bytes or 2GB): what each "
                    "loaded model keeps (weights, runtime sessions and graphs, its batch "
                    "buffer) and their plans; models load on demand within it, the least "
                    "recently used idle one unloaded for another (0: the device's own bound: "
                    "the cgroup limit, the GPU's or the host's free memory)")
    drain_after_s: float = Field(
        default=2.0, gt=0, le=3600,
        description="with more models than fit, how long a load waits for an idle model to "
                    "unload before it drains the least recently used busy one (no request let "
                    "through, those let through answered; a model under steady traffic is never "
                    "idle); at most half of request_timeout_s")
    admit_wait_s: float | None = Field(
        default=None, ge=0, le=3600,
        description="under a memory limit, how long a request waits in line, its body unread, "
                    "for memory to free before 503 with Retry-After (default: its whole "
                    "request_timeout_s; the wait counts toward that timeout)")
    device_cache_idle_s: float = Field(
        default=1.0, ge=0, le=3600,
        description="on CUDA, seconds without a plan running after which the allocator's cache "
                    "is given back to the device, so a neighbour can take it (0: only when a "
                    "smaller plan runs); on a CPU under a memory limit, after which ONNX "
                    "Runtime's arena is (ort_arena auto; 0: only when memory is short)")
    memory_sharing: Literal["arbiter", "static", "none"] = Field(
        default="arbiter",
        description="how models on one device share its memory: arbiter (leases, shares from "
                    "the tables by demand), static (leases, equal shares by weight), none "
                    "(every model plans for all the free memory; may overcommit)")
    memory_weights: dict[str, float] | str = Field(
        default_factory=dict,
        description="per served model, its weight in the memory shares (default 1): "
                    "name=2,other=0.5 or a JSON object")
    memory_minimums: dict[str, int] | str = Field(
        default_factory=dict,
        description="per served model, bytes it keeps even when idle (default 0): "
                    "name=64MB,other=16MB or a JSON object")
    cpu_model_threads: Literal["shared", "per_model"] = Field(
        default="shared",
        description="on the CPU: one torch thread runs every model's batches one at a time "
                    "(shared), or each model its own (per_model: models run at once, and "
                    "their memory is shared by the arbiter); CUDA is always per_model")
    pipeline: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="a model's batches in two stages (on): its thread issues a batch to the "
                    "device and a second thread waits for the output and encodes it, so the "
                    "next batch is gathered and issued while the device runs this one (two in "
                    "flight at most); off: each batch whole on the model's thread; auto: on "
                    "for CUDA, off on the CPU (nothing overlaps there)")
    lean: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="serve a CPU model from its compiled form in the store, without torch: "
                    "its plans run ONNX Runtime's sessions on numpy arrays, and neither torch "
                    "nor the weights file is read (`vbs plan` compiles it with tables it can "
                    "run). on: always (a model the store holds no such form of is refused); "
                    "off: capture the torch model as always; auto: wherever the store holds "
                    "the model compiled with tables it can run (and always where torch cannot "
                    "be imported, the lean worker image), else with torch")
    first_start: Literal["interim", "wait"] = Field(
        default="wait",
        description="a model the store has no table for: served at once from an interim table "
                    "(interim: the whole model in ONNX Runtime at uniform batch sizes, each "
                    "one's memory and time measured) while `vbs plan` profiles and solves it in "
                    "a child process, the planned table swapped in when it is published; or "
                    "profiled and planned before it serves (wait). `make run` serves interim")
    store_retry_base_s: float = Field(default=0.2, gt=0, le=60,
                                      description="first delay before reconnecting to a store that is down")
    store_retry_cap_s: float = Field(default=30.0, gt=0, le=3600,
                                     description="longest delay between reconnects to the store")
    store_poll_s: float = Field(default=1.0, gt=0, le=3600,
                                description="how often a directory store is polled for new tables")

    @field_validator("max_body_bytes", "max_json_bytes", "memory_limit_bytes",
                     "memory_margin_bytes", "models_memory_bytes", mode="before")
    @classmethod
    def _sizes(cls, value: Any, info: Any) -> Any:
        return _size(value, info.field_name)

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_api_key(cls, value: Any) -> Any:
        # VBS_API_KEY="" (compose passes ${VBS_API_KEY:-}) means no key, not a short one
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("memory_weights", "memory_minimums", mode="before")
    @classmethod
    def _per_model(cls, value: Any, info: Any) -> Any:
        """``name=value,name=value`` or a JSON object → a dict; sizes may carry units."""
        field = info.field_name
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                try:
                    value = json.loads(text)
                except ValueError as exc:
                    raise ValueError(f"{field} {text!r} is not a JSON object ({exc}): give "
                                     'name=VALUE,name=VALUE or {"name": VALUE}') from exc
            else:
                pairs = {}
                for part in (p.strip() for p in text.split(",") if p.strip()):
                    name, sep, number = part.partition("=")
                    if not sep or not name.strip() or not number.strip():
                        raise ValueError(f"{field}: {part!r} is not name=VALUE")
                    pairs[name.strip()] = number.strip()
                value = pairs
        if not isinstance(value, dict):
            raise ValueError(f"{field}: give name=VALUE,name=VALUE or a JSON object")
        if field == "memory_minimums":
            return {k: _size(v, f"{field}[{k}]") for k, v in value.items()}
        return value

    @field_validator("memory_weights", mode="after")
    @classmethod
    def _check_weights(cls, value: Any) -> Any:
        for name, weight in value.items():
            if not weight > 0 or weight != weight or weight == float("inf"):
                raise ValueError(f"memory_weights[{name}]: {weight} must be a number > 0")
        return value

    @field_validator("memory_minimums", mode="after")
    @classmethod
    def _check_minimums(cls, value: Any) -> Any:
        for name, size in value.items():
            if size < 0:
                raise ValueError(f"memory_minimums[{name}]: {size} must be bytes >= 0")
        return value

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value().strip()) < 8:
            raise ValueError("api_key must have at least 8 characters (or leave it unset)")
        return value

    @model_validator(mode="after")
    def _check_retry(self) -> Settings:
        if self.store_retry_cap_s < self.store_retry_base_s:
            raise ValueError(f"store_retry_cap_s {self.store_retry_cap_s} must be >= "
                             f"store_retry_base_s {self.store_retry_base_s}")
        return self

    def lean_for(self, device: str) -> bool:
        """Whether a model on ``device`` must be served from its compiled form, without torch
        (``lean`` on, or auto where torch is not installed)."""
        if not device.startswith("cpu") or self.lean == "off":
            return False
        return self.lean == "on" or not torch_importable()

    def lean_if_compiled(self, device: str) -> bool:
        """Whether a model on ``device`` is served without torch where its store holds it
        compiled with tables that run so (``lean`` auto on the CPU), else with torch."""
        return device.startswith("cpu") and self.lean == "auto"

    def pipelined(self, device: str) -> bool:
        """Whether a model on ``device`` runs its batches in two stages (``pipeline``)."""
        return self.pipeline == "on" or (self.pipeline == "auto" and device.startswith("cuda"))

    @property
    def line_wait_s(self) -> float:
        """How long a request waits in line for memory under a limit: ``admit_wait_s``, never
        past its request timeout (the wait counts toward it)."""
        wait = self.request_timeout_s if self.admit_wait_s is None else self.admit_wait_s
        return min(wait, self.request_timeout_s)

    @model_validator(mode="after")
    def _check_memory_names(self) -> Settings:
        served = [name for name, _, _ in self.served_models]
        for field in ("memory_weights", "memory_minimums"):
            for name in getattr(self, field):
                if name not in served:
                    raise ValueError(f"{field}: {name!r} is not a served model (served: "
                                     f"{', '.join(served) or 'none'}); use the served name")
        return self


def torch_importable() -> bool:
    """Whether torch is installed here (the lean worker image has none), found without
    importing it: the import alone grows a process by hundreds of MiB (the CUDA build's
    libraries mapped, its heap), which a server of compiled models never pays."""
    return importlib.util.find_spec("torch") is not None
