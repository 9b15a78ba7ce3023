"""Every weight format this repository reads or writes, and how each maps onto our layers.

=============  ====================================================================  =======================
format         what it is                                                            read / written by
=============  ====================================================================  =======================
checkpoint     our training checkpoint (kind ``alexnet-checkpoint``): config, weights, load_weights, train.py
               velocities, LR-policy state, position (alexnet/trainer.py)           / Trainer, theano import
weights        kind ``alexnet-weights``: config and weights only (a Theano epoch      load_weights
               converted without momentum); train.py refuses to resume it            / theano import
torchvision    torchvision's AlexNet state dict = our ``owt`` (same keys)             load_weights
state_dict     a plain state dict of our ``alexnet``/``caffenet`` (same keys, another  load_weights (--arch)
               layer order, so the arch must be named)
theano         Ding et al.'s folder of per-layer ``.npy`` files, one set per epoch   read_theano, load_weights
                                                                                      / write_theano
=============  ====================================================================  =======================

The Theano folder, epoch E (its network is our ``caffenet`` at crop 227)::

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

Every ``.npy`` is read with ``allow_pickle=False``; every ``.pt`` with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .checkpoint import CHECKPOINT_KIND, _fsync_dir, load
from .config import Config, TrainConfig, from_dict, to_dict
from .models import ARCHS, build_model, feature_side, min_crop
from .optim import LRSchedule, build_optimizer, param_groups

WEIGHTS_KIND = "alexnet-weights"
FORMATS = ("checkpoint", "weights", "torchvision", "state_dict", "theano")
THEANO_CONVS = ("cudnn", "cudaconvnet")
THEANO_CROP = 227
THEANO_DROPOUT = 0.5
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


class FormatError(ValueError):
    """Weights that cannot be read or do not fit; names the file and what was expected."""


# -- the Theano layout -------------------------------------------------------------------------------


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
_STEMS = frozenset(p.stem for p in THEANO_PARAMS)
_FOLDED = ("classifier.fc7.weight", "classifier.fc8.weight")  # read the units dropout drops
_PARAM_FILE = re.compile(r"^((?:W|b)[01]?_\d)_(\d+)\.npy$")
# Widths are tried from these arrays' output counts (most channels first, as _PAPER_LAYERS).
_THEANO_WIDTH_HINTS = (("W_5", 4096, 1), ("W_2", 384, 1), ("W0_3", 384, 2), ("W0_1", 256, 2), ("W0_4", 256, 2),
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
    _check_conv(conv)
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
    _check_conv(conv)
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


def _check_conv(conv: str) -> None:
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


# -- reading a Theano folder ---------------------------------------------------------------------------


@dataclass
class TheanoEpoch:
    """One epoch of a Theano folder (or what will be written as one), arrays in Theano's layout."""

    epoch: int
    params: dict[str, np.ndarray]                   # stem -> array
    velocities: dict[str, np.ndarray] | None = None  # stem -> velocity (written as mom_k)
    lr: float | None = None                          # the lr of epoch E+1
    val_record: np.ndarray | None = None             # n x 2: top-1 error, loss
    width: float = 1.0
    num_classes: int = 1000
    folder: Path | None = None


def load_npy(path: Path, what: str = "", finite: bool = True) -> np.ndarray:
    """A float array (finite unless `finite` is False) from a .npy file, never unpickling.

    FormatError naming the file (and `what` it should be) otherwise.
    """
    try:
        a = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise FormatError(f"{path}: missing{what}") from None
    except (OSError, ValueError, EOFError) as e:  # pickled objects, truncation, not an .npy at all
        raise FormatError(f"{path}: not a plain .npy array ({e})") from None
    if not isinstance(a, np.ndarray):
        raise FormatError(f"{path}: an .npz archive, expected one .npy array")
    if not np.issubdtype(a.dtype, np.floating):
        raise FormatError(f"{path}: dtype {a.dtype}, expected float32{what}")
    if finite and not np.isfinite(a).all():
        raise FormatError(f"{path}: holds NaN or infinite values")
    return a.astype(np.float32, copy=False)


