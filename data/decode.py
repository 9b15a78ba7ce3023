"""Decode one source image to a uint8 RGB square, fast.

JPEGs are decoded with Pillow's draft mode, which lets libjpeg downscale by 1/2, 1/4 or 1/8 in the DCT
domain while decoding: most ImageNet images are ~400x350 or larger, so decoding at reduced scale
before the final resample cuts the work several-fold. The final resample reads only the region that
survives the crop (``resize(box=...)``), so no pixel outside the central square is interpolated.
The ``caffe`` and ``torchvision`` modes reproduce other code's pixels (data/geometry.py), so they decode
at full size: draft mode changes the pixels.
"""
from __future__ import annotations

from typing import BinaryIO

import numpy as np
from PIL import Image

from .geometry import opencv_linear, torchvision_window

RESIZE_MODES = ("short", "warp", "caffe", "torchvision")
EXACT_MODES = ("caffe", "torchvision")  # another library's resize, from fully decoded pixels


def _crop_box(w: int, h: int, mode: str) -> tuple[float, float, float, float]:
    """The source region that maps onto the output square."""
    if mode == "warp":
        return (0.0, 0.0, float(w), float(h))
    side = min(w, h)
    left, top = (w - side) / 2, (h - side) / 2
    return (left, top, left + side, top + side)


def _draft_size(w: int, h: int, size: int, mode: str) -> tuple[int, int]:
    """The smallest decode size that keeps the surviving region at least `size` pixels across."""
    if mode == "warp":
        return (size, size)
    scale = size / min(w, h)
    return (max(size, int(np.ceil(w * scale))), max(size, int(np.ceil(h * scale))))


def to_rgb(im: Image.Image) -> Image.Image:
    """RGB from any mode: CMYK, grayscale, palette (with or without transparency), RGBA, 16-bit."""
    if im.mode == "RGB":
        return im
    if im.mode == "P":
        # Palette images with a transparency entry must pass through RGBA, or Pillow warns and may
        # pick the wrong colours; the alpha is then cut, as for RGBA sources.
        im = im.convert("RGBA")
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        im = Image.fromarray((np.asarray(im, dtype=np.float64) / 257.0).clip(0, 255).astype(np.uint8))
    return im.convert("RGB")


def load_image(path: str | BinaryIO, size: int = 256, mode: str = "short", draft: bool = True) -> np.ndarray:
    """Decode `path` (a file name, or a binary file object such as an archive member's bytes) to an
    HxWx3 uint8 array of side `size`; the same bytes give the same pixels either way.

    mode ``short``: shorter side to `size`, then the central square (Krizhevsky 2012);
    mode ``warp``: the whole image resized to size x size, aspect ratio not kept (the Theano repo);
    mode ``caffe``: the whole image warped as OpenCV's ``cv2.resize`` (BVLC's convert_imageset);
    mode ``torchvision``: ``Resize(size)`` then the window whose centre 224 crop is ``CenterCrop(224)``.
    `draft=False` decodes at full size first (only for measuring what draft mode saves).
    Raises whatever Pillow raises for unreadable, empty or truncated files.
    """
    if mode not in RESIZE_MODES:
        raise ValueError(f"resize mode {mode!r} is not one of {RESIZE_MODES}")
    with Image.open(path) as im:
        if draft and im.format == "JPEG" and mode not in EXACT_MODES:
            im.draft("RGB", _draft_size(*im.size, size, mode))
        arr = _resample(to_rgb(im), size, mode)  # to_rgb decodes fully: truncated files raise here
    if arr.shape != (size, size, 3):  # defensive: a mode Pillow converted oddly
        raise ValueError(f"decoded to shape {arr.shape}, expected {(size, size, 3)}")
    return arr


def _resample(im: Image.Image, size: int, mode: str) -> np.ndarray:
    """The size x size uint8 array of an RGB image in resize `mode`."""
    if mode == "caffe":
        return opencv_linear(np.asarray(im, dtype=np.uint8), size)
    if mode == "torchvision":
        return torchvision_window(im, size)
    out = im.resize((size, size), Image.Resampling.BILINEAR, box=_crop_box(*im.size, mode))
    return np.asarray(out, dtype=np.uint8)
