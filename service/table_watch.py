"""Keeping the served tables current: the plan store watched, new versions swapped in.

When the planner announces a new version of a served table, it and the tables compared with
it are read and swapped in between batches (a batch keeps the table it started with). A model
served from an interim table (``service.first_start``) waits for the first version of its
table the same way; with it come every strategy's table and the profile. When
the store goes away, serving goes on from the tables in memory while the watch reconnects
with backoff; a new version that cannot be used is logged, counted and not read again, and
the model keeps its table.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import replace

from core.errors import ProfileError, StoreError, TableFormatError, UsageError, VbsError
from core.table import PlanTable
from core.tree import Profile, profile_from_json
from planner.store import Backoff, open_async_store
from planner.store.base import AsyncPlanStore
from planner.store.keys import table_id
from planner.stored import strategies
from service.entry import ModelEntry
from service.errors import UnavailableError
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger("vbs.service")


async def _profile(store: AsyncPlanStore, fingerprint: str | None) -> Profile:
    """The profile published under ``fingerprint`` (its tree and measurements, for the page)."""
    raw = await store.get_profile(fingerprint or "")
    where = f"profile {fingerprint} in store {store.location}"
    if raw is None:
        raise TableFormatError(f"{where} is missing: run `vbs plan --replan`")
    try:
        return await asyncio.to_thread(lambda: profile_from_json(json.loads(raw)))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ProfileError) as exc:
        raise TableFormatError(f"{where} cannot be read ({exc}): run `vbs plan --replan`") \
            from exc


class TableWatcher:
    """Watches the store for the tables of ``entries`` (see the module doc)."""

    def __init__(self, settings: Settings, metrics: Metrics, entries: dict[str, ModelEntry],
                 backoff: Backoff, rng: random.Random) -> None:
        self.settings, self.metrics, self.entries = settings, metrics, entries
        self.backoff, self._rng = backoff, rng
        self._astore: AsyncPlanStore | None = None
        self._changed = asyncio.Event()  # replaced after every table swap
        self.store_up: bool | None = None
        self._unusable: dict[str, int] = {}  # model -> the last table version that could not be used

    async def wait_table(self, name: str, version: int, timeout_s: float) -> None:
        """Wait until model ``name`` serves table ``version`` or a later one."""
        entry = self.entries[name]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while entry.table_version is None or entry.table_version < version:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise UnavailableError(f"model {name} still serves table {entry.table_version}, "
                                       f"not {version}, after {timeout_s} s")
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                continue

    def _set_store_up(self, up: bool) -> None:
        self.store_up = up
        self.metrics.store_up.set(1 if up else 0)

    async def run(self) -> None:
        try:
            self._astore = open_async_store(self.settings.store_location,
                                            poll_interval=self.settings.store_poll_s)
        except StoreError as exc:
            self.metrics.store_errors.inc()
            log.error("cannot watch the plan store for new tables: %s", exc)
            return
        attempt = 0
        while True:
            try:
                async with self._astore.watch() as announcements:
                    if attempt:
                        log.info("plan store %s is back; checking for tables published "
                                 "meanwhile", self._astore.location)
                    self._set_store_up(True)
                    attempt = 0
                    await self._catch_up(self._astore)
                    async for announcement in announcements:
                        for entry in self._serving(announcement.fingerprint):
                            await self._reload(self._astore, entry, announcement.version)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the watch must outlive any one failure
                if not isinstance(exc, StoreError):
                    log.exception("plan store watch failed unexpectedly")
                self._set_store_up(False)
                self.metrics.store_errors.inc()
                delay = self.backoff.delay(attempt, self._rng.random())
                attempt += 1
                log.warning("plan store: %s; serving goes on from the tables in memory; "
                            "retrying in %.2f s", " ".join(str(exc).split()), delay)
                await asyncio.sleep(delay)

    def _serving(self, table_id: str) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.ready and e.table_id == table_id]

    async def _catch_up(self, store: AsyncPlanStore) -> None:
        for entry in [e for e in self.entries.values() if e.ready]:
            try:
                version = await store.table_version(entry.table_id)
            except TableFormatError as exc:  # this model's counter: the others go on
                self.metrics.store_errors.inc()
                log.error("%s: keeping table v%s: %s", entry.name, entry.table_version, exc)
                continue
            if version is not None:
                await self._reload(store, entry, version)

    async def _reload(self, store: AsyncPlanStore, entry: ModelEntry, version: int) -> None:
        """Swap in version ``version`` (or a later one) of ``entry``'s table if it is usable;
        else keep serving the one in memory. Only a store that is down raises (StoreError)."""
        seen = max(entry.table_version or 0, self._unusable.get(entry.name, 0))
        if version <= seen:
            return
        where = f"table {entry.table_id} in store {store.location}"
        try:
            stored = await store.get_table(entry.table_id)
        except TableFormatError as exc:  # bad meta: this version is skipped, not retried
            self.metrics.store_errors.inc()
            log.error("%s: table v%d cannot be used, keeping v%s: %s", entry.name, version,
                      entry.table_version, exc)
            self._unusable[entry.name] = version
            return
        if stored.version <= seen:
            return
        try:
            table = await asyncio.to_thread(PlanTable.from_bytes, stored.blob, where)
            if (table.fingerprint, table.solver, table.objective) != (
                    entry.fingerprint, self.settings.solver, self.settings.objective):
                raise UsageError(f"the table under {entry.table_id} holds {table.solver!r} plans "
                                 f"for {table.objective!r} of fingerprint {table.fingerprint}")
            why = entry.worker.unusable(table) if entry.worker is not None else ""
            if why:
                raise UsageError(why)
            tables = await self._compared(store, entry, table)
            profile = await _profile(store, entry.fingerprint) if entry.interim else None
        except Exception as exc:  # noqa: BLE001 - malformed or mismatched: keep serving the old
            self.metrics.store_errors.inc()
            log.error("%s: table v%d cannot be used, keeping v%s: %s", entry.name, stored.version,
                      entry.table_version, exc, exc_info=not isinstance(exc, VbsError))
            self._unusable[entry.name] = stored.version  # not read again until a newer one
            return
        worker = entry.worker
        if worker is None:  # unloaded meanwhile: its next load reads the newest table
            return
        await asyncio.to_thread(worker.prepare, table)  # its runtimes' sessions, off the loop
        if entry.worker is not worker:  # unloaded (or loaded again) meanwhile
            return
        worker.table = table
        entry.tables = tables
        if entry.interim:  # planned beside serving: its planned tables replace the interim one
            entry.solver, entry.profile = table.solver, profile
            entry.prepared = replace(entry.prepared, profile=profile, tables=tables,
                                     solver=table.solver)
        old = entry.table_version
        entry.table_version = stored.version
        entry.table_meta = dict(stored.meta)
        entry.cache.clear()
        self.metrics.table_reloads.labels(entry.name).inc()
        self.metrics.table_version.labels(entry.name).set(stored.version)
        log.info("%s: table v%s -> v%d swapped in (%s, %d plans)", entry.name, old,
                 stored.version, table.solver, len(table.plans))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _compared(self, store: AsyncPlanStore, entry: ModelEntry, table: PlanTable
                        ) -> dict[str, PlanTable]:
        """``table`` and the tables /plan compares it with, read from the store where they can
        be (else the ones in memory); a model leaving its interim table reads every strategy
        `vbs plan` stores."""
        tables = {table.solver: table}
        solvers = strategies(table.solver) if entry.interim else tuple(entry.tables)
        for solver in solvers:
            if solver == table.solver:
                continue
            try:
                tid = table_id(entry.fingerprint, solver, table.objective)
                other = await store.get_table(tid)
                tables[solver] = await asyncio.to_thread(
                    PlanTable.from_bytes, other.blob, f"table {tid} in store {store.location}")
            except StoreError as exc:
                if solver in entry.tables:
                    log.warning("%s: keeping the %s table in memory: %s", entry.name, solver,
                                exc)
                    tables[solver] = entry.tables[solver]
                else:
                    log.warning("%s: no %s table to compare with: %s", entry.name, solver, exc)
        return tables

    async def close(self) -> None:
        if self._astore is not None:
            try:
                await self._astore.aclose()
            except StoreError as exc:
                log.debug("closing the plan store: %s", exc)
