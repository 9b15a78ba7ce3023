"""The Theano reproduction's weights folders: reading and writing epochs (with momentum), and the model.

The files and how their arrays map onto our caffenet: :mod:`alexnet.weights.theano_layout`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from data.fsutil import commit, temp_path

from ..checkpoint import _fsync_dir
from .common import FormatError, check_style, load_npy, load_strict, new_model, weights_info
from .theano_layout import (
    STEMS,
    THEANO_CROP,
    THEANO_DROPOUT,
    THEANO_PARAMS,
    WIDTH_HINTS,
    TheanoParam,
    check_conv,
    infer_theano_shape,
    shape_hint,
    theano_to_ours,
)

_PARAM_FILE = re.compile(r"^((?:W|b)[01]?_\d)_(\d+)\.npy$")


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


# -- reading -------------------------------------------------------------------------------------------


def theano_epochs(folder: Path) -> dict[int, set[str]]:
    """epoch -> the parameter stems present for it in `folder`."""
    out: dict[int, set[str]] = {}
    for name in os.listdir(folder):
        m = _PARAM_FILE.match(name)
        if m and m.group(1) in STEMS:
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
    width, num_classes, shapes = infer_theano_shape(params)

    def expected(p: TheanoParam) -> str:
        return f"expected shape {shapes[p.stem]}" if shapes else f"expected {shape_hint(p)}"

    missing = [p for p in THEANO_PARAMS if p.stem not in params]
    if missing:
        complete = sorted(e for e, stems in epochs.items() if len(stems) == len(THEANO_PARAMS))
        raise FormatError(f"{folder / f'{missing[0].stem}_{epoch}.npy'}: missing ({expected(missing[0])}); epoch "
                          f"{epoch} of {folder} has {len(present)} of {len(THEANO_PARAMS)} parameter files "
                          f"(complete epochs: {_ranges(complete) or 'none'}; choose one with --epoch)")
    if shapes is None:  # no class count (W_7) or no width hint (W_5 ...) has the right number of dimensions
        p = THEANO_PARAMS[-2] if num_classes is None else next(
            p for p in THEANO_PARAMS if p.stem == WIDTH_HINTS[0][0])
        raise FormatError(f"{folder / f'{p.stem}_{epoch}.npy'}: shape {params[p.stem].shape}, expected "
                          f"{shape_hint(p)}")
    for p in THEANO_PARAMS:
        if params[p.stem].shape != shapes[p.stem]:
            raise FormatError(f"{folder / f'{p.stem}_{epoch}.npy'}: shape {params[p.stem].shape}, {expected(p)} "
                              f"({shape_hint(p)}; the other files are a caffenet of {num_classes} classes at "
                              "crop 227)")
    out = TheanoEpoch(epoch, params, width=width, num_classes=num_classes, folder=folder)
    if momentum:
        _read_momentum(folder, out)
    return out


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


# -- writing -------------------------------------------------------------------------------------------


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """np.save to a temporary file, fsync, then rename over `path`."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        commit(tmp, path)
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
    # A file that already holds exactly its array (the same conversion run again, e.g. after it was
    # killed halfway) is kept as it is; one that holds something else is replaced only with `force`.
    same = {n for n in files if not force and _holds(folder / n, files[n])}
    clash = [folder / n for n in files if n not in same and (folder / n).exists()]
    if clash and not force:
        raise FormatError(f"{clash[0]}: exists ({len(clash)} files of epoch {te.epoch} would be replaced; "
                          "pass --force to replace them)")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, array in files.items():
        if name not in same:
            save_npy_atomic(folder / name, array)
            written.append(folder / name)
    record = folder / "val_record.npy"
    if te.val_record is not None and not record.exists():
        save_npy_atomic(record, np.asarray(te.val_record, dtype=np.float32).reshape(-1, 2))
        written.append(record)
    _fsync_dir(folder)  # the renames themselves survive a crash
    return written


def _holds(path: Path, array: np.ndarray) -> bool:
    try:
        have = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return False
    want = np.asarray(array)
    return have.dtype == want.dtype and have.shape == want.shape and np.array_equal(have, want)


# -- the model -----------------------------------------------------------------------------------------


def theano_model(te: TheanoEpoch, conv: str, dropout_style: str = "theano") -> nn.Module:
    """Our caffenet holding `te`'s weights (eval mode, CPU); its logits are the Theano network's."""
    check_style(dropout_style)
    model = new_model("caffenet", te.num_classes, te.width, THEANO_CROP, THEANO_DROPOUT, dropout_style)
    state = {k: torch.from_numpy(v) for k, v in theano_to_ours(te.params, conv, dropout_style).items()}
    load_strict(model, state, te.folder)
    return model.eval()


def read_folder(path, arch: str | None, width: float | None, epoch: int | None,
                conv: str) -> tuple[nn.Module, dict]:
    """load_weights for a Theano folder: the model as the Theano network computes it, and its info."""
    if arch not in (None, "caffenet"):
        raise FormatError(f"{path} is a Theano folder: its network is caffenet, not {arch!r}; omit --arch")
    check_conv(conv)
    te = read_theano(path, epoch)
    if width is not None and width != te.width:
        raise FormatError(f"{path} holds a network of width {te.width}, not {width}")
    model = theano_model(te, conv, "theano")  # the arrays as they are; x0.5 after fc6/fc7 at test time
    info = weights_info("caffenet", te.width, THEANO_CROP, "image", te.num_classes, "theano")
    return model, {**info, "epoch": te.epoch, "theano_conv": conv}
