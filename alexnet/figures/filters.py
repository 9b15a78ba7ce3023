"""Fig. 3 of Krizhevsky et al. 2012: conv1's kernels as colour patches, in the model's groups.

A model trained with ``parallel.model=columns`` holds its two columns' kernels as the first and second
halves of conv1 (each column computes output units [m n/2, (m+1) n/2)), so they are drawn as two
groups, column 1 above column 2, as in the paper; any other model as one group. Each kernel is scaled
to its own range (min -> 0, max -> 255 over its three channels).

The picture is composed pixel by pixel: every kernel pixel is a SCALE x SCALE block at a position
`filter_layout` gives, so a test can read each kernel back from the PNG.
"""
from __future__ import annotations

import os

import numpy as np
from torch import nn

from ..model_parallel import COLUMN_ARCHS
from .common import Box, canvas_figure, read_entries, save_png

SCALE = 4  # PNG pixels per kernel pixel
GAP = 2  # between kernels
MARGIN = 12  # around the grid
TITLE_H = 40  # the title band above everything: two lines of text
MIN_WIDTH = 560  # wide enough for the title in two lines
LABEL_H = 18  # a group's label band above its kernels
GROUP_GAP = 10  # between two groups
PER_ROW = 16  # kernels per row, as the paper's figure
BACKGROUND = 255


def conv1_weight(model: nn.Module) -> np.ndarray:
    """The first convolution's weight, out x 3 x k x k (our models' input channels are RGB)."""
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    return conv.weight.detach().float().cpu().numpy()


def stored_parallel_model(path: str | os.PathLike, info: dict) -> str | None:
    """parallel.model of the config stored in our checkpoint or weights file (None for other formats)."""
    if info["source"] not in ("checkpoint", "weights"):
        return None
    state = read_entries(path)  # load_weights read this file already: this time only its config
    return ((state.get("config") or {}).get("parallel") or {}).get("model")


def column_groups(info: dict, parallel_model: str | None) -> int:
    """2 for an alexnet/caffenet trained as two columns, else 1."""
    return 2 if parallel_model == "columns" and info["arch"] in COLUMN_ARCHS else 1


def kernel_colours(weight: np.ndarray) -> np.ndarray:
    """n x k x k x 3 uint8: each kernel scaled to its own range (a constant kernel is mid grey)."""
    w = weight.astype(np.float64)
    low = w.min(axis=(1, 2, 3), keepdims=True)
    span = w.max(axis=(1, 2, 3), keepdims=True) - low
    scaled = np.where(span > 0, (w - low) / np.where(span > 0, span, 1), 0.5)
    return np.round(scaled * 255).astype(np.uint8).transpose(0, 2, 3, 1)


def filter_layout(n: int, groups: int, k: int) -> tuple[list[Box], int, int]:
    """Each kernel's box (kernels in order; group g = kernels [g n/groups, (g+1) n/groups), groups one
    above the other, each filled row by row, PER_ROW to a row), and the PNG's width and height."""
    per_group = n // groups
    cols = min(PER_ROW, per_group)
    rows = -(-per_group // cols)
    size = k * SCALE
    group_h = LABEL_H + rows * size + (rows - 1) * GAP
    boxes = []
    for i in range(n):
        g, j = divmod(i, per_group)
        top = TITLE_H + g * (group_h + GROUP_GAP) + LABEL_H + (j // cols) * (size + GAP)
        boxes.append(Box(top, MARGIN + (j % cols) * (size + GAP), size))
    width = max(MIN_WIDTH, 2 * MARGIN + cols * size + (cols - 1) * GAP)
    height = TITLE_H + groups * group_h + (groups - 1) * GROUP_GAP + MARGIN
    return boxes, width, height


def compose(weight: np.ndarray, groups: int) -> tuple[np.ndarray, list[Box]]:
    """The H x W x 3 uint8 picture of the kernels (without text) and their boxes."""
    n, _, k, _ = weight.shape
    if n % groups:
        raise ValueError(f"{n} kernels cannot be cut into {groups} equal groups")
    boxes, width, height = filter_layout(n, groups, k)
    canvas = np.full((height, width, 3), BACKGROUND, np.uint8)
    for box, patch in zip(boxes, kernel_colours(weight)):
        canvas[box.top:box.top + box.size, box.left:box.left + box.size] = patch.repeat(SCALE, 0).repeat(SCALE, 1)
    return canvas, boxes


def describe(n: int, groups: int, arch: str) -> str:
    """What the picture shows, for its title."""
    k = n // groups
    if groups == 2:
        return f"2 columns x {k} kernels (parallel.model=columns): column 1 above, column 2 below"
    return f"{n} kernels of a single-device {arch}"


def draw_filters(weight: np.ndarray, groups: int, title: str, out: str | os.PathLike) -> list[Box]:
    """Write filters.png: the composed kernels under `title`, each group labelled; returns the boxes."""
    canvas, boxes = compose(weight, groups)
    height, width = canvas.shape[:2]
    fig = canvas_figure(canvas, title, MARGIN)
    per_group = len(boxes) // groups
    for g in range(groups):
        first = boxes[g * per_group]
        label = (f"column {g + 1}: kernels {g * per_group + 1}-{(g + 1) * per_group}" if groups > 1
                 else f"kernels 1-{len(boxes)}, row by row")
        fig.text(MARGIN / width, 1 - (first.top - 3) / height, label, ha="left", va="bottom", fontsize=7)
    save_png(fig, out)
    return boxes
