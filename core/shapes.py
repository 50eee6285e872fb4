"""Shape text, read by one rule everywhere: a flag (``--input-shape 3,224,224``), a served
model (``tiny=pkg.mod:f@3x8x8``), a request's ``?shape=`` or ``X-Tensor-Shape``.

The rule: whole numbers separated by commas, ``x`` or spaces, optionally inside brackets
(``[4,3,224,224]``); every dimension at least 1, except that a tensor's leading (batch)
dimension may be ``-1`` where ``batch`` allows it ("as many samples as the data holds");
at most ``MAX_RANK`` dimensions. Anything else is a UsageError that says what to give; callers
that report errors in their own terms (a settings validator, a request's field error)
translate it at their boundary.
"""

from __future__ import annotations

import re

from core.errors import UsageError

MAX_RANK = 8  # batch included: 3-D video with channels and time is 5
_SEPARATORS = re.compile(r"[x,\s]+")


def parse_shape(text: str, *, batch: bool = False, max_rank: int = MAX_RANK,
                what: str = "input shape") -> tuple[int, ...]:
    """``"3,224,224"``, ``"3x16x112x112"`` or ``"[4, 3, 8, 8]"`` as a tuple of ints >= 1 (with
    ``batch``, the first may be -1); else a UsageError naming ``what``, the text and the rule."""
    parts = [p for p in _SEPARATORS.split(str(text).strip().strip("[]()")) if p]
    wildcard = batch and parts[:1] == ["-1"]
    dims = parts[1:] if wildcard else parts
    if not parts or len(parts) > max_rank or not all(p.isdigit() and int(p) >= 1 for p in dims):
        example = "4,3,224,224 (or -1,3,224,224)" if batch else "3,224,224 (C,H,W) or 3x16x112x112 (C,T,H,W)"
        raise UsageError(f"{what} {text!r}: give at most {max_rank} whole numbers >= 1 separated by "
                         f"',' or 'x', like {example}")
    return tuple(int(p) for p in parts)
