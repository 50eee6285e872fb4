"""The page's icon, drawn here rather than shipped as a file: bars of different heights, one
batch size per layer, in the page's accent colour.

Browsers ask every site for ``/favicon.ico``; without an answer each load of the page logged a
404. Pillow (already a dependency, for image inputs) draws it once, on the first request, and
writes an ICO that holds 16, 32 and 48 pixel versions.
"""

from __future__ import annotations

import functools
import io

MEDIA_TYPE = "image/x-icon"
ACCENT = (31, 78, 158, 255)       # the page's --accent (#1f4e9e)
BACKGROUND = (246, 247, 249, 255)  # the page's --panel (#f6f7f9)
BARS = (0.45, 0.9, 0.6, 1.0)      # heights, as a share of the tallest: a batch size per layer
SIZES = (16, 32, 48)
CANVAS = 64


@functools.cache
def icon() -> bytes:
    """The ICO file's bytes."""
    from PIL import Image, ImageDraw

    image = Image.new("RGBA", (CANVAS, CANVAS), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    draw.rounded_rectangle((0, 0, CANVAS - 1, CANVAS - 1), radius=12, fill=BACKGROUND,
                           outline=ACCENT, width=3)
    margin, gap = 10, 4
    width = (CANVAS - 2 * margin - gap * (len(BARS) - 1)) / len(BARS)
    floor, tallest = CANVAS - margin, CANVAS - 2 * margin
    for i, share in enumerate(BARS):
        left = margin + i * (width + gap)
        draw.rectangle((round(left), round(floor - share * tallest), round(left + width) - 1,
                        floor), fill=ACCENT)
    out = io.BytesIO()
    image.save(out, format="ICO", sizes=[(s, s) for s in SIZES])
    return out.getvalue()


__all__ = ["MEDIA_TYPE", "icon"]
