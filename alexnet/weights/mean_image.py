"""Mean image files given to evaluation: the Theano run's img_mean.npy (channel first) or ours."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .common import FormatError, load_npy


def read_mean_image(path: str | os.PathLike, size: int) -> np.ndarray:
    """A mean image file as float32 size x size x 3 (ours) from (3, S, S) (Theano's img_mean) or (S, S, 3)."""
    path = Path(path)
    mean = load_npy(path)
    if mean.shape == (3, size, size):
        return np.ascontiguousarray(mean.transpose(1, 2, 0))
    if mean.shape == (size, size, 3):
        return mean
    raise FormatError(f"{path}: shape {mean.shape}, expected (3, {size}, {size}) (Theano's img_mean, channel first) "
                      f"or ({size}, {size}, 3) to match the {size}x{size} images")
