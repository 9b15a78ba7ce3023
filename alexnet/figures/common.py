"""What the figures share: matplotlib set up for files, atomic PNG writing, class labels, choosing images."""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")  # files only: never open a window (and work without a display)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from data.fsutil import commit, remove_stale_temps, temp_path  # noqa: E402

from ..checkpoint import load  # noqa: E402
from ..evaluation import class_words  # noqa: E402

DPI = 100  # figures sized in pixels are drawn at this resolution, so 1 figure pixel = 1 PNG pixel
# Written into every figure's PNG (its Software text chunk): how a later run knows the file as its own
# (data.domains.OutputPath's known=) and replaces it, and refuses a file of the same name that it is not.
MARK = "alexnet alexnet/figures"


class Box(NamedTuple):
    """Where a square picture lies in a composed PNG (pixels, from the top left): a kernel, an image."""

    top: int
    left: int
    size: int


def canvas_figure(canvas: np.ndarray, title: str, margin: int) -> Figure:
    """A figure of exactly `canvas`'s pixels (placed with figimage: 1 canvas pixel = 1 PNG pixel, no
    resampling, so a test reads the picture back) with `title` at its top left, `margin` pixels in."""
    height, width = canvas.shape[:2]
    fig = plt.figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    fig.figimage(canvas, 0, 0, origin="upper")
    fig.text(margin / width, 1 - 6 / height, title, ha="left", va="top", fontsize=8, wrap=True)
    return fig


def save_png(fig: Figure, out: str | os.PathLike, dpi: int = DPI) -> Path:
    """Write `fig` to `out` atomically (a temporary file renamed) and close it; the temporaries that killed
    writers left in its folder go first."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out.parent)
    tmp = temp_path(out, keep_suffix=True)
    try:
        fig.savefig(tmp, dpi=dpi, format="png", metadata={"Software": MARK})
        commit(tmp, out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def class_labels(meta: dict, num_classes: int) -> list[str]:
    """A short name per class, unique: the first of its words (meta.json's class_names), else its wnid, else
    'class i'; a first word that several classes share (ImageNet's two "crane"s, the bird and the machine;
    its two "maillot"s) is followed by each one's wnid."""
    wnids, words = class_words(meta)
    out = []
    for i in range(num_classes):
        word = words[i].split(",")[0].strip() if i < len(words) else ""
        out.append(word or (wnids[i] if i < len(wnids) else "") or f"class {i}")
    shared = {name for name in out if out.count(name) > 1}
    return [f"{name} ({wnids[i] if i < len(wnids) else f'class {i}'})" if name in shared else name
            for i, name in enumerate(out)]


def seeded_choice(total: int, count: int, seed: int, stream: int) -> np.ndarray:
    """`count` distinct positions of `total` (all if fewer), sorted; a pure function of (seed, stream), so
    each figure draws its own images and a re-run draws the same."""
    rng = np.random.default_rng([seed, stream])
    return np.sort(rng.choice(total, size=min(count, total), replace=False)).astype(np.int64)


def center_crop(images: np.ndarray, crop: int) -> np.ndarray:
    """The center crop the model sees (as evaluation's), of uint8 N x S x S x 3 images."""
    o = (images.shape[1] - crop) // 2
    return images[:, o:o + crop, o:o + crop]


def read_entries(path: str | os.PathLike) -> dict:
    """A checkpoint's dict, its tensors memory-mapped (not read) where the file allows it: for the small
    entries (config, epoch). CheckpointError (or the OSError) naming the file, as checkpoint.load."""
    return load(path, mmap=True)
