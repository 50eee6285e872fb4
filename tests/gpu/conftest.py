"""The tests marked ``gpu``: the code paths that only a GPU runs for real.

Each test takes ``device``: CUDA when torch sees it, else the CPU. On the CPU a test runs up to
its first call that needs CUDA and skips there, with a reason that starts with ``CUDA only:``
(``cuda_only``), so the models, profiles, tables and services it builds have run before a GPU
is lent; the GPU run's rehearsal (`make gpu DEVICE=cpu QUICK=1`, bench/gpu/step_tests.py) fails
on any other skip, and on CUDA on any skip at all.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cuda_only(device: str, what: str) -> None:
    """Skip here on the CPU: what follows is ``what``, which needs CUDA."""
    if device != "cuda":
        pytest.skip(f"CUDA only: {what}")
