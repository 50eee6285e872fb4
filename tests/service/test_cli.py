"""``vbs serve`` flags → Settings, the service's settings fields, and ``vbs loadtest`` against a
real uvicorn server on loopback."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from service.commands import build_parser, main
from core.errors import UsageError
from planner.settings import split_model_entry
from service.settings import Settings
from service.cli import serve_settings
from loadgen.loadtest import check_loopback, format_table, run_loadtest
from service.main import create_app
from tests.service.conftest import ServerThread, settings_for


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_serve_flags_override_settings() -> None:
    settings = serve_settings(serve_args(
        "--model", "resnet50", "--model", "tiny=pkg.mod:f@3x8x8", "--input-shape", "3,64,64",
        "--store", "redis://127.0.0.1:6399/0", "--host", "0.0.0.0", "--port", "9000",
        "--memory-limit", "64MB", "--memory-margin", "1MiB", "--batch-max", "8",
        "--max-batch-delay-ms", "3", "--latency-target", "0.05", "--max-queue", "9",
        "--request-timeout", "7", "--precision", "bfloat16", "--calibration", "samples",
        "--max-error", "0.02"))
    assert settings.served_models == [("resnet50", "resnet50", (3, 64, 64)),
                                      ("tiny", "pkg.mod:f", (3, 8, 8))]
    assert settings.store == "redis://127.0.0.1:6399/0"
    assert (settings.host, settings.port) == ("0.0.0.0", 9000)
    assert settings.memory_limit_bytes == 64_000_000 and settings.memory_margin_bytes == 2**20
    assert settings.batch_max == 8 and settings.max_batch_delay_ms == 3
    assert settings.latency_target_s == 0.05 and settings.max_queue == 9
    assert settings.request_timeout_s == 7
    assert (settings.precision, settings.max_error) == ("bfloat16", 0.02)
    assert settings.calibration == Path("samples")


def test_serve_refuses_bad_flags() -> None:
    with pytest.raises(UsageError, match="memory_limit_bytes"):
        serve_settings(serve_args("--model", "resnet50", "--memory-limit", "lots"))
    with pytest.raises(UsageError, match="input shape"):
        serve_settings(serve_args("--model", "resnet50", "--input-shape", "3,a"))
    assert main(["serve", "--model", "no_such_model_at_all"]) == 2


def test_settings_fields() -> None:
    s = Settings(models="tiny=pkg.mod:f@3,8,8, resnet50 ,c3d@3x16x112x112", max_body_bytes="2MB",
                 api_key="0123456789")
    assert s.served_models == [("tiny", "pkg.mod:f", (3, 8, 8)), ("resnet50", "resnet50", None),
                               ("c3d", "c3d", (3, 16, 112, 112))]
    assert s.max_body_bytes == 2_000_000 and s.api_key is not None
    assert "0123456789" not in repr(s) and s.api_key.get_secret_value() == "0123456789"
    assert Settings(models='["a", "b@3x8x8"]').models == ["a", "b@3x8x8"]
    assert Settings().latency_target_s is None and Settings().models == []
    for bad in ({"models": "a,a"}, {"models": "a b"}, {"models": "x=y@3,0"},
                {"api_key": "short"}, {"max_queue": 0}, {"request_timeout_s": 0},
                {"store_retry_base_s": 5, "store_retry_cap_s": 1}, {"port": 70000},
                {"latency_target_s": -1}, {"max_body_bytes": "1KB"}):
        with pytest.raises(ValueError):
            Settings(**bad)
    assert split_model_entry("alias=pkg.mod:f") == ("alias", "pkg.mod:f", None)


def test_loadtest_refuses_other_hosts() -> None:
    for url in ("http://example.com:8000", "http://10.0.0.1:8000", "ftp://127.0.0.1/",
                "http://192.168.1.5", "127.0.0.1:8000"):
        with pytest.raises(UsageError):
            check_loopback(url)
    for url in ("http://127.0.0.1:8000/", "http://localhost:1", "http://[::1]:80",
                "http://127.1.2.3:5"):
        check_loopback(url)
    assert main(["loadtest", "--url", "http://example.com", "--model", "m"]) == 2


def test_loadtest_against_a_running_service(vbs_cache: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    settings = settings_for(vbs_cache, tmp_path / "store")
    with ServerThread(create_app(settings)) as server:
        summary = asyncio.run(run_loadtest(server.url, "tiny", clients=3, duration_s=1.0,
                                           samples=2))
        assert summary["ok"] > 0 and summary["errors"] == 0
        assert summary["requests"] == summary["ok"]
        assert summary["throughput_samples_per_s"] == pytest.approx(
            2 * summary["throughput_rps"])
        assert 0 < summary["latency_p50_s"] <= summary["latency_p99_s"]
        assert 0 <= summary["overhead_p50_s"] <= summary["latency_p50_s"]
        assert summary["overhead_p99_s"] is not None
        parts = summary["breakdown_p50_s"]
        assert set(parts) == {"queue", "input", "infer", "output", "rest"}
        assert all(v >= 0 for v in parts.values()) and parts["infer"] > 0
        table = format_table(summary)
        assert "latency p50 / p99" in table and "overhead p50 / p99" in table
        assert "p50 queue / input / infer / output / rest" in table
        assert main(["loadtest", "--url", server.url, "--model", "tiny", "--clients", "2",
                     "--duration", "0.5", "--format", "json", "--json"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["ok"] > 0 and printed["errors"] == 0
        assert main(["loadtest", "--url", server.url, "--model", "nope", "--duration", "0.2"]) == 2


def test_serve_refuses_a_cache_directory_where_weights_files_cannot_be_written(
        tmp_path, monkeypatch, capsys) -> None:
    """Loaded models keep their weights in files under VBS_CACHE_DIR/weights: a server that
    could not write there says so as it starts, not as a model first loads."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VBS_CACHE_DIR", str(blocker / "cache"))
    assert main(["serve", "--model", "resnet50"]) == 2
    assert "VBS_CACHE_DIR: cannot write the loaded models' weights files" in capsys.readouterr().err
