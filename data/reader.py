"""Read preprocessed batch files: a split as one indexable array, and a sharded, seeded batch order.

The order of one epoch is a pure function of (seed, epoch): every replica computes the same global
order and takes its own share of each step, so no coordination is needed, and starting at step k is
exactly the same as reading and dropping k steps (exact resume). Global step s covers the positions
``[s*W*B, (s+1)*W*B)`` of the epoch order (W replicas of batch B); replica r reads
``[s*W*B + r*B, s*W*B + (r+1)*B)``. With shuffling off the W shares of one step are therefore the very
images one replica with batch W*B would get, in the same order.

Shuffling permutes the file order every epoch and then the images inside windows of
``shuffle_window`` consecutive files (0: one global permutation). Since preprocessing already spread
the training images over the files at random, windows give well-mixed batches while reads stay
within a few files at a time.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from .batchfile import FORMAT_VERSION, BatchFileError, open_batch_file
from .layouts import DataError


def load_meta(root: str | os.PathLike) -> dict:
    """meta.json of a finished preprocessing output, with a clear error for anything else."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data root {root} does not exist (set data.root to a preprocessed folder)")
    path = root / "meta.json"
    if not path.is_file():
        raise DataError(f"{root} is not a finished preprocessing output: {path} is missing "
                        "(run scripts/preprocess.py, or re-run it to finish)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: format_version {meta.get('format_version')}, this code reads {FORMAT_VERSION}")
    return meta


class SplitData:
    """One split of a preprocessed folder, indexable by global image index (file order, row order).

    File handles are opened lazily and per process (a handle must not cross a fork), at most
    `max_open` at a time.
    """

    def __init__(self, root: str | os.PathLike, split: str, max_open: int = 64):
        self.root = Path(root)
        self.split = split
        self.meta = load_meta(root)
        if split not in self.meta["splits"]:
            raise DataError(f"{self.root} has no {split!r} split (has: {', '.join(self.meta['splits'])})")
        files = self.meta["splits"][split]["files"]
        self.paths = [self.root / split / f["name"] for f in files]
        self.counts = np.array([f["count"] for f in files], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self.image_size = int(self.meta["image_size"])
        self.num_classes = int(self.meta["num_classes"])
        self._max_open = max_open
        self._open: OrderedDict[int, h5py.File] = OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state

    def mean_image(self) -> np.ndarray:
        """The training mean image (float32, H x W x 3) written beside meta.json."""
        path = self.root / self.meta.get("mean", "mean.npy")
        try:
            mean = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot read the mean image ({e})") from None
        if mean.shape != (self.image_size, self.image_size, 3):
            raise DataError(f"{path}: shape {mean.shape}, expected {(self.image_size, self.image_size, 3)}")
        return mean.astype(np.float32)

    def _file(self, i: int) -> h5py.File:
        if self._pid != os.getpid():  # forked: the parent's handles are not ours
            self._open, self._pid = OrderedDict(), os.getpid()
        f = self._open.get(i)
        if f is None:
            f = open_batch_file(self.paths[i], int(self.counts[i]), self.image_size)
            self._open[i] = f
            if len(self._open) > self._max_open:
                self._open.popitem(last=False)[1].close()
        else:
            self._open.move_to_end(i)
        return f

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def read(self, indices: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Images (uint8 N x H x W x 3) and labels (int64 N) at global `indices`, in that order."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"index out of range 0..{len(self) - 1} of {self.root / self.split}")
        s = self.image_size
        images = out[:len(indices)] if out is not None else np.empty((len(indices), s, s, 3), np.uint8)
        labels = np.empty(len(indices), np.int64)
        file_of = np.searchsorted(self.offsets, indices, side="right") - 1
        for fi in np.unique(file_of):
            where = np.nonzero(file_of == fi)[0]
            rows = indices[where] - self.offsets[fi]
            self._read_rows(int(fi), rows, where, images, labels)
        return images, labels

    def _read_rows(self, fi: int, rows: np.ndarray, where: np.ndarray, images: np.ndarray,
                   labels: np.ndarray) -> None:
        """Rows `rows` of file `fi` into positions `where` of `images` and `labels`."""
        order = np.argsort(rows, kind="stable")
        rows, where = rows[order], where[order]
        ds = self._file(fi)["images"]
        try:
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            if hi - lo == len(rows) and np.all(np.diff(where) == 1):  # one run, in order: read in place
                ds.read_direct(images, np.s_[lo:hi], np.s_[int(where[0]):int(where[0]) + hi - lo])
            elif hi - lo == len(rows):
                images[where] = ds[lo:hi]
            else:
                for r, w in zip(rows.tolist(), where.tolist()):
                    ds.read_direct(images, np.s_[r], np.s_[w])
            labels[where] = self._file(fi)["labels"][...][rows]
        except OSError as e:
            raise BatchFileError(self.paths[fi], f"corrupt batch file, read failed ({e})") from None


def epoch_order(counts: np.ndarray, epoch: int, seed: int, shuffle: bool, window: int) -> np.ndarray:
    """The global image order of one epoch (see the module docstring)."""
    n = int(counts.sum())
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    if window <= 0:
        return rng.permutation(n).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    file_order = rng.permutation(len(counts))
    parts = []
    for start in range(0, len(file_order), window):
        group = file_order[start:start + window]
        idx = np.concatenate([np.arange(offsets[f], offsets[f + 1]) for f in group])
        parts.append(idx[rng.permutation(len(idx))])
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


class BatchReader:
    """Batches of one replica's share of a split, epoch by epoch.

    ``drop_last=True`` (training): every replica runs ``len(data) // (world*batch_size)`` steps per
    epoch, the remainder of the epoch order (fewer images than one global batch) is not used that
    epoch (with shuffling, a different remainder each epoch). ``drop_last=False`` (validation): the
    last global step is cut to what is left, so some replicas get a short or empty last batch and
    every image is read exactly once over all replicas.
    """

    def __init__(self, data: SplitData, batch_size: int, rank: int = 0, world: int = 1, shuffle: bool = True,
                 seed: int = 0, window: int = 16, drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch size must be positive, got {batch_size}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside 0..{world - 1}")
        self.data, self.batch_size, self.rank, self.world = data, batch_size, rank, world
        self.shuffle, self.seed, self.window, self.drop_last = shuffle, seed, window, drop_last
        self._cached: tuple[int, np.ndarray] | None = None
        if drop_last and self.steps_per_epoch() == 0:
            raise DataError(f"{data.root / data.split} holds {len(data)} images, fewer than one global batch "
                            f"({world} x {batch_size}); lower train.batch_size")

    @property
    def global_batch(self) -> int:
        return self.world * self.batch_size

    def steps_per_epoch(self) -> int:
        n, g = len(self.data), self.global_batch
        return n // g if self.drop_last else -(-n // g)

    def order(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, epoch_order(self.data.counts, epoch, self.seed, self.shuffle, self.window))
        return self._cached[1]

    def positions(self, step: int) -> np.ndarray:
        """Positions in the epoch order of this replica's batch at `step` (may be empty at the end)."""
        lo = step * self.global_batch + self.rank * self.batch_size
        return np.arange(lo, min(lo + self.batch_size, len(self.data)), dtype=np.int64)

    def indices(self, epoch: int, step: int) -> np.ndarray:
        return self.order(epoch)[self.positions(step)]

    def batches(self, epoch: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(images, labels) for steps start..end of `epoch`; empty batches are yielded too."""
        for step in range(start, self.steps_per_epoch()):
            yield self.data.read(self.indices(epoch, step))
