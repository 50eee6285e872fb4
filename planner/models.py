"""Load the model to plan: built by its family (``planner.families``: a torchvision name, the
built-in ``c3d``, or ``pkg.module:factory``), its weights loaded, on its device and dtype.

Models are built with random weights (no hub downloads); a weights file is a state_dict read
with ``torch.load(..., weights_only=True)``. Every failure is a ModelError that says what
was wrong and what to do.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from core.cuda_allocator import split_exactly
from core.errors import ModelError, UsageError
from core.loaded import DTYPES, LoadedModel, ModelSpec
from planner.families import family_of

ONEDNN_CACHE = 8192  # primitives: every unit's kernels at every batch size of a profile


def apply_threads(threads: int) -> None:
    """torch's intra-op threads (0 = leave torch's default). The count is part of a CPU
    profile's fingerprint, so planner and workers must agree on it to share tables.

    Also oneDNN's primitive cache, read when torch's first CPU kernel runs: at its default
    (1024) a profile going round-robin over the batch sizes, or plans running units at many
    sub-batch sizes, evict each other's primitives and every call builds its own again, so
    a unit at one sample measures several times what it costs served. A capacity the user
    set (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) is kept."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE))
    if threads:
        torch.set_num_threads(threads)


def _build(name: str) -> nn.Module:
    model = family_of(name).build(name)
    if not isinstance(model, nn.Module):
        raise ModelError(f"{name!r} was built as a {type(model).__name__}, not an nn.Module")
    return model


def _load_weights(model: nn.Module, path: Path) -> None:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise ModelError(f"no weights file at {path}") from exc
    except Exception as exc:
        raise ModelError(f"cannot read weights {path}: {exc}; save a state_dict with "
                         "torch.save(model.state_dict(), path)") from exc
    if not isinstance(state, dict):
        raise ModelError(f"{path} holds a {type(state).__name__}, not a state_dict")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ModelError(f"weights {path} do not fit the model: {first}") from exc


def load_model(spec: ModelSpec) -> LoadedModel:
    """Build the model, load its weights, and put it in eval mode on its device and dtype."""
    if spec.dtype not in DTYPES:
        raise UsageError(f"dtype {spec.dtype!r}: use one of {', '.join(DTYPES)}")
    if spec.device not in ("cpu", "cuda"):
        raise UsageError(f"device {spec.device!r}: use cpu or cuda")
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("device cuda asked for, but torch sees no CUDA device; use --device cpu")
    model = _build(spec.name)
    if spec.weights is not None:
        _load_weights(model, spec.weights)
    shape = spec.input_shape or getattr(model, "input_shape", None) or \
        family_of(spec.name).input_shape(spec.name)
    dtype = DTYPES[spec.dtype]
    if spec.device == "cuda":
        split_exactly()  # before the weights' first allocation: torch allocates what the walk counts
    model = model.eval().to(device=spec.device, dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return LoadedModel(spec=spec, module=model, input_shape=tuple(shape), torch_dtype=dtype)
