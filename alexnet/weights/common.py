"""What every weight format shares: the error, safe .npy reading, strict loading, shape inference."""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from data.meta import npy_error

from ..models import build_model, feature_side, min_crop

# torchvision's ImageNet normalisation, which its published AlexNet weights expect; also what the info
# of formats that store no normalisation names (they use the mean image).
TORCHVISION_MEAN = (0.485, 0.456, 0.406)
TORCHVISION_STD = (0.229, 0.224, 0.225)
# fc6 input side -> the crop the published models use; other sides get the smallest crop giving them.
_KNOWN_CROPS = {6: 227, 5: 224}
# (state-dict key, unscaled channel count) per layer of our alexnet/caffenet, most channels first: the
# widest layer gives the most precise width estimate, the rest are tried if rounding made it ambiguous.
PAPER_LAYERS = (("classifier.fc6.weight", 4096), ("features.conv3.weight", 384),
                ("features.conv4.weight", 384), ("features.conv2.weight", 256),
                ("features.conv5.weight", 256), ("features.conv1.weight", 96))
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel, torch.compile
# A file's contents as torch.load reads them (a dict), loaded at the first call: formats told by the file
# name need not call it, so load_weights opens a file torch.load cannot read only with its own reader.
Contents = Callable[[], dict]


class FormatError(ValueError):
    """Weights that cannot be read or do not fit; names the file and what was expected."""


def load_npy(path: Path, what: str = "", finite: bool = True) -> np.ndarray:
    """A float array (finite unless `finite` is False) from a .npy file, never unpickling.

    FormatError naming the file (and `what` it should be) otherwise; the OSError of a file that cannot be read.
    """
    try:
        a = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise FormatError(f"{path}: missing{what}") from None
    except OSError as e:  # the operating system refused (permission denied, I/O error): not the file's form
        raise OSError(e.errno, e.strerror, str(path)) from None
    except (ValueError, EOFError) as e:  # pickled objects, truncation, not an .npy at all
        raise FormatError(f"{path}: not a plain .npy array ({npy_error(e)})") from None
    if not isinstance(a, np.ndarray):
        raise FormatError(f"{path}: an .npz archive, expected one .npy array")
    if not np.issubdtype(a.dtype, np.floating):
        raise FormatError(f"{path}: dtype {a.dtype}, expected float32{what}")
    if finite and not np.isfinite(a).all():
        raise FormatError(f"{path}: holds NaN or infinite values")
    return a.astype(np.float32, copy=False)


def weights_info(arch: str, width: float, crop: int, mean: str, num_classes: int, source: str,
                 channel_mean=TORCHVISION_MEAN, channel_std=TORCHVISION_STD, classes: list | None = None) -> dict:
    """load_weights' info dict (see there)."""
    return {"arch": arch, "width": float(width), "crop": int(crop), "mean": mean,
            "channel_mean": [float(v) for v in channel_mean], "channel_std": [float(v) for v in channel_std],
            "num_classes": int(num_classes), "classes": None if classes is None else list(classes),
            "source": source}


def check_style(style: str) -> None:
    if style not in ("theano", "inverted"):
        raise FormatError(f"dropout style must be theano or inverted, got {style!r}")


def unwrap_state(path, obj: dict) -> dict:
    """The state_dict inside `obj` ({"state_dict": ...} and {"model": ...} wrappers, DDP prefixes)."""
    for key in ("state_dict", "model"):
        if isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if not obj or bad:
        raise FormatError(f"{path}: not a state_dict (expected parameter name -> tensor; "
                          f"non-tensor entries: {first_few(bad) or 'none, it is empty'})")
    for prefix in _WRAPPER_PREFIXES:
        if all(isinstance(k, str) and k.startswith(prefix) for k in obj):
            obj = {k[len(prefix):]: v for k, v in obj.items()}
    return obj