def theano_epochs(folder: Path) -> dict[int, set[str]]:
    """epoch -> the parameter stems present for it in `folder`."""
    out: dict[int, set[str]] = {}
    for name in os.listdir(folder):
        m = _PARAM_FILE.match(name)
        if m and m.group(1) in _STEMS:
            out.setdefault(int(m.group(2)), set()).add(m.group(1))
    return out


def is_theano_folder(path: str | os.PathLike) -> bool:
    return Path(path).is_dir()


def _pick_epoch(folder: Path, epoch: int | None) -> tuple[int, dict[int, set[str]]]:
    epochs = theano_epochs(folder)
    if not epochs:
        raise FormatError(f"{folder}: no Theano weight files (W_0_<epoch>.npy, W0_1_<epoch>.npy, ...)")
    if epoch is None:
        return max(epochs), epochs
    if epoch not in epochs:
        raise FormatError(f"{folder}: no files of epoch {epoch} (epochs present: {_ranges(sorted(epochs))})")
    return epoch, epochs


def _ranges(values: list[int]) -> str:
    return ", ".join(map(str, values[:10])) + (f" ... ({len(values)} in all)" if len(values) > 10 else "")


def _simple_first(width: float) -> list[float]:
    """`width` rounded to 1..6 decimals, then as is: a converted 0.3 is found as 0.3, not 0.30005."""
    out = []
    for w in [round(width, d) for d in range(1, 7)] + [width]:
        if w > 0 and w not in out:
            out.append(w)
    return out


