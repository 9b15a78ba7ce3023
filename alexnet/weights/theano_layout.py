"""The Theano reproduction's parameter layout and how it maps onto our caffenet (arrays only, no files).

The Theano folder, epoch E (its network is our ``caffenet`` at crop 227; read and written by
:mod:`alexnet.weights.theano`)::

    W_{i}_E.npy, b_{i}_E.npy                      i = 0 conv1, 2 conv3, 5 fc6, 6 fc7, 7 fc8
    W0_{i}_E.npy, W1_{i}_E.npy, b0_/b1_{i}_E.npy  i = 1 conv2, 3 conv4, 4 conv5 (two columns)
    mom_{k}_E.npy                                 velocity of the k-th array in THEANO_PARAMS order
    lr_E.npy                                      saved after the end-of-epoch lr change: the lr of E+1
    val_record.npy                                [top-1 error, loss] per validated epoch (one file)

Mapping (`theano_to_ours` / `ours_to_theano`, the same for weights and velocities):

- conv weights are (in, rows, cols, out) there, (out, in, rows, cols) here. With ``lib_conv: cudnn``
  (the released weights) Theano's dnn_conv is a true convolution, so the kernels are flipped in both
  spatial dimensions (torch's conv2d is a cross-correlation); with ``cudaconvnet`` nothing is flipped.
- a grouped layer's W0/b0 are the first half of the outputs (reading the first half of the inputs),
  which is exactly torch's ``groups=2`` weight cut in two along the outputs.
- fc weights are (n_in, n_out) used as x.W + b; ours are (n_out, n_in). fc6's input is pool5
  flattened in (channel, row, col) order, as torch.flatten of NCHW: no permutation.
- dropout: Theano scales by 0.5 at test time. A ``theano``-style model (layers/dropout.py) holds the
  arrays unchanged (and continues a Theano run with the same SGD dynamics); an ``inverted``-style one
  computes the same function with the 0.5 folded into fc7's and fc8's weights (the layers that read
  the dropped units) and, as the velocity is a step in weight space, into their velocities. x0.5 and
  x2 are exact in binary floating point, so ours -> Theano -> ours is bitwise exact.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..models import build_model
from .common import FormatError

THEANO_CONVS = ("cudnn", "cudaconvnet")
THEANO_CROP = 227
THEANO_DROPOUT = 0.5


class TheanoParam(NamedTuple):
    stem: str          # file name without "_{epoch}.npy", e.g. "W0_1"
    key: str           # our state-dict key, e.g. "features.conv2.weight"
    group: int | None  # 0 / 1: the column of a grouped layer; None: a single layer
    conv: bool
    weight: bool       # W (else b)


def _theano_params() -> tuple[TheanoParam, ...]:
    layers = (("features.conv1", False, True), ("features.conv2", True, True), ("features.conv3", False, True),
              ("features.conv4", True, True), ("features.conv5", True, True), ("classifier.fc6", False, False),
              ("classifier.fc7", False, False), ("classifier.fc8", False, False))
    out = []
    for i, (module, grouped, conv) in enumerate(layers):
        for group in ((0, 1) if grouped else (None,)):
            tag = "" if group is None else str(group)
            out += [TheanoParam(f"W{tag}_{i}", f"{module}.weight", group, conv, True),
                    TheanoParam(f"b{tag}_{i}", f"{module}.bias", group, conv, False)]
    return tuple(out)


THEANO_PARAMS = _theano_params()  # Theano's parameter list order: mom_k is THEANO_PARAMS[k]'s velocity
STEMS = frozenset(p.stem for p in THEANO_PARAMS)
_FOLDED = ("classifier.fc7.weight", "classifier.fc8.weight")  # read the units dropout drops
# Widths are tried from these arrays' output counts (most channels first, as common.PAPER_LAYERS).
WIDTH_HINTS = (("W_5", 4096, 1), ("W_2", 384, 1), ("W0_3", 384, 2), ("W0_1", 256, 2), ("W0_4", 256, 2),
               ("W_0", 96, 1))


def _to_ours(p: TheanoParam, a: np.ndarray, flip: bool) -> np.ndarray:
    if not p.weight:
        return a
    if not p.conv:
        return a.T
    w = a.transpose(3, 0, 1, 2)  # (in, rows, cols, out) -> (out, in, rows, cols)
    return w[:, :, ::-1, ::-1] if flip else w


def _to_theano(p: TheanoParam, a: np.ndarray, flip: bool) -> np.ndarray:
    if not p.weight:
        return a
    if not p.conv:
        return a.T
    w = a[:, :, ::-1, ::-1] if flip else a
    return w.transpose(1, 2, 3, 0)


def theano_to_ours(arrays: dict[str, np.ndarray], conv: str, dropout_style: str) -> dict[str, np.ndarray]:
    """Theano arrays (stem -> array; weights or velocities) -> our state-dict keys, float32, contiguous."""
    check_conv(conv)
    parts: dict[str, list[np.ndarray]] = {}
    for p in THEANO_PARAMS:
        parts.setdefault(p.key, []).append(_to_ours(p, arrays[p.stem], conv == "cudnn"))
    out = {}
    for key, pieces in parts.items():
        a = np.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]
        if dropout_style == "inverted" and key in _FOLDED:
            a = a * np.float32(THEANO_DROPOUT)
        out[key] = np.ascontiguousarray(a, dtype=np.float32)
    return out


def ours_to_theano(tensors: dict[str, np.ndarray], conv: str, dropout_style: str) -> dict[str, np.ndarray]:
    """Our state-dict arrays (weights or velocities) -> Theano stems, float32, contiguous."""
    check_conv(conv)
    out = {}
    for p in THEANO_PARAMS:
        a = np.asarray(tensors[p.key], dtype=np.float32)
        if dropout_style == "inverted" and p.key in _FOLDED:
            a = a * np.float32(1 / THEANO_DROPOUT)
        if p.group is not None:
            half = a.shape[0] // 2
            a = a[:half] if p.group == 0 else a[half:]
        out[p.stem] = np.ascontiguousarray(_to_theano(p, a, conv == "cudnn"), dtype=np.float32)
    return out


def check_conv(conv: str) -> None:
    if conv not in THEANO_CONVS:
        raise FormatError(f"the Theano convolution must be one of {', '.join(THEANO_CONVS)}, got {conv!r}")


def theano_shapes(width: float, num_classes: int) -> dict[str, tuple[int, ...]]:
    """The shape of every Theano array of a caffenet of `width` and `num_classes` at crop 227."""
    with torch.device("meta"):
        model = build_model("caffenet", num_classes, width, THEANO_DROPOUT, THEANO_CROP, init="torch")
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    out = {}
    for p in THEANO_PARAMS:
        shape = ours[p.key]
        split = 2 if p.group is not None else 1
        if not p.weight:
            out[p.stem] = (shape[0] // split,)
        elif p.conv:
            out[p.stem] = (shape[1], shape[2], shape[3], shape[0] // split)
        else:
            out[p.stem] = (shape[1], shape[0])
    return out


def shape_hint(p: TheanoParam) -> str:
    """The layout of `p`'s array, for error messages."""
    if not p.weight:
        return "b: (n_out,)"
    return "W: (in, rows, cols, out)" if p.conv else "W: (n_in, n_out)"


