"""How the plan store fails: unreachable Redis, unusable directories, damaged data, bad
locations. Every failure is a StoreError that says what was wrong and what to do."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.errors import StoreError, TableNotFoundError
from planner.settings import Settings
from planner.store import (AsyncLocalStore, AsyncRedisStore, LocalStore, RedisStore,
                           open_async_store, open_store, printable_location)
from planner.store.keys import mask_url


# -- Redis that cannot be reached ----------------------------------------------------------

def test_unreachable_redis_names_the_url_without_the_password(closed_redis_url: str) -> None:
    store = open_store(closed_redis_url)
    assert isinstance(store, RedisStore)
    shown = closed_redis_url.replace("s3cret", "***")
    started = time.monotonic()
    for call in (lambda: store.put_table("fp", b"x", {}), lambda: store.get_table("fp"),
                 lambda: store.get_model("m"), store.list_tables):
        with pytest.raises(StoreError) as caught:
            call()
        message = str(caught.value)
        assert shown in message and "s3cret" not in message
        assert "is redis-server running?" in message
        assert not isinstance(caught.value, TableNotFoundError)
    assert time.monotonic() - started < 10, "a store that is down is reported quickly"
    store.close()


def test_unreachable_redis_async_says_serving_continues(closed_redis_url: str) -> None:
    async def main() -> list[str]:
        messages = []
        async with open_async_store(closed_redis_url) as store:
            assert isinstance(store, AsyncRedisStore)
            for call in (lambda: store.table_version("fp"), lambda: store.get_table("fp"),
                         lambda: store.get_model("m")):
                with pytest.raises(StoreError) as caught:
                    await call()
                messages.append(str(caught.value))
            with pytest.raises(StoreError) as caught:
                async with store.watch():
                    pass
            messages.append(str(caught.value))
        return messages

    for message in asyncio.run(main()):
        assert closed_redis_url.replace("s3cret", "***") in message
        assert "s3cret" not in message
        assert "is redis-server running? serving continues from the last table" in message


def test_unix_socket_that_does_not_exist(tmp_path: Path) -> None:
    url = f"unix://{tmp_path / 'absent.sock'}"
    with pytest.raises(StoreError, match="is redis-server running"), open_store(url) as store:
        store.table_version("fp")


def test_redis_that_stops_mid_watch_raises_store_error(redis_server_factory) -> None:
    """A private redis-server is stopped while a watcher waits on it."""
    server = redis_server_factory()

    async def main() -> str:
        async with open_async_store(server.url) as store, store.watch() as announcements:
            waiter = asyncio.ensure_future(anext(announcements))
            await asyncio.to_thread(server.stop)
            with pytest.raises(StoreError) as caught:
                await asyncio.wait_for(waiter, 10)
            return str(caught.value)

    message = asyncio.run(main())
    assert server.url in message and "serving continues from the last table" in message


# -- directories that cannot be used -------------------------------------------------------

def test_missing_directory_reads_as_empty_and_says_so(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "never-created")
    assert store.table_version("fp") is None
    assert store.get_model("m") is None
    assert store.get_profile("fp") is None
    assert store.list_tables() == []
    with pytest.raises(TableNotFoundError, match="does not exist.*`vbs plan`"):
        store.get_table("fp")
    assert not (tmp_path / "never-created").exists(), "reads create nothing"


def test_missing_directory_is_created_on_first_write(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "a" / "b" / "store")
    assert store.put_table("fp", b"x", {}) == 1
    assert store.get_table("fp").blob == b"x"


def test_directory_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = LocalStore(blocker / "store")
    with pytest.raises(StoreError, match="cannot create the plan store directory .*writable"):
        store.put_table("fp", b"x", {})
    with pytest.raises(StoreError, match="cannot create the plan store directory"):
        store.put_profile("fp", b"{}")


def test_store_path_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "store"
    path.write_bytes(b"")
    with pytest.raises(StoreError, match="is a file, not a directory"):
        LocalStore(path)
    with pytest.raises(StoreError, match="is a file, not a directory"):
        open_async_store(str(path))


_READ_ONLY_CHECK = """
import sys
from core.errors import StoreError
from planner.store import LocalStore
store = LocalStore(sys.argv[1])
for write in (lambda: store.put_table("fp", b"new", {}), lambda: store.set_model("m", "fp")):
    try:
        write()
    except StoreError as exc:
        print(exc)
    else:
        sys.exit("a write to a read-only store did not fail")
