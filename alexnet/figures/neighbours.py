"""Fig. 4 (right) of Krizhevsky et al. 2012: validation images, each followed by the training images
whose last hidden layer (fc7 after its ReLU, the input of the classifier's last linear layer) is
nearest in Euclidean distance.

The training images are a seeded subset (``--train-images``) of the train split; their features are
computed in batches on the evaluation device and cached in a .npz named by a digest of everything
they depend on (the weights' path, size and modification time, the data folder and its meta.json, the
subset, the crop and normalisation), so a re-run with the same inputs reads them back.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from data.augment import center_crops
from data.fsutil import commit, remove_stale_temps, temp_path
from data.reader import SplitData

from ..evaluation import Prepared, read_names
from .common import Box, canvas_figure, center_crop, save_png

QUERY_STREAM, TRAIN_STREAM = 2, 3  # seeded_choice streams of the queries and of the training subset
_CACHE_VERSION = 1  # bump when the features' definition changes
FRAME = 3  # the coloured frame around each image (pixels)
GAP = 8  # between two framed images
MARGIN = 12  # around everything
TITLE_H = 40  # the title band: two lines of text
LABEL_H = 22  # above each image: two lines of 6-point text
MIN_WIDTH = 560  # wide enough for the title in two lines
BACKGROUND = 255
# matplotlib's tab:red and tab:green, as the labels' colours; a neighbour of another class in grey
QUERY_RGB, SAME_RGB, OTHER_RGB = (214, 39, 40), (44, 160, 44), (128, 128, 128)
TEXT_COLOUR = {QUERY_RGB: "tab:red", SAME_RGB: "tab:green", OTHER_RGB: "black"}  # each label's, by its frame


def last_hidden(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input of the model's last nn.Linear (fc7's activations, as the model applies them at test
    time) for the normalised batch `x`, float32 N x D."""
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    seen: list[torch.Tensor] = []
    handle = last.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    try:
        model(x)
    finally:
        handle.remove()
    return seen[0].float()