def _infer_theano_shape(arrays: dict[str, np.ndarray]) -> tuple[float | None, int | None, dict | None]:
    """(width, num_classes, expected shapes) explaining `arrays` (some may be missing).

    width is None when no width fits every array; the shapes are then those of the width that fits
    the most arrays, so that the first array not fitting them is the one to name.
    """
    w7, b7 = arrays.get("W_7"), arrays.get("b_7")
    num_classes = (w7.shape[1] if w7 is not None and w7.ndim == 2 else
                   b7.shape[0] if b7 is not None and b7.ndim == 1 else None)
    if not num_classes:
        return None, None, None
    guesses = [arrays[s].shape[-1] * split / base for s, base, split in _THEANO_WIDTH_HINTS
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


def read_theano(folder: str | os.PathLike, epoch: int | None = None, momentum: bool = False) -> TheanoEpoch:
    """Epoch `epoch` (default: the highest present) of a Theano folder, every array checked.

    momentum: also the velocities (mom_*), the lr (lr_E.npy) and val_record.npy (optional).
    FormatError names the first missing, unreadable or misshapen file and the expected shape.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FormatError(f"{folder}: no such Theano weights folder")
    epoch, epochs = _pick_epoch(folder, epoch)
    present = epochs[epoch]
    params = {p.stem: load_npy(folder / f"{p.stem}_{epoch}.npy") for p in THEANO_PARAMS if p.stem in present}
    width, num_classes, shapes = _infer_theano_shape(params)

    def expected(p: TheanoParam) -> str:
        return f"expected shape {shapes[p.stem]}" if shapes else f"expected {_shape_hint(p)}"

    missing = [p for p in THEANO_PARAMS if p.stem not in params]
    if missing:
        complete = sorted(e for e, stems in epochs.items() if len(stems) == len(THEANO_PARAMS))
        raise FormatError(f"{folder / f'{missing[0].stem}_{epoch}.npy'}: missing ({expected(missing[0])}); epoch "
                          f"{epoch} of {folder} has {len(present)} of {len(THEANO_PARAMS)} parameter files "
                          f"(complete epochs: {_ranges(complete) or 'none'}; choose one with --epoch)")
    if shapes is None:  # no class count (W_7) or no width hint (W_5 ...) has the right number of dimensions
        p = THEANO_PARAMS[-2] if num_classes is None else next(
            p for p in THEANO_PARAMS if p.stem == _THEANO_WIDTH_HINTS[0][0])
        raise FormatError(f"{folder / f'{p.stem}_{epoch}.npy'}: shape {params[p.stem].shape}, expected "
                          f"{_shape_hint(p)}")
    for p in THEANO_PARAMS:
        if params[p.stem].shape != shapes[p.stem]:
            raise FormatError(f"{folder / f'{p.stem}_{epoch}.npy'}: shape {params[p.stem].shape}, {expected(p)} "
                              f"({_shape_hint(p)}; the other files are a caffenet of {num_classes} classes at "
                              "crop 227)")
    out = TheanoEpoch(epoch, params, width=width, num_classes=num_classes, folder=folder)
    if momentum:
        _read_momentum(folder, out)
    return out


def _shape_hint(p: TheanoParam) -> str:
    if not p.weight:
        return "b: (n_out,)"
    return "W: (in, rows, cols, out)" if p.conv else "W: (n_in, n_out)"


def _read_momentum(folder: Path, te: TheanoEpoch) -> None:
    te.velocities = {}
    for k, p in enumerate(THEANO_PARAMS):
        path = folder / f"mom_{k}_{te.epoch}.npy"
        shape = te.params[p.stem].shape
        v = load_npy(path, f" (the velocity of {p.stem}, expected shape {shape}; needed for --momentum)")
        if v.shape != shape:
            raise FormatError(f"{path}: shape {v.shape}, expected {shape} (mom_{k} is the velocity of {p.stem})")
        te.velocities[p.stem] = v
    path = folder / f"lr_{te.epoch}.npy"
    lr = load_npy(path, " (the learning rate of the next epoch; needed for --momentum)")
    if lr.size != 1 or float(lr.reshape(-1)[0]) < 0:
        raise FormatError(f"{path}: {lr.reshape(-1)[:3].tolist()} (shape {lr.shape}), expected one "
                          "non-negative learning rate")
    te.lr = float(lr.reshape(-1)[0])
    record = folder / "val_record.npy"
    if record.is_file():  # informational only: a damaged one must not block the conversion
        try:
            rows = load_npy(record, finite=False)  # a loss we did not know is written as NaN
        except FormatError:
            rows = None
        te.val_record = rows if rows is not None and rows.ndim == 2 and rows.shape[1] == 2 else None


# -- writing a Theano folder ---------------------------------------------------------------------------


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """np.save to a temporary file, fsync, then rename over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def theano_files(te: TheanoEpoch) -> dict[str, np.ndarray]:
    """File name -> array of everything `te` writes (val_record.npy apart)."""
    files = {f"{p.stem}_{te.epoch}.npy": te.params[p.stem] for p in THEANO_PARAMS}
    if te.velocities is not None:
        files.update({f"mom_{k}_{te.epoch}.npy": te.velocities[p.stem] for k, p in enumerate(THEANO_PARAMS)})
    if te.lr is not None:
        files[f"lr_{te.epoch}.npy"] = np.array(te.lr, dtype=np.float32)  # Theano saves a 0-d float32
    return files


def write_theano(folder: str | os.PathLike, te: TheanoEpoch, force: bool = False) -> list[Path]:
    """Write `te` into `folder` (created); existing files of that epoch are refused unless `force`.

    val_record.npy (one per folder, which Theano's resume reads) is written only where absent.
    Returns the paths written.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FormatError(f"{folder}: exists and is not a folder")
    files = theano_files(te)
    clash = [folder / n for n in files if (folder / n).exists()]
    if clash and not force:
        raise FormatError(f"{clash[0]}: exists ({len(clash)} files of epoch {te.epoch} would be replaced; "
                          "pass --force to replace them)")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, array in files.items():
        save_npy_atomic(folder / name, array)
        written.append(folder / name)
    record = folder / "val_record.npy"
    if te.val_record is not None and not record.exists():
        save_npy_atomic(record, np.asarray(te.val_record, dtype=np.float32).reshape(-1, 2))
        written.append(record)
    _fsync_dir(folder)  # the renames themselves survive a crash
    return written


# -- Theano <-> our files ----------------------------------------------------------------------------------


def theano_config(te: TheanoEpoch, dropout_style: str) -> Config:
    """The config of a converted Theano epoch: caffenet, its width and classes, crop 227, mean image."""
    cfg = Config()
    cfg.model.arch, cfg.model.width, cfg.model.num_classes = "caffenet", float(te.width), int(te.num_classes)
    cfg.model.dropout, cfg.model.dropout_style = THEANO_DROPOUT, dropout_style
    cfg.data.crop, cfg.data.mean = THEANO_CROP, "image"
    return cfg


def theano_model(te: TheanoEpoch, conv: str, dropout_style: str = "theano") -> nn.Module:
    """Our caffenet holding `te`'s weights (eval mode, CPU); its logits are the Theano network's."""
    _check_style(dropout_style)
    model = _build("caffenet", te.num_classes, te.width, THEANO_CROP, THEANO_DROPOUT, dropout_style)
    state = {k: torch.from_numpy(v) for k, v in theano_to_ours(te.params, conv, dropout_style).items()}
    _load_strict(model, state, te.folder)
    return model.eval()


def theano_checkpoint(te: TheanoEpoch, conv: str, dropout_style: str = "theano") -> dict:
    """Our file for a Theano epoch: a training checkpoint if `te` has velocities, else a weights file.

    The checkpoint has exactly Trainer.state_dict()'s keys (epoch E completed, step 0, no RNG state:
    the trainer reseeds dropout deterministically), plus ``next_lr`` (lr_E.npy: the lr of E+1, which
    the trainer compares with its schedule) and ``source``.
    """
    model = theano_model(te, conv, dropout_style)
    cfg = theano_config(te, dropout_style)
    source = {"format": "theano", "folder": str(te.folder), "epoch": te.epoch, "conv": conv}
    if te.val_record is not None:
        source["val_record"] = te.val_record.tolist()
    common = {"model": model.state_dict(), "config": to_dict(cfg), "num_classes": te.num_classes, "classes": None}
    if te.velocities is None:
        return {"kind": WEIGHTS_KIND, "version": 1, **common, "source": source}
    optimizer = build_optimizer(model, TrainConfig())
    velocities = theano_to_ours(te.velocities, conv, dropout_style)
    names = {id(p): k for k, p in model.named_parameters()}
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    for p, v in zip(ordered, optimizer.velocities()):
        v.copy_(torch.from_numpy(velocities[names[id(p)]]))
    # best_top1_err stays inf: val_record's errors were measured by Theano's own validation (per-batch
    # averages over its files), not comparable with this code's, and best.pt should compare like with like.
    return {"kind": CHECKPOINT_KIND, "version": 1, **common, "optimizer": optimizer.state_dict(),
            "schedule": {"auto_factor": 1.0, "auto_last_drop": 0, "val_history": []},
            "epoch": te.epoch, "step": 0, "global_step": 0, "global_batch": 256, "best_top1_err": math.inf,
            "elapsed": 0.0, "meter": torch.zeros(4, dtype=torch.float64), "rng": [], "world": 1,
            "next_lr": float(te.lr), "source": source}


def _check_style(style: str) -> None:
    if style not in ("theano", "inverted"):
        raise FormatError(f"dropout style must be theano or inverted, got {style!r}")


def to_theano(obj: dict, path, conv: str, *, arch: str | None = None, dropout_style: str | None = None,
              epoch: int | None = None, lr: float | None = None, warn=print) -> TheanoEpoch:
    """A checkpoint, weights file or caffenet state dict (`obj`, loaded from `path`) as a Theano epoch.

    Only caffenet exports: alexnet normalises before pooling, another function in the Theano network.
    epoch: default the checkpoint's completed epochs. lr (lr_E.npy, the lr of epoch E+1): `lr`, else
    the file's next_lr, else the checkpoint's schedule at the first step of epoch E+1, else none is
    written. mom_* come from the file's velocities when it has them. Inverted-style weights are
    unfolded (fc7, fc8 x2). `warn` receives notes that do not stop the export.
    """
    if obj.get("kind") in (CHECKPOINT_KIND, WEIGHTS_KIND):
        state, style, cfg = _checkpoint_source(obj, path, arch, dropout_style, warn)
        if epoch is None:
            epoch = obj.get("epoch", (obj.get("source") or {}).get("epoch"))
        if obj.get("step"):
            warn(f"note: {path} stopped at step {obj['step']} of epoch {obj['epoch'] + 1}; written as epoch {epoch}, "
                 f"so a Theano run resumed from it does epoch {obj['epoch'] + 1} again from its start")
        velocities = _optimizer_velocities(obj.get("optimizer"), state, path)
        if lr is None:
            lr = obj["next_lr"] if "next_lr" in obj else _schedule_lr(obj, cfg)
        record = _val_record(obj)
    else:
        state, style = _state_source(obj, path, arch, dropout_style)
        velocities, record = None, None
    if epoch is None:
        raise FormatError(f"{path} records no epoch: pass --epoch")
    width, num_classes = _theano_fit(state, path)
    arrays = {k: v.detach().cpu().numpy() for k, v in state.items()}
    return TheanoEpoch(int(epoch), ours_to_theano(arrays, conv, style),
                       None if velocities is None else ours_to_theano(velocities, conv, style),
                       None if lr is None else float(np.float32(lr)), record, width, num_classes)


def _checkpoint_source(obj: dict, path, arch: str | None, dropout_style: str | None,
                       warn) -> tuple[dict, str, Config]:
    missing = [k for k in ("config", "model") if k not in obj]
    if missing:
        raise FormatError(f"{path}: {obj['kind']} without {', '.join(missing)} (damaged or too old)")
    cfg = from_dict(obj["config"])
    m = cfg.model
    _check_exportable(path, m.arch, arch)
    if dropout_style is not None and dropout_style != m.dropout_style:
        raise FormatError(f"{path} was trained with model.dropout_style={m.dropout_style}, not {dropout_style}; "
                          "omit --dropout-style")
    if m.dropout != THEANO_DROPOUT:
        warn(f"note: {path} was trained with model.dropout={m.dropout}; the Theano network drops with p=0.5 "
             "(x0.5 at test time): the weights are written as they are")
    return _unwrap(path, obj["model"]), m.dropout_style, cfg


def _state_source(obj: dict, path, arch: str | None, dropout_style: str | None) -> tuple[dict, str]:
    state = _unwrap(path, obj)
    if "features.0.weight" in state:
        raise FormatError(f"{path} holds torchvision AlexNet weights (arch owt: other layers, no LRN, no groups); "
                          "the Theano network is caffenet")
    if arch is None:
        raise FormatError(f"{path} is a plain state_dict: its keys fit alexnet and caffenet, which differ in "
                          "layer order; pass --arch caffenet if it is one")
    _check_exportable(path, arch, None)
    style = dropout_style or "inverted"  # build_model's default, so a plain state dict's most likely
    _check_style(style)
    return state, style


def _check_exportable(path, arch: str, asked: str | None) -> None:
    if asked is not None and asked != arch:
        raise FormatError(f"{path} is a checkpoint of arch {arch!r}, not {asked!r}; omit --arch")
    if arch != "caffenet":
        raise FormatError(f"{path} holds arch {arch!r}; only caffenet is the Theano network (conv, ReLU, max-pool, "
                          "then LRN): alexnet normalises before pooling and owt has other layers, so their "
                          "weights would compute another function there")


def _theano_fit(state: dict, path) -> tuple[float, int]:
    """(width, classes) of a caffenet state dict that fits the Theano network (crop 227), else FormatError."""
    if "classifier.fc8.weight" not in state:
        raise FormatError(f"{path}: no classifier.fc8.weight (keys {_first(list(state))})")
    num_classes = int(state["classifier.fc8.weight"].shape[0])
    try:
        return _infer_width(path, "caffenet", state, num_classes, THEANO_CROP, _PAPER_LAYERS), num_classes
    except FormatError as e:
        raise FormatError(f"{e}; the Theano network is caffenet at crop 227 (fc6 reads 6x6 pool5 maps)") from None


def _optimizer_velocities(opt: dict | None, state: dict, path) -> dict[str, np.ndarray] | None:
    """The velocity of each parameter (our keys) of a PaperSGD state_dict, or None if it holds none."""
    if not opt or not opt.get("state"):
        return None
    with torch.device("meta"):  # the parameter order of the optimizer depends only on the structure
        model = build_model("caffenet", 1000, 1.0, THEANO_DROPOUT, THEANO_CROP, init="torch")
    names = {id(p): k for k, p in model.named_parameters()}
    keys = [names[id(p)] for group in param_groups(model, TrainConfig()) for p in group["params"]]
    ids = [i for group in opt.get("param_groups", []) for i in group["params"]]
    if len(ids) != len(keys):
        raise FormatError(f"{path}: the optimizer state has {len(ids)} parameters, caffenet has {len(keys)}")
    out = {}
    for i, key in zip(ids, keys):
        v = opt["state"].get(i, {}).get("velocity")
        if not isinstance(v, torch.Tensor) or v.shape != state[key].shape:
            raise FormatError(f"{path}: optimizer state {i} ({key}) has no velocity of shape "
                              f"{tuple(state[key].shape)}")
        out[key] = v.detach().cpu().numpy()
    return out


def _schedule_lr(obj: dict, cfg: Config) -> float | None:
    """The lr the checkpoint's run would use at the first step of its next epoch (None if unknown)."""
    if "schedule" not in obj or "epoch" not in obj:
        return None
    t = cfg.train
    scale = obj.get("global_batch", t.batch_size) / t.lr_ref_batch if t.lr_scaling == "linear" else 1.0
    schedule = LRSchedule(t, 1, scale)  # one step per epoch: lr_at(E) is the lr at the start of epoch E+1
    schedule.load_state_dict(obj["schedule"])
    return schedule.lr_at(int(obj["epoch"]))


