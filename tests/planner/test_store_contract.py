"""The plan-store contract, run against every back end: a directory, Redis over TCP and over
a unix socket (a real redis-server from tests/conftest.py).

Async behaviour (reads, watching announcements) is driven with ``asyncio.run`` inside plain
tests; every wait on an announcement is bounded by ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from core.errors import StoreError, TableNotFoundError
from planner.store import (AsyncPlanStore, PlanStore, StoredTable, TableAnnouncement,
                           open_async_store, open_store)

WAIT_S = 5.0
POLL_S = 0.02
BINARY = bytes(range(256)) * 3 + b"\xff\xfe\x00\x80 not utf-8 \xc3\x28"


@dataclass(frozen=True)
class Backend:
    """Where one back end under test lives, and how to open it sync or async."""

    name: str
    location: str

    def open(self) -> PlanStore:
        return open_store(self.location)

    def open_async(self) -> AsyncPlanStore:
        return open_async_store(self.location, poll_interval=POLL_S)


@pytest.fixture(params=["local", "redis", "redis-unix"])
def backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    if request.param == "local":
        return Backend("local", str(tmp_path / "store"))
    fixture = "redis_url" if request.param == "redis" else "redis_unix_url"
    return Backend(request.param, request.getfixturevalue(fixture))


@pytest.fixture
def store(backend: Backend) -> Iterator[PlanStore]:
    with backend.open() as opened:
        yield opened


# -- sync contract -------------------------------------------------------------------------

@pytest.mark.parametrize("blob", [BINARY, b"", b"\x00" * 100_000], ids=["binary", "empty", "zeros"])
def test_put_get_round_trip_of_arbitrary_bytes(store: PlanStore, blob: bytes) -> None:
    version = store.put_table("fp1", blob, {"solver": "vbs"})
    table = store.get_table("fp1")
    assert version == 1
    assert isinstance(table, StoredTable)
    assert (table.fingerprint, table.blob, table.version) == ("fp1", blob, 1)
    assert table.meta["solver"] == "vbs" and table.meta["version"] == 1


def test_bytearray_and_memoryview_blobs_are_stored_as_bytes(store: PlanStore) -> None:
    store.put_table("fp1", bytearray(b"abc"), {})
    store.put_table("fp2", memoryview(b"xyz"), {})
    assert store.get_table("fp1").blob == b"abc"
    assert store.get_table("fp2").blob == b"xyz"


def test_versions_increase_per_fingerprint(store: PlanStore) -> None:
    assert [store.put_table("a", f"blob {i}".encode(), {"i": i}) for i in range(3)] == [1, 2, 3]
    assert store.put_table("b", b"other", {}) == 1
    assert store.table_version("a") == 3
    assert store.table_version("b") == 1
    latest = store.get_table("a")
    assert (latest.blob, latest.version, latest.meta["i"]) == (b"blob 2", 3, 2)


def test_meta_round_trip(store: PlanStore) -> None:
    meta = {"solver": "paper", "model": "resnet18", "created_at": "2024-05-01T12:00:00+00:00",
            "budgets": [1, 2.5, None], "nested": {"ok": True, "name": "ünïcødé ✓"},
            "version": 99}
    store.put_table("fp", b"x", meta)
    stored = store.get_table("fp").meta
    assert stored["version"] == 1, "the store's version wins over a caller's 'version'"
    assert isinstance(stored["stored_at"], str)
    assert {k: v for k, v in stored.items() if k not in ("version", "stored_at")} == \
        {k: v for k, v in meta.items() if k != "version"}


def test_meta_that_is_not_json_is_rejected_and_nothing_is_stored(store: PlanStore) -> None:
    with pytest.raises(StoreError, match="JSON"):
        store.put_table("fp", b"x", {"bad": object()})
    with pytest.raises(StoreError, match="JSON"):
        store.put_table("fp", b"x", {"nan": float("nan")})
    assert store.table_version("fp") is None


def test_missing_table_says_to_run_vbs_plan(store: PlanStore) -> None:
    assert store.table_version("nope") is None
    with pytest.raises(TableNotFoundError) as caught:
        store.get_table("nope")
    assert isinstance(caught.value, StoreError)
    message = str(caught.value)
    assert "nope" in message and "`vbs plan`" in message and store.location in message


def test_profiles_round_trip_and_replace(store: PlanStore) -> None:
    assert store.get_profile("fp") is None
    store.put_profile("fp", b'{"schema": "vbs.profile/1"}')
    assert store.get_profile("fp") == b'{"schema": "vbs.profile/1"}'
    store.put_profile("fp", BINARY)
    assert store.get_profile("fp") == BINARY
    assert store.list_tables() == [], "profiles are not tables"


def test_compiled_models_and_their_load_figures_round_trip_apart(store: PlanStore) -> None:
    cid = "fp.0123456789abcdef"
    assert store.get_compiled(cid) is None and store.get_load(cid) is None
    store.put_compiled(cid, BINARY)
    assert store.get_load(cid) is None, "a compiled model is not its load figures"
    store.put_load(cid, b'{"kept_bytes": 1}')
    store.put_load(cid, b'{"kept_bytes": 2}')
    assert store.get_compiled(cid) == BINARY and store.get_load(cid) == b'{"kept_bytes": 2}'
    assert store.get_load("fp.other") is None
    assert store.list_tables() == [], "neither is a table"


@pytest.mark.parametrize("model", ["resnet18", "torchvision:resnet50@3x224x224/float32/cpu",
                                   "pkg.module:factory 2", "../..", "x" * 256])
def test_model_alias(store: PlanStore, model: str) -> None:
    assert store.get_model(model) is None
    store.set_model(model, "fp1")
    assert store.get_model(model) == "fp1"
    store.set_model(model, "fp2")
    assert store.get_model(model) == "fp2"


def test_put_table_with_model_key_points_the_alias(store: PlanStore) -> None:
    store.put_table("fp1", b"one", {}, model_key="resnet18/cpu")
    assert store.get_model("resnet18/cpu") == "fp1"
    store.put_table("fp2", b"two", {}, model_key="resnet18/cpu")
    assert store.get_model("resnet18/cpu") == "fp2"
    assert store.get_model("other") is None


def test_list_tables(store: PlanStore) -> None:
    assert store.list_tables() == []
    store.put_table("zz", b"1", {"model": "b"})
    store.put_table("aa", b"2", {"model": "a"})
    store.put_table("zz", b"3", {"model": "b"})
    infos = store.list_tables()
    assert [(i.fingerprint, i.version, i.meta["model"]) for i in infos] == [("aa", 1, "a"),
                                                                             ("zz", 2, "b")]


@pytest.mark.parametrize("bad", ["", "a:b", "../etc", "a/b", "-lead", "x" * 129, "sp ace"])
def test_invalid_fingerprints_are_rejected(store: PlanStore, bad: str) -> None:
    with pytest.raises(StoreError, match="fingerprint"):
        store.put_table(bad, b"x", {})
    with pytest.raises(StoreError, match="fingerprint"):
        store.get_table(bad)


@pytest.mark.parametrize("bad", ["", " lead", "new\nline", "x" * 257])
def test_invalid_model_keys_are_rejected(store: PlanStore, bad: str) -> None:
    with pytest.raises(StoreError, match="model key"):
        store.set_model(bad, "fp")


def test_concurrent_writers_get_distinct_versions(backend: Backend) -> None:
    """Writers of one fingerprint, each with its own store, never share a version; a reader
    running meanwhile never sees a blob with another put's meta."""
    writers, puts = 4, 6
    versions: list[int] = []
    mismatches: list[str] = []
    done = threading.Event()
    lock = threading.Lock()

    def write(w: int) -> None:
        with backend.open() as mine:
            for i in range(puts):
                tag = f"{w}-{i}"
                version = mine.put_table("shared", tag.encode() * 50, {"tag": tag})
                with lock:
                    versions.append(version)

    def read() -> None:
        with backend.open() as mine:
            while not done.is_set():
                try:
                    table = mine.get_table("shared")
                except TableNotFoundError:
                    continue
                if table.blob != table.meta["tag"].encode() * 50:
                    mismatches.append(f"v{table.version}: meta {table.meta['tag']}")

    reader = threading.Thread(target=read)
    reader.start()
    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    done.set()
    reader.join(timeout=30)
    assert sorted(versions) == list(range(1, writers * puts + 1))
    assert mismatches == []
    with backend.open() as check:
        final = check.get_table("shared")
        assert final.version == writers * puts == check.table_version("shared")
        assert final.blob == final.meta["tag"].encode() * 50