def features(prep: Prepared, data: SplitData, indices: np.ndarray, device: torch.device, batch_size: int = 100,
             progress: bool = False, desc: str = "fc7 features") -> np.ndarray:
    """last_hidden of the center crops of `data`'s images at `indices`, in batches: float32 N x D."""
    model, crop = prep.model.to(device).eval(), prep.info["crop"]
    out = []
    with torch.no_grad(), tqdm(total=len(indices), unit="img", desc=desc, disable=not progress,
                               dynamic_ncols=True) as bar:
        for start in range(0, len(indices), batch_size):
            images, _ = data.read(indices[start:start + batch_size])
            x8 = torch.from_numpy(images).to(device)
            x = prep.normalizer(x8, center_crops(len(images), data.image_size, crop), crop)
            out.append(last_hidden(model, x).cpu().numpy())
            bar.update(len(images))
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def stamp(path: str | os.PathLike) -> list:
    """What changes when a weights file or folder changes: sizes and modification times."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def cache_key(weights: str | os.PathLike, prep: Prepared, train: SplitData, indices: np.ndarray) -> str:
    """A digest of everything the training features depend on."""
    parts = {"version": _CACHE_VERSION, "weights": str(Path(weights).resolve()), "stamp": stamp(weights),
             "data": str(train.root.resolve()), "meta": stamp(train.root / "meta.json"),
             "indices": hashlib.sha256(np.ascontiguousarray(indices, np.int64).tobytes()).hexdigest(),
             "crop": prep.info["crop"], "mean": prep.mean,
             "mean_stamp": stamp(prep.mean) if prep.mean not in ("data", "caffe_channel") else None,
             **{k: prep.info.get(k) for k in ("arch", "epoch", "theano_conv", "source")}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def train_features(prep: Prepared, train: SplitData, indices: np.ndarray, weights: str | os.PathLike,
                   device: torch.device, cache: Path | None, batch_size: int = 100,
                   progress: bool = False) -> tuple[np.ndarray, bool]:
    """Features of the training images at `indices`, read from `cache` when there (and True), else
    computed and written there (and False)."""
    path = None if cache is None else cache / f"fc7-{cache_key(weights, prep, train, indices)}.npz"
    if path is not None and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as f:
                if np.array_equal(f["indices"], indices):
                    return f["features"], True
        except (OSError, ValueError, KeyError) as e:  # a damaged cache file is only a recomputation
            print(f"note: {path} is unreadable ({e}); computing the features again", file=sys.stderr)
    feats = features(prep, train, indices, device, batch_size, progress, desc="fc7 of training images")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path.parent)  # what a killed writer left
        tmp = temp_path(path, keep_suffix=True)
        try:
            np.savez(tmp, features=feats, indices=indices)
            commit(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return feats, False


def nearest(train: np.ndarray, queries: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """For each query row, the rows of `train` nearest in Euclidean distance (K x M positions, nearest
    first, ties in row order) and their distances."""
    t, q = train.astype(np.float64), queries.astype(np.float64)
    d2 = (q * q).sum(1)[:, None] - 2 * q @ t.T + (t * t).sum(1)[None, :]
    order = np.argsort(d2, axis=1, kind="stable")[:, :m]
    return order, np.sqrt(np.maximum(np.take_along_axis(d2, order, axis=1), 0))


def neighbour_records(prep: Prepared, train: SplitData, subset: np.ndarray, train_feats: np.ndarray,
                      queries: np.ndarray, m: int, labels: list[str], device: torch.device
                      ) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """One record per query (its index, name, label and its `m` neighbours'), the queries' crops and
    the neighbours' crops (K x M x crop x crop x 3)."""
    crop = prep.info["crop"]
    q_images, q_labels = prep.data.read(queries)
    order, dist = nearest(train_feats, features(prep, prep.data, queries, device), m)
    found = subset[order]  # global training indices, K x M
    n_images, n_labels = train.read(found.reshape(-1))
    n_names = read_names(train, found.reshape(-1))
    records = []
    for k, (i, name, y) in enumerate(zip(queries, read_names(prep.data, queries), q_labels)):
        near = [{"index": int(found[k, j]), "name": n_names[k * m + j], "label": int(n_labels[k * m + j]),
                 "label_name": labels[n_labels[k * m + j]], "distance": float(dist[k, j])} for j in range(m)]
        records.append({"index": int(i), "name": name, "label": int(y), "label_name": labels[y], "neighbours": near})
    shown = center_crop(n_images, crop).reshape(len(queries), m, crop, crop, 3)
    return records, center_crop(q_images, crop), shown


def neighbour_layout(rows: int, cols: int, crop: int) -> tuple[list[list[Box]], int, int]:
    """Each image's box, a row per query (the query, then its neighbours), and the PNG's width and
    height: every image at its own pixels inside a FRAME-wide frame, its two-line label above."""
    outer = crop + 2 * FRAME
    row_h = LABEL_H + outer
    boxes = [[Box(TITLE_H + r * (row_h + GAP) + LABEL_H + FRAME, MARGIN + c * (outer + GAP) + FRAME, crop)
              for c in range(cols)] for r in range(rows)]
    width = max(MIN_WIDTH, 2 * MARGIN + cols * outer + (cols - 1) * GAP)
    return boxes, width, TITLE_H + rows * row_h + (rows - 1) * GAP + MARGIN


def frame_colours(records: list[dict]) -> list[list[tuple[int, int, int]]]:
    """Each row's frames: the query's red, a neighbour's green where its class is the query's, else grey."""
    return [[QUERY_RGB] + [SAME_RGB if n["label"] == rec["label"] else OTHER_RGB for n in rec["neighbours"]]
            for rec in records]


def compose(records: list[dict], queries: np.ndarray, found: np.ndarray) -> tuple[np.ndarray, list[list[Box]]]:
    """The H x W x 3 uint8 picture (without text) and each image's box, row by row."""
    boxes, width, height = neighbour_layout(len(records), 1 + found.shape[1], queries.shape[1])
    canvas = np.full((height, width, 3), BACKGROUND, np.uint8)
    for q, row_images, row, colours in zip(queries, found, boxes, frame_colours(records)):
        for box, image, colour in zip(row, [q, *row_images], colours):
            canvas[box.top - FRAME:box.top + box.size + FRAME, box.left - FRAME:box.left + box.size + FRAME] = colour
            canvas[box.top:box.top + box.size, box.left:box.left + box.size] = image
    return canvas, boxes


def draw_neighbours(records: list[dict], queries: np.ndarray, found: np.ndarray, title: str,
                    out: str | os.PathLike) -> list[list[Box]]:
    """Write neighbours.png: a row per query, the query (red frame) then its neighbours, nearest first, each
    image at its own pixels (composed, not resampled: one figure without axes draws fast for many
    images); returns each image's box, row by row."""
    canvas, boxes = compose(records, queries, found)
    height, width = canvas.shape[:2]
    fig = canvas_figure(canvas, title, MARGIN)
    for rec, row, colours in zip(records, boxes, frame_colours(records)):
        texts = [f"{rec['label_name'][:16]}\n(query)"] + [f"{n['label_name'][:16]}\nd={n['distance']:.3g}"
                                                         for n in rec["neighbours"]]
        for box, text, colour in zip(row, texts, colours):
            fig.text(box.left / width, 1 - (box.top - FRAME - 2) / height, text, ha="left", va="bottom",
                     fontsize=6, color=TEXT_COLOUR[colour])
    save_png(fig, out)
    return boxes
