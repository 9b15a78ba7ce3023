"""Checks before the first step: the data folder, the config against the data, a resumed checkpoint
against both. Everything here is the same on every rank, so train.py runs it once, in the process
that launches the replicas, before any of them starts (under torchrun: on every rank).
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import torch

from data.domains import dataset_above
from data.layouts import DataError
from data.meta import check_files, class_difference, read_meta

from .checkpoint import CHECKPOINT_KIND, CheckpointDir, CheckpointError
from .config import Config, ConfigError, to_dict
from .distributed import DistInfo
from .model_parallel import sharding_problem
from .models import build_model
from .replica import MeshLayout
from .weights.common import FormatError
from .weights.hub import resolve, to_fetch
from .weights.start import starting_checkpoint

# Keys a checkpoint and the current config must agree on to resume (the model's shape and the data).
RESUME_KEYS = ("model.arch", "model.width", "model.num_classes", "model.dropout_style", "model.lrn", "data.crop",
               "data.mean")


def resolve_num_classes(cfg: Config, meta: dict) -> int:
    """The number of classes (the dataset's); ConfigError if the config disagrees or the crop cannot fit."""
    data_classes = int(meta["num_classes"])
    if cfg.model.num_classes is not None and cfg.model.num_classes != data_classes:
        raise ConfigError(f"model.num_classes={cfg.model.num_classes} but {cfg.data.root} has {data_classes} "
                          "classes; remove model.num_classes to use the dataset's")
    if cfg.data.crop > int(meta["image_size"]):
        raise ConfigError(f"data.crop={cfg.data.crop} is larger than the images of {cfg.data.root} "
                          f"({meta['image_size']}x{meta['image_size']})")
    return data_classes


def check_run(cfg: Config, world: int, dry: bool = False) -> dict:
    """Everything a run of `world` processes needs from the data and the config, checked before any
    replica starts, and a published run.resume_from fetched (not in a `dry` run); returns meta.json.
    DataError / ConfigError (exit 2), OSError for the run.dir or a fetch."""
    meta = read_meta(cfg.data.root)
    splits = ("train", "val") if "val" in meta["splits"] else ("train",)
    check_files(cfg.data.root, meta, splits, mean=cfg.data.mean == "image")
    classes = resolve_num_classes(cfg, meta)
    try:
        with torch.device("meta"):  # shapes only: no memory, no random numbers
            full = build_model(cfg.model.arch, classes, cfg.model.width, cfg.model.dropout, cfg.data.crop, "torch")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.parallel.model_size > 1:
        problem = sharding_problem(cfg.parallel.model, cfg.model.arch, cfg.parallel.model_size, full)
        if problem:
            raise ConfigError(problem)
    layout = MeshLayout(cfg, DistInfo(world=world, model_size=cfg.parallel.model_size))
    n = meta["splits"]["train"]["count"]
    if n < layout.global_batch:
        raise DataError(f"{Path(cfg.data.root) / 'train'} holds {n} images, fewer than one global batch "
                        f"({layout.global_batch} = {layout.reader_world} x {layout.reader_batch}); lower "
                        "train.batch_size or parallel.replicas")
    _check_free_space(cfg, classes, _checkpoint_bytes(full))
    if not dry and cfg.run.resume_from and not run_checkpoints(cfg).exists():
        try:  # a published set is fetched once here, with its bar, before any replica starts
            resolve(cfg.run.resume_from, progress=cfg.run.progress)
        except FormatError as e:
            raise DataError(f"run.resume_from: {e}") from None
    return meta


def check_apart(cfg: Config) -> None:
    """run.dir in data.root (or it), or in another preprocessed output: the run's files would lie among the
    data's, which holds only what preprocess wrote (a later preprocess or upgrade_data of it refuses the
    folder, naming them). Before run.dir is locked (which makes the folder)."""
    run, data = Path(cfg.run.dir).resolve(), Path(cfg.data.root).resolve()
    root = data if run == data or data in run.parents else dataset_above(run)
    if root is not None:
        name = f"data.root={cfg.data.root}" if root == data else f"the preprocessed output {root}"
        raise ConfigError(f"run.dir={cfg.run.dir} is {'' if run == root else 'inside '}{name}: the run's files "
                          "would lie among the data's; name a folder outside it")


def run_checkpoints(cfg: Config) -> CheckpointDir:
    """run.dir's checkpoints: where a run saves, and resumes from (run.resume_from is then not read)."""
    return CheckpointDir(Path(cfg.run.dir) / "checkpoints", cfg.run.keep_last)


def newest_own(ckpt: CheckpointDir, warn) -> tuple[dict | None, Path | None]:
    """The newest checkpoint of `ckpt` that loads (`warn` told of each skipped), (None, None) where it has
    none; a DataError naming every file where none loads. What a run resumes from, and what its dry run
    names: one function, so the two cannot differ."""
    if not ckpt.exists():
        return None, None
    try:
        return ckpt.load_newest(warn)
    except CheckpointError as e:
        raise DataError(str(e)) from None


def resume_position(cfg: Config, meta: dict, state: dict, path: Path, global_batch: int,
                    steps_per_epoch: int) -> tuple[int, list[str]]:
    """Everything a resume checks of `state` before it uses it: a training checkpoint of this repository,
    of this data and model (check_resume), stopped where this run's steps can take it up (resume_step).
    (Its step in this run's epoch, the changes to report.) The run and its dry run both call it."""
    if state.get("kind") != CHECKPOINT_KIND:
        raise DataError(f"{path} is not a training checkpoint of this repository")
    changes = check_resume(cfg, meta, state, path, global_batch)
    return resume_step(state, path, global_batch, steps_per_epoch), changes


def resume_step(state: dict, path: Path, global_batch: int, steps_per_epoch: int) -> int:
    """The checkpoint's position in this run's steps (the global batch may have changed)."""
    samples = state["step"] * state.get("global_batch", global_batch)
    if samples % global_batch:
        raise ConfigError(f"{path} stopped {samples} images into epoch {state['epoch'] + 1}, not a "
                          f"multiple of the global batch {global_batch} (replicas x batch changed); "
                          "resume with a global batch that divides it, or from an epoch checkpoint")
    step = samples // global_batch
    # step == steps_per_epoch: stopped after the epoch's last step, before its validation and epoch
    # checkpoint; resuming runs no batch of that epoch and goes straight to them.
    if step > steps_per_epoch:
        raise ConfigError(f"{path} stopped at step {step} of an epoch, but an epoch now has "
                          f"{steps_per_epoch} steps (batch size or data changed)")
    return step


def load_start(cfg: Config, meta: dict, progress: bool) -> tuple[dict, Path]:
    """(checkpoint, path) of run.resume_from (weights.start: a checkpoint, or weights as a start, with a new
    last layer for `meta`'s classes under run.new_classifier); a file that is not one is a DataError naming
    the key."""
    try:
        return starting_checkpoint(cfg.run.resume_from, cfg, progress, resolve_num_classes(cfg, meta))
    except (CheckpointError, FormatError) as e:
        raise DataError(f"run.resume_from: {e}") from None


def describe_start(cfg: Config, meta: dict, global_batch: int, steps_per_epoch: int, warn) -> str:
    """A dry run's words on where the run starts: run.dir's newest checkpoint, or run.resume_from checked as
    a start checks it ("" for a fresh start); a published set not fetched yet is not fetched."""
    state, path = newest_own(run_checkpoints(cfg), warn)
    if state is not None:
        step, changes = resume_position(cfg, meta, state, path, global_batch, steps_per_epoch)
        return (f"; would resume from {path} at epoch {state['epoch'] + 1}, step {step} (run.dir's newest "
                "checkpoint that loads; run.resume_from is not read)" + "".join(f"; changed on resume: {c}"
                                                                                 for c in changes))
    if not cfg.run.resume_from:
        return ""
    fetched = to_fetch(cfg.run.resume_from)
    if fetched:
        return f"; run.resume_from={cfg.run.resume_from}: would fetch {fetched[0]} into {fetched[1]}"
    state, path = load_start(cfg, meta, progress=False)
    step, changes = resume_position(cfg, meta, state, path, global_batch, steps_per_epoch)
    source = state.get("source", {})
    what = "the weights of " if source.get("weights_only") else ""
    return (f"; would start from {what}{path}{new_classifier_words(state)} at epoch {state['epoch'] + 1}, "
            f"step {step}" + "".join(f"; changed on resume: {c}" for c in changes))


def new_classifier_words(state: dict) -> str:
    """" with a new last layer for N classes (the weights': M)" for a start under run.new_classifier."""
    new = state.get("source", {}).get("new_classifier")
    if new is None:
        return ""
    return f" with a new last layer for {state['num_classes']} classes (the weights': {new['classes_before']})"


def _checkpoint_bytes(model: torch.nn.Module) -> int:
    """One checkpoint of `model`: its weights and velocities in float32."""
    return 2 * 4 * sum(p.numel() for p in model.parameters())


def _check_free_space(cfg: Config, classes: int, need: int) -> None:
    """OSError(ENOSPC) if not even one checkpoint fits on run.dir's disk, saying how big it is and how much
    is free; ConfigError naming model.width where the width is why (at width 1 it would fit)."""
    run_dir = folder = Path(cfg.run.dir)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free >= need:
        return
    what = (f"a checkpoint needs {_size(need)}, {_size(free)} free ({cfg.model.arch} at model.width="
            f"{cfg.model.width:g}: weights and velocities in float32)")
    if cfg.model.width > 1:
        with torch.device("meta"):
            paper = build_model(cfg.model.arch, classes, 1.0, cfg.model.dropout, cfg.data.crop, "torch")
        if _checkpoint_bytes(paper) <= free:
            raise ConfigError(f"model.width={cfg.model.width:g} is too wide for the disk of {run_dir}: {what}; "
                              "lower model.width")
    raise OSError(errno.ENOSPC, f"disk full: {what}", str(run_dir))


def _size(n: int) -> str:
    """Bytes in binary units: "2.5 MiB", "5.6 TiB"."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    k = min(len(units) - 1, max(0, (int(n).bit_length() - 1) // 10))
    return f"{n / 1024**k:.1f} {units[k]}"


def check_resume(cfg: Config, meta: dict, state: dict, path: Path, global_batch: int | None = None) -> list[str]:
    """Refuse a checkpoint trained on other data (classes, image size) or another model shape; return
    the other changed keys as "key old -> new" (the config the checkpoint was written with vs now), and
    the global batch where this run's (`global_batch`) is not the checkpoint's."""
    classes = state.get("classes")
    if classes is not None and list(classes) != list(meta["classes"]):
        raise DataError(f"{path} was trained on other classes than those of {cfg.data.root} "
                        f"({class_difference(list(classes), list(meta['classes']))}); use another run.dir, "
                        f"or the same data{_fine_tune_hint(cfg, path)}")
    count = state.get("num_classes")
    if count is not None and int(count) != int(meta["num_classes"]):
        raise DataError(f"{path} holds weights for {count} classes, {cfg.data.root} has {meta['num_classes']}; "
                        f"use the data they were trained on{_fine_tune_hint(cfg, path)}")
    size = state.get("image_size")
    if size is not None and size != meta["image_size"]:
        raise DataError(f"{path} was trained on {size}x{size} images, {cfg.data.root} holds "
                        f"{meta['image_size']}x{meta['image_size']}; use another run.dir, or the same data")
    was, now = _flat(to_dict(Config())), _flat(to_dict(cfg))
    was.update(_flat(state["config"]))  # keys an older checkpoint lacks had their defaults
    changed = [key for key in now if key in was and was[key] != now[key]]
    if "train.optimizer" in changed:  # the state of one (velocities, Adam moments) means nothing to another
        raise ConfigError(f"{path} was trained with train.optimizer={was['train.optimizer']}, this config has "
                          f"train.optimizer={now['train.optimizer']}: the optimizer state does not carry over; use "
                          "another run.dir or the same optimizer")
    for key in RESUME_KEYS:
        if key in changed and not (key == "model.num_classes" and now[key] is None):
            raise ConfigError(f"{path} was trained with {key}={was[key]!r}, this config has {now[key]!r}; use "
                              "another run.dir or the same setting")
    changes = [f"{key} {was[key]!r} -> {now[key]!r}" for key in changed if key not in RESUME_KEYS]
    old = state.get("global_batch")  # a converted checkpoint's ("source": not a run of ours) means nothing
    if global_batch is not None and old is not None and old != global_batch and "source" not in state:
        changes.append(f"global batch {old} -> {global_batch}{_fc_batch_hint(cfg, changed, old, global_batch)}")
    return changes


def _fine_tune_hint(cfg: Config, path: Path) -> str:
    """How to fine-tune weights on other classes, where `path` is run.resume_from's (not run.dir's own)."""
    if not cfg.run.resume_from or Path(path).resolve().parent == (Path(cfg.run.dir) / "checkpoints").resolve():
        return ""
    return (", or set run.new_classifier=true to fine-tune them with a new last layer for its classes "
            "(a new run.dir)")


def _fc_batch_hint(cfg: Config, changed: list[str], old: int, new: int) -> str:
    """Why an fc checkpoint made before 2026-11-28 resumes with 1/M of its batch under the same config:
    train.batch_size was then per process in fc, and is now a replica's batch in every layout."""
    p = cfg.parallel
    if p.model != "fc" or "train.batch_size" in changed or old != new * p.model_size:
        return ""
    return (f" (train.batch_size is a replica's batch in every layout; fc read it per process before 2026-11-28: "
            f"train.batch_size={cfg.train.batch_size * p.model_size} keeps this checkpoint's global batch)")


def _flat(sections: dict) -> dict:
    return {f"{s}.{k}": v for s, keys in sections.items() if isinstance(keys, dict) for k, v in keys.items()}
