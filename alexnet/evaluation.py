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
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from data.augment import Normalizer, center_crops, ten_crops
from data.batchfile import open_batch_file
from data.domains import json_holding, starting_with
from data.fsutil import commit, temp_path
from data.meta import check_files, class_difference
from data.reader import BatchReader, SplitData

from .checkpoint import refuse_non_finite
from .metrics import topk_correct
from .precision import autocast_for
from .weights.common import crop_for_side
from .weights.geometry import geometry_notice
from .weights.hub import resolve
from .weights.load import load_weights
from .weights.mean_image import CAFFE_CHANNEL_MEAN_BGR, caffe_channel_mean, read_mean_image

PRECISIONS = ("fp32", "tf32", "bf16")
CONFUSION_PAIRS = 20  # how many of the most frequent (true, predicted) pairs the record lists
CSV_HEADER = ("name", "label", "pred1", "pred2", "pred3", "pred4", "pred5", "correct1", "correct5",
              "prob1", "prob2", "prob3", "prob4", "prob5", "label_wnid", "label_name",
              *(f"pred{k}_{what}" for k in range(1, 6) for what in ("wnid", "name")))
# What an existing --json or --csv file must be for a new run to replace it (data.domains.OutputPath).
EARLIER_JSON = json_holding("an earlier evaluate.py --json output (JSON with top1_err, top5_err, n, crops)",
                            ("top1_err", "top5_err", "n", "crops"))
EARLIER_CSV = starting_with("an earlier evaluate.py --csv output (its header row)",
                            (",".join(CSV_HEADER) + "\r\n").encode())
__all__ = ["CSV_HEADER", "EARLIER_CSV", "EARLIER_JSON", "PRECISIONS", "check_compatible", "class_words",
           "crop_for_side", "evaluate", "load_weights",
           "make_normalizer", "precision_mode", "predict_log_probs", "prepare", "read_names"]


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
    classes, ours = info.get("classes"), list(data.meta["classes"])
    if classes is not None and list(classes) != ours:
        raise ValueError(f"{weights}: the model's classes differ from those of {data.root} "
                         f"({class_difference(list(classes), ours)}); its label numbers would mean other classes")


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


class Prepared(NamedTuple):
    """Weights checked against a split, with the normalisation they were trained with."""

    model: nn.Module  # eval mode, on the CPU
    info: dict  # load_weights' info
    data: SplitData
    normalizer: Normalizer
    mean: str  # what is subtracted: the mean file given, "caffe_channel" or "data"