# -- async contract ------------------------------------------------------------------------

def test_async_reads_match_sync_writes(backend: Backend) -> None:
    with backend.open() as store:
        store.put_table("fp", BINARY, {"solver": "vbs"}, model_key="m")
        store.put_table("fp", BINARY + b"2", {"solver": "vbs"})

    async def main() -> None:
        async with backend.open_async() as astore:
            table = await astore.get_table("fp")
            assert (table.blob, table.version, table.meta["solver"]) == (BINARY + b"2", 2, "vbs")
            assert await astore.table_version("fp") == 2
            assert await astore.table_version("nope") is None
            assert await astore.get_model("m") == "fp"
            assert await astore.get_model("unknown") is None
            with pytest.raises(TableNotFoundError, match="vbs plan"):
                await astore.get_table("nope")

    asyncio.run(main())


def test_watch_announces_each_new_table(backend: Backend) -> None:
    with backend.open() as store:
        store.put_table("old", b"before the watch", {})

        async def main() -> list[TableAnnouncement]:
            async with backend.open_async() as astore, astore.watch() as announcements:
                got = []
                # the watch is live: each put below must be announced, and nothing earlier
                await asyncio.to_thread(store.put_table, "fp", b"v1", {}, model_key="resnet18")
                got.append(await asyncio.wait_for(anext(announcements), WAIT_S))
                await asyncio.to_thread(store.put_table, "fp", b"v2", {"model": "from-meta"})
                got.append(await asyncio.wait_for(anext(announcements), WAIT_S))
                await asyncio.to_thread(store.put_table, "other", b"x", {})
                got.append(await asyncio.wait_for(anext(announcements), WAIT_S))
                # what an announcement promises can be read at once
                assert (await astore.get_table("fp")).blob == b"v2"
                assert await astore.get_model("resnet18") == "fp"
                return got

        assert asyncio.run(main()) == [TableAnnouncement("fp", 1, "resnet18"),
                                       TableAnnouncement("fp", 2, "from-meta"),
                                       TableAnnouncement("other", 1, None)]


def test_two_watchers_both_hear_an_announcement(backend: Backend) -> None:
    with backend.open() as store:
        async def main() -> list[TableAnnouncement]:
            async with backend.open_async() as astore, astore.watch() as first, \
                    astore.watch() as second:
                await asyncio.to_thread(store.put_table, "fp", b"x", {})
                return await asyncio.wait_for(asyncio.gather(anext(first), anext(second)), WAIT_S)

        assert asyncio.run(main()) == [TableAnnouncement("fp", 1), TableAnnouncement("fp", 1)]


def test_closed_watch_stops_iterating(backend: Backend) -> None:
    async def main() -> None:
        async with backend.open_async() as astore:
            watch = astore.watch()
            await watch.start()
            await watch.aclose()
            with pytest.raises(StopAsyncIteration):
                await anext(watch)
            # closing the store closes the watches it handed out
            other = astore.watch()
            await other.start()
        with pytest.raises(StopAsyncIteration):
            await anext(other)

    asyncio.run(main())