def _val_record(obj: dict) -> np.ndarray | None:
    """Theano's val_record rows [top-1 error, loss]: the converted source's, else ours (loss unknown: NaN)."""
    source = obj.get("source") or {}
    if source.get("format") == "theano" and source.get("val_record") is not None:
        return np.asarray(source["val_record"], dtype=np.float32).reshape(-1, 2)
    history = (obj.get("schedule") or {}).get("val_history")
    if history is None:
        return None
    return np.array([[err, np.nan] for err in history], dtype=np.float32).reshape(-1, 2)


# -- loading any format for evaluation -------------------------------------------------------------------


def detect(path: str | os.PathLike, obj: dict | None = None) -> str:
    """The format of `path` (a folder, or the loaded dict `obj` of a file): one of FORMATS."""
    if Path(path).is_dir():
        return "theano"
    kind = obj.get("kind")
    if kind == CHECKPOINT_KIND:
        return "checkpoint"
    if kind == WEIGHTS_KIND:
        return "weights"
    state = _unwrap(path, obj)
    if "features.0.weight" in state and "classifier.6.weight" in state:
        return "torchvision"
    if "features.conv1.weight" in state:
        return "state_dict"
    raise FormatError(f"{path}: unrecognised weights: keys {_first(list(state))} are neither torchvision "
                      "AlexNet's (features.0.weight ...) nor ours (features.conv1.weight ...)")


