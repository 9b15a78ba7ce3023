"""What ``run.resume_from`` names, as the training checkpoint a run starts from.

A training checkpoint is used as it is (its run continues). Any other weights a tool's ``--weights`` reads
is a start from those weights: a published set by name (``torchvision``, ``bvlc_alexnet``, ...: fetched
and checked by ``hub``), a torchvision file, a ``.caffemodel``, a weights file, a plain state dict of a
named arch. Such a start is a checkpoint at epoch 0 with the optimizer at rest (zero momentum)
and the schedule afresh, as pytorch/examples' ``--pretrained``; the model settings the weights fix (arch,
width, classes, LRN, dropout style, crop, mean) must be the run's, else one line says which to set.
"""
from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

from layers import Dropout

from ..checkpoint import CHECKPOINT_KIND, load
from ..config import Config, ConfigError, get
from .caffe import is_caffemodel
from .common import FormatError
from .hub import PUBLISHED, resolve
from .load import load_weights

# The settings a start's weights fix, read off the weights (their arch, shapes and format).
FIXED_BY_WEIGHTS = ("model.arch", "model.width", "model.lrn", "model.dropout_style", "data.crop", "data.mean")


def starting_checkpoint(value: str, cfg: Config, progress: bool) -> tuple[dict, Path]:
    """(checkpoint, its path) for run.resume_from=`value`; ConfigError where the weights need other model
    settings than `cfg`'s, FormatError / CheckpointError for a file that is not usable weights, hub's
    DownloadError where a published set cannot be fetched."""
    path = resolve(value, progress)
    if path.is_dir():
        raise FormatError(f"{path} is a folder; a Theano folder becomes a checkpoint with scripts/convert_weights.py "
                          f"{path} FILE.pt --momentum (then run.resume_from=FILE.pt)")
    state = None
    if not is_caffemodel(path):  # a protobuf is never handed to torch.load
        state = load(path)
        if state.get("kind") == CHECKPOINT_KIND:
            return state, path
    model, info = load_weights(path, loaded=state)  # the file is read once
    return weights_checkpoint(model, info, value, path, cfg), path


def weights_checkpoint(model: nn.Module, info: dict, value: str, path: Path, cfg: Config) -> dict:
    """Trainer.state_dict()'s keys for `model` at epoch 0: the config is `cfg` (checked against what the
    weights fix; its train section, so that any optimizer starts: the trainer takes the optimizer's settings
    from the config, and the zero velocities of training_checkpoint are every optimizer's rest, as a run with
    LARS and LAMB from a .caffemodel showed: the same weights whether the state was SGD's or theirs), the
    schedule afresh, no RNG state (dropout is seeded from the seed), ``source`` naming the weights."""
    from .convert import training_checkpoint  # convert reads every format: imported where it is used

    fixed = {"model.arch": info["arch"], "model.width": float(info["width"]),
             "model.lrn": getattr(model, "lrn", cfg.model.lrn), "model.dropout_style": _dropout_style(model),
             "data.crop": cfg.data.crop if info["arch"] == "owt" else info["crop"],  # owt: an adaptive pool
             "data.mean": info["mean"]}
    start = copy.deepcopy(cfg)
    ours = {key: get(start, key) for key in FIXED_BY_WEIGHTS}
    wrong = [f"{key}={fixed[key]}" for key in FIXED_BY_WEIGHTS if fixed[key] != ours[key]]
    if wrong:
        named = f"{value} ({path})" if value in PUBLISHED else str(path)
        raise ConfigError(f"run.resume_from={named} holds weights for {', '.join(wrong)}; this config has "
                          f"{', '.join(f'{k}={ours[k]}' for k in FIXED_BY_WEIGHTS if fixed[k] != ours[k])}: "
                          f"set {' '.join(wrong)}")
    start.model.num_classes = info["num_classes"]
    source = {"format": info["source"], "file": str(path), "weights_only": True,
              **({"name": value} if value in PUBLISHED else {})}
    return training_checkpoint(model, start, info["num_classes"], source)


def _dropout_style(model: nn.Module) -> str:
    """The style the weights were trained with, as load_weights built their dropout layers (Theano's
    folders: theano; torchvision's and Caffe's: inverted; our files: their config's). Every arch has them."""
    return next(m.style for m in model.modules() if isinstance(m, Dropout))