assert store.get_table("fp").blob == b"old", "a failed write must leave the old table"
"""


def test_read_only_directory(tmp_path: Path) -> None:
    """Writes to a read-only store fail with a StoreError; the old table stays readable.

    Root ignores permission bits, so as root the check runs in a child without the
    capabilities that let root write anywhere (setpriv), which then sees what a user sees.
    """
    store_dir = tmp_path / "store"
    LocalStore(store_dir).put_table("fp", b"old", {})
    modes = {p: p.stat().st_mode for p in [store_dir, store_dir / "tables"]}
    for path in modes:
        path.chmod(0o555)
    try:
        command = [sys.executable, "-c", _READ_ONLY_CHECK, str(store_dir)]
        if os.access(store_dir / "tables", os.W_OK):
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                pytest.skip("running as root without setpriv: permission bits do not stop root, "
                            "so a read-only directory cannot be made here")
            drop = "-dac_override,-dac_read_search"
            command = [setpriv, "--bounding-set", drop, "--inh-caps", drop, *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        messages = done.stdout.splitlines()
        assert len(messages) == 2
        for message in messages:
            assert re.search(r"cannot .*: Permission denied; choose a writable directory", message)
    finally:
        for path, mode in modes.items():
            path.chmod(mode)


def test_damaged_table_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_table("fp", b"x", {})
    store.table_path("fp").write_bytes(b"garbage")
    with pytest.raises(StoreError, match="not a vbs table file"):
        store.get_table("fp")
    with pytest.raises(StoreError, match="not a vbs table file"):
        store.table_version("fp")
    assert store.put_table("fp", b"y", {}) == 2, "a put repairs it, keeping versions rising"
    assert store.get_table("fp").blob == b"y"


def test_damaged_meta_in_redis(redis_url: str) -> None:
    import redis

    with open_store(redis_url) as store:
        store.put_table("fp", b"x", {})
        with redis.Redis.from_url(redis_url) as client:
            client.set("vbs:v1:table:fp:meta", b"\xff not json")
        with pytest.raises(StoreError, match="not JSON.*vbs plan"):
            store.get_table("fp")


def test_no_temporary_files_are_left_behind(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    for i in range(3):
        store.put_table("fp", bytes([i]), {}, model_key="m")
    store.put_profile("fp", b"{}")
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


# -- locations -----------------------------------------------------------------------------

def test_open_store_picks_the_back_end(tmp_path: Path, redis_url: str, redis_unix_url: str) -> None:
    assert isinstance(open_store(redis_url), RedisStore)
    assert isinstance(open_store(redis_unix_url), RedisStore)
    assert isinstance(open_store("rediss://localhost:6380/0"), RedisStore)
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(tmp_path), LocalStore)
    assert isinstance(open_async_store(str(tmp_path)), AsyncLocalStore)


@pytest.mark.parametrize("location, match", [
    ("http://example.com/store", "not supported"),
    ("", "empty"),
    ("   ", "empty"),
    ("redis://:pw@host:notaport/0", r"redis://:\*\*\*@host:notaport/0 is not valid"),
])
def test_bad_locations(location: str, match: str) -> None:
    with pytest.raises(StoreError, match=match):
        open_store(location)


def test_bad_poll_interval(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="poll interval"):
        open_async_store(str(tmp_path), poll_interval=0)


def test_settings_store_location_opens_a_local_store(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path)
    store = open_store(settings.store_location)
    assert isinstance(store, LocalStore) and store.directory == tmp_path / "store"


@pytest.mark.parametrize("url, shown", [
    ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
    ("redis://user:pw@h:1/0", "redis://user:***@h:1/0"),
    ("rediss://user@h:1", "rediss://user@h:1"),
    ("redis://h:6379/2", "redis://h:6379/2"),
    ("unix:///run/redis.sock?db=1&password=pw", "unix:///run/redis.sock?db=1&password=***"),
])
def test_mask_url(url: str, shown: str) -> None:
    assert mask_url(url) == shown


@pytest.mark.parametrize("location, shown", [
    (" redis://:pw@redis:6379/0 ", "redis://:***@redis:6379/0"),
    ("unix:///run/redis.sock?password=pw", "unix:///run/redis.sock?password=***"),
    ("/var/cache/vbs/store", "/var/cache/vbs/store"),
])
def test_printable_location_masks_redis_passwords_only(location: str, shown: str) -> None:
    """What `vbs serve` and `vbs plan` log as their store (docker compose logs show it)."""
    assert printable_location(location) == shown
