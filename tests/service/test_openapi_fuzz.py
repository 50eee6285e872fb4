"""Schemathesis against the service's own OpenAPI, through real HTTP (uvicorn), with the tiny
model: generated requests (valid and invalid), a bounded number per operation and a fixed
seed. No 5xx, every error a JSON body ``{"error": ...}``, every status documented, every
response matching its schema and media type."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               response_schema_conformance,
                                               status_code_conformance)
from schemathesis.checks import not_a_server_error

from service.main import create_app
from tests.service.conftest import TINY, ServerThread, settings_for

EXAMPLES = 25  # per operation


@pytest.fixture(scope="module")
def server(vbs_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = settings_for(vbs_cache, tmp_path_factory.mktemp("openapi") / "store",
                            models=[TINY, "tiny2=tests.planner.factories:two_layer@3x6x6"],
                            max_body_bytes=200_000, max_json_bytes=100_000)
    with ServerThread(create_app(settings)) as started:
        yield started


@schemathesis.check
def errors_are_json(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                    case: schemathesis.Case) -> bool | None:
    """Every 4xx/5xx is a JSON object with a string ``error`` saying what was wrong."""
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"], \
            f"{response.status_code} without a JSON error body: {response.text[:300]}"
    return None


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, errors_are_json]


def operations(server: ServerThread) -> list[schemathesis.APIOperation]:
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    return [result.ok() for result in api.get_all_operations()]


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_every_operation_keeps_its_openapi(server: ServerThread, mode: GenerationMode) -> None:
    found = operations(server)
    assert len(found) >= 10, [op.label for op in found]
    skipped: list[str] = []
    for operation in found:
        @seed(20240607)
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=CHECKS, timeout=60)

        try:
            check()
        except Unsatisfiable:  # nothing to make invalid (no parameters, or a str path part)
            assert mode is GenerationMode.NEGATIVE, operation.label
            skipped.append(operation.label)
    # the operations that take input were fuzzed with invalid input too
    assert not {"POST /infer", "GET /plan", "POST /v2/models/{name}/infer"} & set(skipped), skipped
