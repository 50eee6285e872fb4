"""The plan store: versioned plan tables, profiles and model aliases in Redis or a directory.

``open_store(location)`` (sync, for `vbs plan`) and ``open_async_store(location)`` (async,
for workers and the HTTP service) take ``Settings.store_location``: a redis://, rediss:// or
unix:// URL, or a directory. See ``base`` for the interface, ``keys`` for the key scheme,
``backoff`` for the delays between reconnects to a store that is down.
"""

from planner.store.backoff import Backoff
from planner.store.base import (AsyncPlanStore, PlanStore, StoredTable, TableAnnouncement,
                                TableInfo, TableWatch)
from planner.store.factory import open_async_store, open_store, printable_location
from planner.store.keys import CHANNEL, NAMESPACE
from planner.store.local import AsyncLocalStore, LocalStore

__all__ = [
    "CHANNEL", "NAMESPACE", "AsyncLocalStore", "AsyncPlanStore", "AsyncRedisStore", "Backoff",
    "LocalStore", "PlanStore", "RedisStore", "StoredTable", "TableAnnouncement", "TableInfo",
    "TableWatch",
    "open_async_store", "open_store", "printable_location",
]


def __getattr__(name: str) -> object:
    # The Redis back end is imported on first use, so a local-only caller never loads redis-py.
    if name in ("RedisStore", "AsyncRedisStore"):
        from planner.store import redis_backend
        return getattr(redis_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