def load_weights(path: str | os.PathLike, arch: str | None = None, width: float | None = None, *,
                 epoch: int | None = None, theano_conv: str | None = None) -> tuple[nn.Module, dict]:
    """The model (eval mode, CPU) and its info dict for weights in any of FORMATS.

    info: arch, width, crop, mean ("image" | "channel"), channel_mean, channel_std, num_classes,
    classes (list or None), source (the format); for a Theano folder also epoch and theano_conv.
    epoch, theano_conv: a Theano folder's epoch (default the highest) and convolution (default cudnn).
    Raises CheckpointError (unreadable file) or ValueError (readable, but not usable), naming `path`.
    """
    if arch is not None and arch not in ARCHS:
        raise FormatError(f"unknown arch {arch!r}; valid archs: {', '.join(ARCHS)}")
    if is_theano_folder(path):
        return _from_theano(path, arch, width, epoch, theano_conv or "cudnn")
    if epoch is not None or theano_conv is not None:
        raise FormatError(f"{path} is a file: --epoch and --theano-conv apply to a Theano weights folder")
    obj = load(path)  # weights_only=True: never runs code from the file
    fmt = detect(path, obj)
    if fmt in ("checkpoint", "weights"):
        model, info = _from_checkpoint(path, obj, arch, width, fmt)
    elif fmt == "torchvision":
        model, info = _from_torchvision(path, _unwrap(path, obj), arch, width)
    else:
        model, info = _from_paper_state(path, _unwrap(path, obj), arch, width)
    return model.eval(), info


