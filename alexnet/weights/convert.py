"""Theano epochs <-> our files, and Caffe models -> our checkpoints: scripts/convert_weights.py.

Theano -> ours: a training checkpoint when the epoch has its velocities (mom_*, lr_E.npy), so train.py
continues the Theano run, else a weights file. Ours -> Theano: a checkpoint, weights file or caffenet
state dict as an epoch for :func:`alexnet.weights.theano.write_theano`. Only caffenet with the paper's
LRN exports: alexnet normalises before pooling, another function in the Theano network. Caffe -> ours:
a training checkpoint at epoch 0 with zero velocities (a .caffemodel holds no momentum), from which
train.py fine-tunes.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..checkpoint import CHECKPOINT_KIND
from ..config import Config, TrainConfig, from_dict, to_dict
from ..models import build_model
from ..optim import LRSchedule, build_optimizer, param_groups
from .caffe import CAFFE_LRN, caffe_model
from .checkpoint_file import WEIGHTS_KIND
from .common import PAPER_LAYERS, FormatError, check_style, first_few, infer_width, unwrap_state
from .theano import TheanoEpoch, theano_model
from .theano_layout import THEANO_CROP, THEANO_DROPOUT, ours_to_theano, theano_to_ours

# -- Theano -> ours ----------------------------------------------------------------------------------------


def theano_config(te: TheanoEpoch, dropout_style: str) -> Config:
    """The config of a converted Theano epoch: caffenet, its width and classes, crop 227, mean image."""
    cfg = Config()
    cfg.model.arch, cfg.model.width, cfg.model.num_classes = "caffenet", float(te.width), int(te.num_classes)
    cfg.model.dropout, cfg.model.dropout_style = THEANO_DROPOUT, dropout_style
    cfg.data.crop, cfg.data.mean = THEANO_CROP, "image"
    return cfg


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
    if te.velocities is None:
        return {"kind": WEIGHTS_KIND, "version": 1, "model": model.state_dict(), "config": to_dict(cfg),
                "num_classes": te.num_classes, "classes": None, "source": source}
    return training_checkpoint(model, cfg, te.num_classes, source, epoch=te.epoch,
                               velocities=theano_to_ours(te.velocities, conv, dropout_style), next_lr=float(te.lr))


def training_checkpoint(model: torch.nn.Module, cfg: Config, num_classes: int, source: dict, epoch: int = 0,
                        velocities: dict[str, np.ndarray] | None = None, next_lr: float | None = None) -> dict:
    """A training checkpoint of `model` with exactly Trainer.state_dict()'s keys (epoch `epoch` completed,
    step 0, no RNG state: the trainer reseeds dropout deterministically), plus ``source`` and, if given,
    ``next_lr``. velocities: our key -> PaperSGD's velocity (default zero)."""
    optimizer = build_optimizer(model, TrainConfig())
    if velocities is not None:
        names = {id(p): k for k, p in model.named_parameters()}
        ordered = [p for group in optimizer.param_groups for p in group["params"]]
        for p, v in zip(ordered, optimizer.velocities()):
            v.copy_(torch.from_numpy(velocities[names[id(p)]]))
    # best_top1_err stays inf: a converted run's own errors (Theano's validation: per-batch averages over
    # its files) are not comparable with this code's, and best.pt should compare like with like.
    out = {"kind": CHECKPOINT_KIND, "version": 1, "model": model.state_dict(), "config": to_dict(cfg),
           "num_classes": num_classes, "classes": None, "image_size": None, "resize": None,
           "optimizer": optimizer.state_dict(),
           "schedule": {"auto_factor": 1.0, "auto_last_drop": 0, "val_history": []},
           "epoch": epoch, "step": 0, "global_step": 0, "global_batch": 256, "best_top1_err": math.inf,
           "elapsed": 0.0, "meter": torch.zeros(4, dtype=torch.float64), "rng": [], "world": 1, "source": source}
    if next_lr is not None:
        out["next_lr"] = next_lr
    return out


# -- Caffe -> ours -----------------------------------------------------------------------------------------