def crop_for_side(arch: str, side: int) -> int:
    """The crop that gives `side` x `side` features before fc6 (227 for 6, 224 for 5, else the smallest)."""
    crop = min_crop(arch)
    while feature_side(arch, crop) < side:
        crop += 1
    if feature_side(arch, crop) != side:
        raise ValueError(f"no crop gives {side}x{side} features for {arch}")
    known = _KNOWN_CROPS.get(side)
    return known if known is not None and feature_side(arch, known) == side else crop


def crop_from_fc6(path, arch: str, conv5_channels: int, fc6_inputs: int) -> int:
    """The crop of a model whose fc6 reads `fc6_inputs` values of conv5's `conv5_channels` maps."""
    side = math.isqrt(fc6_inputs // conv5_channels) if conv5_channels else 0
    if side < 1 or conv5_channels * side * side != fc6_inputs:
        raise FormatError(f"{path}: fc6 takes {fc6_inputs} inputs, not conv5's {conv5_channels} channels times "
                          "a square feature map")
    return crop_for_side(arch, side)


def infer_width(path, arch: str, state: dict, num_classes: int, crop: int,
                layers: tuple[tuple[str, int], ...]) -> float:
    """The width multiplier whose model has the shapes of `state` in every key both hold (tried on the meta
    device): a key too many or too few is then named by load_strict, not taken for another width; else
    FormatError naming the first tensor whose shape fits no width tried."""
    first = None
    for key, base in layers:
        if key not in state:
            continue
        width = state[key].shape[0] / base
        with torch.device("meta"):
            model = build_model(arch, num_classes, width, 0.5, crop, init="torch")
        wrong = [f"{k} is {tuple(state[k].shape)}, {tuple(v.shape)} at width {width:g}"
                 for k, v in model.state_dict().items() if k in state and state[k].shape != v.shape]
        if not wrong:
            return width
        first = first or wrong[0]
    raise FormatError(f"{path}: the tensor shapes match no width of {arch} ({first or 'none of its layers is there'})")


def new_model(arch: str, num_classes: int, width: float, crop: int, dropout: float = 0.5,
              dropout_style: str = "inverted", lrn: str = "paper") -> nn.Module:
    """A model to load weights into (load_strict sets every tensor of its state): its memory on the default
    device, NaN in its floating tensors instead of initial values, which were overwritten (drawing them was
    half of loading a full-size file on a CPU): a reader that missed a tensor gives NaN, which evaluation
    refuses, not plausible numbers; on the meta device where that is the default (a check of shapes)."""
    with torch.device("meta"):  # nothing is drawn there: the caller's RNG is left alone
        model = build_model(arch, num_classes, width, dropout, crop, init="torch", dropout_style=dropout_style,
                            lrn=lrn)
    unset = sorted({name for name, _ in model.named_buffers()} - set(model.state_dict()))
    if unset:  # a buffer outside the state would keep whatever its memory held
        raise TypeError(f"{arch}: buffers {unset} are not in its state; new_model cannot load them")
    device = torch.get_default_device()
    if device.type == "meta":
        return model
    # to_empty's empty_like of a meta tensor imports sympy (0.6 s of a tool's start); torch.full does not
    return model._apply(lambda t: torch.full(t.shape, float("nan") if t.is_floating_point() else 0, dtype=t.dtype,
                                              device=device))


def load_strict(model: nn.Module, state: dict, path) -> None:
    """load_state_dict(strict=True), with mismatches as a FormatError naming the file and keys."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [f"{k} {tuple(state[k].shape)} (model: {tuple(v.shape)})" for k, v in expected.items()
             if k in state and isinstance(state[k], torch.Tensor) and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        parts = [f"{label}: {first_few(keys, 3)}" for label, keys in
                 (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if keys]
        raise FormatError(f"{path}: weights do not fit the model; " + "; ".join(parts))
    try:
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError) as e:
        raise FormatError(f"{path}: weights do not fit the model ({e})") from None


def first_few(keys: list, n: int = 5) -> str:
    """The first `n` of `keys`, comma-separated, and how many more."""
    more = f" (+{len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(map(str, keys[:n])) + more

