"""The wire formats' table (``service.wire.FORMATS``): every Content-Type ``/infer`` takes has
one format, the 415 answer and the OpenAPI document name the formats from it, and a format is
its entry: one added to the table is served with no other change."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from service import wire
from service.main import create_app
from service.settings import Settings
from service.wire import FORMATS, SUPPORTED, body_format, infer_json
from service.wire.common import Format
from service.wire.raw import decode_raw
from tests.service.conftest import (
    TINY_SHAPE,
    assert_close,
    assert_error,
    reference,
    run,
    running,
)


def test_every_media_type_has_one_format() -> None:
    kinds = [kind for f in FORMATS for kind in f.media_types]
    assert len(kinds) == len(set(kinds))
    assert {f.reads for f in FORMATS} == {"json", "tensor", "image", "multipart"}
    assert all(body_format(kind) is f for f in FORMATS for kind in f.media_types)
    assert body_format("") is infer_json.FORMAT  # no Content-Type: JSON
    assert body_format("application/vnd.example+json") is infer_json.FORMAT
    assert body_format("text/plain") is None


def test_the_415_answer_and_the_openapi_document_name_the_formats() -> None:
    assert SUPPORTED == ("application/json, application/x-npy, application/octet-stream, "
                         "multipart/form-data (JPEG/PNG files), image/jpeg or image/png")
    post = create_app(Settings(grpc_port=0)).openapi()["paths"]["/infer"]["post"]
    assert list(post["requestBody"]["content"]) == [
        "application/json", "application/x-npy", "application/octet-stream",
        "multipart/form-data", "image/jpeg", "image/png"]


def test_a_format_is_its_entry(make_settings: Callable[..., Settings],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    kind = "application/x-example"
    example = Format(kind, (kind,), "tensor", decode_raw, {})
    monkeypatch.setitem(wire.BY_MEDIA_TYPE, kind, example)
    app = create_app(make_settings())

    async def main() -> None:
        async with running(app) as client:
            entry = app.state.registry.entries["tiny"]
            x = np.random.default_rng(0).standard_normal((2, *TINY_SHAPE)).astype(np.float32)
            r = await client.post("/infer", content=x.tobytes(), headers={"Content-Type": kind})
            assert r.status_code == 200, r.text
            assert_close(r.json()["outputs"], reference(entry, x))
            r = await client.post("/infer", content=b"x", headers={"Content-Type": "text/plain"})
            assert_error(r, 415, "text/plain", SUPPORTED)

    run(main())
