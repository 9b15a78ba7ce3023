"""The three figures of one set of weights on one data folder, each with a JSON of what it shows."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from data.batchfile import atomic_write_json
from data.domains import OutputPath, holding, json_holding, output_of
from data.meta import check_files
from data.reader import SplitData

from ..evaluation import Prepared
from . import filters, neighbours, predictions
from .common import MARK, class_labels, seeded_choice

FIGURES = ("filters", "predictions", "neighbours")
# The folder they go to (scripts/figures.py --out, a report's figures/, where the report adds its curves): its
# own names, nothing else in it (not any .png: a folder of the user's pictures is not the tool's).
CURVES = ("curves", "throughput")
# What each figure's JSON holds at least (the records below): how a later run knows it as its own.
RECORD_KEYS = {"filters": ("title", "groups", "kernels", "boxes"), "predictions": ("title", "crops", "images"),
               "neighbours": ("title", "layer", "queries")}
# The features cache (its cache/, or scripts/figures.py --cache): .npz files named by what they hold.
CACHE_FOLDER = OutputPath("folder", own=("*.npz",))
FIGURES_FOLDER = OutputPath(
    "folder", own=(*(f"{name}.{ext}" for name in FIGURES for ext in ("png", "json")),
                   *(f"{name}.png" for name in CURVES), "cache"),
    known={**{f"{name}.png": holding("a figure that alexnet drew (a PNG marked so)", MARK.encode())
              for name in (*FIGURES, *CURVES)},
           **{f"{name}.json": json_holding(f"the record of an earlier {name} figure", RECORD_KEYS[name])
              for name in FIGURES},
           "cache": output_of("the features cache of an earlier run (.npz files)", lambda: CACHE_FOLDER)})


@dataclass
class FigureOptions:
    """What to draw and how many (the command-line options of scripts/figures.py)."""

    images: int = 8  # predictions: how many validation images
    chosen: list[str] | None = None  # predictions: these images (indices or names) instead
    queries: int = 4  # neighbours: validation images
    neighbours: int = 6  # neighbours: training images per query
    train_images: int = 2000  # neighbours: the training subset searched
    seed: int = 0
    batch_size: int = 100
    crops: int = 1
    progress: bool = True
    cache: Path | None = None  # the features' cache folder (default: <out>/cache)
    only: tuple[str, ...] = FIGURES


def subject(weights: str | os.PathLike, info: dict) -> str:
    """A short name of the weights for titles: arch, width, file (and a Theano folder's epoch)."""
    epoch = f" epoch {info['epoch']}" if "epoch" in info else ""
    return f"{info['arch']} (width {info['width']:g}), {Path(weights).name}{epoch}"


def make_figures(weights: str | os.PathLike, prep: Prepared, out: str | os.PathLike, opts: FigureOptions,
                 device: torch.device) -> dict:
    """Write <out>/{filters,predictions,neighbours}.png (those in opts.only) and a JSON beside each;
    returns {figure: {"png": path, "json": path, ...}}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    labels = class_labels(prep.data.meta, prep.info["num_classes"])
    done = {}
    if "filters" in opts.only:
        done["filters"] = _filters(weights, prep, out)
    if "predictions" in opts.only:
        done["predictions"] = _predictions(weights, prep, out, opts, labels, device)
    if "neighbours" in opts.only:
        done["neighbours"] = _neighbours(weights, prep, out, opts, labels, device)
    return done


def _filters(weights, prep: Prepared, out: Path) -> dict:
    weight = filters.conv1_weight(prep.model)
    layout = filters.stored_parallel_model(weights, prep.info)
    groups = filters.column_groups(prep.info, layout)
    what = filters.describe(len(weight), groups, prep.info["arch"])
    title = f"conv1 of {subject(weights, prep.info)}: {what}; each kernel scaled to its own range"
    png = out / "filters.png"
    boxes = filters.draw_filters(weight, groups, title, png)
    record = {"title": title, "groups": groups, "kernels": len(weight), "parallel_model": layout,
              "boxes": [b._asdict() for b in boxes]}
    return {**_with_json(out / "filters.json", record), "png": str(png)}


def _predictions(weights, prep: Prepared, out: Path, opts: FigureOptions, labels: list[str],
                 device: torch.device) -> dict:
    chosen = predictions.pick_images(prep.data, opts.images, opts.seed, opts.chosen)
    records, crops = predictions.prediction_records(prep, chosen, labels, device, opts.crops)
    views = "center crop" if opts.crops == 1 else f"{opts.crops} crops averaged"
    title = f"{subject(weights, prep.info)}: top-5 of validation images ({views}); the true class in red"
    png = out / "predictions.png"
    predictions.draw_predictions(records, crops, title, png)
    return {**_with_json(out / "predictions.json", {"title": title, "crops": opts.crops, "images": records}),
            "png": str(png)}


def _neighbours(weights, prep: Prepared, out: Path, opts: FigureOptions, labels: list[str],
                device: torch.device) -> dict:
    root = prep.data.root
    check_files(root, prep.data.meta, ("train",), mean=False)  # DataError naming what is missing
    train = SplitData(root, "train")
    if len(train) == 0:
        raise ValueError(f"{root / 'train'} holds no images: no neighbours to search")
    subset = seeded_choice(len(train), opts.train_images, opts.seed, neighbours.TRAIN_STREAM)
    cache = opts.cache or out / "cache"
    feats, cached = neighbours.train_features(prep, train, subset, weights, device, cache, opts.batch_size,
                                              opts.progress)
    queries = seeded_choice(len(prep.data), opts.queries, opts.seed, neighbours.QUERY_STREAM)
    m = min(opts.neighbours, len(subset))
    records, shown, found = neighbours.neighbour_records(prep, train, subset, feats, queries, m, labels, device)
    title = (f"{subject(weights, prep.info)}: validation images (left) and the {m} training images nearest in "
             f"fc7 features, among {len(subset)} of {len(train)}")
    png = out / "neighbours.png"
    for rec, row in zip(records, neighbours.draw_neighbours(records, shown, found, title, png)):
        rec["box"] = row[0]._asdict()
        for near, box in zip(rec["neighbours"], row[1:]):
            near["box"] = box._asdict()
    record = {"title": title, "layer": "fc7", "train_images": len(subset), "seed": opts.seed,
              "features_cached": cached, "queries": records}
    return {**_with_json(out / "neighbours.json", record), "png": str(png), "cached": cached}


def _with_json(path: Path, record: dict) -> dict:
    atomic_write_json(path, record)
    return {"json": str(path)}
