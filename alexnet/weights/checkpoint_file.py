"""Our own files: training checkpoints (kind ``alexnet-checkpoint``, written by the trainer) and weights
files (kind ``alexnet-weights``: config and weights only, e.g. a Theano epoch converted without momentum;
train.py starts from their weights at epoch 1). Both store their config, so the model is rebuilt from it."""
from __future__ import annotations

from torch import nn

from ..checkpoint import CHECKPOINT_KIND
from ..config import from_dict
from .common import Contents, FormatError, load_strict, new_model, weights_info
from .geometry import checkpoint_geometry

WEIGHTS_KIND = "alexnet-weights"


def is_checkpoint(path, contents: Contents) -> bool:
    return contents().get("kind") == CHECKPOINT_KIND


def is_weights_file(path, contents: Contents) -> bool:
    return contents().get("kind") == WEIGHTS_KIND


def read_checkpoint(path, contents: Contents, arch: str | None, width: float | None) -> tuple[nn.Module, dict]:
    """load_weights for a training checkpoint."""
    return _read(path, contents(), arch, width, "checkpoint")


def read_weights_file(path, contents: Contents, arch: str | None, width: float | None) -> tuple[nn.Module, dict]:
    """load_weights for a weights file."""
    return _read(path, contents(), arch, width, "weights")


def _read(path, state: dict, arch: str | None, width: float | None, source: str) -> tuple[nn.Module, dict]:
    missing = [k for k in ("config", "model", "num_classes") if k not in state]
    if missing:
        raise FormatError(f"{path}: training checkpoint without {', '.join(missing)} (damaged or too old)")
    cfg = from_dict(state["config"])  # ConfigError is a ValueError
    m, d = cfg.model, cfg.data
    if arch is not None and arch != m.arch:
        raise FormatError(f"{path} is a checkpoint of arch {m.arch!r}, not {arch!r}; omit --arch")
    if width is not None and width != m.width:
        raise FormatError(f"{path} is a checkpoint of width {m.width}, not {width}")
    model = new_model(m.arch, int(state["num_classes"]), m.width, d.crop, m.dropout, m.dropout_style, m.lrn)
    load_strict(model, state["model"], path)
    info = weights_info(m.arch, m.width, d.crop, d.mean, state["num_classes"], source, d.channel_mean,
                        d.channel_std, state.get("classes"))
    info["geometry"] = checkpoint_geometry(state)  # the --resize and --size of its data, if known
    return model, info
