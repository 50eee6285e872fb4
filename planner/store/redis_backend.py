"""The plan store in Redis: the production back end, shared by planner Jobs and workers.

Keys follow ``planner.store.keys``. ``put_table`` is one optimistic transaction: it WATCHes
the fingerprint's version key, reads it, and in MULTI/EXEC writes version + 1, the blob, the
meta (carrying that version), the table index, the model alias (if given) and PUBLISHes the
announcement; if another writer got in between, EXEC fails and the transaction runs again.
So concurrent writers get distinct versions, and since ``get_table`` reads blob and meta with
one MGET, a reader never sees a blob with the wrong meta.

Redis and socket errors are translated here into StoreError naming the URL (password masked).
redis-py's own retries are kept short, so a store that is down is reported within a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, RedisError
from redis.retry import Retry

from core.errors import StoreError, TableFormatError
from planner.store import keys
from planner.store.base import (AsyncPlanStore, PlanStore, StoredTable, TableAnnouncement,
                                TableInfo, TableWatch, table_not_found)
from planner.store.codec import (announced_model, decode_announcement, decode_meta,
                                 encode_announcement, encode_meta)
from planner.store.keys import CHANNEL, TABLE_INDEX, check_fingerprint, check_model_key, mask_url

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0
REDIS_VALUE_MAX = 512 * 1024 * 1024  # the most one Redis string holds (proto-max-bulk-len)
DEFAULT_RETRIES = 2
SYNC_HINT = ("is redis-server running? Start it, or point the plan store at a directory "
             "(--store or VBS_STORE)")
ASYNC_HINT = "is redis-server running? serving continues from the last table"
_URL_FORMS = "use redis://[:password@]host:port/db, rediss://... or unix:///path/to/redis.sock"


def translate(exc: BaseException, location: str, hint: str) -> StoreError:
    """The StoreError for a redis-py or socket error met while talking to ``location``."""
    if isinstance(exc, (AuthenticationError, AuthorizationError)):
        return StoreError(f"redis at {location} refused the credentials ({exc}): check the user "
                          "and password in the store URL")
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
        return StoreError(f"cannot reach redis at {location} ({exc}): {hint}")
    return StoreError(f"redis at {location} failed ({exc}): check that it is a Redis server "
                      "the plan store may write to")


@contextlib.contextmanager
def _translated(location: str, hint: str) -> Iterator[None]:
    try:
        yield
    except (RedisError, OSError) as exc:
        raise translate(exc, location, hint) from exc


def _client_options(timeout: float, retries: int, retry_class: type) -> dict[str, Any]:
    return {"socket_connect_timeout": timeout, "socket_timeout": timeout,
            "retry": retry_class(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries)}


def _bad_url(url: str, exc: Exception) -> StoreError:
    return StoreError(f"plan store URL {mask_url(url)} is not valid ({exc}): {_URL_FORMS}")


def _fingerprint_from(data: bytes | None, where: str, location: str) -> str | None:
    if data is None:
        return None
    try:
        return check_fingerprint(data.decode())
    except (UnicodeDecodeError, StoreError) as exc:
        raise TableFormatError(f"{where} in redis at {location} does not hold a fingerprint: "
                               "set it again with `vbs plan`") from exc


def _stored_table(fingerprint: str, blob: bytes | None, meta: bytes | None,
                  location: str) -> StoredTable:
    if blob is None:
        raise table_not_found(fingerprint, location)
    if meta is None:
        raise TableFormatError(f"{keys.meta_key(fingerprint)} in redis at {location} is "
                               "missing beside its table: run `vbs plan --replan` to rewrite it")
    record = decode_meta(meta, f"{keys.meta_key(fingerprint)} in redis at {location}")
    return StoredTable(fingerprint=fingerprint, blob=bytes(blob), meta=record,
                       version=record["version"])


def _version_from(data: bytes | None, fingerprint: str, location: str) -> int | None:
    if data is None:
        return None
    try:
        return int(data)
    except ValueError as exc:
        raise TableFormatError(f"{keys.version_key(fingerprint)} in redis at {location} is not "
                               "an integer: run `vbs plan --replan` to rewrite the table") from exc


class RedisStore(PlanStore):
    """Plan store in Redis, through a synchronous redis-py client."""

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT,
                 retries: int = DEFAULT_RETRIES) -> None:
        self.location = mask_url(url)
        try:
            self._client = redis.Redis.from_url(url, **_client_options(timeout, retries, Retry))
        except (ValueError, TypeError, RedisError) as exc:
            raise _bad_url(url, exc) from exc

    def _errors(self) -> contextlib.AbstractContextManager[None]:
        return _translated(self.location, SYNC_HINT)

    def put_table(self, fingerprint: str, blob: bytes, meta: Mapping[str, Any],
                  *, model_key: str | None = None) -> int:
        check_fingerprint(fingerprint)
        if model_key is not None:
            check_model_key(model_key)
        blob = bytes(blob)
        encode_meta(meta, 0)  # reject meta that is not JSON before talking to redis
        counter = keys.version_key(fingerprint)

        def write(pipe: redis.client.Pipeline) -> int:
            version = _version_from(pipe.get(counter), fingerprint, self.location) or 0
            version += 1
            announcement = TableAnnouncement(fingerprint, version, announced_model(meta, model_key))
            pipe.multi()
            pipe.set(counter, version)
            pipe.set(keys.table_key(fingerprint), blob)
            pipe.set(keys.meta_key(fingerprint), encode_meta(meta, version))
            pipe.sadd(TABLE_INDEX, fingerprint)
            if model_key is not None:
                pipe.set(keys.model_key(model_key), fingerprint)
            pipe.publish(CHANNEL, encode_announcement(announcement))
            return version

        with self._errors():
            return self._client.transaction(write, counter, value_from_callable=True)

    def get_table(self, fingerprint: str) -> StoredTable:
        with self._errors():
            blob, meta = self._client.mget(keys.table_key(fingerprint), keys.meta_key(fingerprint))
        return _stored_table(fingerprint, blob, meta, self.location)

    def table_version(self, fingerprint: str) -> int | None:
        with self._errors():
            data = self._client.get(keys.version_key(fingerprint))
        return _version_from(data, fingerprint, self.location)

    def put_profile(self, fingerprint: str, data: bytes) -> None:
        key = keys.profile_key(fingerprint)
        with self._errors():
            self._client.set(key, bytes(data))

    def get_profile(self, fingerprint: str) -> bytes | None:
        key = keys.profile_key(fingerprint)
        with self._errors():
            return self._client.get(key)

    def put_compiled(self, fingerprint: str, data: bytes) -> None:
        if len(data) > REDIS_VALUE_MAX:
            raise StoreError(f"the compiled model {fingerprint} is {len(data)} bytes, more than a "
                             f"Redis value holds ({REDIS_VALUE_MAX}): use a directory store "
                             "(--store DIR) for this model")
        key = keys.compiled_key(fingerprint)
        with self._errors():
            self._client.set(key, bytes(data))

    def get_compiled(self, fingerprint: str) -> bytes | None:
        key = keys.compiled_key(fingerprint)
        with self._errors():
            return self._client.get(key)

    def put_load(self, compiled_id: str, data: bytes) -> None:
        key = keys.load_key(compiled_id)
        with self._errors():
            self._client.set(key, bytes(data))

    def get_load(self, compiled_id: str) -> bytes | None:
        key = keys.load_key(compiled_id)
        with self._errors():
            return self._client.get(key)

    def set_model(self, model_key: str, fingerprint: str) -> None:
        key = keys.model_key(model_key)
        check_fingerprint(fingerprint)
        with self._errors():
            self._client.set(key, fingerprint)

    def get_model(self, model_key: str) -> str | None:
        key = keys.model_key(model_key)
        with self._errors():
            data = self._client.get(key)
        return _fingerprint_from(data, key, self.location)

    def list_tables(self) -> list[TableInfo]:
        with self._errors():
            members = sorted(m.decode() for m in self._client.smembers(TABLE_INDEX))
            metas = self._client.mget([keys.meta_key(fp) for fp in members]) if members else []
        infos = []
        for fingerprint, data in zip(members, metas):
            if data is not None:
                where = f"{keys.meta_key(fingerprint)} in redis at {self.location}"
                record = decode_meta(data, where)
                infos.append(TableInfo(fingerprint=fingerprint, version=record["version"],
                                       meta=record))
        return infos

    def close(self) -> None:
        self._client.close()


class RedisTableWatch(TableWatch):
    """Announcements from the Redis channel ``vbs:v1:tables``, by pub/sub."""

    def __init__(self, client: redis.asyncio.Redis, location: str, timeout: float) -> None:
        super().__init__()
        self._client = client
        self._location = location
        self._timeout = timeout
        self._pubsub: redis.asyncio.client.PubSub | None = None

    async def _start(self) -> None:
        self._pubsub = self._client.pubsub()
        try:
            await self._pubsub.subscribe(CHANNEL)
            # Wait for the server's confirmation: only then is every later PUBLISH seen here.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._timeout
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise StoreError(f"redis at {self._location} did not confirm the subscription "
                                     f"to {CHANNEL} within {self._timeout:g} s: {ASYNC_HINT}")
                message = await self._pubsub.get_message(timeout=remaining)
                if message is not None and message.get("type") == "subscribe":
                    return
        except (RedisError, OSError) as exc:
            await self._close()
            raise translate(exc, self._location, ASYNC_HINT) from exc
        except BaseException:
            await self._close()
            raise

    async def _next(self) -> TableAnnouncement:
        assert self._pubsub is not None
        while True:
            try:
                message = await self._pubsub.get_message(ignore_subscribe_messages=True,
                                                         timeout=None)
            except (RedisError, OSError) as exc:
                if self._closed:
                    raise StopAsyncIteration from exc
                raise translate(exc, self._location, ASYNC_HINT) from exc
            if message is None or message.get("type") != "message":
                continue
            announcement = decode_announcement(message["data"])
            if announcement is None:
                log.warning("ignoring a message on %s that is not a table announcement: %r",
                            CHANNEL, message["data"][:200])
                continue
            return announcement

    async def _close(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()


class AsyncRedisStore(AsyncPlanStore):
    """Async reads of a Redis plan store and pub/sub announcements (redis.asyncio)."""

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT,
                 retries: int = DEFAULT_RETRIES) -> None:
        self.location = mask_url(url)
        self._timeout = timeout
        try:
            self._client = redis.asyncio.Redis.from_url(
                url, **_client_options(timeout, retries, AsyncRetry))
        except (ValueError, TypeError, RedisError) as exc:
            raise _bad_url(url, exc) from exc
        self._watches: weakref.WeakSet[TableWatch] = weakref.WeakSet()

    def _errors(self) -> contextlib.AbstractContextManager[None]:
        return _translated(self.location, ASYNC_HINT)

    async def get_table(self, fingerprint: str) -> StoredTable:
        names = (keys.table_key(fingerprint), keys.meta_key(fingerprint))
        with self._errors():
            blob, meta = await self._client.mget(*names)
        return _stored_table(fingerprint, blob, meta, self.location)

    async def table_version(self, fingerprint: str) -> int | None:
        key = keys.version_key(fingerprint)
        with self._errors():
            data = await self._client.get(key)
        return _version_from(data, fingerprint, self.location)

    async def get_model(self, model_key: str) -> str | None:
        key = keys.model_key(model_key)
        with self._errors():
            data = await self._client.get(key)
        return _fingerprint_from(data, key, self.location)

    async def get_profile(self, fingerprint: str) -> bytes | None:
        key = keys.profile_key(fingerprint)
        with self._errors():
            return await self._client.get(key)  # type: ignore[no-any-return]

    def watch(self) -> TableWatch:
        watch = RedisTableWatch(self._client, self.location, self._timeout)
        self._watches.add(watch)
        return watch

    async def aclose(self) -> None:
        for watch in list(self._watches):
            await watch.aclose()
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()