def _simple_first(width: float) -> list[float]:
    """`width` rounded to 1..6 decimals, then as is: a converted 0.3 is found as 0.3, not 0.30005."""
    out = []
    for w in [round(width, d) for d in range(1, 7)] + [width]:
        if w > 0 and w not in out:
            out.append(w)
    return out


def infer_theano_shape(arrays: dict[str, np.ndarray]) -> tuple[float | None, int | None, dict | None]:
    """(width, num_classes, expected shapes) explaining `arrays` (some may be missing).

    width is None when no width fits every array; the shapes are then those of the width that fits
    the most arrays, so that the first array not fitting them is the one to name.
    """
    w7, b7 = arrays.get("W_7"), arrays.get("b_7")
    num_classes = (w7.shape[1] if w7 is not None and w7.ndim == 2 else
                   b7.shape[0] if b7 is not None and b7.ndim == 1 else None)
    if not num_classes:
        return None, None, None
    guesses = [arrays[s].shape[-1] * split / base for s, base, split in WIDTH_HINTS
               if s in arrays and arrays[s].ndim >= 2 and arrays[s].shape[-1] > 0]
    best, best_fits = None, -1
    for guess in guesses:
        for width in _simple_first(guess):
            shapes = theano_shapes(width, num_classes)
            fits = sum(a.shape == shapes[s] for s, a in arrays.items())
            if fits == len(arrays):
                return width, num_classes, shapes
            if fits > best_fits:
                best, best_fits = shapes, fits
    return None, num_classes, best
