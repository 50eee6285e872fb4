"""The planner's settings (environment prefix ``VBS_``): what to load, profile and plan, and
where profiles and tables are kept. `vbs profile`, `vbs plan` and `vbs graph` read these;
`vbs serve` reads ``service.settings.Settings``, these and what only serving needs.

Command-line flags override fields by building ``Settings(**overrides)``; nothing else in the
planner reads the environment.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.errors import UsageError
from core.shapes import parse_shape


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
        try:
            shape = parse_shape(shape_text)
        except UsageError as exc:
            raise ValueError(f"model {entry!r}: {exc}") from exc
    return served, name, shape


class Settings(BaseSettings):
    """What the planner can be configured with, typed and checked once at start."""

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
    select_rounds: int = Field(
        default=3, ge=0, le=100,
        description="`vbs plan`: rounds that every plan of the served table and every uniform "
                    "plan run in the executor, interleaved; a per-unit plan is kept only where "
                    "it measured faster than the uniform batch at its budget (0: no "
                    "measurement, the tables as solved; more rounds make the choice surer)")
    select_margin: float = Field(
        default=0.10, ge=0, le=0.9,
        description="`vbs plan`: how much faster than fbs-best's uniform plan another plan "
                    "must measure to take a budget (the median of its times over that plan's, "
                    "round by round; and faster in 80% of the rounds, every round of 3 or 4): "
                    "above the noise between two plans of one round")
    profile_grid: bool = Field(default=False, description="profile a grid of batch sizes and "
                                                          "interpolate (part of the fingerprint)")
    threads: int = Field(default=0, ge=0, description="torch intra-op threads on CPU; 0 = torch's default")
    runtime: Literal["auto", "torch", "onnxruntime", "cudagraph"] = Field(
        default="auto",
        description="unit runtimes: auto (measure every installed one that runs on the "
                    "device; each step of a plan runs on the fastest for it), onnxruntime "
                    "(CPU) or cudagraph (CUDA graphs) wherever it takes the unit, torch "
                    "elsewhere, or torch (part of the profile's fingerprint)")
    precision: Literal["float32", "int8", "bfloat16", "float16", "auto"] = Field(
        default="float32",
        description="what the units run at: float32; int8 on ONNX Runtime (static, per-channel "
                    "weights, quantized from VBS_CALIBRATION's samples, the units that move the "
                    "answer most kept float32 by the error guard); bfloat16 or float16 (the "
                    "whole model on torch, guarded on the samples); or auto (given calibration "
                    "samples, the fastest of those that measured faster than float32 here, a "
                    "half precision only on a device with its kernels, else float32); part of "
                    "the fingerprint")
    calibration: Path | None = Field(
        default=None,
        description="a folder of the model's input samples (.npy, or images through the "
                    "family's preprocessing) that int8 units are calibrated on; the last "
                    "quarter is held out for the error guard")
    max_error: float = Field(
        default=0.01, ge=0, le=1,
        description="the error guard: the largest share of held-out calibration samples whose "
                    "top-1 class may differ from float32's with the int8 units on")
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
