"""The plan store in a local directory: the embedded default (``<cache_dir>/store``).

Layout, mirroring the Redis key scheme (``planner.store.keys``)::

    <dir>/tables/<fingerprint>.table     b"vbs-table/1\\n" + meta JSON + b"\\n" + blob
    <dir>/tables/<fingerprint>.version   the last announcement JSON {fingerprint, version, model}
    <dir>/tables/<fingerprint>.lock      held (flock) by a writer of that fingerprint
    <dir>/profiles/<fingerprint>.json    profile JSON bytes
    <dir>/compiled/<fingerprint>.zip     the model compiled for a worker without torch
    <dir>/loads/<compiled-id>.json       what that compiled model keeps loaded, its load's time
    <dir>/models/<model-key>.model       the fingerprint the model key points at

The meta (with its version) is the first line of the table file, so blob and meta are
replaced together by one ``os.replace``: a reader sees the old pair or the new pair, never a
blob with the wrong meta, and needs no lock. Every file is written to a temporary file in
the same directory and renamed over the old one. Writers of one fingerprint take an
exclusive flock so concurrent ``put_table`` calls get distinct versions. After the table
(and model alias) is in place, the ``.version`` file is replaced: that is the announcement,
which ``AsyncLocalStore.watch()`` finds by polling.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import hashlib
import os
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

from core.errors import StoreError, TableFormatError
from planner.store.base import (AsyncPlanStore, PlanStore, StoredTable, TableAnnouncement,
                                TableInfo, TableWatch, table_not_found)
from planner.store.codec import (announced_model, decode_announcement, decode_meta,
                                 encode_announcement, encode_meta)
from planner.store.keys import check_fingerprint, check_model_key

MAGIC = b"vbs-table/1\n"
_HEADER_LIMIT = 1 << 20  # the meta line is small; never read a whole blob by mistake
_FILE_MODE = 0o644
DEFAULT_POLL_INTERVAL = 1.0


def _os_error(action: str, path: Path, exc: OSError) -> StoreError:
    reason = exc.strerror or str(exc)
    return StoreError(f"cannot {action} {path}: {reason}; choose a writable directory for the "
                      "plan store (--store or VBS_STORE) or fix its permissions")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _model_file_name(model_key: str) -> str:
    name = quote(model_key, safe="")
    if len(name) > 200:  # file names are limited to 255 bytes
        name = "sha256-" + hashlib.sha256(model_key.encode()).hexdigest()
    return name + ".model"


class LocalStore(PlanStore):
    """Plan store in a directory on the local file system."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).expanduser()
        self.location = str(self.directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise StoreError(f"plan store {self.directory} is a file, not a directory: "
                             "choose a directory (--store or VBS_STORE)")
        self._tables = self.directory / "tables"
        self._profiles = self.directory / "profiles"
        self._compiled = self.directory / "compiled"
        self._loads = self.directory / "loads"
        self._models = self.directory / "models"

    # -- paths and low-level reads -------------------------------------------------------

    def table_path(self, fingerprint: str) -> Path:
        return self._tables / f"{check_fingerprint(fingerprint)}.table"

    def version_path(self, fingerprint: str) -> Path:
        return self._tables / f"{check_fingerprint(fingerprint)}.version"

    def _ensure(self, directory: Path) -> Path:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _os_error("create the plan store directory", directory, exc) from exc
        return directory

    def _write(self, path: Path, data: bytes) -> None:
        try:
            write_atomic(path, data)
        except OSError as exc:
            raise _os_error("write", path, exc) from exc

    def _read(self, path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror or exc}; check the plan store's "
                             "permissions (--store or VBS_STORE)") from exc

    def _read_meta(self, path: Path) -> dict[str, Any] | None:
        """The meta line of a table file, without reading its blob; None if there is no file."""
        try:
            with open(path, "rb") as handle:
                magic = handle.read(len(MAGIC))
                line = handle.readline(_HEADER_LIMIT)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror or exc}; check the plan store's "
                             "permissions (--store or VBS_STORE)") from exc
        if magic != MAGIC or not line.endswith(b"\n"):
            raise TableFormatError(f"{path} is not a vbs table file: delete it and run "
                                   "`vbs plan` again")
        return decode_meta(line[:-1], str(path))

    @contextmanager
    def _writer_lock(self, fingerprint: str) -> Iterator[None]:
        path = self._tables / f"{fingerprint}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, _FILE_MODE)
        except OSError as exc:
            raise _os_error("lock", path, exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _current_version(self, fingerprint: str) -> int:
        """Highest version written so far: the table file's, or the announcement's after a crash."""
        version = 0
        try:
            meta = self._read_meta(self.table_path(fingerprint))
            version = meta["version"] if meta else 0
        except StoreError:
            pass  # a damaged table file is overwritten; its version survives in .version
        data = self._read(self.version_path(fingerprint))
        announcement = decode_announcement(data) if data else None
        if announcement is not None:
            version = max(version, announcement.version)
        return version

    def _missing_why(self) -> str:
        return "" if self.directory.is_dir() else "the store directory does not exist"

    # -- PlanStore -----------------------------------------------------------------------

    def put_table(self, fingerprint: str, blob: bytes, meta: Mapping[str, Any],
                  *, model_key: str | None = None) -> int:
        check_fingerprint(fingerprint)
        if model_key is not None:
            check_model_key(model_key)
        blob = bytes(blob)
        self._ensure(self._tables)
        if model_key is not None:
            self._ensure(self._models)
        with self._writer_lock(fingerprint):
            version = self._current_version(fingerprint) + 1
            record = encode_meta(meta, version)
            self._write(self.table_path(fingerprint), MAGIC + record + b"\n" + blob)
            if model_key is not None:
                self._write_model(model_key, fingerprint)
            announcement = TableAnnouncement(fingerprint, version, announced_model(meta, model_key))
            self._write(self.version_path(fingerprint), encode_announcement(announcement))
        return version

    def get_table(self, fingerprint: str) -> StoredTable:
        path = self.table_path(fingerprint)
        data = self._read(path)
        if data is None:
            raise table_not_found(fingerprint, self.location, self._missing_why())
        end = data.find(b"\n", len(MAGIC))
        if not data.startswith(MAGIC) or end < 0:
            raise TableFormatError(f"{path} is not a vbs table file: delete it and run "
                                   "`vbs plan` again")
        meta = decode_meta(data[len(MAGIC):end], str(path))
        return StoredTable(fingerprint=fingerprint, blob=data[end + 1:], meta=meta,
                           version=meta["version"])

    def table_version(self, fingerprint: str) -> int | None:
        meta = self._read_meta(self.table_path(fingerprint))
        return None if meta is None else meta["version"]

    def put_profile(self, fingerprint: str, data: bytes) -> None:
        path = self._profiles / f"{check_fingerprint(fingerprint)}.json"
        self._ensure(self._profiles)
        self._write(path, bytes(data))

    def get_profile(self, fingerprint: str) -> bytes | None:
        return self._read(self._profiles / f"{check_fingerprint(fingerprint)}.json")

    def put_compiled(self, fingerprint: str, data: bytes) -> None:
        path = self._compiled / f"{check_fingerprint(fingerprint)}.zip"
        self._ensure(self._compiled)
        self._write(path, bytes(data))

    def get_compiled(self, fingerprint: str) -> bytes | None:
        return self._read(self._compiled / f"{check_fingerprint(fingerprint)}.zip")

    def put_load(self, compiled_id: str, data: bytes) -> None:
        path = self._loads / f"{check_fingerprint(compiled_id)}.json"
        self._ensure(self._loads)
        self._write(path, bytes(data))

    def get_load(self, compiled_id: str) -> bytes | None:
        return self._read(self._loads / f"{check_fingerprint(compiled_id)}.json")

    def set_model(self, model_key: str, fingerprint: str) -> None:
        check_model_key(model_key)
        check_fingerprint(fingerprint)
        self._ensure(self._models)
        self._write_model(model_key, fingerprint)

    def _write_model(self, model_key: str, fingerprint: str) -> None:
        self._write(self._models / _model_file_name(model_key), fingerprint.encode() + b"\n")

    def get_model(self, model_key: str) -> str | None:
        path = self._models / _model_file_name(check_model_key(model_key))
        data = self._read(path)
        if data is None:
            return None
        try:
            return check_fingerprint(data.decode().strip())
        except (UnicodeDecodeError, StoreError) as exc:
            raise TableFormatError(f"{path} does not hold a fingerprint: delete it and run "
                                   "`vbs plan` again") from exc

    def list_tables(self) -> list[TableInfo]:
        try:
            paths = sorted(self._tables.glob("*.table"))
        except OSError as exc:
            raise StoreError(f"cannot list {self._tables}: {exc.strerror or exc}") from exc
        infos = []
        for path in paths:
            meta = self._read_meta(path)
            if meta is not None:  # None: removed while listing
                infos.append(TableInfo(fingerprint=path.stem, version=meta["version"], meta=meta))
        return infos


def scan_announcements(tables: Path) -> dict[str, TableAnnouncement]:
    """Read every ``.version`` file under ``tables``: the latest announcement per fingerprint."""
    found: dict[str, TableAnnouncement] = {}
    try:
        entries = list(os.scandir(tables))
    except FileNotFoundError:
        return found
    except OSError as exc:
        raise StoreError(f"cannot list {tables}: {exc.strerror or exc}; check the plan store's "
                         "permissions") from exc
    for entry in entries:
        if not entry.name.endswith(".version") or entry.name.startswith("."):
            continue
        try:
            with open(entry.path, "rb") as handle:
                announcement = decode_announcement(handle.read())
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StoreError(f"cannot read {entry.path}: {exc.strerror or exc}") from exc
        if announcement is not None:
            found[announcement.fingerprint] = announcement
    return found


class LocalTableWatch(TableWatch):
    """Announcements from a local store, found by polling its ``.version`` files.

    Each poll reports the latest version of each fingerprint that changed, so two puts of
    one fingerprint within one interval are announced once, with the later version.
    """

    def __init__(self, tables: Path, poll_interval: float) -> None:
        super().__init__()
        self._tables = tables
        self._interval = poll_interval
        self._seen: dict[str, int] = {}
        self._pending: collections.deque[TableAnnouncement] = collections.deque()

    async def _start(self) -> None:
        current = await asyncio.to_thread(scan_announcements, self._tables)
        self._seen = {fp: a.version for fp, a in current.items()}

    async def _next(self) -> TableAnnouncement:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            current = await asyncio.to_thread(scan_announcements, self._tables)
            fresh = [a for fp, a in current.items() if a.version > self._seen.get(fp, 0)]
            for announcement in sorted(fresh, key=lambda a: (a.fingerprint, a.version)):
                self._seen[announcement.fingerprint] = announcement.version
                self._pending.append(announcement)
            if not self._pending:
                await asyncio.sleep(self._interval)
        return self._pending.popleft()

    async def _close(self) -> None:
        self._pending.clear()


class AsyncLocalStore(AsyncPlanStore):
    """Async reads of a local store (file I/O runs in threads, off the event loop)."""

    def __init__(self, directory: str | os.PathLike[str], *,
                 poll_interval: float = DEFAULT_POLL_INTERVAL) -> None:
        if poll_interval <= 0:
            raise StoreError(f"poll interval {poll_interval} must be positive (seconds)")
        self._store = LocalStore(directory)
        self.location = self._store.location
        self.poll_interval = poll_interval
        self._watches: weakref.WeakSet[TableWatch] = weakref.WeakSet()

    async def get_table(self, fingerprint: str) -> StoredTable:
        return await asyncio.to_thread(self._store.get_table, fingerprint)

    async def table_version(self, fingerprint: str) -> int | None:
        return await asyncio.to_thread(self._store.table_version, fingerprint)

    async def get_model(self, model_key: str) -> str | None:
        return await asyncio.to_thread(self._store.get_model, model_key)

    async def get_profile(self, fingerprint: str) -> bytes | None:
        return await asyncio.to_thread(self._store.get_profile, fingerprint)

    def watch(self) -> TableWatch:
        watch = LocalTableWatch(self._store.directory / "tables", self.poll_interval)
        self._watches.add(watch)
        return watch

    async def aclose(self) -> None:
        for watch in list(self._watches):
            await watch.aclose()
