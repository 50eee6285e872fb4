"""Load the model to plan: built by its family (``planner.families``: a torchvision name, the
built-in ``c3d``, or ``pkg.module:factory``), its weights loaded, on its device and dtype.

Models are built with random weights (no hub downloads), the same in every process (seeded);
a weights file is a state_dict read with ``torch.load(..., weights_only=True)``. Every failure is a ModelError that says what
was wrong and what to do. ``sketch_model`` builds one on the meta device (or, where its
construction needs real tensors, on the CPU with its weights left unset): what its weights
take and its output shape, without the memory (a server weighs a model before it loads it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from core.cuda_allocator import split_exactly
from core.errors import ModelError, UsageError
from core.gate import MODULE_GATE
from core.loaded import DTYPES, LoadedModel, ModelSpec
from core.precision import HALF
from planner.families import family_of

log = logging.getLogger("vbs.plan")

ONEDNN_CACHE = 8192  # primitives: every unit's kernels at every batch size of a profile
WEIGHTS_SEED = 0  # a model's random weights (no weights file): bench/peers.py's peers use it too


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


def _load_weights(model: nn.Module, path: Path, *, meta: bool = False) -> None:
    try:
        state = torch.load(path, map_location="meta" if meta else "cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise ModelError(f"no weights file at {path}") from exc
    except Exception as exc:
        raise ModelError(f"cannot read weights {path}: {exc}; save a state_dict with "
                         "torch.save(model.state_dict(), path)") from exc
    if not isinstance(state, dict):
        raise ModelError(f"{path} holds a {type(state).__name__}, not a state_dict")
    try:
        model.load_state_dict(state, strict=True, assign=meta)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ModelError(f"weights {path} do not fit the model: {first}") from exc


def _check(spec: ModelSpec) -> None:
    if spec.dtype not in DTYPES:
        raise UsageError(f"dtype {spec.dtype!r}: use one of {', '.join(DTYPES)}")
    if spec.device not in ("cpu", "cuda"):
        raise UsageError(f"device {spec.device!r}: use cpu or cuda")
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("device cuda asked for, but torch sees no CUDA device; use --device cpu")


def load_model(spec: ModelSpec) -> LoadedModel:
    """Build the model, load its weights, and put it in eval mode on its device and dtype."""
    _check(spec)
    with torch.random.fork_rng(devices=[]):  # the process's own random stream left as it was
        # random weights the same in every process: without a weights file the planner's
        # compiled graphs, a torch worker's capture and the int8 guard's verdict are of one model
        torch.manual_seed(WEIGHTS_SEED)
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
    loaded = LoadedModel(spec=spec, module=model, input_shape=tuple(shape), torch_dtype=dtype)
    return replace(loaded, channels_last=True) if channels_last(loaded) else loaded


def channels_last(model: LoadedModel) -> bool:
    """Put a half-precision model of images on the CPU in channels_last (its 4-d weights NHWC,
    so its convolutions' outputs are too), where it runs; True where it does.

    Why: oneDNN's bfloat16 and float16 convolutions (AVX512-BF16, AVX512-FP16, AMX) run on
    NHWC, and on NCHW tensors torch reorders around each one: resnet50's units ran 1.8x
    faster in channels_last in bfloat16 on AMX, 1.3x in float16 on AVX512-FP16
    (docs/benchmarks.md, section 13). float32 stays as it is (ONNX Runtime runs
    it; torch's float32 kernels gain less). A model whose forward cannot take the layout (a
    ``view`` across channels, say) is put back and runs as before: one sample tried here."""
    if model.spec.dtype not in HALF or model.spec.device != "cpu" or \
            len(model.input_shape) != 3:
        return False
    module = model.module.to(memory_format=torch.channels_last)
    try:
        with torch.inference_mode(), MODULE_GATE.running():  # never beside a trace
            module(model.example(1))
    except Exception as exc:  # noqa: BLE001 - any failure of the layout: the model as it was
        module.to(memory_format=torch.contiguous_format)
        log.info("%s: runs in %s without channels_last (%s: %s)", model.spec.name, model.spec.dtype,
                 type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    return True


@dataclass(frozen=True)
class ModelSketch:
    """What a model is and what its weights take, known without loading it (``sketch_model``)."""

    weights_bytes: int                   # parameters and buffers, in the spec's dtype
    input_shape: tuple[int, ...]         # per sample
    output_shape: tuple[int, ...] | None  # per sample; None when the model cannot run on meta


_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _weights_left_unset() -> Iterator[None]:
    """Every ``torch.nn.init`` function a no-op while a model is built: its weights are
    allocated (pages mapped lazily, never written) but not initialised, so building it costs
    neither the time nor the memory of its values."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    with _INIT_LOCK:
        saved = {n: getattr(nn.init, n) for n in names}
        try:
            for n in names:
                setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
            yield
        finally:
            for n, function in saved.items():
                setattr(nn.init, n, function)


def _build_sketch(name: str) -> nn.Module:
    """The model on the meta device; where its construction reads a tensor's values (a RegNet
    computes its widths with tensors), built on the CPU with its weights left unset and then
    moved to meta. A sketch is a shortcut: it must never refuse a model ``load_model`` builds."""
    try:
        with torch.device("meta"):
            return _build(name)
    except (ModelError, RuntimeError, NotImplementedError):
        with _weights_left_unset():
            return _build(name).to("meta")


def sketch_model(spec: ModelSpec, *, check_weights: bool = False) -> ModelSketch:
    """The model built on the meta device (no memory, no weights read): what its weights take
    and, from one pass on meta tensors, its output shape. With ``check_weights`` the weights
    file is read on meta too and must fit the model (what ``load_model`` would refuse, refused
    without the memory it takes: ModelError)."""
    _check(spec)
    model = _build_sketch(spec.name)
    if check_weights and spec.weights is not None:
        _load_weights(model, spec.weights, meta=True)
    shape = spec.input_shape or getattr(model, "input_shape", None) or \
        family_of(spec.name).input_shape(spec.name)
    size = DTYPES[spec.dtype].itemsize
    tensors = [*model.parameters(), *model.buffers()]
    weights = sum(t.numel() * (size if t.is_floating_point() else t.element_size())
                  for t in tensors)
    try:
        with torch.no_grad():
            y = model.eval()(torch.empty((1, *shape), device="meta"))
        output: tuple[int, ...] | None = tuple(int(d) for d in y.shape[1:])
    except Exception:  # noqa: BLE001 - an op without a meta kernel: known once loaded
        output = None
    return ModelSketch(int(weights), tuple(int(d) for d in shape), output)
