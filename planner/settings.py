"""The one place vbs-serve reads its configuration: ``Settings`` (environment prefix ``VBS_``).

Command-line flags override fields by building ``Settings(**overrides)``; nothing else in the
project reads the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_cache() -> Path:
    return Path.home() / ".cache" / "vbs-serve"


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
    threads: int = Field(default=0, ge=0, description="torch intra-op threads on CPU; 0 = torch's default")

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        value = value.strip()
        if value and "://" in value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"store {value!r}: use a redis://host:port/db URL or a directory path")
        return value

    @property
    def profile_cache(self) -> Path:
        return self.cache_dir / "profiles"

    @property
    def store_location(self) -> str:
        return self.store or str(self.cache_dir / "store")
