"""The wire formats: every way a tensor or an image reaches the service, one module a format,
and what they share in ``common``.

Decoders turn a body into a numpy array of shape ``(N, *input_shape)`` (N >= 1, a numeric
dtype, native byte order, C-contiguous; binary bodies are read in place, not copied, so the
array may be read-only: the batcher copies it once, into its batch buffer), or raise a
RequestError naming the field and the problem. Decoding a binary body reads none of its
values: that NaN and infinities are refused (400, naming the field) is checked by the batcher
as it copies the samples into its batch, in the model's dtype. They are plain functions of
bytes: binary ones cost microseconds and run on the event loop for small bodies, JSON and
images in a worker thread (torch is only touched by image preprocessing, and never on the
event loop). Nothing from a request is unpickled, imported or used as a path.

``FORMATS`` is what ``/infer`` takes, by Content-Type: a new format is its module, with its
``Format`` entry, and that entry here. OIP v2 (``v2``) has its own routes, and ``/infer`` reads
a JSON body of v2 tensors too.
"""

from __future__ import annotations

from service.media import is_json_type
from service.wire import images, infer_json, npy, raw
from service.wire.common import Format

# In the order the 415 answer names them.
FORMATS: tuple[Format, ...] = (infer_json.FORMAT, npy.FORMAT, raw.FORMAT,
                               images.MULTIPART_FORMAT, images.FORMAT)
BY_MEDIA_TYPE = {kind: f for f in FORMATS for kind in f.media_types}
SUPPORTED = ", ".join(f.label for f in FORMATS)


def body_format(kind: str) -> Format | None:
    """The format of a ``/infer`` body of media type ``kind`` (``service.media.media_type``):
    JSON for none and for any JSON type; None for one no format takes."""
    return infer_json.FORMAT if is_json_type(kind) else BY_MEDIA_TYPE.get(kind)
