"""Images: ``multipart/form-data`` with one or many JPEG/PNG files, or one image as the body
(``image/jpeg``, ``image/png``), made samples by the model family's preprocessing
(``planner.families``).

Pillow decodes them from memory, restricted to JPEG and PNG, after checking the pixel count
against ``max_image_pixels``; the preprocessing runs no torch op, so decoding threads never
start OpenMP teams beside the model's.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.families import Preprocess
from service.errors import PayloadTooLargeError, RequestError, field_error
from service.wire.common import BINARY_SCHEMA, Format, check_tensor

MEDIA_TYPES = ("image/jpeg", "image/jpg", "image/png")
MULTIPART = "multipart/form-data"
IMAGE_FORMATS = ("JPEG", "PNG")


@dataclass(frozen=True)
class ImagePart:
    """One uploaded image: where it came from (for errors) and its bytes."""

    where: str
    data: bytes


def decode_images(parts: Sequence[ImagePart], preprocess: Preprocess, mode: str,
                  input_shape: Sequence[int], max_samples: int, max_pixels: int) -> np.ndarray:
    """Decode JPEG/PNG images with Pillow and preprocess them into ``(N, *input_shape)``."""
    from PIL import Image, UnidentifiedImageError

    if not parts:
        raise field_error("files", "no image in the request: send JPEG or PNG files as "
                                   "multipart/form-data")
    if len(parts) > max_samples:
        raise field_error("files", f"{len(parts)} images are more than the {max_samples} one "
                                   "request may hold (max_samples_per_request)", PayloadTooLargeError)
    samples = []
    for part in parts:
        if not part.data:
            raise field_error(part.where, "is empty: send a JPEG or PNG image")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(part.data), formats=list(IMAGE_FORMATS)) as image:
                    width, height = image.size
                    if width * height > max_pixels:
                        raise field_error(part.where, f"{width}x{height} pixels are more than "
                                                      f"{max_pixels} (max_image_pixels)",
                                          PayloadTooLargeError)
                    image.load()
                    converted = image.convert(mode)
        except RequestError:
            raise
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError,
                ValueError, EOFError, TypeError) as exc:
            raise field_error(part.where, f"cannot be decoded as a JPEG or PNG image ({exc})") from exc
        sample = np.asarray(preprocess(converted), dtype=np.float32)
        samples.append(sample)
    array = np.stack(samples)
    return check_tensor(array, input_shape, "files", max_samples, single_ok=False)


FORMAT = Format("image/jpeg or image/png", MEDIA_TYPES, "image", decode_images,
                {"image/jpeg": BINARY_SCHEMA, "image/png": BINARY_SCHEMA})
MULTIPART_FORMAT = Format(
    "multipart/form-data (JPEG/PNG files)", (MULTIPART,), "multipart", decode_images,
    {MULTIPART: {"schema": {"type": "object", "properties": {"files": {
        "type": "array", "items": {"type": "string", "format": "binary"}}}}}})
