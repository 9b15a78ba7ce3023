"""Evaluate weights on a preprocessed split: top-1/top-5 error, center crop or 10-crop.

Weights may be this repository's training checkpoints, torchvision AlexNet state dicts (our ``owt``
variant has the same keys) or plain state dicts of our ``alexnet``/``caffenet`` models; the model is
rebuilt from the file alone (arch, width, crop inferred from the tensor shapes where no config is
stored), and loading is strict: every key and shape must match.

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

from .checkpoint import load
from .config import from_dict
from .metrics import topk_correct
from .models import ARCHS, build_model, feature_side, min_crop
from .trainer import CHECKPOINT_KIND, autocast_for

PRECISIONS = ("fp32", "tf32", "bf16")
CSV_HEADER = ("name", "label", "pred1", "pred2", "pred3", "pred4", "pred5", "correct1", "correct5")
# torchvision's ImageNet normalisation, which its published AlexNet weights expect.
TORCHVISION_MEAN = (0.485, 0.456, 0.406)
TORCHVISION_STD = (0.229, 0.224, 0.225)
TORCHVISION_CROP = 224
# fc6 input side -> the crop the published models use; other sides get the smallest crop giving them.
_KNOWN_CROPS = {6: 227, 5: 224}
# (state-dict key, unscaled channel count) per layer, most channels first: the widest layer gives the
# most precise width estimate, the rest are tried if rounding made it ambiguous.
_OWT_LAYERS = (("classifier.1.weight", 4096), ("features.6.weight", 384), ("features.8.weight", 256),
               ("features.10.weight", 256), ("features.3.weight", 192), ("features.0.weight", 64))
_PAPER_LAYERS = (("classifier.fc6.weight", 4096), ("features.conv3.weight", 384),
                 ("features.conv4.weight", 384), ("features.conv2.weight", 256),
                 ("features.conv5.weight", 256), ("features.conv1.weight", 96))
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel, torch.compile


# -- loading weights -------------------------------------------------------------------------------


def load_weights(path: str | os.PathLike, arch: str | None = None,
                 width: float | None = None) -> tuple[nn.Module, dict]:
    """The model (eval mode, CPU) and its info dict for a checkpoint or state_dict file.

    info: arch, width, crop, mean ("image" | "channel"), channel_mean, channel_std, num_classes,
    classes (list or None), source ("checkpoint" | "torchvision" | "state_dict").
    Raises CheckpointError (unreadable file) or ValueError (readable, but not usable), naming `path`.
    """
    if arch is not None and arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid archs: {', '.join(ARCHS)}")
    obj = load(path)  # weights_only=True: never runs code from the file
    if obj.get("kind") == CHECKPOINT_KIND:
        model, info = _from_checkpoint(path, obj, arch, width)
    else:
        state = _unwrap(path, obj)
        if "features.0.weight" in state and "classifier.6.weight" in state:
            model, info = _from_torchvision(path, state, arch, width)
        elif "features.conv1.weight" in state:
            model, info = _from_paper_state(path, state, arch, width)
        else:
            raise ValueError(f"{path}: unrecognised weights: keys {_first(list(state))} are neither torchvision "
                             "AlexNet's (features.0.weight ...) nor ours (features.conv1.weight ...)")
    return model.eval(), info


def _first(keys: list, n: int = 5) -> str:
    more = f" (+{len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(map(str, keys[:n])) + more


def _info(arch: str, width: float, crop: int, mean: str, num_classes: int, source: str,
          channel_mean=TORCHVISION_MEAN, channel_std=TORCHVISION_STD, classes: list | None = None) -> dict:
    return {"arch": arch, "width": float(width), "crop": int(crop), "mean": mean,
            "channel_mean": [float(v) for v in channel_mean], "channel_std": [float(v) for v in channel_std],
            "num_classes": int(num_classes), "classes": None if classes is None else list(classes),
            "source": source}


def _from_checkpoint(path, state: dict, arch: str | None, width: float | None) -> tuple[nn.Module, dict]:
    missing = [k for k in ("config", "model", "num_classes") if k not in state]
    if missing:
        raise ValueError(f"{path}: training checkpoint without {', '.join(missing)} (damaged or too old)")
    cfg = from_dict(state["config"])  # ConfigError is a ValueError
    m, d = cfg.model, cfg.data
    if arch is not None and arch != m.arch:
        raise ValueError(f"{path} is a checkpoint of arch {m.arch!r}, not {arch!r}; omit --arch")
    if width is not None and width != m.width:
        raise ValueError(f"{path} is a checkpoint of width {m.width}, not {width}")
    model = _build(m.arch, int(state["num_classes"]), m.width, d.crop, m.dropout, m.dropout_style)
    _load_strict(model, state["model"], path)
    info = _info(m.arch, m.width, d.crop, d.mean, state["num_classes"], "checkpoint", d.channel_mean,
                 d.channel_std, state.get("classes"))
    return model, info


def _unwrap(path, obj: dict) -> dict:
    """The state_dict inside `obj` ({"state_dict": ...} and {"model": ...} wrappers, DDP prefixes)."""
    for key in ("state_dict", "model"):
        if isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if not obj or bad:
        raise ValueError(f"{path}: not a state_dict (expected parameter name -> tensor; "
                         f"non-tensor entries: {_first(bad) or 'none, it is empty'})")
    for prefix in _WRAPPER_PREFIXES:
        if all(isinstance(k, str) and k.startswith(prefix) for k in obj):
            obj = {k[len(prefix):]: v for k, v in obj.items()}
    return obj


def _from_torchvision(path, state: dict, arch: str | None, width: float | None) -> tuple[nn.Module, dict]:
    if arch not in (None, "owt"):
        raise ValueError(f"{path} holds torchvision AlexNet weights (arch owt), not {arch!r}; omit --arch")
    num_classes = state["classifier.6.weight"].shape[0]
    crop = TORCHVISION_CROP  # the adaptive pool makes the weights crop-independent: use torchvision's
    width = width or _infer_width(path, "owt", state, num_classes, crop, _OWT_LAYERS)
    model = _build("owt", num_classes, width, crop)
    _load_strict(model, state, path)
    return model, _info("owt", width, crop, "channel", num_classes, "torchvision")


def _from_paper_state(path, state: dict, arch: str | None, width: float | None) -> tuple[nn.Module, dict]:
    if arch is None:
        raise ValueError(f"{path} is a state_dict of our alexnet or caffenet (the same keys, a different "
                         "layer order): pass --arch alexnet or --arch caffenet")
    if arch == "owt":
        raise ValueError(f"{path} holds alexnet/caffenet weights (features.conv1 ...), not owt ones")
    need = [k for k in ("features.conv5.weight", "classifier.fc6.weight", "classifier.fc8.weight")
            if k not in state]
    if need:
        raise ValueError(f"{path}: incomplete {arch} state_dict, missing {_first(need)}")
    num_classes = state["classifier.fc8.weight"].shape[0]
    crop = _crop_from_fc6(path, arch, state["features.conv5.weight"].shape[0],
                          state["classifier.fc6.weight"].shape[1])
    width = width or _infer_width(path, arch, state, num_classes, crop, _PAPER_LAYERS)
    model = _build(arch, num_classes, width, crop)
    _load_strict(model, state, path)
    return model, _info(arch, width, crop, "image", num_classes, "state_dict")


def crop_for_side(arch: str, side: int) -> int:
    """The crop that gives `side` x `side` features before fc6 (227 for 6, 224 for 5, else the smallest)."""
    crop = min_crop(arch)
    while feature_side(arch, crop) < side:
        crop += 1
    if feature_side(arch, crop) != side:
        raise ValueError(f"no crop gives {side}x{side} features for {arch}")
    known = _KNOWN_CROPS.get(side)
    return known if known is not None and feature_side(arch, known) == side else crop


def _crop_from_fc6(path, arch: str, conv5_channels: int, fc6_inputs: int) -> int:
    side = math.isqrt(fc6_inputs // conv5_channels) if conv5_channels else 0
    if side < 1 or conv5_channels * side * side != fc6_inputs:
        raise ValueError(f"{path}: fc6 takes {fc6_inputs} inputs, not conv5's {conv5_channels} channels times "
                         "a square feature map")
    return crop_for_side(arch, side)


def _infer_width(path, arch: str, state: dict, num_classes: int, crop: int,
                 layers: tuple[tuple[str, int], ...]) -> float:
    """The width multiplier whose model has exactly the shapes of `state` (tried on the meta device)."""
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    for key, base in layers:
        if key not in state:
            continue
        width = state[key].shape[0] / base
        with torch.device("meta"):
            model = build_model(arch, num_classes, width, 0.5, crop, init="torch")
        if {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes:
            return width
    raise ValueError(f"{path}: the tensor shapes match no width of {arch} (keys {_first(list(state))})")


def _build(arch: str, num_classes: int, width: float, crop: int, dropout: float = 0.5,
           dropout_style: str = "inverted") -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # initial values are overwritten: leave the caller's RNG alone
        return build_model(arch, num_classes, width, dropout, crop, init="torch", dropout_style=dropout_style)


def _load_strict(model: nn.Module, state: dict, path) -> None:
    """load_state_dict(strict=True), with mismatches as a ValueError naming the file and keys."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [f"{k} {tuple(state[k].shape)} (model: {tuple(v.shape)})" for k, v in expected.items()
             if k in state and isinstance(state[k], torch.Tensor) and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        parts = [f"{label}: {_first(keys, 3)}" for label, keys in
                 (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if keys]
        raise ValueError(f"{path}: weights do not fit the model; " + "; ".join(parts))
    try:
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{path}: weights do not fit the model ({e})") from None


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


def make_normalizer(info: dict, data: SplitData, device: torch.device | str = "cpu") -> Normalizer:
    """The normalisation the model was trained with, on `device`."""
    if info["mean"] != "image":
        return Normalizer(info["mean"], None, info["channel_mean"], info["channel_std"], device)
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

    Images are read in file order; with `csv_path`, one row per image (written atomically).
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
    k = min(5, logp.shape[1])
    top = logp.topk(k, dim=1).indices.cpu().numpy()
    for name, label, preds in zip(names, labels.tolist(), top.tolist()):
        padded = preds + [""] * (5 - k)  # fewer than 5 classes: empty prediction columns
        writer.writerow([name, label, *padded, int(preds[0] == label), int(label in preds)])
