"""Config options that change results, each through the path train.py takes (load_config -> loader_spec ->
BatchMaker, or train.main) against a hand computation from the stored files (read with h5py directly),
never against the code's own lists."""
from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from alexnet.config import load_config
from alexnet.distributed import DistInfo
from alexnet.optim import LRSchedule, build_optimizer
from alexnet.replica import MeshLayout
from alexnet.trainer import loader_spec
from data.loader import BatchMaker


def stored_train(root: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each train batch file's images (uint8 N x S x S x 3) and labels, in file order, read with h5py."""
    files = sorted((root / "train").glob("*.h5"))
    assert len(files) >= 3, files
    images, labels = [], []
    for path in files:
        with h5py.File(path, "r") as f:
            images.append(f["images"][...])
            labels.append(f["labels"][...])
    return images, labels


def first_batch(root: Path, *overrides: str) -> tuple[np.ndarray, np.ndarray]:
    """The first training batch train.py would feed the model, with `overrides` on configs/demo.yaml."""
    cfg = load_config("configs/demo.yaml", [f"data.root={root}", "data.crop=56", "train.batch_size=8",
                                             "run.device=cpu", *overrides])
    dist = DistInfo()
    maker = BatchMaker(loader_spec(cfg, dist, MeshLayout(cfg, dist), ("train",)))
    batch = maker.make("train", 0, 0)
    return batch.x.numpy(), batch.y.numpy()


def center(images: np.ndarray, crop: int) -> np.ndarray:
    off = (images.shape[1] - crop) // 2
    return images[:, off:off + crop, off:off + crop]


def find_rows(batch_u8: np.ndarray, files: list[np.ndarray]) -> list[tuple[int, int]]:
    """(file, row) of each batch image, found by exact pixel equality among the stored center crops."""
    crop = batch_u8.shape[1]
    where = []
    for img in batch_u8:
        hits = [(i, r) for i, f in enumerate(files) for r, s in enumerate(center(f, crop)) if np.array_equal(s, img)]
        assert len(hits) == 1, f"{len(hits)} stored images match a batch image"
        where.append(hits[0])
    return where


def test_no_random_crop_no_flip_no_shuffle_gives_the_written_center_crops(train_data):
    """data.random_crop=false, data.flip=false, data.shuffle=false: the first batch is the first 8 stored
    images, center-cropped, minus the same crop of the training mean (the mean of every stored image)."""
    files, labels = stored_train(train_data)
    x, y = first_batch(train_data, "data.random_crop=false", "data.flip=false", "data.shuffle=false",
                       "data.mean=image")
    everything = np.concatenate(files).astype(np.float64)
    mean = everything.mean(axis=0)
    want = center(files[0][:8].astype(np.float64) - mean, 56).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(x, want, atol=1e-3)
    np.testing.assert_array_equal(y, labels[0][:8])


def test_channel_mean_and_std_normalise_as_stated(train_data):
    """data.mean=channel with a stated channel_mean/channel_std: (x / 255 - mean) / std per channel."""
    files, _ = stored_train(train_data)
    m, s = [0.25, 0.5, 0.75], [0.5, 0.25, 0.125]
    x, _ = first_batch(train_data, "data.random_crop=false", "data.flip=false", "data.shuffle=false",
                       "data.mean=channel", f"data.channel_mean={m}", f"data.channel_std={s}")
    want = (center(files[0][:8], 56) / 255.0 - np.array(m)) / np.array(s)
    np.testing.assert_allclose(x, want.transpose(0, 3, 1, 2), atol=1e-5)


def test_flip_mirrors_some_images_and_random_crop_moves_the_window(train_data):
    """data.flip=true (crops centred): each image is its stored center crop or its mirror image, both
    occur; data.random_crop=true (no flip): each is some crop window of its stored image, not all centred."""
    files, _ = stored_train(train_data)
    x, _ = first_batch(train_data, "data.random_crop=false", "data.flip=true", "data.shuffle=false",
                       "data.mean=channel", "data.channel_mean=[0,0,0]", "data.channel_std=[1,1,1]")
    got = np.rint(x.transpose(0, 2, 3, 1) * 255).astype(np.uint8)
    plain = center(files[0][:8], 56)
    flipped = [not np.array_equal(g, p) and np.array_equal(g, p[:, ::-1]) for g, p in zip(got, plain)]
    assert all(f or np.array_equal(g, p) for f, g, p in zip(flipped, got, plain))
    assert 0 < sum(flipped) < 8, flipped

    x, _ = first_batch(train_data, "data.random_crop=true", "data.flip=false", "data.shuffle=false",
                       "data.mean=channel", "data.channel_mean=[0,0,0]", "data.channel_std=[1,1,1]")
    got = np.rint(x.transpose(0, 2, 3, 1) * 255).astype(np.uint8)
    size = files[0].shape[1]
    offsets = []
    for g, stored in zip(got, files[0][:8]):
        hits = [(i, j) for i in range(size - 55) for j in range(size - 55)
                if np.array_equal(stored[i:i + 56, j:j + 56], g)]
        assert hits, "a random crop that is no window of its stored image"
        offsets.append(hits[0])
    assert len(set(offsets)) > 1 and set(offsets) != {((size - 56) // 2,) * 2}, offsets


def test_validation_batches_are_center_crops_whatever_the_training_augmentation(train_data):
    """data.random_crop and data.flip (both on, shuffle on) touch training only: every validation batch is
    the stored validation images in file order, center-cropped and unflipped, minus the same crop of the mean."""
    cfg = load_config("configs/demo.yaml", [f"data.root={train_data}", "data.crop=56", "train.batch_size=8",
                                             "data.val_batch_size=5", "run.device=cpu", "data.random_crop=true",
                                             "data.flip=true", "data.shuffle=true"])
    dist = DistInfo()
    maker = BatchMaker(loader_spec(cfg, dist, MeshLayout(cfg, dist), ("train", "val")))
    stored, labels = [], []
    for path in sorted((train_data / "val").glob("*.h5")):
        with h5py.File(path, "r") as f:
            stored.append(f["images"][...])
            labels.append(f["labels"][...])
    images, labels = np.concatenate(stored), np.concatenate(labels)
    mean = np.load(train_data / "mean.npy").astype(np.float64)
    assert maker.steps("val") == -(-len(images) // 5) > 1
    for step in range(maker.steps("val")):
        batch = maker.make("val", 3, step)
        rows = slice(5 * step, 5 * step + 5)
        want = center(images[rows].astype(np.float64) - mean, 56).transpose(0, 3, 1, 2)
        np.testing.assert_allclose(batch.x.numpy(), want, atol=1e-3)
        np.testing.assert_array_equal(batch.y.numpy(), labels[rows])


@pytest.mark.parametrize("window", [1, 0])
def test_shuffle_window_bounds_where_a_batch_comes_from(train_data, window):
    """data.shuffle_window=1: images are shuffled inside one file only, so batch 0 (8 of a 16-image file)
    comes from one file; 0 (one global permutation): from several files (seed 0; a fixed draw)."""
    files, _ = stored_train(train_data)
    x, _ = first_batch(train_data, "data.random_crop=false", "data.flip=false", "data.shuffle=true",
                       f"data.shuffle_window={window}", "data.mean=channel", "data.channel_mean=[0,0,0]",
                       "data.channel_std=[1,1,1]")
    got = np.rint(x.transpose(0, 2, 3, 1) * 255).astype(np.uint8)
    sources = {i for i, _ in find_rows(got, files)}
    assert (len(sources) == 1) if window == 1 else (len(sources) > 1), sources


def test_bias_lr_and_decay_multipliers():
    """build_optimizer + LRSchedule.apply (what the trainer calls) on a linear layer, one step from zero
    velocity, against the update written out: w -= lr (g + wd w), b -= lr m (g + wd d b)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 3)
    cfg = load_config(None, ["data.root=unused", "train.lr=0.1", "train.weight_decay=0.01", "train.bias_lr_mult=3",
                             "train.bias_decay_mult=2", "train.lr_policy=constant"]).train
    opt = build_optimizer(layer, cfg)
    LRSchedule(cfg, steps_per_epoch=10).apply(opt, 0)
    w0, b0 = layer.weight.detach().clone().double(), layer.bias.detach().clone().double()
    gw, gb = torch.randn(3, 5), torch.randn(3)
    layer.weight.grad, layer.bias.grad = gw.clone(), gb.clone()
    opt.step()
    torch.testing.assert_close(layer.weight.double(), w0 - 0.1 * (gw.double() + 0.01 * w0), rtol=0, atol=1e-6)
    torch.testing.assert_close(layer.bias.double(), b0 - 0.1 * 3 * (gb.double() + 0.01 * 2 * b0), rtol=0, atol=1e-6)
