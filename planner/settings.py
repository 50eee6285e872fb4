"""The one place vbs-serve reads its configuration: ``Settings`` (environment prefix ``VBS_``).

Command-line flags override fields by building ``Settings(**overrides)``; nothing else in the
project reads the environment.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_cache() -> Path:
    return Path.home() / ".cache" / "vbs-serve"


_SERVED_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,127}$")


def split_model_entry(entry: str) -> tuple[str, str, tuple[int, ...] | None]:
    """A served model ``[ALIAS=]NAME[@C,H,W]`` as (served name, model name, input shape or None).

    The served name (in URLs) is ALIAS, else NAME. The shape may use ``x`` or ``,``
    (``3x224x224``); without it the model's default input shape is planned.
    """
    text = entry.strip()
    alias, sep, rest = text.partition("=")
    if not sep:
        alias, rest = "", text
    name, at, shape_text = rest.partition("@")
    name, alias = name.strip(), alias.strip()
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"model {entry!r}: give [ALIAS=]NAME[@C,H,W], e.g. resnet50, "
                         "tiny=pkg.module:factory@3x32x32")
    served = alias or name
    if not _SERVED_NAME.match(served):
        raise ValueError(f"model {entry!r}: the served name {served!r} may hold letters, digits, "
                         "'_', '.', ':', '-' (128 at most); give an alias: ALIAS=NAME")
    shape = None
    if at:
        parts = [p for p in re.split(r"[x,]", shape_text.replace(" ", "")) if p]
        if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts) or len(parts) > 5:
            raise ValueError(f"model {entry!r}: input shape {shape_text!r} must be positive "
                             "integers like 3x224x224 (C,H,W) or 3x16x112x112 (C,T,H,W)")
        shape = tuple(int(p) for p in parts)
    return served, name, shape


def _size(value: Any, field: str) -> Any:
    """A byte count given as a number or as text with a unit (``64MB``; MB = 10^6, MiB = 2^20)."""
    if isinstance(value, str):
        from core.errors import UsageError
        from core.sizes import parse_bytes  # light: no numba, no torch
        try:
            return parse_bytes(value)
        except UsageError as exc:
            raise ValueError(f"{field}: {exc}") from exc
    return value


class Settings(BaseSettings):
    """Everything configurable, typed and checked once at start."""

    model_config = SettingsConfigDict(env_prefix="VBS_", extra="forbid")

    cache_dir: Path = Field(default_factory=_default_cache,
                            description="where measured profiles are cached by fingerprint")
    store: str = Field(default="",
                       description="plan store: a redis:// URL or a directory; empty = <cache_dir>/store")
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    batch_max: int = Field(default=16, ge=1, le=1024, description="largest request size planned")
    slot_count: int = Field(default=512, ge=8, le=1 << 16,
                            description="memory slots of a table, up to the unconstrained peak")
    slot_bytes: int = Field(default=0, ge=0, description="bytes per slot; 0 = derived from slot_count")
    profile_repeats: int = Field(default=5, ge=1, le=1000, description="timed runs per (unit, batch)")
    profile_warmup: int = Field(default=2, ge=0, le=1000, description="untimed runs before timing")
    profile_grid: bool = Field(default=False, description="profile a grid of batch sizes and "
                                                          "interpolate (part of the fingerprint)")
    threads: int = Field(default=0, ge=0, description="torch intra-op threads on CPU; 0 = torch's default")
    runtime: Literal["auto", "torch", "onnxruntime"] = Field(
        default="auto",
        description="unit runtimes: auto (measure every installed one; each step of a plan "
                    "runs on the fastest for it), onnxruntime (wherever it takes the unit, "
                    "torch elsewhere) or torch (part of the profile's fingerprint)")
    ort_sessions: int = Field(default=128, ge=1, le=100_000,
                              description="ONNX Runtime sessions kept per model (one per run of "
                                          "units a plan uses; each holds a thread); beyond it "
                                          "the least recently used is given back")
    ort_spin: bool = Field(default=True,
                           description="ONNX Runtime's threads spin between the operators of a "
                                       "call, and sleep once it returns; false: they sleep "
                                       "between operators too (a wake-up each, slower on small "
                                       "operators; the profile is measured spinning)")

    # -- the HTTP service (`vbs serve`) ------------------------------------------------------
    host: str = Field(default="127.0.0.1", min_length=1, description="address the service listens on")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port of the service (0 = any free)")
    grpc_port: int = Field(default=8001, ge=0, le=65535,
                           description="TCP port of the Open Inference Protocol v2 over gRPC "
                                       "(KServe's GRPCInferenceService, beside HTTP on the same "
                                       "host; 8001 as Triton's); 0 turns gRPC off")
    models: list[str] | str = Field(
        default_factory=list,
        description="models to serve, each [ALIAS=]NAME[@C,H,W]; VBS_MODELS takes them "
                    "comma-separated (a,b@3x64x64) or as a JSON list")
    weights: Path | None = Field(
        default=None, description="a state_dict file (read with weights_only=True) loaded into the "
                                  "served model(s); default: random weights")
    solver: Literal["vbs", "paper", "fbs", "fbs-best", "greedy"] = Field(
        default="vbs", description="solver of the tables the service asks the store for")
    objective: Literal["time", "energy"] = Field(
        default="time", description="what the tables minimise: time, or energy where profiles "
                                    "carry measured energy")
    access_log: bool = Field(
        default=False, description="uvicorn's access log, a line per request at --log-level info "
                                   "(vbs_requests counts them; the line costs the event loop "
                                   "0.1-0.3 ms a request on a 2-core CPU)")
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
                    "batch saves over two (0, the default: never; on a 2-core CPU waiting did "
                    "not pay)")
    max_queue: int = Field(default=256, ge=1, le=1_000_000,
                           description="requests waiting per model before 503 + Retry-After")
    request_timeout_s: float = Field(default=30.0, gt=0, le=3600,
                                     description="queue + run time after which a request gets 504")
    max_body_bytes: int = Field(default=64 * 2**20, ge=1024, le=2**34,
                                description="largest request body (bytes or 64MB); larger gets 413")
    max_json_bytes: int = Field(
        default=16 * 2**20, ge=1024, le=2**34,
        description="largest JSON request body (bytes or 16MB); larger gets 413 before it is "
                    "parsed (64 MB of JSON numbers is about half a gigabyte of Python floats): "
                    "send large inputs as .npy, raw bytes or OIP v2 binary tensors")
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
    store_retry_base_s: float = Field(default=0.2, gt=0, le=60,
                                      description="first delay before reconnecting to a store that is down")
    store_retry_cap_s: float = Field(default=30.0, gt=0, le=3600,
                                     description="longest delay between reconnects to the store")
    store_poll_s: float = Field(default=1.0, gt=0, le=3600,
                                description="how often a directory store is polled for new tables")

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        value = value.strip()
        if value and "://" in value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"store {value!r}: use a redis://host:port/db URL or a directory path")
        return value

    @field_validator("models", mode="before")
    @classmethod
    def _split_models(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except ValueError as exc:
                    raise ValueError(f"models {text!r} is not a JSON list ({exc}): give "
                                     'NAME,NAME or ["NAME", "NAME"]') from exc
            # Commas separate models, except inside a shape (a comma before a digit).
            return [part for part in re.split(r",\s*(?=[^\d\s])", text) if part.strip()]
        return value

    @field_validator("models", mode="after")
    @classmethod
    def _check_models(cls, value: list[str] | str) -> list[str]:
        entries = [value] if isinstance(value, str) else list(value)
        served: dict[str, str] = {}
        out = []
        for entry in entries:
            name = split_model_entry(entry)[0]
            if name in served:
                raise ValueError(f"models {served[name]!r} and {entry!r} are both served as "
                                 f"{name!r}: give one an alias, ALIAS=NAME")
            served[name] = entry
            out.append(entry.strip())
        return out

    @field_validator("max_body_bytes", "max_json_bytes", "memory_limit_bytes",
                     "memory_margin_bytes", mode="before")
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

    @model_validator(mode="after")
    def _check_memory_names(self) -> Settings:
        served = [name for name, _, _ in self.served_models]
        for field in ("memory_weights", "memory_minimums"):
            for name in getattr(self, field):
                if name not in served:
                    raise ValueError(f"{field}: {name!r} is not a served model (served: "
                                     f"{', '.join(served) or 'none'}); use the served name")
        return self

    @property
    def served_models(self) -> list[tuple[str, str, tuple[int, ...] | None]]:
        """(served name, model name, input shape or None) of every model to serve."""
        entries = [self.models] if isinstance(self.models, str) else self.models
        return [split_model_entry(e) for e in entries]

    @property
    def profile_cache(self) -> Path:
        return self.cache_dir / "profiles"

    @property
    def store_location(self) -> str:
        return self.store or str(self.cache_dir / "store")
