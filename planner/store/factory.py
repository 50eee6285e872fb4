"""Open the plan store that a location names: a Redis URL or a directory.

The location is ``Settings.store_location``; Redis clients connect lazily, on first use.
"""

from __future__ import annotations

import os

from core.errors import StoreError
from planner.store.base import AsyncPlanStore, PlanStore
from planner.store.keys import mask_url
from planner.store.local import DEFAULT_POLL_INTERVAL, AsyncLocalStore, LocalStore

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def _kind(location: str | os.PathLike[str]) -> str:
    text = os.fspath(location)
    if not isinstance(text, str) or not text.strip():
        raise StoreError("the plan store location is empty: give a redis:// URL or a directory "
                         "(--store or VBS_STORE)")
    text = text.strip()
    if text.lower().startswith(REDIS_SCHEMES):
        return "redis"
    if "://" in text:
        raise StoreError(f"plan store {text.split('://', 1)[0]}://... is not supported: use "
                         "redis://, rediss://, unix:// or a directory path")
    return "local"


def printable_location(location: str | os.PathLike[str]) -> str:
    """The location as logs and messages show it: a Redis URL with its password masked (the
    password must not reach `docker compose logs` or a log collector)."""
    text = os.fspath(location).strip()
    return mask_url(text) if _kind(text) == "redis" else text


def open_store(location: str | os.PathLike[str]) -> PlanStore:
    """A synchronous store: RedisStore for redis://, rediss://, unix:// URLs, else LocalStore."""
    if _kind(location) == "redis":
        from planner.store.redis_backend import RedisStore
        return RedisStore(os.fspath(location).strip())
    return LocalStore(location)


def open_async_store(location: str | os.PathLike[str], *,
                     poll_interval: float = DEFAULT_POLL_INTERVAL) -> AsyncPlanStore:
    """An async store for the same locations; ``poll_interval`` (s) applies to directories."""
    if _kind(location) == "redis":
        from planner.store.redis_backend import AsyncRedisStore
        return AsyncRedisStore(os.fspath(location).strip())
    return AsyncLocalStore(location, poll_interval=poll_interval)
