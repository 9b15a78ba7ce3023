"""What ``run.resume_from`` names, as the training checkpoint a run starts from.

A training checkpoint is used as it is (its run continues). Any other weights a tool's ``--weights`` reads
is a start from those weights: a published set by name (``torchvision``, ``bvlc_alexnet``, ...: fetched
and checked by ``hub``), a torchvision file, a ``.caffemodel``, a weights file, a plain state dict of a
named arch. Such a start is a checkpoint at epoch 0 with the optimizer at rest (zero momentum)
and the schedule afresh, as pytorch/examples' ``--pretrained``; the model settings the weights fix (arch,
width, classes, LRN, dropout style, crop, mean) must be the run's, else one line says which to set.
With ``run.new_classifier``, the weights (a training checkpoint's too) are fine-tuned on other classes:
the last layer is a new one for the data's classes, the rest is the weights', as timm's
``pretrained=True, num_classes=N``.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from layers import Dropout

from ..checkpoint import CHECKPOINT_KIND, load
from ..config import Config, ConfigError, get
from ..models import THEANO_INIT
from .caffe import is_caffemodel
from .common import FormatError
from .hub import PUBLISHED, resolve
from .load import load_weights

# The settings a start's weights fix, read off the weights (their arch, shapes and format).
FIXED_BY_WEIGHTS = ("model.arch", "model.width", "model.lrn", "model.dropout_style", "data.crop", "data.mean")


def starting_checkpoint(value: str, cfg: Config, progress: bool, classes: int | None = None) -> tuple[dict, Path]:
    """(checkpoint, its path) for run.resume_from=`value` (`classes`: the data's, for run.new_classifier);
    ConfigError where the weights need other model settings than `cfg`'s, FormatError / CheckpointError for a
    file that is not usable weights, hub's DownloadError where a published set cannot be fetched."""
    path = resolve(value, progress)
    if path.is_dir():
        raise FormatError(f"{path} is a folder; a Theano folder becomes a checkpoint with scripts/convert_weights.py "
                          f"{path} FILE.pt --momentum (then run.resume_from=FILE.pt)")
    state = None
    if not is_caffemodel(path):  # a protobuf is never handed to torch.load
        state = load(path)
        if state.get("kind") == CHECKPOINT_KIND and not cfg.run.new_classifier:
            return state, path
    model, info = load_weights(path, loaded=state)  # the file is read once
    if cfg.run.new_classifier:
        if classes is None:
            raise ValueError("run.new_classifier needs the data's class count")
        info = {**info, "num_classes": classes, "classes_before": info["num_classes"]}
        new_classifier_(model, classes, cfg)
    return weights_checkpoint(model, info, value, path, cfg), path


def new_classifier_(model: nn.Module, classes: int, cfg: Config) -> None:
    """Replace `model`'s last linear layer (fc8) by a new one for `classes` classes, initialised as a fresh
    model's is (model.init) from train.seed alone, so that every process of a run draws the same one."""
    owner, name, last = [(m, n, c) for m in model.modules() for n, c in m.named_children()
                         if isinstance(c, nn.Linear)][-1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        fresh = nn.Linear(last.in_features, classes)  # torch's init; float32, as the trainer's model
        if cfg.model.init == "paper":
            init = getattr(model, "paper_init", THEANO_INIT)
            nn.init.normal_(fresh.weight, 0.0, init.fc_std[-1])
            nn.init.constant_(fresh.bias, init.fc_bias[-1])
    setattr(owner, name, fresh)


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
              **({"name": value} if value in PUBLISHED else {}),
              **({"new_classifier": {"classes_before": info["classes_before"]}} if "classes_before" in info else {})}
    return training_checkpoint(model, start, info["num_classes"], source)


def _dropout_style(model: nn.Module) -> str:
    """The style the weights were trained with, as load_weights built their dropout layers (Theano's
    folders: theano; torchvision's and Caffe's: inverted; our files: their config's). Every arch has them."""
    return next(m.style for m in model.modules() if isinstance(m, Dropout))
