"""Images (JPEG, PNG; one or many; multipart or a raw body) for a torchvision classifier
(squeezenet1_0 planned at 3x32x32): decoded with Pillow, preprocessed with the weights'
transforms, and top-k labels from the weights' categories."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from service.main import create_app
from tests.service.conftest import ServerThread, assert_close, assert_error, reference, settings_for

SIZE = 32


@pytest.fixture(scope="module")
def server(vbs_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = settings_for(vbs_cache, tmp_path_factory.mktemp("images") / "store", batch_max=2,
                            models=[f"squeezenet1_0@3x{SIZE}x{SIZE}"])
    with ServerThread(create_app(settings)) as started:
        yield started


@pytest.fixture
def entry(server: ServerThread):  # type: ignore[no-untyped-def]
    return server.app.state.registry.entries["squeezenet1_0"]


def picture(seed: int, size: tuple[int, int] = (60, 45), mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = 3 if mode == "RGB" else 1
    pixels = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def encode(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def expected_input(data: bytes) -> np.ndarray:
    """The model's transforms, as torchvision defines them, at the planned crop (32 of 224 →
    resize 256 * 32 / 224 ≈ 37)."""
    weights = torchvision.models.get_model_weights("squeezenet1_0").DEFAULT
    transforms = weights.transforms(crop_size=SIZE, resize_size=round(SIZE * 256 / 224))
    image = Image.open(io.BytesIO(data)).convert("RGB")
    return transforms(image).numpy()


def test_many_images_in_one_multipart_request(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    jpeg = encode(picture(1), "JPEG")
    png = encode(picture(2, (50, 80)), "PNG")
    gray = encode(picture(3, mode="L"), "PNG")
    files = [("files", ("a.jpg", jpeg, "image/jpeg")), ("files", ("b.png", png, "image/png")),
             ("files", ("c.png", gray, "image/png"))]
    r = client.post("/infer", files=files)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["samples"] == 3 and body["output_shape"] == [3, 1000]
    x = np.stack([expected_input(d) for d in (jpeg, png, gray)])
    assert_close(body["outputs"], reference(entry, x))
    assert sum(p["batch"] for p in body["plans"]) == 3  # 3 samples, batch_max 2: split


def test_top_k_labels_from_the_weights_categories(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    data = encode(picture(4), "PNG")
    r = client.post("/infer?top_k=5", content=data, headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text
    (top,) = r.json()["top_k"]
    logits = reference(entry, expected_input(data)[None])[0]
    probs = torch.softmax(torch.from_numpy(logits).double(), 0).numpy()
    order = np.argsort(-probs, kind="stable")[:5]
    categories = torchvision.models.get_model_weights("squeezenet1_0").DEFAULT.meta["categories"]
    assert [t["index"] for t in top] == order.tolist()
    assert [t["label"] for t in top] == [categories[i] for i in order]
    np.testing.assert_allclose([t["score"] for t in top], probs[order], rtol=1e-4)
    assert "outputs" not in r.json()


def test_top_k_for_tensors_and_as_a_form_field(client: httpx.Client, entry) -> None:  # type: ignore[no-untyped-def]
    x = np.random.default_rng(5).standard_normal((2, 3, SIZE, SIZE)).astype(np.float32)
    r = client.post("/infer", json={"inputs": x.tolist(), "top_k": 3})
    assert r.status_code == 200, r.text
    tops = r.json()["top_k"]
    want = np.argsort(-reference(entry, x), axis=1, kind="stable")[:, :3]
    assert [[t["index"] for t in top] for top in tops] == want.tolist()
    r = client.post("/infer", data={"top_k": "2"},
                    files={"f": ("x.jpg", encode(picture(6), "JPEG"), "image/jpeg")})
    assert r.status_code == 200, r.text
    assert len(r.json()["top_k"][0]) == 2


def test_top_k_beyond_the_classes(client: httpx.Client) -> None:
    r = client.post("/infer?top_k=1001", content=encode(picture(7), "PNG"),
                    headers={"Content-Type": "image/png"})
    assert_error(r, 400, "top_k", "1000 classes")


def test_an_undecodable_image_is_named(client: httpx.Client) -> None:
    files = [("files", ("ok.jpg", encode(picture(8), "JPEG"), "image/jpeg")),
             ("files", ("broken.jpg", b"\xff\xd8\xff\xe0 this is not a jpeg", "image/jpeg"))]
    assert_error(client.post("/infer", files=files), 400, "files[1]", "broken.jpg", "JPEG or PNG")
