"""data/geometry.py by hand and against OpenCV, without real images (tests/test_geometry.py checks the same
functions on the ImageNet sample and through preprocessing): OpenCV's taps worked out on paper, cv2.resize on
the sizes where its rounding is delicate, and torchvision's Resize + CenterCrop arithmetic spelled out.

Fast (no model, no data files): `make mutants` mutates data/geometry.py against it.
"""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from data.geometry import _linear_taps, opencv_linear, torchvision_size, torchvision_window, window_offset

# -- OpenCV's taps (cv::resize INTER_LINEAR) -----------------------------------------------------------------


def test_taps_of_an_enlargement_by_two_worked_by_hand():
    """2 -> 4: positions (i + 0.5) / 2 - 0.5 = -0.25, 0.25, 0.75, 1.25; floor -1, 0, 0, 1; fractions 0.75,
    0.25, 0.75, 0.25; weights out of 2048. Along x a position outside [0, 1) of the two-pixel row takes
    the border pixel whole; along y the fraction is kept and only the row indices are clamped."""
    x0, x1, a0, a1 = _linear_taps(2, 4, clamp_weight=True)
    assert x0.tolist() == [0, 0, 0, 1] and x1.tolist() == [0, 1, 1, 1]
    assert a0.tolist() == [2048, 1536, 512, 2048] and a1.tolist() == [0, 512, 1536, 0]
    y0, y1, b0, b1 = _linear_taps(2, 4, clamp_weight=False)
    assert y0.tolist() == [0, 0, 0, 1] and y1.tolist() == [0, 1, 1, 1]
    assert b0.tolist() == [512, 1536, 512, 1536] and b1.tolist() == [1536, 512, 1536, 512]
    assert {a.dtype for a in (a0, a1, b0, b1)} == {np.dtype(np.int32)}


def test_taps_of_a_reduction_by_three_worked_by_hand():
    """6 -> 2: positions 1.0 and 4.0, exactly on pixels: one tap each, nothing clamped."""
    for clamp in (True, False):
        i0, i1, w0, w1 = _linear_taps(6, 2, clamp_weight=clamp)
        assert i0.tolist() == [1, 4] and i1.tolist() == [2, 5]
        assert w0.tolist() == [2048, 2048] and w1.tolist() == [0, 0]


def test_taps_of_a_single_pixel_and_of_the_last_pair():
    """1 -> 3: every position reads pixel 0 (indices clamped both ways); x weighs it whole, y keeps the
    fractions (-1/3: floor -1, fraction 2/3 -> 683 of 2048; 0: 0; 1/3: 683). 3 -> 2: positions 0.25 and
    1.75, the second between pixels 1 and 2 (the last pair, nothing clamped)."""
    x0, x1, a0, a1 = _linear_taps(1, 3, clamp_weight=True)
    assert x0.tolist() == x1.tolist() == [0, 0, 0] and a0.tolist() == [2048] * 3 and a1.tolist() == [0] * 3
    y0, y1, b0, b1 = _linear_taps(1, 3, clamp_weight=False)
    assert y0.tolist() == y1.tolist() == [0, 0, 0]
    assert b0.tolist() == [683, 2048, 1365] and b1.tolist() == [1365, 0, 683]
    i0, i1, w0, w1 = _linear_taps(3, 2, clamp_weight=True)
    assert i0.tolist() == [0, 1] and i1.tolist() == [1, 2] and w0.tolist() == [1536, 512] and w1.tolist() == [512, 1536]


# sides where OpenCV's float32 positions, its y rounding at the border rows and its vertical pass's rounding
# show (36 -> 227: the position in double rounds to another weight than OpenCV's float32 one)
SHAPES = [(36, 36), (37, 41), (2, 4), (4, 2), (1, 3), (3, 1), (5, 300), (300, 5), (130, 257)]


@pytest.mark.parametrize("size", [227, 256, 7])
def test_opencv_linear_is_cv2_resize(size):
    cv2 = pytest.importorskip("cv2")
    rng = np.random.default_rng(size)
    for h, w in SHAPES:
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        np.testing.assert_array_equal(opencv_linear(image, size), cv2.resize(image, (size, size)),
                                      err_msg=f"{h} x {w} to {size}")