def caffe_checkpoint(path, arch: str | None = None) -> dict:
    """Our training checkpoint of a .caffemodel: its arch and width, Caffe's LRN, crop 227 (from fc6), mean
    image, epoch 0 with zero velocities (train.py fine-tunes from it; the lr schedule starts afresh)."""
    model, info, version = caffe_model(path, arch)
    cfg = Config()
    cfg.model.arch, cfg.model.width, cfg.model.num_classes = info["arch"], info["width"], info["num_classes"]
    cfg.model.lrn, cfg.data.crop, cfg.data.mean = CAFFE_LRN, info["crop"], "image"
    source = {"format": "caffe", "file": str(path), "version": version}
    return training_checkpoint(model, cfg, info["num_classes"], source)


# -- ours -> Theano ----------------------------------------------------------------------------------------


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
        _check_momentum_state(obj, cfg, path)
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
    if m.lrn != "paper":
        raise FormatError(f"{path} was trained with model.lrn={m.lrn} (Caffe's LRN); the Theano network computes "
                          "the paper's (k=2, alpha not divided by n), so its weights would compute another function")
    if dropout_style is not None and dropout_style != m.dropout_style:
        raise FormatError(f"{path} was trained with model.dropout_style={m.dropout_style}, not {dropout_style}; "
                          "omit --dropout-style")
    if m.dropout != THEANO_DROPOUT:
        warn(f"note: {path} was trained with model.dropout={m.dropout}; the Theano network drops with p=0.5 "
             "(x0.5 at test time): the weights are written as they are")
    return unwrap_state(path, obj["model"]), m.dropout_style, cfg


def _state_source(obj: dict, path, arch: str | None, dropout_style: str | None) -> tuple[dict, str]:
    state = unwrap_state(path, obj)
    if "features.0.weight" in state:
        raise FormatError(f"{path} holds torchvision AlexNet weights (arch owt: other layers, no LRN, no groups); "
                          "the Theano network is caffenet")
    if any(k.endswith(".running_mean") for k in state):  # batch-norm statistics: an alexnet_bn state dict
        arch = "alexnet_bn"
    if arch is None:
        raise FormatError(f"{path} is a plain state_dict: its keys fit alexnet and caffenet, which differ in "
                          "layer order; pass --arch caffenet if it is one")
    _check_exportable(path, arch, None)
    style = dropout_style or "inverted"  # build_model's default, so a plain state dict's most likely
    check_style(style)
    return state, style


def _check_exportable(path, arch: str, asked: str | None) -> None:
    if asked is not None and asked != arch:
        raise FormatError(f"{path} is a checkpoint of arch {arch!r}, not {asked!r}; omit --arch")
    if arch == "alexnet_bn":  # its running statistics have no place in the Theano files
        raise FormatError(f"{path} holds arch 'alexnet_bn' (batch norm): only caffenet is the Theano network, "
                          "whose files hold no batch-norm statistics; alexnet_bn cannot be exported to Theano")
    if arch != "caffenet":
        raise FormatError(f"{path} holds arch {arch!r}; only caffenet is the Theano network (conv, ReLU, max-pool, "
                          "then LRN): alexnet normalises before pooling and owt has other layers, so their "
                          "weights would compute another function there")


def _check_momentum_state(obj: dict, cfg: Config, path) -> None:
    """FormatError for a checkpoint holding LAMB's optimizer state: the Theano files hold momentum velocities
    only (mom_*). LARS keeps PaperSGD's velocity, so it exports as SGD's; a weights file has no state."""
    state = (obj.get("optimizer") or {}).get("state") or {}
    if not state:
        return
    if cfg.train.optimizer == "lamb" or any("exp_avg" in s for s in state.values() if isinstance(s, dict)):
        raise FormatError(f"{path} holds the state of train.optimizer=lamb (Adam's moments, not momentum "
                          "velocities); the Theano files hold momentum velocities only (mom_*), so a LAMB "
                          "checkpoint cannot be exported to Theano")


def _theano_fit(state: dict, path) -> tuple[float, int]:
    """(width, classes) of a caffenet state dict that fits the Theano network (crop 227), else FormatError."""
    if "classifier.fc8.weight" not in state:
        raise FormatError(f"{path}: no classifier.fc8.weight (keys {first_few(list(state))})")
    num_classes = int(state["classifier.fc8.weight"].shape[0])
    try:
        return infer_width(path, "caffenet", state, num_classes, THEANO_CROP, PAPER_LAYERS), num_classes
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
