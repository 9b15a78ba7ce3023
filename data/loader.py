"""Turning batch files into ready device batches.

:class:`BatchMaker` is the one piece of code that prepares a batch: read the replica's share of a step
from the batch files into the staging ring (:mod:`data.staging`: pinned host memory on a GPU), copy the
images, labels and crop parameters to the device together, and crop, flip and subtract the mean there.
The loaders only decide *where* it runs: ``inline`` calls it in the trainer between steps; ``thread``
and ``process`` (:mod:`data.slot_loader`) run it concurrently with the trainer and hand over the result
in shared device memory.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from .augment import CropSpec, Normalizer, center_crops, train_crops
from .reader import BatchReader, SplitData
from .staging import StagingRing


@dataclass(frozen=True)
class LoaderSpec:
    """Everything a loader needs, as plain data (it crosses process boundaries)."""

    root: str
    batch_size: int
    val_batch_size: int
    crop: int
    rank: int = 0
    world: int = 1
    seed: int = 0
    shuffle: bool = True
    shuffle_window: int = 16
    random_crop: bool = True
    flip: bool = True
    mean: str = "image"
    channel_mean: tuple = (0.485, 0.456, 0.406)
    channel_std: tuple = (0.229, 0.224, 0.225)
    device: str = "cpu"
    channels_last: bool = False
    splits: tuple = field(default=("train", "val"))
    keep_empty: bool = False  # yield the empty last batches of a split too (every process must take part
                              # in every step of a model-parallel group)


@dataclass
class Batch:
    """One prepared batch: float images N x 3 x crop x crop and int64 labels, on the device."""

    x: torch.Tensor
    y: torch.Tensor
    step: int

    @property
    def n(self) -> int:
        return int(self.y.shape[0])


@dataclass
class HostBatch:
    """One batch read on the host (into the staging ring's slot on a GPU), with its crops."""

    images: np.ndarray  # uint8 N x S x S x 3
    labels: np.ndarray  # int64 N
    crops: CropSpec

    @property
    def n(self) -> int:
        return len(self.labels)


def make_readers(spec: LoaderSpec) -> dict[str, BatchReader]:
    """This replica's reader of each split: train shuffled and cut to whole global batches, val exact."""
    readers = {}
    for split in spec.splits:
        train = split == "train"
        readers[split] = BatchReader(
            SplitData(spec.root, split), spec.batch_size if train else spec.val_batch_size, rank=spec.rank,
            world=spec.world, shuffle=spec.shuffle and train, seed=spec.seed, window=spec.shuffle_window,
            drop_last=train)
    return readers


def count_steps(spec: LoaderSpec) -> dict[str, int]:
    """Steps per epoch of each split (reads meta.json only)."""
    return {split: r.steps_per_epoch() for split, r in make_readers(spec).items()}


class BatchMaker:
    """Reads and prepares the batches of one replica (see the module docstring)."""

    def __init__(self, spec: LoaderSpec):
        self.spec = spec
        self.device = torch.device(spec.device)
        self.readers = make_readers(spec)
        first = next(iter(self.readers.values())).data
        self.size = first.image_size
        mean_image = first.mean_image() if spec.mean == "image" else None
        self.normalize = Normalizer(spec.mean, mean_image, spec.channel_mean, spec.channel_std, self.device)
        self.ring = StagingRing(self.device, max(spec.batch_size, spec.val_batch_size), self.size)

    def steps(self, split: str) -> int:
        return self.readers[split].steps_per_epoch()

    def crops(self, split: str, epoch: int, positions: np.ndarray) -> CropSpec:
        s = self.spec
        if split == "train":
            return train_crops(s.seed, epoch, positions, self.size, s.crop, s.random_crop, s.flip)
        return center_crops(len(positions), self.size, s.crop)

    def read(self, split: str, epoch: int, step: int) -> HostBatch:
        """Host side: this replica's share of `step`, read into the ring's next slot, and its crops."""
        reader = self.readers[split]
        positions = reader.positions(step)
        images, labels = reader.data.read(reader.order(epoch)[positions], out=self.ring.host_images(len(positions)))
        return HostBatch(images, labels, self.crops(split, epoch, positions))

    def to_device(self, host: HostBatch, out: torch.Tensor | None = None, before_write=None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device side: upload, then crop, flip and normalise into `out` (or a new tensor).

        `before_write` runs between the upload and the first write into `out` (the loader makes its
        stream wait there until the trainer has freed the slot, so the upload need not wait too).
        """
        staged = self.ring.upload(host.images, host.labels, host.crops)
        if before_write is not None:
            before_write()
        x = self.normalize(staged.images, host.crops, self.spec.crop, out=out, indices=staged.crops)
        if out is None and not self.spec.channels_last:
            x = x.contiguous()
        return x, staged.labels

    def make(self, split: str, epoch: int, step: int) -> Batch:
        x, y = self.to_device(self.read(split, epoch, step))
        return Batch(x, y, step)


class InlineLoader:
    """``data.loading: inline``: each batch is prepared in the trainer, right before its step.

    The paper's "parallel loading: no" row: reading and preparing the next batch does not overlap
    with computing the current one.
    """

    def __init__(self, spec: LoaderSpec):
        self.maker = BatchMaker(spec)

    def steps(self, split: str) -> int:
        return self.maker.steps(split)

    def batches(self, split: str, epoch: int, start: int = 0) -> Iterator[Batch]:
        for step in range(start, self.steps(split)):
            batch = self.maker.make(split, epoch, step)
            if batch.n or self.maker.spec.keep_empty:
                yield batch

    def close(self) -> None:
        """Nothing to stop: no thread or process works for the inline loader."""