def _info(arch: str, width: float, crop: int, mean: str, num_classes: int, source: str,
          channel_mean=TORCHVISION_MEAN, channel_std=TORCHVISION_STD, classes: list | None = None) -> dict:
    return {"arch": arch, "width": float(width), "crop": int(crop), "mean": mean,
            "channel_mean": [float(v) for v in channel_mean], "channel_std": [float(v) for v in channel_std],
            "num_classes": int(num_classes), "classes": None if classes is None else list(classes),
            "source": source}


def _from_theano(path, arch: str | None, width: float | None, epoch: int | None,
                 conv: str) -> tuple[nn.Module, dict]:
    if arch not in (None, "caffenet"):
        raise FormatError(f"{path} is a Theano folder: its network is caffenet, not {arch!r}; omit --arch")
    _check_conv(conv)
    te = read_theano(path, epoch)
    if width is not None and width != te.width:
        raise FormatError(f"{path} holds a network of width {te.width}, not {width}")
    model = theano_model(te, conv, "theano")  # the arrays as they are; x0.5 after fc6/fc7 at test time
    info = _info("caffenet", te.width, THEANO_CROP, "image", te.num_classes, "theano")
    return model, {**info, "epoch": te.epoch, "theano_conv": conv}


def _from_checkpoint(path, state: dict, arch: str | None, width: float | None,
                     source: str = "checkpoint") -> tuple[nn.Module, dict]:
    missing = [k for k in ("config", "model", "num_classes") if k not in state]
    if missing:
        raise FormatError(f"{path}: training checkpoint without {', '.join(missing)} (damaged or too old)")
    cfg = from_dict(state["config"])  # ConfigError is a ValueError
    m, d = cfg.model, cfg.data
    if arch is not None and arch != m.arch:
        raise FormatError(f"{path} is a checkpoint of arch {m.arch!r}, not {arch!r}; omit --arch")
    if width is not None and width != m.width:
        raise FormatError(f"{path} is a checkpoint of width {m.width}, not {width}")
    model = _build(m.arch, int(state["num_classes"]), m.width, d.crop, m.dropout, m.dropout_style)
    _load_strict(model, state["model"], path)
    info = _info(m.arch, m.width, d.crop, d.mean, state["num_classes"], source, d.channel_mean,
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
        raise FormatError(f"{path}: not a state_dict (expected parameter name -> tensor; "
                          f"non-tensor entries: {_first(bad) or 'none, it is empty'})")
    for prefix in _WRAPPER_PREFIXES:
        if all(isinstance(k, str) and k.startswith(prefix) for k in obj):
            obj = {k[len(prefix):]: v for k, v in obj.items()}
    return obj


def _from_torchvision(path, state: dict, arch: str | None, width: float | None) -> tuple[nn.Module, dict]:
    if arch not in (None, "owt"):
        raise FormatError(f"{path} holds torchvision AlexNet weights (arch owt), not {arch!r}; omit --arch")
    num_classes = state["classifier.6.weight"].shape[0]
    crop = TORCHVISION_CROP  # the adaptive pool makes the weights crop-independent: use torchvision's
    width = width or _infer_width(path, "owt", state, num_classes, crop, _OWT_LAYERS)
    model = _build("owt", num_classes, width, crop)
    _load_strict(model, state, path)
    return model, _info("owt", width, crop, "channel", num_classes, "torchvision")


def _from_paper_state(path, state: dict, arch: str | None, width: float | None) -> tuple[nn.Module, dict]:
    if arch is None:
        raise FormatError(f"{path} is a state_dict of our alexnet or caffenet (the same keys, a different "
                          "layer order): pass --arch alexnet or --arch caffenet")
    if arch == "owt":
        raise FormatError(f"{path} holds alexnet/caffenet weights (features.conv1 ...), not owt ones")
    need = [k for k in ("features.conv5.weight", "classifier.fc6.weight", "classifier.fc8.weight")
            if k not in state]
    if need:
        raise FormatError(f"{path}: incomplete {arch} state_dict, missing {_first(need)}")
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
        raise FormatError(f"{path}: fc6 takes {fc6_inputs} inputs, not conv5's {conv5_channels} channels times "
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
    raise FormatError(f"{path}: the tensor shapes match no width of {arch} (keys {_first(list(state))})")


def _build(arch: str, num_classes: int, width: float, crop: int, dropout: float = 0.5,
           dropout_style: str = "inverted") -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # initial values are overwritten: leave the caller's RNG alone
        return build_model(arch, num_classes, width, dropout, crop, init="torch", dropout_style=dropout_style)


def _load_strict(model: nn.Module, state: dict, path) -> None:
    """load_state_dict(strict=True), with mismatches as a FormatError naming the file and keys."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [f"{k} {tuple(state[k].shape)} (model: {tuple(v.shape)})" for k, v in expected.items()
             if k in state and isinstance(state[k], torch.Tensor) and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        parts = [f"{label}: {_first(keys, 3)}" for label, keys in
                 (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if keys]
        raise FormatError(f"{path}: weights do not fit the model; " + "; ".join(parts))
    try:
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError) as e:
        raise FormatError(f"{path}: weights do not fit the model ({e})") from None


def _first(keys: list, n: int = 5) -> str:
    more = f" (+{len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(map(str, keys[:n])) + more


# -- mean images ---------------------------------------------------------------------------------------------


def read_mean_image(path: str | os.PathLike, size: int) -> np.ndarray:
    """A mean image file as float32 size x size x 3 (ours) from (3, S, S) (Theano's img_mean) or (S, S, 3)."""
    path = Path(path)
    mean = load_npy(path)
    if mean.shape == (3, size, size):
        return np.ascontiguousarray(mean.transpose(1, 2, 0))
    if mean.shape == (size, size, 3):
        return mean
    raise FormatError(f"{path}: shape {mean.shape}, expected (3, {size}, {size}) (Theano's img_mean, channel first) "
                      f"or ({size}, {size}, 3) to match the {size}x{size} images")
