"""Mean image files given to evaluation: the Theano run's img_mean.npy (channel first), ours, or Caffe's
.binaryproto (a BlobProto, BGR, e.g. BVLC's imagenet_mean.binaryproto); and Caffe's per-channel mean.

Every mean comes back as float32 S x S x 3 in RGB order, 0-255, as the images it is subtracted from.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from data.fsutil import SPECIAL, is_special

from .caffe_proto import read_blobproto
from .common import FormatError, load_npy
from .hub import MEANS, fetch

# Caffe's ImageNet mean per channel, in Caffe's BGR order: what BVLC's examples subtract without a mean file.
CAFFE_CHANNEL_MEAN_BGR = (104.0, 117.0, 123.0)
_NPY_MAGIC = b"\x93NUMPY"


def read_mean_image(path: str | os.PathLike, size: int, progress: bool = True) -> np.ndarray:
    """A mean image file as float32 size x size x 3 (RGB): from an .npy of (3, S, S) (Theano's img_mean) or
    (S, S, 3), or from a Caffe .binaryproto of (1, 3, S, S) or (3, S, S) in BGR order; or a published mean
    by name (hub.MEANS: Caffe's (3, S, S) BGR .npy), fetched once with a progress bar if `progress`."""
    if not Path(path).exists() and str(path) in MEANS:  # a misspelt name is refused by the parsers' MEAN_FILE
        return _caffe_npy(fetch(str(path), progress), size)
    path = Path(path)
    if is_special(path):  # a pipe would block the reader for ever
        raise FormatError(f"{path}: {SPECIAL}")
    if not _is_npy(path):
        return _read_binaryproto(path, size)
    mean = load_npy(path)
    if mean.shape == (3, size, size):
        return np.ascontiguousarray(mean.transpose(1, 2, 0))
    if mean.shape == (size, size, 3):
        return mean
    raise FormatError(f"{path}: shape {mean.shape}, expected (3, {size}, {size}) (Theano's img_mean, channel first) "
                      f"or ({size}, {size}, 3) to match the {size}x{size} images")


def caffe_channel_mean(size: int) -> np.ndarray:
    """Caffe's per-channel ImageNet mean as a constant size x size x 3 RGB image."""
    rgb = np.array(CAFFE_CHANNEL_MEAN_BGR[::-1], dtype=np.float32)
    return np.ascontiguousarray(np.broadcast_to(rgb, (size, size, 3)))


def _is_npy(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(_NPY_MAGIC)) == _NPY_MAGIC
    except FileNotFoundError:
        raise FormatError(f"{path}: missing") from None
    except OSError as e:
        raise FormatError(f"{path}: cannot be read ({e.strerror or e})") from None


def _read_binaryproto(path: Path, size: int) -> np.ndarray:
    blob = read_blobproto(path)
    shape = blob.shape[1:] if blob.ndim == 4 and blob.shape[0] == 1 else blob.shape
    if shape != (3, size, size):
        raise FormatError(f"{path}: neither an .npy array nor a Caffe mean of shape (1, 3, {size}, {size}) to match "
                          f"the {size}x{size} images (read as a .binaryproto: shape {blob.shape})")
    if not np.isfinite(blob).all():
        raise FormatError(f"{path}: holds NaN or infinite values")
    return np.ascontiguousarray(blob.reshape(3, size, size)[::-1].transpose(1, 2, 0))  # BGR planes -> RGB pixels


def _caffe_npy(path: Path, size: int) -> np.ndarray:
    """Caffe's python mean (ilsvrc_2012_mean.npy): BGR planes, (3, S, S)."""
    mean = load_npy(path)
    if mean.shape != (3, size, size):
        raise FormatError(f"{path}: Caffe's mean image of shape {mean.shape}, not (3, {size}, {size}) as the "
                          f"{size}x{size} images")
    return np.ascontiguousarray(mean[::-1].transpose(1, 2, 0))  # BGR planes -> RGB pixels (load_npy: float32)
