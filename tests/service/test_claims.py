"""A request's claims (``service.claims``) are taken and given back by one owner, over HTTP and
gRPC alike: however a request ends (answered, refused while decoding, its model named only in
its body, a format refused before anything is read), its model's pin is given back by the time
its answer arrives, and what the metrics count it by is the one object the request carries."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from service.claims import Claims
from service.main import create_app
from service.settings import Settings
from tests.conftest import free_port
from tests.service.conftest import TINY_SHAPE, ServerThread, run, running, settings_for


@pytest.fixture(scope="module")
def served(vbs_cache: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[ServerThread, str]]:
    port = free_port()
    settings = settings_for(vbs_cache, tmp_path_factory.mktemp("claims-store"), grpc_port=port)
    with ServerThread(create_app(settings)) as server:
        yield server, f"127.0.0.1:{port}"


def _v2(x: np.ndarray, **extra: object) -> dict[str, object]:
    return {**extra, "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                 "data": x.ravel().tolist()}]}


def test_every_claim_is_given_back_however_the_request_ends(
        served: tuple[ServerThread, str]) -> None:
    server, target = served
    entry = server.app.state.registry.entries["tiny"]
    x = np.ones((2, *TINY_SHAPE), np.float32)
    wrong = np.ones((2, 5, 5, 5), np.float32)
    http = [
        (200, lambda c: c.post("/infer", json={"inputs": x.tolist()})),
        (200, lambda c: c.post("/infer", json=_v2(x, model="tiny"))),  # named in the body only
        (400, lambda c: c.post("/infer", json={"inputs": wrong.tolist()})),  # refused decoding
        (415, lambda c: c.post("/infer", content=b"x", headers={"content-type": "text/csv"})),
        (200, lambda c: c.post("/v2/models/tiny/infer", json=_v2(x))),
        (400, lambda c: c.post("/v2/models/tiny/infer", json=_v2(wrong))),
    ]
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for status, send in http:
            answer = send(client)
            assert answer.status_code == status, answer.text
            assert entry.pins == 0, f"HTTP {status}: its pin outlived its answer"
    grpc = tgrpc.InferenceServerClient(target)
    try:
        for data, ok in ((x, True), (wrong, False)):
            tensor = tgrpc.InferInput("input", list(data.shape), "FP32")
            tensor.set_data_from_numpy(data)
            if ok:
                assert grpc.infer("tiny", [tensor]).as_numpy("output") is not None
            else:
                with pytest.raises(InferenceServerException):
                    grpc.infer("tiny", [tensor])
            assert entry.pins == 0, f"gRPC (ok={ok}): its pin outlived its answer"
    finally:
        grpc.close()


def test_a_claim_is_given_back_once(make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings())

    async def twice() -> tuple[int, int, int]:
        async with running(app):
            registry = app.state.registry
            entry = registry.entries["tiny"]
            claims = Claims(endpoint="infer")
            await claims.pin(registry, entry)
            await claims.pin(registry, entry)  # the same request pins once
            pinned = entry.pins
            claims.release()
            after = entry.pins
            claims.release()  # given back already: nothing more
            return pinned, after, entry.pins

    assert run(twice()) == (1, 0, 0)
