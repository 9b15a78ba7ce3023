"""Evaluate weights on a preprocessed split: top-1/top-5 error, center crop or 10-crop.

Weights may be any format of :mod:`alexnet.weights` (our checkpoints and weights files,
torchvision AlexNet state dicts, plain state dicts of our ``alexnet``/``caffenet``, the Theano
reproduction's .npy folders); the model is rebuilt from the weights alone (arch, width, crop inferred
from the shapes where no config is stored), and loading is strict: every key and shape must match.

    model, info = load_weights("runs/demo/checkpoints/last.pt")
    data = SplitData("demo/data", "val")
    check_compatible(info, data, "last.pt")
    result = evaluate(model, data, info["crop"], make_normalizer(info, data), crops=10)

10-crop (Krizhevsky 2012): the four corners and the center, each also mirrored; the softmax
probabilities of the ten views are averaged and top-k is taken from the average.
"""
from __future__ import annotations

import contextlib
import csv
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from data.augment import Normalizer, center_crops, ten_crops
from data.batchfile import open_batch_file
from data.reader import BatchReader, SplitData

from .metrics import topk_correct
from .precision import autocast_for
from .weights.common import crop_for_side
from .weights.load import load_weights

PRECISIONS = ("fp32", "tf32", "bf16")
CSV_HEADER = ("name", "label", "pred1", "pred2", "pred3", "pred4", "pred5", "correct1", "correct5",
              "prob1", "prob2", "prob3", "prob4", "prob5")
__all__ = ["CSV_HEADER", "PRECISIONS", "check_compatible", "crop_for_side", "evaluate", "load_weights",
           "make_normalizer", "precision_mode", "predict_log_probs", "read_names"]


# -- data and model together --------------------------------------------------------------------------


def check_compatible(info: dict, data: SplitData, weights: str | os.PathLike = "the weights") -> None:
    """ValueError if the model cannot give meaningful numbers on `data` (classes, crop size)."""
    where = data.root / data.split
    if info["num_classes"] != data.num_classes:
        raise ValueError(f"{weights}: the model has {info['num_classes']} classes but {where} has "
                         f"{data.num_classes}")
    if info["crop"] > data.image_size:
        raise ValueError(f"{weights}: the model takes {info['crop']}x{info['crop']} crops, larger than the "
                         f"{data.image_size}x{data.image_size} images of {where}")
    classes, ours = info.get("classes"), list(data.meta.get("classes", []))
    if classes is not None and list(classes) != ours:
        i = next((i for i, (a, b) in enumerate(zip(classes, ours)) if a != b), min(len(classes), len(ours)))
        raise ValueError(f"{weights}: the model's classes differ from those of {data.root} (first at index {i}: "
                         f"{classes[i] if i < len(classes) else None!r} vs {ours[i] if i < len(ours) else None!r}); "
                         "its label numbers would mean other classes")


def make_normalizer(info: dict, data: SplitData, device: torch.device | str = "cpu",
                    mean_image: np.ndarray | None = None) -> Normalizer:
    """The normalisation the model was trained with, on `device`.

    mean_image (H x W x 3): subtract it instead of the dataset's (e.g. the Theano run's img_mean.npy);
    only for weights normalised by a mean image.
    """
    if info["mean"] != "image":
        if mean_image is not None:
            raise ValueError(f"the weights use per-channel normalisation (data.mean={info['mean']}), not a mean "
                             "image: drop --mean")
        return Normalizer(info["mean"], None, info["channel_mean"], info["channel_std"], device)
    if mean_image is not None:
        if mean_image.shape != (data.image_size, data.image_size, 3):
            raise ValueError(f"the mean image has shape {mean_image.shape}, the images of {data.root} are "
                             f"{data.image_size}x{data.image_size}")
        return Normalizer("image", mean_image, device=device)
    # meta.json's mean.npy is the training mean image whichever split we evaluate: prefer the train
    # split's reader when present, else the evaluated split's (both read <root>/mean.npy).
    source = SplitData(data.root, "train") if "train" in data.meta["splits"] else data
    return Normalizer("image", source.mean_image(), device=device)


# -- evaluation -----------------------------------------------------------------------------------


