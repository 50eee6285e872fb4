"""A real Redis holding corrupt data: a table blob of garbage, meta that is not JSON, a version
counter that is not a number. Such a model turns ``failed`` with a message naming the key (it
is not "store unavailable" and nothing retries it), the other models served beside it become
ready, and on reload the corrupt version is skipped while the old table goes on serving and the
watch goes on serving every other model's reloads."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import redis

from core.loaded import ModelSpec
from planner.pipeline import Prepared, prepare, publish
from service.settings import Settings
from planner.solver.tables import build_table
from planner.store import keys, open_store
from service.main import create_app
from tests.service.conftest import assert_close, assert_error, reference, run, running, wait_until

MODEL = "tests.planner.factories:two_layer"
BAD, GOOD = "bad", "good"
SHAPES = {BAD: (3, 8, 8), GOOD: (3, 6, 6)}  # two shapes: two fingerprints, two tables


def serve_two(make_settings: Callable[..., Settings], url: str) -> Settings:
    # the model that goes bad is listed first: it is loaded and caught up first
    return make_settings(store=url, models=[f"{name}={MODEL}@{'x'.join(map(str, shape))}"
                                            for name, shape in SHAPES.items()])


def publish_both(settings: Settings) -> dict[str, Prepared]:
    """What `vbs plan` does for both models (profiles come from the session cache)."""
    out = {}
    with open_store(settings.store_location) as store:
        for name, shape in SHAPES.items():
            spec = ModelSpec(MODEL, input_shape=shape)
            out[name] = prepare(spec, settings, store, batch_max=settings.batch_max,
                                progress=False)
    return out


def x_(name: str, n: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *SHAPES[name])).astype(np.float32)


def publish_raw(client: redis.Redis, tid: str, model: str, blob: bytes,
                meta: bytes | None = None) -> int:
    """A new version of ``tid`` stored and announced as `vbs plan` would, with ``blob`` and
    ``meta`` (default: the good meta of that version) whatever they are."""
    version = int(client.incr(keys.version_key(tid)))
    if meta is None:
        record = json.loads(client.get(keys.meta_key(tid)))
        meta = json.dumps({**record, "version": version}).encode()
    client.mset({keys.table_key(tid): blob, keys.meta_key(tid): meta})
    client.publish(keys.CHANNEL, json.dumps({"fingerprint": tid, "version": version,
                                             "model": model}))
    return version


def check_one_corrupt_model_at_start(make_settings: Callable[..., Settings], url: str,
                                     corrupt: Callable[[redis.Redis, str], str]) -> None:
    settings = serve_two(make_settings, url)
    prepared = publish_both(settings)
    tid = prepared[BAD].table_id
    with redis.Redis.from_url(url) as client:
        key = corrupt(client, tid)
    app = create_app(settings)

    async def main() -> None:
        async with running(app, wait=False) as client:
            registry, metrics = app.state.registry, app.state.metrics
            bad, good = registry.entries[BAD], registry.entries[GOOD]
            await wait_until(lambda: bad.state == "failed" and good.state == "ready",
                             timeout_s=120, what="one model failed, the other ready")
            assert key in bad.error and "store unavailable" not in bad.error, bad.error
            assert "--replan" in bad.error or "vbs plan" in bad.error
            ready = await client.get("/v2/health/ready")
            assert_error(ready, 503, "bad failed", key)
            r = await client.post("/infer", params={"model": BAD},
                                  json={"inputs": x_(BAD).tolist()})
            assert_error(r, 503, "failed to load", key)
            x = x_(GOOD)
            r = await client.post("/infer", params={"model": GOOD}, json={"inputs": x.tolist()})
            assert r.status_code == 200, r.text
            assert_close(r.json()["outputs"], reference(good, x))
            # counted once, never retried: the loads are over
            await asyncio.wait_for(registry._loaded.wait(), 30)
            assert metrics.value("vbs_store_errors_total") == 1
            assert bad.state == "failed"

    run(main())


def test_a_table_blob_of_garbage_fails_its_model_and_not_the_other(
        make_settings: Callable[..., Settings], redis_url: str) -> None:
    def garbage(client: redis.Redis, tid: str) -> str:
        client.set(keys.table_key(tid), b"\x00garbage, not zlib")
        return f"table {tid}"
    check_one_corrupt_model_at_start(make_settings, redis_url, garbage)


def test_table_meta_that_is_not_json_fails_its_model_and_not_the_other(
        make_settings: Callable[..., Settings], redis_url: str) -> None:
    def bad_meta(client: redis.Redis, tid: str) -> str:
        client.set(keys.meta_key(tid), b"{not json")
        return keys.meta_key(tid)
    check_one_corrupt_model_at_start(make_settings, redis_url, bad_meta)


def test_a_version_counter_that_is_not_a_number_fails_its_model(
        make_settings: Callable[..., Settings], redis_url: str) -> None:
    def bad_counter(client: redis.Redis, tid: str) -> str:
        client.set(keys.version_key(tid), b"seven")
        return keys.version_key(tid)
    check_one_corrupt_model_at_start(make_settings, redis_url, bad_counter)


def republish(settings: Settings, entry: Any) -> int:
    """A good new version of ``entry``'s table (another slot size), as `vbs plan` publishes it."""
    profile = entry.prepared.profile
    table = build_table(profile, solver="vbs", slot_bytes=entry.table.slot_bytes * 2)
    with open_store(settings.store_location) as store:
        return publish(store, entry.spec, profile, {"vbs": table})["vbs"]


def test_a_corrupt_reload_keeps_the_old_table_and_the_watch_serves_the_others(
        make_settings: Callable[..., Settings], redis_url: str) -> None:
    settings = serve_two(make_settings, redis_url)
    publish_both(settings)
    app = create_app(settings)

    async def main() -> None:
        async with running(app) as client:
            registry, metrics = app.state.registry, app.state.metrics
            bad, good = registry.entries[BAD], registry.entries[GOOD]
            await wait_until(lambda: registry.store_up is True, what="the store watch")
            old_table = bad.table
            tid = bad.table_id
            with redis.Redis.from_url(redis_url) as r:
                # v2: a blob of garbage with good meta
                v2 = publish_raw(r, tid, BAD, b"garbage")
                await wait_until(lambda: metrics.value("vbs_store_errors_total") >= 1,
                                 what="the bad blob counted")
                # v3: meta that is not JSON (the watch once reconnected forever on this)
                v3 = publish_raw(r, tid, BAD, old_table.to_bytes(), b"{not json")
                await wait_until(lambda: metrics.value("vbs_store_errors_total") >= 2,
                                 what="the bad meta counted")
            assert (v2, v3) == (2, 3)
            assert bad.table is old_table and bad.table_version == 1
            # the other model's reload is served: the watch goes on
            assert await asyncio.to_thread(republish, settings, good) == 2
            await registry.wait_table(GOOD, 2, timeout_s=30)
            assert registry.store_up is True  # no reconnect loop
            for name, entry in ((BAD, bad), (GOOD, good)):
                x = x_(name, 3, seed=1)
                answer = await client.post("/infer", params={"model": name},
                                           json={"inputs": x.tolist()})
                assert answer.status_code == 200, answer.text
                assert answer.json()["table_version"] == (1 if name == BAD else 2)
                assert_close(answer.json()["outputs"], reference(entry, x))
            # a good version after the bad ones is taken
            assert await asyncio.to_thread(republish, settings, bad) == 4
            await registry.wait_table(BAD, 4, timeout_s=30)
            assert bad.table.slot_bytes == 2 * old_table.slot_bytes
            assert metrics.value("vbs_store_errors_total") == 2

    run(main())
