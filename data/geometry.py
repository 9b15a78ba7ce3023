"""The input geometries of the released AlexNets, reproduced from fully decoded pixels (no draft mode).

``caffe``: BVLC's ``convert_imageset`` warps every image straight to 256 x 256 with OpenCV's
``cv::resize(..., INTER_LINEAR)``: two taps per axis at half-pixel centres, no antialiasing even when
shrinking, 11-bit fixed-point weights. :func:`opencv_linear` computes it with numpy, rounding as
OpenCV's vectorised 8-bit path does (bit-equal to ``cv2.resize`` 4.14 on the 500 sample ImageNet images
and on random sizes from 1 pixel up; OpenCV is not needed at run time).

``torchvision``: ``Resize(256)`` on a PIL image (shorter side to 256, the longer one ``int(256 * long /
short)``, Pillow's antialiased bilinear), then the 256-pixel window along the longer side whose central
224 crop (at offset 16, as data/augment's center crop) is ``CenterCrop(224)``'s, which starts at
``int(round((L - 224) / 2.0))`` (Python's round: halves to even). With ``--size 256`` that window
always lies inside the image (see :func:`window_offset`).
"""
from __future__ import annotations

import numpy as np
from PIL import Image

_COEF_BITS = 11  # OpenCV's INTER_RESIZE_COEF_BITS: weights are integers out of 2048
TORCHVISION_CROP = 224  # CenterCrop(224) of torchvision's ImageNet evaluation


def _linear_taps(n_src: int, n_dst: int, clamp_weight: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """OpenCV's source indices and fixed-point weights of each output position along one axis.

    The position is computed in double and stored as float32, as OpenCV does. Along x a position outside
    the source takes the border pixel with weight 1 (``clamp_weight``); along y OpenCV keeps the fraction
    and clamps the row indices, which rounds differently at the border rows when upscaling.
    """
    pos = ((np.arange(n_dst) + 0.5) * (n_src / n_dst) - 0.5).astype(np.float32)
    first = np.floor(pos).astype(np.int64)
    frac = pos - first.astype(np.float32)
    if clamp_weight:  # the indices are clamped below, for both axes
        frac[(first < 0) | (first >= n_src - 1)] = 0
    one = np.float32(1 << _COEF_BITS)
    w0 = np.rint((np.float32(1) - frac) * one).astype(np.int32)
    w1 = np.rint(frac * one).astype(np.int32)
    return np.clip(first, 0, n_src - 1), np.clip(first + 1, 0, n_src - 1), w0, w1


def opencv_linear(image: np.ndarray, size: int) -> np.ndarray:
    """``cv2.resize(image, (size, size))`` (INTER_LINEAR) of an H x W x C uint8 array, without OpenCV."""
    h, w = image.shape[:2]
    y0, y1, b0, b1 = _linear_taps(h, size, clamp_weight=False)
    x0, x1, a0, a1 = _linear_taps(w, size, clamp_weight=True)
    rows = np.unique(np.concatenate([y0, y1]))  # only the source rows the output reads
    src = image[rows]
    # int32 holds every intermediate: 255 * 2048 here, 2048 * (255 * 2048 >> 4) below
    horizontal = src[:, x0].astype(np.int32) * a0[None, :, None] + src[:, x1].astype(np.int32) * a1[None, :, None]
    top, bottom = horizontal[np.searchsorted(rows, y0)], horizontal[np.searchsorted(rows, y1)]
    # OpenCV's SIMD rounding of the vertical pass (its scalar tail rounds once, at 22 bits, instead)
    out = (((b0[:, None, None] * (top >> 4)) >> 16) + ((b1[:, None, None] * (bottom >> 4)) >> 16) + 2) >> 2
    return np.clip(out, 0, 255).astype(np.uint8)


def torchvision_size(w: int, h: int, size: int) -> tuple[int, int]:
    """(width, height) after torchvision's ``Resize(size)``: the shorter side to `size`, the longer
    ``int(size * long / short)``."""
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(size * long / short)
    return (size, new_long) if w <= h else (new_long, size)


def window_offset(length: int, size: int) -> int:
    """Where the `size` window starts along a resized side of `length`, so that its central
    TORCHVISION_CROP crop (offset (size - crop) // 2) starts where ``CenterCrop`` starts.

    For size 256 it is round((L - 224) / 2) - 16, between 0 and L - 256 for every L >= 256 (round of a
    number >= 16 is >= 16, and at most ceil((L - 256) / 2) + 16), so it is always possible; other sizes
    may need clipping into the image, which then shifts the crop by one pixel.
    """
    crop = min(TORCHVISION_CROP, size)
    offset = int(round((length - crop) / 2.0)) - (size - crop) // 2
    return min(max(offset, 0), length - size)


def torchvision_window(im: Image.Image, size: int) -> np.ndarray:
    """torchvision's ``Resize(size)`` of an RGB image, then the size x size window of window_offset."""
    w, h = torchvision_size(*im.size, size)
    if (w, h) != im.size:
        im = im.resize((w, h), Image.Resampling.BILINEAR)
    left, top = window_offset(w, size), window_offset(h, size)
    return np.asarray(im.crop((left, top, left + size, top + size)), dtype=np.uint8)
