"""An API key, when set, guards inference and /plan; health, metrics and metadata stay open."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.main import create_app
from tests.service.conftest import ServerThread, assert_error, settings_for

KEY = "s3cret-key-for-tests"


@pytest.fixture(scope="module")
def server(vbs_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = settings_for(vbs_cache, tmp_path_factory.mktemp("auth") / "store", api_key=KEY)
    with ServerThread(create_app(settings)) as started:
        yield started


def requests() -> list[tuple[str, str, dict]]:
    x = np.zeros((1, 3, 8, 8), np.float32)
    v2 = {"inputs": [{"name": "i", "shape": [1, 3, 8, 8], "datatype": "FP32",
                      "data": x.ravel().tolist()}]}
    return [("POST", "/infer", {"json": {"inputs": x.tolist()}}),
            ("POST", "/v2/models/tiny/infer", {"json": v2}),
            ("GET", "/plan", {"params": {"mem": "30KB", "batch": 2}})]


@pytest.mark.parametrize("method,path,kwargs", requests(), ids=["infer", "v2-infer", "plan"])
def test_guarded_endpoints_need_the_key(server: ServerThread, method: str, path: str,
                                        kwargs: dict) -> None:
    with server.client() as client:
        r = client.request(method, path, **kwargs)
        assert_error(r, 401, "Authorization", "Bearer")
        assert r.headers["WWW-Authenticate"] == "Bearer"
        for wrong in ({"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"},
                      {"Authorization": KEY}):
            assert_error(client.request(method, path, headers=wrong, **kwargs), 401)
        r = client.request(method, path, headers={"Authorization": f"Bearer {KEY}"}, **kwargs)
        assert r.status_code == 200, r.text


def test_key_is_checked_before_the_body_is_decoded(server: ServerThread) -> None:
    with server.client() as client:
        assert_error(client.post("/infer", content=b"garbage"), 401)


@pytest.mark.parametrize("path", ["/v2/health/live", "/v2/health/ready", "/health/live",
                                  "/health/ready", "/metrics", "/models", "/v2",
                                  "/v2/models/tiny", "/v2/models/tiny/ready", "/openapi.json"])
def test_health_metrics_and_metadata_are_open(server: ServerThread, path: str) -> None:
    with server.client() as client:
        assert client.get(path).status_code == 200


def test_the_key_never_shows(server: ServerThread) -> None:
    with server.client() as client:
        for path in ("/models", "/metrics", "/openapi.json"):
            assert KEY not in client.get(path).text
    assert KEY not in repr(server.app.state.settings)
