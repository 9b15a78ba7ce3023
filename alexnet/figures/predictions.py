"""Fig. 4 (left) of Krizhevsky et al. 2012: validation images, each with its five most probable classes
as bars, the true class's bar in red.

The probabilities are evaluation's (``predict_log_probs``: the center crop, or the 10 crops averaged),
so the classes drawn are those ``scripts/evaluate.py`` writes for the same images.
"""
from __future__ import annotations

import os

import matplotlib.pyplot as plt
import numpy as np
import torch

from data.reader import SplitData

from ..evaluation import Prepared, predict_log_probs, read_names
from .common import center_crop, save_png, seeded_choice

TRUE_COLOUR, OTHER_COLOUR = "tab:red", "tab:blue"
PANELS_PER_ROW = 4
_STREAM = 1  # seeded_choice stream of this figure


def pick_images(data: SplitData, count: int, seed: int, wanted: list[str] | None = None) -> np.ndarray:
    """Global indices into `data`: `wanted` (indices or the batch files' image names), else `count` drawn
    with `seed`. ValueError naming an image that is not there."""
    if not wanted:
        return seeded_choice(len(data), count, seed, _STREAM)
    names: dict[str, int] = {}
    out = []
    for w in wanted:
        if not w.isdigit() and not names:  # read every name once, only if a name was given
            names = {name: i for i, name in enumerate(read_names(data, np.arange(len(data))))}
        i = int(w) if w.isdigit() else names.get(w, -1)
        if not 0 <= i < len(data):
            raise ValueError(f"--images: {w!r} is neither an index below {len(data)} nor an image name of "
                             f"{data.root / data.split}")
        out.append(i)
    return np.asarray(out, np.int64)


def top_classes(prep: Prepared, images: np.ndarray, device: torch.device, crops: int = 1,
                k: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(classes, probabilities), each N x k, most probable first, for uint8 N x S x S x 3 `images`."""
    model = prep.model.to(device).eval()
    with torch.no_grad():
        logp = predict_log_probs(model, torch.from_numpy(images).to(device), prep.info["crop"], prep.normalizer,
                                 crops)
    top = logp.topk(min(k, logp.shape[1]), dim=1)
    return top.indices.cpu().numpy(), top.values.double().exp().cpu().numpy()


def prediction_records(prep: Prepared, indices: np.ndarray, labels: list[str], device: torch.device,
                       crops: int = 1) -> tuple[list[dict], np.ndarray]:
    """One record per image (index, name, label, label_name, top: [{class, name, prob}]) and the images'
    center crops (what the figure shows)."""
    images, y = prep.data.read(indices)
    classes, probs = top_classes(prep, images, device, crops)
    names = read_names(prep.data, indices)
    records = [{"index": int(i), "name": name, "label": int(t), "label_name": labels[t],
                "top": [{"class": int(c), "name": labels[c], "prob": float(p)} for c, p in zip(cs, ps)]}
               for i, name, t, cs, ps in zip(indices, names, y, classes, probs)]
    return records, center_crop(images, prep.info["crop"])


def draw_predictions(records: list[dict], images: np.ndarray, title: str, out: str | os.PathLike) -> list[list[str]]:
    """Write predictions.png; returns each panel's bar labels, top to bottom."""
    n = len(records)
    cols = min(PANELS_PER_ROW, n)
    rows = -(-n // cols)
    fig = plt.figure(figsize=(2.6 * cols, 3.3 * rows + 0.4), layout="constrained")
    grid = fig.add_gridspec(2 * rows, cols, height_ratios=[1.0, 0.6] * rows)
    drawn = []
    for j, (rec, image) in enumerate(zip(records, images)):
        r, c = divmod(j, cols)
        ax = fig.add_subplot(grid[2 * r, c])
        ax.imshow(image, interpolation="nearest")
        ax.set_axis_off()
        ax.set_title(rec["label_name"], fontsize=9, fontweight="bold")
        drawn.append(_bars(fig.add_subplot(grid[2 * r + 1, c]), rec))
    fig.suptitle(title, fontsize=10)
    save_png(fig, out)
    return drawn


def _bars(ax, rec: dict) -> list[str]:
    top = rec["top"]
    ys = np.arange(len(top))
    colours = [TRUE_COLOUR if t["class"] == rec["label"] else OTHER_COLOUR for t in top]
    ax.barh(ys, [t["prob"] for t in top], color=colours, height=0.7)
    ax.set_yticks(ys, [_short(t["name"]) for t in top], fontsize=7)
    ax.invert_yaxis()  # the most probable on top
    ax.set_xlim(0, 1)
    ax.tick_params(axis="x", labelsize=6)
    ax.set_xlabel("probability", fontsize=7)
    return [label.get_text() for label in ax.get_yticklabels()]


def _short(name: str, most: int = 20) -> str:
    return name if len(name) <= most else name[:most - 1] + "…"
