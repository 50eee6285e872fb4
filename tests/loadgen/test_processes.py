"""``vbs loadtest --processes`` (loadgen.processes): client processes against a real server
(uvicorn in a thread, HTTP and gRPC), a closed loop and an open one, and the options it
refuses."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from core.errors import UsageError
from service.commands import main
from loadgen.loadtest import format_table
from loadgen.processes import configure, parse_cpus, run_load
from service.main import create_app
from tests.conftest import free_port
from tests.service.conftest import TINY_SHAPE, ServerThread, settings_for


@pytest.fixture(scope="module")
def server(vbs_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    # torch alone: no ONNX Runtime session is built inside a measured window
    settings = settings_for(vbs_cache, tmp_path_factory.mktemp("loadgen-store"),
                            grpc_port=free_port(), runtime="torch")
    with ServerThread(create_app(settings)) as running, running.client() as client:
        for n in range(1, 5):  # every batch size run once: no first-run cost inside a window
            x = np.zeros((n, *TINY_SHAPE), np.float32)
            assert client.post("/infer?model=tiny", content=x.tobytes(), headers={
                "Content-Type": "application/octet-stream"}).status_code == 200
        yield running


def grpc_target(server: ServerThread) -> str:
    return f"127.0.0.1:{server.app.state.settings.grpc_port}"


def check_closed(summary: dict, processes: int, concurrency: int, samples: int) -> None:
    assert summary["ok"] > 0 and summary["errors"] == 0, summary["errors_by_status"]
    assert summary["loop"] == "closed" and summary["processes"] == processes
    assert summary["concurrency"] == summary["clients"] == concurrency
    assert summary["client_cpu_s"] > 0 and summary["client_cores"] > 0
    assert summary["client_cpu_ms_per_request"] > 0
    assert summary["connections"] >= 1 and summary["late"] == 0
    assert 0 <= summary["in_flight_at_end"] <= concurrency
    assert summary["throughput_samples_per_s"] == pytest.approx(samples * summary["throughput_rps"])
    assert 0 < summary["latency_p50_s"] <= summary["latency_p90_s"] <= summary["latency_p99_s"]
    assert summary["breakdown_p50_s"]["infer"] > 0  # the service's timings were read
    assert sum(summary["requests_by_batch_size"].values()) == summary["ok"]


def test_closed_loop_in_processes_over_http(server: ServerThread,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    cpu = min(os.sched_getaffinity(0))
    load = configure("http", server.url, "tiny", processes=2, concurrency=8, samples=2,
                     duration_s=1.0, warmup_s=0.2, cpus=str(cpu))
    assert load.shape == (3, 8, 8) and load.loop == "closed"
    summary = run_load(load)
    check_closed(summary, processes=2, concurrency=8, samples=2)
    assert summary["cpus"] == [cpu]
    assert summary["protocol"] == "http" and summary["format"] == "oip-binary"
    assert summary["connections"] == 8  # one a request in flight
    assert "clients' CPU" in format_table(summary)
    assert main(["loadtest", "--url", server.url, "--model", "tiny", "--processes", "2",
                 "--clients", "3", "--duration", "0.5", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["ok"] > 0 and printed["errors"] == 0 and printed["concurrency"] == 3
    assert printed["client_cpu_ms_per_request"] > 0


def test_closed_loop_in_processes_over_grpc(server: ServerThread) -> None:
    # a window of 3 s: in one of 1 s, with make test's four suites on two cores, no request
    # came back once (0 answered, 0 errors; not seen alone)
    summary = run_load(configure("grpc", grpc_target(server), "tiny", processes=2,
                                 concurrency=4, duration_s=3.0, warmup_s=0.2))
    check_closed(summary, processes=2, concurrency=4, samples=1)
    assert summary["url"].startswith("grpc://") and summary["protocol"] == "grpc"


@pytest.mark.parametrize("protocol,arrivals", [("http", "fixed"), ("grpc", "poisson")])
def test_open_loop_sends_at_the_rate_asked(server: ServerThread, protocol: str,
                                           arrivals: str) -> None:
    """40 requests a second for 1.5 s: about 60 sent, whatever the answers (broad bounds: a
    busy machine may send some late, never many fewer)."""
    url = server.url if protocol == "http" else grpc_target(server)
    summary = run_load(configure(protocol, url, "tiny", processes=2, rate=40.0,
                                 arrivals=arrivals, duration_s=1.5, warmup_s=0.2))
    assert summary["loop"] == "open" and summary["arrivals"] == arrivals
    assert summary["rate_rps"] == 40.0 and summary["clients"] == 2
    assert 25 <= summary["sent"] <= 110, summary
    assert summary["achieved_rate_rps"] == pytest.approx(summary["sent"] / 1.5)
    assert summary["errors"] == 0 and summary["ok"] > 0
    assert summary["client_cpu_s"] > 0 and summary["send_lag_p99_s"] is not None
    assert 0 <= summary["late"] <= summary["sent"]


@pytest.mark.parametrize("options,named", [
    ({"rate": 10.0, "concurrency": 4}, "--rate"),
    ({"rate": 10.0, "clients": 4}, "--rate"),
    ({"processes": 0}, "--processes"),
    ({"processes": 4, "concurrency": 2}, "--concurrency"),
    ({"rate": -1.0}, "--rate"),
    ({"arrivals": "bursty", "rate": 5.0}, "--arrivals"),
    ({"fmt": "npy"}, "--format"),
    ({"cpus": "x"}, "--cpus"),
    ({"cpus": "4096"}, "--cpus"),
    ({"url": "http://10.0.0.1:8000"}, "--url"),
    ({"url": "https://127.0.0.1:8000"}, "--url"),
])
def test_bad_options_name_the_option(options: dict, named: str) -> None:
    url = options.pop("url", "http://127.0.0.1:9")  # nothing listens: refused before any call
    with pytest.raises(UsageError, match=named):
        configure("http", url, "tiny", **options)


def test_bad_options_on_the_command_line(server: ServerThread) -> None:
    for argv in (["--processes", "0"], ["--rate", "5", "--concurrency", "2"],
                 ["--processes", "1", "--url", "http://example.com:8000"],
                 ["--protocol", "grpc", "--processes", "1", "--url", "10.0.0.1:8001"],
                 ["--processes", "2", "--model", "nope"]):
        if "--url" not in argv:
            argv = ["--url", server.url, *argv]
        assert main(["loadtest", "--model", "tiny", "--duration", "0.2", *argv]) == 2, argv


def test_parse_cpus() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert parse_cpus(None) is None
    assert parse_cpus(str(allowed[0])) == (allowed[0],)
    assert parse_cpus(",".join(map(str, allowed))) == tuple(allowed)
    if allowed[-1] - allowed[0] == len(allowed) - 1:  # contiguous: as a range too
        assert parse_cpus(f"{allowed[0]}-{allowed[-1]}") == tuple(allowed)
