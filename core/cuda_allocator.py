"""One rule for CUDA's caching allocator, so that what torch allocates is what the walk counts.

By default the allocator serves a tensor from a cached block up to 1 MiB larger than it and does
not split off the rest, and counts the whole block as allocated: a plan whose tensors sum to its
claim then allocates more than it (runs over budget on a GPU: docs/benchmarks.md section 10).
With expandable segments a block is split whenever 512 bytes or more are left, so a plan
allocates the sizes it asks for, rounded to 512 (the profile's granule). A user who sets
``PYTORCH_CUDA_ALLOC_CONF`` keeps it, with a warning where it leaves that slack in.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

SETTING = "expandable_segments:True"
_done = False


def chosen_by_user() -> str | None:
    """The user's own allocator settings, if they set any."""
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or None


def split_exactly() -> bool:
    """Make the allocator split blocks to the size asked (expandable segments), once per
    process, before the model's first allocation on the device; True when it does. Takes effect
    for every block from then on (segments already made included)."""
    global _done
    if _done:
        return True
    own = chosen_by_user()
    if own is not None:
        if "expandable_segments:true" not in own.replace(" ", "").lower():
            log.warning("PYTORCH_CUDA_ALLOC_CONF=%s without %s: the caching allocator may count up "
                        "to 1 MiB more per live tensor than the plans claim; add %s to keep every "
                        "plan inside its budget", own, SETTING, SETTING)
            return False
        _done = True
        return True
    # torch >= 2.9 names it on the accelerator (the old name warns it is deprecated, then calls it)
    setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
              or getattr(torch.cuda.memory, "_set_allocator_settings", None))
    if setter is None:  # pragma: no cover - every torch this project supports has it
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = SETTING  # read when CUDA starts
    else:
        try:
            setter(SETTING)
        except RuntimeError as exc:  # a build without them (ROCm): say so, serve on
            log.warning("the CUDA allocator refused %s (%s): plans may allocate up to 1 MiB per "
                        "live tensor more than they claim", SETTING, exc)
            return False
    _done = True
    return True