def test_opencv_linear_of_a_ramp_by_hand():
    """A 1 x 2 row (0, 255) enlarged to 4 x 4: every row is the x taps' mix, 0 * a0 + 255 * a1 / 2048 ->
    0, 63.75, 191.25, 255, which the 8-bit path rounds to 0, 64, 191, 255."""
    image = np.array([[[0], [255]]], dtype=np.uint8)
    out = opencv_linear(image, 4)
    assert out.dtype == np.uint8 and out.shape == (4, 4, 1)
    assert out[..., 0].tolist() == [[0, 64, 191, 255]] * 4


# -- torchvision's Resize(size) + CenterCrop(224) -------------------------------------------------------------


@pytest.mark.parametrize("w,h,size,expected", [
    (500, 375, 256, (341, 256)),  # landscape: 256 * 500 / 375 = 341.33
    (375, 500, 256, (256, 341)),  # portrait
    (300, 300, 256, (256, 256)),
    (100, 299, 256, (256, 765)),  # 256 * 2.99 = 765.44
    (640, 480, 227, (302, 227)),  # 227 * 4 / 3 = 302.67: int() truncates
    (17, 1000, 256, (256, 15058)),  # 15058.82
])
def test_torchvision_size_by_hand(w, h, size, expected):
    assert torchvision_size(w, h, size) == expected


@pytest.mark.parametrize("length,size,expected", [
    (256, 256, 0), (257, 256, 0),  # round(16.5) = 16 (halves to even): 16 - 16
    (259, 256, 2),  # round(17.5) = 18
    (341, 256, 42),  # round(58.5) = 58, minus 16
    (300, 227, 37),  # round(38) = 38, minus (227 - 224) // 2 = 1
    (227, 227, 0),  # round(1.5) = 2, minus 1 = 1, past the image (227 - 227 = 0): clipped
    (230, 227, 2),  # round(3) = 3, minus 1
    (100, 64, 18),  # crop = size = 64: round(18) = 18
    (65, 64, 0),  # round(0.5) = 0
])
def test_window_offset_by_hand(length, size, expected):
    got = window_offset(length, size)
    assert got == expected and type(got) is int


def _pil_center_crop(im: Image.Image, crop: int) -> np.ndarray:
    """torchvision's CenterCrop on a PIL image: top = int(round((h - crop) / 2.0)), left likewise."""
    w, h = im.size
    top, left = int(round((h - crop) / 2.0)), int(round((w - crop) / 2.0))
    return np.asarray(im)[top:top + crop, left:left + crop]


@pytest.mark.parametrize("w,h,resized", [(500, 375, (341, 256)), (375, 517, (256, 352)), (256, 300, (256, 300)),
                                         (120, 97, (316, 256))])
def test_torchvision_window_holds_centercrop_at_its_center(w, h, resized):
    """Resize(256) (PIL bilinear to the size worked out by hand) then CenterCrop(224) is the window's
    central 224 x 224 (offset 16); the window is size x size uint8. (256 x 300 is not resized at all.)"""
    rng = np.random.default_rng(w)
    im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    window = torchvision_window(im, 256)
    assert window.shape == (256, 256, 3) and window.dtype == np.uint8
    reference = im.resize(resized, Image.Resampling.BILINEAR) if resized != (w, h) else im
    np.testing.assert_array_equal(window[16:240, 16:240], _pil_center_crop(reference, 224))


def test_torchvision_window_at_another_size_is_clipped_into_the_image():
    """size 227 of a 227 x 300 image (portrait: not resized): the window is the whole width; vertically
    CenterCrop(224) starts at round(38) = 38, so the window at 38 - 1 = 37."""
    rng = np.random.default_rng(5)
    pixels = rng.integers(0, 256, (300, 227, 3), dtype=np.uint8)
    window = torchvision_window(Image.fromarray(pixels), 227)
    np.testing.assert_array_equal(window, pixels[37:37 + 227, 0:227])
