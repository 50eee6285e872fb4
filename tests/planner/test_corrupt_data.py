"""Malformed data in a plan store is TableFormatError (never retried as a store that is down),
naming the key or file and the problem: bad zlib, bad JSON, an unknown schema, plan indices
out of range, a table that decompresses past the bound, bad meta, a bad version counter.
Real redis-server and a real directory store."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import redis

from core.errors import StoreError, TableFormatError
from planner.pipeline import read
from core.table import PlanTable
from planner.solver.tables import build_table
from planner.store import keys, open_store


def small_table() -> PlanTable:
    from core.tree import Layer, Profile, Series
    layers = tuple(Layer(name=f"l{i}", in_bytes=64, out_bytes=64, time=(1e-3, 1.5e-3),
                         ws=(0, 0)) for i in range(3))
    return build_table(Profile(batch_max=2, root=Series("root", layers),
                               meta={"fingerprint": "f" * 16}))


def table_json(table: PlanTable) -> dict:
    return json.loads(zlib.decompress(table.to_bytes()))


def test_from_bytes_names_where_and_what() -> None:
    table = small_table()
    assert PlanTable.from_bytes(table.to_bytes(), "table t1").fingerprint == table.fingerprint
    cases = {
        b"not zlib": "cannot be read",
        zlib.compress(b"{not json"): "cannot be read",
        zlib.compress(json.dumps({**table_json(table), "schema": "vbs.table/9"}).encode()):
            "vbs.table/9",
    }
    raw = table_json(table)
    raw["rows"][0]["plans"] = [len(raw["plans"]) + 5] * len(raw["rows"][0]["plans"])
    cases[zlib.compress(json.dumps(raw).encode())] = "plan index is outside"
    raw = table_json(table)
    raw["plans"][0]["steps"][0] = 99
    cases[zlib.compress(json.dumps(raw).encode())] = "names a unit outside"
    for data, problem in cases.items():
        with pytest.raises(TableFormatError) as caught:
            PlanTable.from_bytes(data, "table t1 in store S")
        assert str(caught.value).startswith("table t1 in store S: ")
        assert problem in str(caught.value) and "vbs plan" in str(caught.value)


def test_a_table_past_the_size_bound_is_refused_before_it_is_inflated() -> None:
    data = small_table().to_bytes()
    size = len(zlib.decompress(data))
    assert PlanTable.from_bytes(data, max_bytes=size).batch_max == 2
    with pytest.raises(TableFormatError, match=f"more than {size - 1} bytes"):
        PlanTable.from_bytes(data, max_bytes=size - 1)
    bomb = zlib.compress(b" " * (8 << 20))  # 8 MiB of spaces in ~8 KB
    with pytest.raises(TableFormatError, match="more than 1000000 bytes"):
        PlanTable.from_bytes(bomb, "t", max_bytes=1_000_000)


def test_bad_meta_and_counters_in_redis_are_format_errors_naming_the_key(redis_url: str) -> None:
    table = small_table()
    tid = "t1.vbs.time"
    with open_store(redis_url) as store, redis.Redis.from_url(redis_url) as client:
        store.put_table(tid, table.to_bytes(), {"model": "m"}, model_key="m")
        for value, problem in ((b"{not json", "not JSON"), (b'{"version": "x"}', "'version'"),
                               (b"[1, 2]", "'version'")):
            client.set(keys.meta_key(tid), value)
            with pytest.raises(TableFormatError, match=problem) as caught:
                store.get_table(tid)
            assert keys.meta_key(tid) in str(caught.value)
        client.delete(keys.meta_key(tid))
        with pytest.raises(TableFormatError, match=keys.meta_key(tid)):
            store.get_table(tid)
        client.set(keys.version_key(tid), b"seven")
        with pytest.raises(TableFormatError, match=keys.version_key(tid)):
            store.table_version(tid)
        client.set(keys.model_key("m"), b"not a/fingerprint")
        with pytest.raises(TableFormatError, match=keys.model_key("m")):
            store.get_model("m")


def test_a_damaged_table_file_is_a_format_error_naming_the_file(tmp_path: Path) -> None:
    table = small_table()
    with open_store(tmp_path / "store") as store:
        store.put_table("t1.vbs.time", table.to_bytes(), {})
        path = store.table_path("t1.vbs.time")
        path.write_bytes(b"garbage")
        with pytest.raises(TableFormatError, match=str(path)):
            store.get_table("t1.vbs.time")
        path.write_bytes(b"vbs-table/1\n{bad\n" + table.to_bytes())
        with pytest.raises(TableFormatError, match="not JSON"):
            store.get_table("t1.vbs.time")


def test_read_repairs_for_vbs_plan_and_raises_for_a_service(tmp_path: Path) -> None:
    table = small_table()
    fp = table.fingerprint
    tid = keys.table_id(fp, "vbs", "time")
    with open_store(tmp_path / "store") as store:
        store.put_table(tid, b"garbage", {})
        store.put_profile(fp, b"{}")
        assert read(store, fp, ("vbs",), "time") is None  # `vbs plan` plans it again
        with pytest.raises(TableFormatError) as caught:
            read(store, fp, ("vbs",), "time", repair=False)
        assert f"table {tid} in store {store.location}" in str(caught.value)
        assert isinstance(caught.value, StoreError)
