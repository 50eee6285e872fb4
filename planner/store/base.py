"""The plan store's interface: what a table is, what every back end must do, sync and async.

A plan store holds opaque blobs. The solver serialises a plan table to bytes and the CLI
(``vbs plan``) puts it here under the profile's fingerprint, with a JSON meta record and a
version that rises by one on every put of that fingerprint; a model key names the current
fingerprint of a model, so a worker that knows only its model finds its table. Workers and
the HTTP service read tables through the async interface and ``watch()`` announcements of
new ones, so they can switch tables without restarting.

Two back ends implement both interfaces: ``planner.store.local`` (a directory, the embedded
default) and ``planner.store.redis_backend`` (Redis, production).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from core.errors import TableNotFoundError


@dataclass(frozen=True)
class TableInfo:
    """A stored table's fingerprint, version and meta, without its blob."""

    fingerprint: str
    version: int
    meta: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class StoredTable:
    """A table blob as stored, with the meta and version written with it."""

    fingerprint: str
    blob: bytes = field(repr=False)
    meta: dict[str, Any] = field(hash=False)
    version: int


@dataclass(frozen=True)
class TableAnnouncement:
    """A table was stored: its fingerprint, its new version and the model it is for (if known)."""

    fingerprint: str
    version: int
    model: str | None = None


def table_not_found(fingerprint: str, location: str, why: str = "") -> TableNotFoundError:
    """The one wording of 'no table here', for every back end."""
    detail = f" ({why})" if why else ""
    return TableNotFoundError(
        f"no plan table for fingerprint {fingerprint} in store {location}{detail}: run `vbs plan` "
        "for this model with the same store (--store / VBS_STORE) first")


class PlanStore(abc.ABC):
    """Synchronous plan store, used by the CLI (`vbs plan`)."""

    location: str  # where the store is, safe to print (passwords masked)

    @abc.abstractmethod
    def put_table(self, fingerprint: str, blob: bytes, meta: Mapping[str, Any],
                  *, model_key: str | None = None) -> int:
        """Store ``blob`` with ``meta`` under ``fingerprint``; return the new version (1, 2, ...).

        Blob, meta and version are written together: a reader never sees one without the
        others. ``meta`` gains ``version`` and ``stored_at``. With ``model_key``, the model
        alias is pointed at this fingerprint in the same step. Every put is announced.
        """

    @abc.abstractmethod
    def get_table(self, fingerprint: str) -> StoredTable:
        """Return the stored table, or raise TableNotFoundError."""

    @abc.abstractmethod
    def table_version(self, fingerprint: str) -> int | None:
        """Return the current version of a table, or None if none is stored."""

    @abc.abstractmethod
    def put_profile(self, fingerprint: str, data: bytes) -> None:
        """Store profile JSON bytes under ``fingerprint``, replacing any earlier one."""

    @abc.abstractmethod
    def get_profile(self, fingerprint: str) -> bytes | None:
        """Return the stored profile bytes, or None if none is stored."""

    @abc.abstractmethod
    def put_compiled(self, fingerprint: str, data: bytes) -> None:
        """Store a model compiled for workers without torch (``core.compiled``) under its
        profile's ``fingerprint``, replacing any earlier one."""

    @abc.abstractmethod
    def get_compiled(self, fingerprint: str) -> bytes | None:
        """Return the stored compiled model, or None if none is stored."""

    @abc.abstractmethod
    def put_load(self, compiled_id: str, data: bytes) -> None:
        """Store what the compiled model ``compiled_id`` keeps once loaded and how long its
        load took (JSON, measured by `vbs plan`), replacing any earlier figures."""

    @abc.abstractmethod
    def get_load(self, compiled_id: str) -> bytes | None:
        """Return the stored load figures of ``compiled_id``, or None if none are stored."""

    @abc.abstractmethod
    def set_model(self, model_key: str, fingerprint: str) -> None:
        """Point the alias ``model_key`` at ``fingerprint`` (does not announce)."""

    @abc.abstractmethod
    def get_model(self, model_key: str) -> str | None:
        """Return the fingerprint ``model_key`` points at, or None."""

    @abc.abstractmethod
    def list_tables(self) -> list[TableInfo]:
        """Return every stored table's info, sorted by fingerprint."""

    def close(self) -> None:
        """Release connections; the store is not used afterwards."""

    def __enter__(self) -> PlanStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class TableWatch(abc.ABC):
    """Announcements of new tables: an async iterator, best used as an async context manager.

    ``async with store.watch() as announcements:`` returns once the watch is live, so every
    table stored after that point is announced; then ``async for a in announcements``. Used
    bare (``async for a in store.watch()``) it goes live on the first iteration. A lost
    connection raises StoreError: the caller keeps serving its last table, reconnects with
    ``planner.store.backoff`` and re-reads ``get_model``/``table_version`` (announcements made
    while it was away are not replayed). One task iterates a watch at a time.
    """

    def __init__(self) -> None:
        self._started = False
        self._closed = False

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("this watch is closed; call store.watch() again")
        if not self._started:
            await self._start()
            self._started = True

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            if self._started:
                await self._close()

    async def __aenter__(self) -> TableWatch:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def __aiter__(self) -> TableWatch:
        return self

    async def __anext__(self) -> TableAnnouncement:
        if self._closed:
            raise StopAsyncIteration
        await self.start()
        return await self._next()

    @abc.abstractmethod
    async def _start(self) -> None:
        """Go live: from now on every stored table must be announced."""

    @abc.abstractmethod
    async def _next(self) -> TableAnnouncement:
        """Wait for and return the next announcement."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Release what ``_start`` took."""


class AsyncPlanStore(abc.ABC):
    """Asynchronous, read-only view of a plan store, used by workers and the HTTP service."""

    location: str

    @abc.abstractmethod
    async def get_table(self, fingerprint: str) -> StoredTable:
        """Return the stored table, or raise TableNotFoundError."""

    @abc.abstractmethod
    async def table_version(self, fingerprint: str) -> int | None:
        """Return the current version of a table, or None if none is stored."""

    @abc.abstractmethod
    async def get_model(self, model_key: str) -> str | None:
        """Return the fingerprint ``model_key`` points at, or None."""

    @abc.abstractmethod
    async def get_profile(self, fingerprint: str) -> bytes | None:
        """Return the profile stored under ``fingerprint`` (JSON), or None."""

    @abc.abstractmethod
    def watch(self) -> TableWatch:
        """Return a new watch of table announcements (see TableWatch)."""

    async def aclose(self) -> None:
        """Release connections and close open watches."""

    async def __aenter__(self) -> AsyncPlanStore:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