def prepare(weights: str | os.PathLike, root: str | os.PathLike, split: str = "val", *, arch: str | None = None,
            epoch: int | None = None, theano_conv: str | None = None, mean: str | None = None,
            device: torch.device | str = "cpu", prog: str = "evaluate.py") -> Prepared:
    """Load `weights` (any format), refuse non-finite ones, check them against `split` of the preprocessed
    `root` and its files, and build their normaliser on `device`: the `mean` image file if given, Caffe's
    per-channel mean for Caffe weights without one, else the data's. Notes go to stderr, prefixed `prog`.

    Raises CheckpointError or ValueError naming the file at fault.
    """
    weights = resolve(weights)  # a published set's name: its checked file in torch's hub cache
    model, info = load_weights(weights, arch, epoch=epoch, theano_conv=theano_conv)
    refuse_non_finite(model.state_dict(), weights)
    data = SplitData(root, split)
    check_compatible(info, data, weights)
    notice = geometry_notice(weights, info, data.meta, root)
    if notice:
        print(f"{prog}: note: {notice}", file=sys.stderr)
    caffe_mean = info["source"] == "caffe" and not mean  # Caffe's per-channel mean, not the data's
    check_files(data.root, data.meta, (split,), mean=info["mean"] == "image" and not mean and not caffe_mean)
    image = read_mean_image(mean, data.image_size) if mean else None
    if caffe_mean:
        image = caffe_channel_mean(data.image_size)
        print(f"{prog}: note: subtracting Caffe's per-channel mean (B, G, R) = {CAFFE_CHANNEL_MEAN_BGR}; pass "
              "--mean ilsvrc_2012_mean (BVLC's mean image, fetched once) for BVLC's published numbers", file=sys.stderr)
    if image is None and info["source"] == "theano":
        print(f"{prog}: warning: {weights} was trained with its run's own mean image (img_mean.npy); "
              f"subtracting {root}'s mean.npy instead; pass --mean img_mean.npy for the paper's numbers",
              file=sys.stderr)
    normalizer = make_normalizer(info, data, device, image)
    return Prepared(model, info, data, normalizer, mean or ("caffe_channel" if caffe_mean else "data"))


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
    CSV_HEADER, the probabilities being those averaged over the views, the classes named by wnid and
    words (meta.json's class_names; empty where the data has none). ``per_class``: each class's wnid,
    name, image count and errors (None without images). ``confusions``: the CONFUSION_PAIRS most frequent
    (true class, top-1 prediction) pairs of distinct classes (see _confusion_record).
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
    per_class = torch.zeros(3, data.num_classes, dtype=torch.float64, device=device)  # images, top-1/5 hits
    confusion = torch.zeros(data.num_classes ** 2, dtype=torch.int64, device=device)  # [true * C + top-1]
    wnids, words = class_words(data.meta)
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
            _count_per_class(per_class, logp, y)
            confusion += torch.bincount(y * data.num_classes + logp.argmax(1), minlength=confusion.numel())
            if rows is not None:
                _write_rows(rows, read_names(data, indices), labels, logp, wnids, words)
            bar.update(len(indices))
    loss, top1, top5 = (float(v) for v in sums.cpu())
    n = len(data)
    return {"top1_err": 1 - top1 / n, "top5_err": 1 - top5 / n, "n": n, "crops": crops, "loss": loss / n,
            "per_class": _per_class_record(per_class.cpu().numpy(), wnids, words),
            "confusions": _confusion_record(confusion.view(data.num_classes, -1).cpu().numpy(), wnids, words)}


def class_words(meta: dict) -> tuple[list[str], list[str]]:
    """The wnid and words of each class of a preprocessed folder (words empty where meta.json has none)."""
    wnids = [str(c) for c in meta.get("classes", [])]
    words = meta.get("class_names")
    if not isinstance(words, list) or len(words) != len(wnids):
        words = [""] * len(wnids)
    return wnids, [str(w) for w in words]


def _count_per_class(counts: torch.Tensor, logp: torch.Tensor, y: torch.Tensor) -> None:
    top = logp.topk(min(5, logp.shape[1]), dim=1).indices
    hits = torch.stack([torch.ones_like(y, dtype=torch.float64), (top[:, 0] == y).double(),
                        (top == y[:, None]).any(1).double()])
    counts.index_add_(1, y, hits)


def _per_class_record(counts: np.ndarray, wnids: list[str], words: list[str]) -> list[dict]:
    out = []
    for i, (n, top1, top5) in enumerate(counts.T):
        out.append({"index": i, "wnid": wnids[i] if i < len(wnids) else "", "name": words[i] if i < len(words) else "",
                    "n": int(n), "top1_err": 1 - top1 / n if n else None, "top5_err": 1 - top5 / n if n else None})
    return out


def _confusion_record(matrix: np.ndarray, wnids: list[str], words: list[str],
                      most: int = CONFUSION_PAIRS) -> list[dict]:
    """The `most` largest off-diagonal counts of `matrix` (true class x top-1 prediction), most first
    (ties: by true, then predicted index): both classes (index, wnid, words), the count, and its share
    of the true class's images."""
    off = matrix.copy()
    np.fill_diagonal(off, 0)
    cells = np.flatnonzero(off)
    cells = cells[np.lexsort((cells, -off.flat[cells]))][:most]
    n_true = matrix.sum(axis=1)

    def named(c: int, role: str) -> dict:
        return {role: c, f"{role}_wnid": wnids[c] if c < len(wnids) else "",
                f"{role}_name": words[c] if c < len(words) else ""}

    return [{**named(int(t), "label"), **named(int(p), "pred"), "count": int(off[t, p]),
             "share": float(off[t, p] / n_true[t])} for t, p in (divmod(int(c), matrix.shape[1]) for c in cells)]


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
    tmp = temp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # made with the rows, not when the options were read
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(CSV_HEADER)
            yield writer
            f.flush()
            os.fsync(f.fileno())
        commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_rows(writer, names: list[str], labels: np.ndarray, logp: torch.Tensor, wnids: list[str],
                words: list[str]) -> None:
    """name, label, top-5 classes, correct1/5, the (view-averaged) probability of each top-5 class, then
    the wnid and words of the true class and of each prediction."""
    k = min(5, logp.shape[1])
    top = logp.topk(k, dim=1)
    probs = top.values.double().exp().cpu().numpy()
    pad = [""] * (5 - k)  # fewer than 5 classes: empty prediction and probability columns

    def named(c: int) -> list[str]:
        return [wnids[c], words[c]] if c < len(wnids) else ["", ""]

    for name, label, preds, p in zip(names, labels.tolist(), top.indices.cpu().numpy().tolist(), probs):
        writer.writerow([name, label, *preds, *pad, int(preds[0] == label), int(label in preds),
                         *(f"{v:.7g}" for v in p), *pad, *named(label),
                         *(v for c in preds for v in named(c)), *pad, *pad])
