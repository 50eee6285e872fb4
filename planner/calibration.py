"""A user's calibration samples (`vbs plan --calibration DIR`): what int8 units are quantized
from and what the error guard measures them on (``planner.precision``).

Why the user's: static int8 fixes each activation's scale from the values it sees, and the
guard's answer is only as good as its samples; random inputs would calibrate ranges no image
gives. A folder holds ``.npy`` files (one sample of the model's input shape, or a batch of
them) or images (``.png``, ``.jpg``, ...), which go through the model family's preprocessing,
as the service's image inputs do. The samples are split once, in file order: the first ones
calibrate, the last quarter (at least ``HELD_OUT_MIN``) are held out for the guard.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import UsageError

IMAGES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
SAMPLES_MIN = 8      # fewer calibrate nothing worth trusting
HELD_OUT_MIN = 4
HELD_OUT_SHARE = 0.25
FIT_MAX = 64         # calibration samples beyond this add time, not ranges


@dataclass(frozen=True)
class Calibration:
    """Samples of the model's input, split into those that calibrate and those held out."""

    fit: np.ndarray       # float32, (n, *input_shape)
    held_out: np.ndarray  # float32, (m, *input_shape)
    digest: str           # of every sample's bytes, in order
    source: str           # where they came from, for messages

    @property
    def count(self) -> int:
        return int(self.fit.shape[0] + self.held_out.shape[0])


def read_calibration(path: Path, model_name: str, input_shape: Sequence[int]) -> Calibration:
    """The samples in folder ``path`` for a model of per-sample ``input_shape``."""
    if not path.is_dir():
        raise UsageError(f"--calibration {path}: no such folder; give a folder of .npy files "
                         "(samples of the model's input) or images")
    shape = tuple(int(d) for d in input_shape)
    samples: list[np.ndarray] = []
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    for file in files:
        if file.suffix.lower() == ".npy":
            samples.extend(_npy(file, shape))
        elif file.suffix.lower() in IMAGES:
            samples.append(_image(file, model_name, shape))
    if len(samples) < SAMPLES_MIN + HELD_OUT_MIN:
        raise UsageError(f"--calibration {path}: {len(samples)} samples of shape {shape}; give "
                         f"at least {SAMPLES_MIN + HELD_OUT_MIN} (.npy files of that shape, or "
                         f"a batch of them, or images)")
    held = max(HELD_OUT_MIN, int(round(len(samples) * HELD_OUT_SHARE)))
    fit, held_out = samples[:-held][:FIT_MAX], samples[-held:]
    digest = hashlib.sha256()
    for s in samples:
        digest.update(s.tobytes())
    return Calibration(np.stack(fit), np.stack(held_out), digest.hexdigest()[:16], str(path))


def _npy(file: Path, shape: tuple[int, ...]) -> list[np.ndarray]:
    try:
        array = np.load(file, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--calibration: cannot read {file}: {exc}") from exc
    if tuple(array.shape) == shape:
        return [np.ascontiguousarray(array, dtype=np.float32)]
    if array.ndim == len(shape) + 1 and tuple(array.shape[1:]) == shape:
        return [np.ascontiguousarray(a, dtype=np.float32) for a in array]
    raise UsageError(f"--calibration: {file} has shape {tuple(array.shape)}; the model takes "
                     f"samples of shape {shape} (one sample, or a batch of them)")


def _image(file: Path, model_name: str, shape: tuple[int, ...]) -> np.ndarray:
    from PIL import Image

    from planner.families import build_preprocess

    found = build_preprocess(model_name, shape)
    if found is None:
        raise UsageError(f"--calibration: {file} is an image, but {model_name} takes samples of "
                         f"shape {shape}, not images: give .npy files")
    preprocess, mode = found
    try:
        with Image.open(file) as image:
            return np.asarray(preprocess(image.convert(mode)), dtype=np.float32)
    except OSError as exc:
        raise UsageError(f"--calibration: cannot read image {file}: {exc}") from exc