@contextlib.contextmanager
def precision_mode(precision: str, device: torch.device) -> Iterator[None]:
    """fp32 (exact), tf32 (TF32 matmuls/convolutions on CUDA) or bf16 autocast; restores the flags."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    try:
        with autocast_for(precision, device):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def predict_log_probs(model: nn.Module, images: torch.Tensor, crop: int, normalizer: Normalizer,
                      crops: int = 1) -> torch.Tensor:
    """log of the softmax probabilities averaged over the views: float32 N x classes.

    images: uint8 N x S x S x 3 on the model's device. crops=1: the center crop; crops=10: corners and
    center, plain and mirrored. logsumexp of the log-softmaxes is the log of the mean probability
    without underflow, so the loss stays finite for confident wrong predictions.
    """
    n, size = images.shape[0], images.shape[1]
    if crops == 1:
        views = [center_crops(n, size, crop)]
    elif crops == 10:
        views = ten_crops(n, size, crop)
    else:
        raise ValueError(f"crops must be 1 or 10, got {crops}")
    logp = [F.log_softmax(model(normalizer(images, v, crop)).float(), dim=1) for v in views]
    if len(logp) == 1:
        return logp[0]
    return torch.logsumexp(torch.stack(logp), dim=0) - math.log(len(logp))


def read_names(data: SplitData, indices: np.ndarray) -> list[str]:
    """Source paths (the batch files' ``names``) of the images at global `indices` of `data`."""
    indices = np.asarray(indices, dtype=np.int64)
    out = [""] * len(indices)
    file_of = np.searchsorted(data.offsets, indices, side="right") - 1
    for fi in np.unique(file_of):
        with open_batch_file(data.paths[fi]) as f:
            names = f["names"].asstr()[...]
        for w in np.nonzero(file_of == fi)[0]:
            out[w] = str(names[indices[w] - data.offsets[fi]])
    return out


def evaluate(model: nn.Module, data: SplitData, crop: int, normalizer: Normalizer, crops: int = 1,
             batch_size: int = 100, device: torch.device | str = "cpu", csv_path: str | os.PathLike | None = None,
             progress: bool = True, precision: str = "fp32") -> dict:
    """top1_err, top5_err, loss (mean NLL of the averaged probabilities), n, crops over the whole split.

    Images are read in file order; with `csv_path`, one row per image (written atomically):
    CSV_HEADER, the probabilities being those averaged over the views.
    """
    device = torch.device(device)
    if len(data) == 0:
        raise ValueError(f"{data.root / data.split} holds no images")
    if crop > data.image_size:
        raise ValueError(f"crop {crop} is larger than the {data.image_size}x{data.image_size} images of "
                         f"{data.root / data.split}")
    model = model.to(device).eval()
    reader = BatchReader(data, batch_size, shuffle=False, drop_last=False)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, top-1 hits, top-5 hits
    with (_csv_rows(csv_path) as rows, torch.no_grad(), precision_mode(precision, device),
          tqdm(total=len(data), unit="img", desc="evaluate", disable=not progress, dynamic_ncols=True) as bar):
        for step in range(reader.steps_per_epoch()):
            indices = reader.indices(0, step)
            images, labels = data.read(indices)
            x8, y = torch.from_numpy(images).to(device), torch.from_numpy(labels).to(device)
            logp = predict_log_probs(model, x8, crop, normalizer, crops)
            _check_outputs(logp, data)
            hits = topk_correct(logp, y)
            sums += torch.stack([-logp.gather(1, y[:, None]).sum().double(), *hits.double()])
            if rows is not None:
                _write_rows(rows, read_names(data, indices), labels, logp)
            bar.update(len(indices))
    loss, top1, top5 = (float(v) for v in sums.cpu())
    n = len(data)
    return {"top1_err": 1 - top1 / n, "top5_err": 1 - top5 / n, "n": n, "crops": crops, "loss": loss / n}


def _check_outputs(logp: torch.Tensor, data: SplitData) -> None:
    if logp.shape[1] != data.num_classes:
        raise ValueError(f"the model outputs {logp.shape[1]} classes but {data.root} has {data.num_classes}")


@contextlib.contextmanager
def _csv_rows(path: str | os.PathLike | None) -> Iterator[csv.writer | None]:
    """A csv writer on a temporary file renamed to `path` on success (None without a path)."""
    if path is None:
        yield None
        return
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(CSV_HEADER)
            yield writer
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_rows(writer, names: list[str], labels: np.ndarray, logp: torch.Tensor) -> None:
    """name, label, top-5 classes, correct1/5, then the (view-averaged) probability of each top-5 class."""
    k = min(5, logp.shape[1])
    top = logp.topk(k, dim=1)
    probs = top.values.double().exp().cpu().numpy()
    pad = [""] * (5 - k)  # fewer than 5 classes: empty prediction and probability columns
    for name, label, preds, p in zip(names, labels.tolist(), top.indices.cpu().numpy().tolist(), probs):
        writer.writerow([name, label, *preds, *pad, int(preds[0] == label), int(label in preds),
                         *(f"{v:.7g}" for v in p), *pad])
