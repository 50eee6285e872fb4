"""What a request body is, from its headers: the one reading of ``Content-Type`` that the body
limits (``service.deps``) and the decoders (``service.serving``, by the formats of
``service.wire``) share.

A missing Content-Type is JSON (what ``curl -d`` and most clients mean). A JSON body is
parsed whole into Python objects, so it has its own, smaller limit; an OIP v2 body with
binary tensors (``Inference-Header-Content-Length``) carries a JSON header but is mostly
bytes, so it is not JSON for the limits.
"""

from __future__ import annotations

from collections.abc import Mapping

JSON_TYPES = ("application/json", "text/json")
BINARY_HEADER = "inference-header-content-length"  # OIP v2's binary tensor extension


def media_type(headers: Mapping[str, str]) -> str:
    """The body's media type, lower case, without parameters; "" when none is given."""
    return headers.get("content-type", "").split(";")[0].strip().lower()


def is_json_type(kind: str) -> bool:
    """Whether a media type (``media_type``) is JSON: none given, a JSON type or ``+json``."""
    return kind in ("", *JSON_TYPES) or kind.endswith("+json")


def is_json_body(headers: Mapping[str, str]) -> bool:
    """A body parsed whole as JSON: a JSON media type and no binary tensors behind it."""
    return is_json_type(media_type(headers)) and BINARY_HEADER not in headers
