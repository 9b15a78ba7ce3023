"""alexnet/preflight.py's checks at their edges: which changed settings a resume refuses (each setting that
changes the model's shape or what its input means: the checkpoint's weights would not fit it, or would see
other numbers) and which it only reports, a training split of exactly one global batch (allowed) or one
image short of it (refused), and a batch file one byte shorter than its images (refused by its size, before
HDF5 reads it)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from alexnet.config import ConfigError, load_config, to_dict
from alexnet.preflight import check_resume, check_run
from data.layouts import DataError
from data.meta import check_files, read_meta
from tests.conftest import tiny_overrides

# each setting a checkpoint's weights depend on, and another value of it
REFUSED = {"model.arch": "caffenet", "model.width": 0.25, "model.num_classes": 5, "model.dropout_style": "theano",
           "model.lrn": "caffe", "data.crop": 63, "data.mean": "channel"}
REPORTED = {"train.lr": 0.02, "data.flip": False, "train.val_every": 3, "run.keep_last": 1}


def _cfg(root: Path, run: Path, **extra):
    return load_config("configs/demo.yaml", tiny_overrides(root, run, **extra))


@pytest.mark.parametrize("key", list(REFUSED))
def test_a_resume_refuses_a_change_of_the_models_shape_or_input(train_data, tmp_path, key):
    meta = json.loads((train_data / "meta.json").read_text())
    state = {"config": to_dict(_cfg(train_data, tmp_path)), "classes": meta["classes"],
             "image_size": meta["image_size"]}
    now = _cfg(train_data, tmp_path, **{key: REFUSED[key]})
    with pytest.raises(ConfigError, match=f"was trained with {key}="):
        check_resume(now, meta, state, tmp_path / "last.pt")


def test_a_resume_reports_the_other_changes(train_data, tmp_path):
    meta = json.loads((train_data / "meta.json").read_text())
    state = {"config": to_dict(_cfg(train_data, tmp_path)), "classes": meta["classes"],
             "image_size": meta["image_size"]}
    changes = check_resume(_cfg(train_data, tmp_path, **REPORTED), meta, state, tmp_path / "last.pt")
    assert sorted(changes) == sorted(["train.lr 0.01 -> 0.02", "data.flip True -> False", "train.val_every 1 -> 3",
                                      "run.keep_last 3 -> 1"])


def test_a_resume_reports_another_global_batch_and_why_for_an_old_fc_checkpoint(train_data, tmp_path):
    """An fc checkpoint written when train.batch_size was per process (global 2 x 8 = 16 with 1 replica of 2
    processes) resumed under the same config now trains a global batch of 8: said, with the batch that keeps
    16. Columns, or an fc config whose batch changed too, get the change without the hint."""
    meta = json.loads((train_data / "meta.json").read_text())
    fc = {"parallel.model": "fc", "parallel.model_size": 2}
    state = {"config": to_dict(_cfg(train_data, tmp_path, **fc)), "classes": meta["classes"],
             "image_size": meta["image_size"], "global_batch": 16}
    assert check_resume(_cfg(train_data, tmp_path, **fc), meta, state, tmp_path / "last.pt", 16) == []
    assert check_resume(_cfg(train_data, tmp_path, **fc), meta, state, tmp_path / "last.pt") == []
    assert check_resume(_cfg(train_data, tmp_path, **fc), meta, state, tmp_path / "last.pt", 8) == [
        "global batch 16 -> 8 (train.batch_size is a replica's batch in every layout; fc read it per process "
        "before 2026-11-28: train.batch_size=16 keeps this checkpoint's global batch)"]
    columns = {"parallel.model": "columns", "parallel.model_size": 2}
    state["config"] = to_dict(_cfg(train_data, tmp_path, **columns))
    assert check_resume(_cfg(train_data, tmp_path, **columns), meta, state, tmp_path / "last.pt", 8) == [
        "global batch 16 -> 8"]
    assert check_resume(_cfg(train_data, tmp_path, **columns), meta, {**state, "source": {"format": "caffe"}},
                        tmp_path / "last.pt", 8) == []  # converted weights: their 256 was never a batch of ours
    state["config"] = to_dict(_cfg(train_data, tmp_path, **fc))
    assert check_resume(_cfg(train_data, tmp_path, **fc, **{"train.batch_size": 4}), meta, state,
                        tmp_path / "last.pt", 8) == ["train.batch_size 8 -> 4", "global batch 16 -> 8"]  # 2 replicas


def test_exactly_one_global_batch_of_training_images_is_enough(train_data, tmp_path):
    """`train_data` holds 48 training images: 6 replicas x 8 is one global batch, 1 x 48 too; 7 x 7 is not."""
    for replicas, batch in ((6, 8), (1, 48)):
        cfg = _cfg(train_data, tmp_path / "run", **{"parallel.replicas": replicas, "train.batch_size": batch})
        assert check_run(cfg, replicas)["splits"]["train"]["count"] == 48
    cfg = _cfg(train_data, tmp_path / "run", **{"parallel.replicas": 7, "train.batch_size": 7})
    with pytest.raises(DataError, match="holds 48 images, fewer than one global batch"):
        check_run(cfg, 7)


def test_a_batch_file_shorter_than_its_images_is_named_by_its_size(train_data, tmp_path):
    """16 images of 72 x 72 x 3 need 248,832 bytes: a file cut to one byte less is refused saying so."""
    root = tmp_path / "data"
    shutil.copytree(train_data, root)
    path = root / "train" / "00001.h5"
    with open(path, "r+b") as f:
        f.truncate(16 * 72 * 72 * 3 - 1)
    with pytest.raises(DataError) as e:
        check_files(root, read_meta(root), ("train", "val"))
    assert str(e.value) == f"{path}: 248831 bytes, but 16 images of 72x72 need at least 248832 (truncated?)"
